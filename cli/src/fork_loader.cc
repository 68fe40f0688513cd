// ForkingLoader: see fork_loader.h and Note [Fork loader] in docs/cli.md.
#include "spillway/cli/fork_loader.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

namespace spillway::cli {
namespace {

std::string DescribeWait(int wstatus) {
  if (WIFEXITED(wstatus)) return StrCat("exited with status ", WEXITSTATUS(wstatus));
  if (WIFSIGNALED(wstatus)) {
    return StrCat("was killed by signal ", WTERMSIG(wstatus), " (", strsignal(WTERMSIG(wstatus)),
                  ")");
  }
  return StrCat("ended with wait status ", wstatus);
}

}  // namespace

ForkingLoader::ForkingLoader(const CharCorpus* corpus, ForkingLoaderOptions options)
    : corpus_(corpus), options_(options) {}

Result<std::unique_ptr<ForkingLoader>> ForkingLoader::Create(const CharCorpus* corpus,
                                                             ForkingLoaderOptions options) {
  if (corpus == nullptr) return Status::InvalidArgument("ForkingLoader: corpus is null");
  if (options.workers == 0 || options.batch_size == 0 || options.seq_len == 0) {
    return Status::InvalidArgument(StrCat("data loader: workers (", options.workers,
                                          "), batch_size (", options.batch_size, ") and seq_len (",
                                          options.seq_len, ") must all be at least 1"));
  }
  if (options.timeout_seconds <= 0) {
    return Status::InvalidArgument("data loader: timeout_seconds must be positive");
  }
  if (corpus->tokens().size() < static_cast<uint64_t>(options.seq_len) + 2) {
    return Status::InvalidArgument(
        StrCat("data loader: the corpus has ", corpus->tokens().size(),
               " tokens, fewer than one row of seq_len + 1 = ", options.seq_len + 1, " plus one"));
  }
  return std::unique_ptr<ForkingLoader>(new ForkingLoader(corpus, options));
}

ForkingLoader::~ForkingLoader() {
  if (epoch_open()) Reap(/*kill_first=*/true).IgnoreError();  // a destructor reports nothing
}

Status ForkingLoader::BeginEpoch(int64_t epoch, uint64_t batches) {
  if (epoch_open()) {
    return Status::FailedPrecondition(StrCat("data loader: epoch ", epoch_,
                                             " is still open; call EndEpoch before BeginEpoch(",
                                             epoch, ")"));
  }
  if (batches == 0)
    return Status::InvalidArgument("data loader: an epoch needs at least one batch");
  // Everything the children read is fixed here, before the fork.
  const uint64_t row = row_elems();
  const uint64_t positions = corpus_->tokens().size() - row + 1;
  std::mt19937_64 rng(options_.seed * 1'000'003ull + static_cast<uint64_t>(epoch));
  starts_.resize(batches * options_.batch_size);
  for (uint64_t& s : starts_) s = rng() % positions;
  child_rows_.assign(options_.batch_size * row, 0);
  batches_ = batches;
  next_ = 0;
  epoch_ = epoch;
  for (uint32_t w = 0; w < options_.workers; ++w) {
    int fds[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
      const int err = errno;
      Reap(/*kill_first=*/true).IgnoreError();  // the error below is the one to report
      return Status::FromErrno(StatusCode::kUnavailable, err,
                               "data loader: socketpair for a worker");
    }
    const pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      // Earlier workers' parent ends: holding them would hide the end of the epoch from them.
      for (int fd : fds_) close(fd);
      WorkerMain(w, fds[1]);
    }
    const int err = errno;
    close(fds[1]);  // only worker w holds its end, so its death is an EOF here
    if (pid < 0) {
      close(fds[0]);
      Reap(/*kill_first=*/true).IgnoreError();  // the error below is the one to report
      return Status::FromErrno(StatusCode::kUnavailable, err,
                               StrCat("data loader: fork of worker ", w, " for epoch ", epoch,
                                      "; lower the worker count"));
    }
    pids_.push_back(pid);
    fds_.push_back(fds[0]);
    ++stats_.forks;
    // The first prefetch_factor credits.
    const std::string credits(options_.prefetch_factor, 'c');
    if (send(fds[0], credits.data(), credits.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(credits.size())) {
      const int send_err = errno;
      Reap(/*kill_first=*/true).IgnoreError();  // the error below is the one to report
      return Status::FromErrno(
          StatusCode::kUnavailable, send_err,
          StrCat("data loader: cannot reach worker ", w, " for epoch ", epoch));
    }
  }
  return Status::Ok();
}

void ForkingLoader::WorkerMain(uint32_t worker, int fd) {
  // The default SIGPIPE action ends this worker when the parent goes away mid-write.
  signal(SIGPIPE, SIG_DFL);
  const uint64_t row = row_elems();
  const uint8_t* tokens = corpus_->tokens().data();
  const size_t bytes = child_rows_.size() * sizeof(int64_t);
  char credit;
  for (uint64_t b = worker; b < batches_; b += options_.workers) {
    ssize_t got;
    do got = read(fd, &credit, 1);
    while (got < 0 && errno == EINTR);
    if (got == 0) _exit(0);  // the epoch ended early
    if (got < 0) _exit(4);
    for (uint32_t r = 0; r < options_.batch_size; ++r) {
      const uint8_t* src = tokens + starts_[b * options_.batch_size + r];
      int64_t* dst = child_rows_.data() + r * row;
      for (uint64_t i = 0; i < row; ++i) dst[i] = src[i];
    }
    const char* p = reinterpret_cast<const char*>(child_rows_.data());
    size_t left = bytes;
    while (left > 0) {
      const ssize_t n = write(fd, p, left);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) _exit(3);
      p += n;
      left -= static_cast<size_t>(n);
    }
  }
  // Like a DataLoader worker, stay until the epoch ends (the parent closes its end).
  for (;;) {
    const ssize_t got = read(fd, &credit, 1);  // spare credits, then EOF
    if (got == 0 || (got < 0 && errno != EINTR)) _exit(0);
  }
}

Status ForkingLoader::Next(int64_t* rows) {
  if (!epoch_open())
    return Status::FailedPrecondition("data loader: Next() outside an epoch; call BeginEpoch");
  if (next_ >= batches_) {
    return Status::FailedPrecondition(
        StrCat("data loader: epoch ", epoch_, " has only ", batches_, " batches; call EndEpoch"));
  }
  const uint32_t w = static_cast<uint32_t>(next_ % options_.workers);
  char* p = reinterpret_cast<char*>(rows);
  size_t left = options_.batch_size * row_elems() * sizeof(int64_t);
  while (left > 0) {
    pollfd pfd{fds_[w], POLLIN, 0};
    const int ready = poll(&pfd, 1, options_.timeout_seconds * 1000);
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0)
      return WorkerFailed(w, StrCat("sent nothing for ", options_.timeout_seconds, " s").c_str());
    if (ready < 0) return WorkerFailed(w, StrCat("poll failed: ", ErrnoText(errno)).c_str());
    const ssize_t n = read(fds_[w], p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return WorkerFailed(w, StrCat("read failed: ", ErrnoText(errno)).c_str());
    if (n == 0) return WorkerFailed(w, "closed its pipe early");
    p += n;
    left -= static_cast<size_t>(n);
  }
  ++next_;
  ++stats_.batches;
  // One credit back: the worker may make its next batch. A worker that has finished ignores it.
  const char credit = 'c';
  if (send(fds_[w], &credit, 1, MSG_NOSIGNAL) != 1 && errno != EPIPE && errno != ECONNRESET) {
    return WorkerFailed(w, StrCat("cannot take a credit: ", ErrnoText(errno)).c_str());
  }
  return Status::Ok();
}

Status ForkingLoader::WorkerFailed(uint32_t worker, const char* what) {
  const pid_t pid = pids_[worker];
  const uint64_t batch = next_;
  // Reap that worker first to learn how it ended, then the rest.
  // A dead worker's pipe reaches EOF a moment before the process becomes reapable: give it a
  // second.
  int wstatus = 0;
  std::string how;
  for (int i = 0; i < 100; ++i) {
    if (waitpid(pid, &wstatus, WNOHANG) == pid) {
      how = StrCat("; it ", DescribeWait(wstatus));
      pids_[worker] = -1;
      break;
    }
    usleep(10'000);
  }
  Reap(/*kill_first=*/true).IgnoreError();
  return Status::Make(
      StatusCode::kUnavailable,
      StrCat("data loader worker ", worker, " (pid ", pid, ") ", what, " before batch ", batch,
             " of epoch ", epoch_, how,
             "; the epoch is closed and its workers reaped (see the worker's stderr)"));
}

Status ForkingLoader::EndEpoch() {
  if (!epoch_open()) return Status::FailedPrecondition("data loader: EndEpoch without BeginEpoch");
  return Reap(/*kill_first=*/next_ < batches_);
}

Status ForkingLoader::Reap(bool kill_first) {
  // Kill before closing the pipes, so a worker ends by our SIGKILL and not by a SIGPIPE that would
  // read as its own failure.
  if (kill_first) {
    for (pid_t pid : pids_) {
      if (pid > 0) kill(pid, SIGKILL);
    }
  }
  for (int fd : fds_) close(fd);
  fds_.clear();
  Status first;
  for (size_t w = 0; w < pids_.size(); ++w) {
    const pid_t pid = pids_[w];
    if (pid <= 0) continue;
    int wstatus = 0;
    pid_t r;
    do r = waitpid(pid, &wstatus, 0);
    while (r < 0 && errno == EINTR);
    const bool killed_by_us = kill_first && WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL;
    const bool ok = (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) || killed_by_us;
    if (r == pid && !ok && first.ok()) {
      first = Status::Make(StatusCode::kUnavailable,
                           StrCat("data loader worker ", w, " (pid ", pid, ") of epoch ", epoch_,
                                  " ", DescribeWait(wstatus)));
    }
  }
  pids_.clear();
  starts_.clear();
  return first;
}

}  // namespace spillway::cli
