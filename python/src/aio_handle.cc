// spillway.aio_handle: DeepSpeed's aio_handle contract on Spillway's I/O engine (docs/python.md,
// Note [aio_handle]). Owns the file table (named files kept open, checked against the path on every
// use), the pending async ops, and the rules that make one handle safe to share between threads.
#include "aio_handle.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <torch/extension.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"
#include "py_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/base/log.h"

namespace py = pybind11;

namespace spillway::python {
namespace {

// A contiguous CPU tensor's bytes, or InvalidArgument naming what is wrong with it.
Result<std::pair<void*, uint64_t>> TensorBytes(const torch::Tensor& t, const char* what) {
  if (!t.defined()) return Status::InvalidArgument(StrCat(what, ": an undefined tensor"));
  if (!t.device().is_cpu()) {
    return Status::InvalidArgument(
        StrCat(what, ": the tensor is on ", t.device().str(),
               "; aio transfers need a CPU tensor (copy it with .cpu())"));
  }
  if (!t.is_contiguous()) {
    return Status::InvalidArgument(
        StrCat(what, ": the tensor is not contiguous; pass t.contiguous()"));
  }
  return std::make_pair(t.data_ptr(), static_cast<uint64_t>(t.numel()) * t.element_size());
}

// One descriptor registered with the engine. A named file's entry is shared by the table and by the
// ops using it; it is unregistered and closed once it has left the table and no op uses it.
struct OpenFile {
  int fd = -1;
  int id = -1;
  bool owned = true;  // we opened (or dup'd) it and close it
  dev_t dev = 0;      // what the path named when it was opened (checked on every use)
  ino_t ino = 0;
  std::string key;  // the table key; empty for an fd op's private dup
  uint64_t last_use = 0;
  int users = 0;  // calls between lookup and submit, plus ops in flight
  bool in_table = true;
  bool released = false;  // unregistered and closed (once: the number may be reused after)
  std::shared_ptr<allocator::IoEngine> engine;  // it is registered here (outlives close())
};
using FilePtr = std::shared_ptr<OpenFile>;

struct Pending {
  allocator::Ticket ticket;
  uint64_t seq = 0;
  std::string what;
  FilePtr file;
  torch::Tensor keep;  // the buffer stays alive until the op is waited for
  bool done = false;   // completed early (to free its file's slot); `status` is its result
  bool ready = true;   // for done ops: false while the thread that completes it is still waiting
  Status status;
};

// Thread-safe. Python entry points validate their tensors with the GIL held, then release it before
// taking mu_, so a thread holding mu_ never waits for the GIL. mu_ is never held across a syscall,
// an engine call or a wait: lookups pin a file (users), the work happens unlocked, and the last
// user of a file that left the table unregisters and closes it.
//
// Invariants: every op submitted has a seq in outstanding_ until its wait finished; wait() returns
// only when every op submitted before it, by any thread, has finished.
class AioHandle {
 public:
  AioHandle(uint64_t block_size, int queue_depth, bool single_submit, bool overlap_events,
            int intra_op_parallelism, std::shared_ptr<PyArena> arena, const std::string& backend)
      : block_size_(block_size),
        queue_depth_(queue_depth),
        single_submit_(single_submit),
        overlap_events_(overlap_events),
        intra_op_(intra_op_parallelism),
        arena_(std::move(arena)) {
    if (block_size == 0 || queue_depth <= 0 || intra_op_parallelism <= 0) {
      Raise(Status::InvalidArgument(
          StrCat("aio_handle(block_size=", block_size, ", queue_depth=", queue_depth,
                 ", intra_op_parallelism=", intra_op_parallelism, "): each must be positive")));
    }
    if (backend != "auto" && backend != "uring" && backend != "thread_pool") {
      Raise(Status::InvalidArgument(
          StrCat("aio_handle(backend='", backend, "'): one of 'auto', 'uring', 'thread_pool'")));
    }
    allocator::IoEngineOptions eo;
    eo.arena = arena_->get();
    // DeepSpeed's op takes any block size (it is how it cuts an op into iocbs); the engine's chunks
    // are whole pages, so a smaller or odd one is rounded up to the next 4 KiB for the engine, and
    // get_block_size() still says what was asked. A chunk size changes no byte of the transfer.
    eo.block_size = (block_size + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    eo.queue_depth = static_cast<uint32_t>(queue_depth);
    eo.force_thread_pool = backend == "thread_pool";
    engine_ =
        std::shared_ptr<allocator::IoEngine>(Check(allocator::IoEngine::Create(eo)).release());
    if (backend == "uring" && engine_->Stats().backend != allocator::IoBackend::kUring) {
      Raise(Status::Make(
          StatusCode::kUnavailable,
          StrCat("aio_handle(backend='uring'): io_uring is not available here (",
                 engine_->Stats().fallback_reason, "); use backend='auto' or 'thread_pool'")));
    }
  }
  ~AioHandle() {
    if (!process_.InOwner()) {
      // A forked child: the ring, its threads and the files are the parent's. Destroying them here
      // would join threads the child does not have and free buffers into the parent's arena, so
      // they are left to the child's exit.
      new std::shared_ptr<allocator::IoEngine>(std::move(engine_));
      new std::map<std::string, FilePtr>(std::move(files_));
      new std::vector<Pending>(std::move(pending_));
      new std::vector<Pending>(std::move(done_early_));
      new std::map<const void*, c10::Storage>(std::move(locked_));
      return;
    }
    py::gil_scoped_release nogil;
    CloseNoGil();
  }

  void Close() {
    CheckProcess();
    py::gil_scoped_release nogil;
    CloseNoGil();
  }

  uint64_t block_size() const { return block_size_; }
  int queue_depth() const { return queue_depth_; }
  bool single_submit() const { return single_submit_; }
  bool overlap_events() const { return overlap_events_; }
  int intra_op_parallelism() const { return intra_op_; }
  int alignment() const { return intra_op_ * 512; }
  std::string last_error() {
    CheckProcess();
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    return last_error_;
  }

  // DeepSpeed's read/write: one op, on its own (its pending async ops are left to wait()).
  int Read(const torch::Tensor& b, const std::string& f, bool validate, int64_t off) {
    return Transfer(b, f, -1, off, false, Mode::kAlone, validate) < 0 ? -1 : 0;
  }
  int Write(const torch::Tensor& b, const std::string& f, bool validate, int64_t off) {
    return Transfer(b, f, -1, off, true, Mode::kAlone, validate) < 0 ? -1 : 0;
  }
  // pread/pwrite, and sync_pread/sync_pwrite (async false): as DeepSpeed's, a sync call schedules
  // its op and then waits like wait(), for the async ops before it too, and returns how many ops
  // completed.
  int Pread(const torch::Tensor& b, const std::string& f, bool validate, bool async, int64_t off) {
    return Transfer(b, f, -1, off, false, async ? Mode::kAsync : Mode::kSync, validate);
  }
  int Pwrite(const torch::Tensor& b, const std::string& f, bool validate, bool async, int64_t off) {
    return Transfer(b, f, -1, off, true, async ? Mode::kAsync : Mode::kSync, validate);
  }
  int PwriteFd(const torch::Tensor& b, int fd, int64_t off) {
    return Transfer(b, "", fd, off, true, Mode::kAsync, false);
  }
  int PreadFd(const torch::Tensor& b, int fd, int64_t off) {
    return Transfer(b, "", fd, off, false, Mode::kAsync, false);
  }

  // Waits for this handle's async ops: those it takes, and those other threads' wait() calls took
  // that were submitted before this call. Returns how many it took, -1 if any failed.
  int Wait() {
    CheckProcess();
    Status closed;
    int result = 0;
    {
      py::gil_scoped_release nogil;
      result = WaitNoGil(&closed);
    }
    if (!closed.ok()) Raise(closed);
    return result;
  }

  torch::Tensor NewLockedTensor(int64_t num_elem, const torch::Tensor& example) {
    CheckProcess();
    if (num_elem < 0)
      Raise(Status::InvalidArgument(StrCat("new_cpu_locked_tensor: num_elem ", num_elem, " < 0")));
    torch::Tensor t = arena_->Empty({num_elem}, example.scalar_type(), allocator::Kind::kSwapBuffer,
                                    allocator::Lifetime::kPersistent, 0);
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    locked_[t.storage().data()] = t.storage();
    return t;
  }
  bool FreeLockedTensor(const torch::Tensor& t) {
    CheckProcess();
    if (!t.defined() || !t.device().is_cpu()) return false;
    py::gil_scoped_release nogil;
    c10::Storage dropped;  // released after the lock (its deleter may free arena memory)
    std::lock_guard<std::mutex> lock(mu_);
    auto it = locked_.find(t.storage().data());
    if (it == locked_.end()) return false;
    dropped = std::move(it->second);
    locked_.erase(it);
    return true;
  }
  // Page-locked: memory of this handle's arena when that arena pins (not a pageable one), or memory
  // torch itself reports as pinned.
  bool IsPinned(const torch::Tensor& t) const {
    CheckProcess();
    const bool arena_pins = arena_->get()->pin_mode() != allocator::PinMode::kPageable;
    return (arena_pins && arena_->Owns(t)) || (t.defined() && t.is_pinned());
  }

 private:
  // Open descriptors kept at most (half the engine's fixed-file slots): past that, the least
  // recently used one with no call in progress leaves the table (closed when its ops finish).
  static constexpr size_t kMaxOpenFiles = 128;
  static constexpr uint64_t kDirectAlign = 4096;

  // wait()'s body, without the GIL: the ops submitted before it, or (a sync op's drain) before
  // seq `before` only. `closed` receives the error of a closed handle.
  int WaitNoGil(Status* closed, uint64_t before = UINT64_MAX) {
    std::vector<Pending> ops;
    std::shared_ptr<allocator::IoEngine> engine;
    uint64_t horizon = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (engine_ == nullptr) {
        *closed = ClosedError();
        return -1;
      }
      horizon = std::min(next_seq_, before);
      // pending_ is in submission (seq) order: the ops before the horizon are a prefix.
      const auto end = std::partition_point(pending_.begin(), pending_.end(),
                                            [&](const Pending& q) { return q.seq < horizon; });
      ops.assign(std::make_move_iterator(pending_.begin()), std::make_move_iterator(end));
      pending_.erase(pending_.begin(), end);
      TakeReadyEarly(&ops, horizon);
      engine = engine_;
    }
    std::string first_error = Finish(engine.get(), &ops);
    std::vector<Pending> late;  // destroyed after the lock (a buffer's deleter may free memory)
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return outstanding_.empty() || *outstanding_.begin() >= horizon; });
    // Ops submitted before this wait that another thread was completing early (to close their
    // file) when it began: finished now, so their results are this wait's, errors included.
    TakeReadyEarly(&late, horizon);
    for (const Pending& p : late) {
      if (!p.status.ok() && first_error.empty())
        first_error = StrCat(p.what, ": ", p.status.ToString());
    }
    if (!first_error.empty()) {
      last_error_ = first_error;
      return -1;
    }
    return static_cast<int>(ops.size() + late.size());
  }

  // Moves the early-completed ops submitted before seq `before` whose completion is recorded into
  // `ops` (assumes mu_).
  void TakeReadyEarly(std::vector<Pending>* ops, uint64_t before) {
    for (auto it = done_early_.begin(); it != done_early_.end();) {
      if (it->ready && it->seq < before) {
        ops->push_back(std::move(*it));
        it = done_early_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Every call in a process forked from the one that made the handle is refused: the child has no
  // ring thread and must not touch the parent's ring, fixed files or buffers.
  void CheckProcess() const {
    if (!process_.InOwner()) {
      Raise(Status::FailedPrecondition(
          StrCat("aio_handle was made in process ", process_.pid(),
                 " and this is a forked child (pid ", ::getpid(),
                 "); its ring and files belong to the parent. Make a new aio_handle in the "
                 "child")));
    }
  }

  static Status ClosedError() {
    return Status::Make(StatusCode::kFailedPrecondition, "aio_handle is closed; make a new one");
  }

  // kAsync: submitted, waited for by wait(). kSync: waits for it and every op pending before it
  // (DeepSpeed's pread/pwrite with async false). kAlone: waits for it only (read/write).
  enum class Mode : uint8_t { kAsync, kSync, kAlone };

  // Returns 0 (kAsync, submitted), the number of completed ops (kSync: 1 and the async ops pending
  // before it; kAlone: 1), or -1 with last_error.
  int Transfer(const torch::Tensor& buffer, const std::string& filename, int fd, int64_t offset,
               bool write, Mode mode, bool validate) {
    (void)validate;  // DeepSpeed's validate re-reads with pread in its tests only
    CheckProcess();
    auto bytes = TensorBytes(buffer, write ? "aio write" : "aio read");
    if (!bytes.ok()) Raise(bytes.status());
    Status raise;
    int rc = 0;
    {
      py::gil_scoped_release nogil;
      rc = TransferNoGil(buffer, bytes->first, bytes->second, filename, fd, offset, write, mode,
                         &raise);
    }
    if (!raise.ok()) Raise(raise);
    return rc;
  }

  int Fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(mu_);
    last_error_ = message;
    return -1;
  }

  int TransferNoGil(const torch::Tensor& buffer, void* data, uint64_t n,
                    const std::string& filename, int fd, int64_t offset, bool write, Mode mode,
                    Status* raise) {
    const char* op = write ? "pwrite" : "pread";
    const std::string name = fd >= 0 ? StrCat("fd ", fd) : filename;
    if (offset < 0) return Fail(StrCat(op, " ", name, ": negative file offset ", offset));
    if (n % static_cast<uint64_t>(intra_op_) != 0) {
      return Fail(StrCat(op, " ", name, ": ", n, " bytes is not divisible by intra_op_parallelism=",
                         intra_op_, " (DeepSpeed's rule); pad the tensor or use 1"));
    }
    std::shared_ptr<allocator::IoEngine> engine;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (engine_ != nullptr && !closing_) {
        engine = engine_;
        active_++;  // close() waits for this call to have submitted (or failed)
      }
    }
    if (engine == nullptr) {
      *raise = ClosedError();
      return -1;
    }
    struct Active {
      AioHandle* h;
      ~Active() {
        {
          std::lock_guard<std::mutex> lock(h->mu_);
          h->active_--;
        }
        h->done_.notify_all();
      }
    } active{this};
    // Page-aligned requests on a named file go through O_DIRECT (DeepSpeed's mode: no page cache,
    // no double copy); others through a buffered descriptor, so no size or offset is refused.
    const bool direct = fd < 0 && direct_ok_.load() && offset % kDirectAlign == 0 &&
                        n % kDirectAlign == 0 &&
                        reinterpret_cast<uintptr_t>(data) % kDirectAlign == 0;
    struct stat now {};  // the file as it is at this call (its size, for reads)
    Result<FilePtr> file = fd >= 0 ? DupFd(engine, fd, write ? nullptr : &now)
                                   : OpenNamed(engine, filename, write, direct, &now);
    if (!file.ok()) return Fail(StrCat(op, " ", name, ": ", file.status().message()));
    FilePtr f = *file;
    if (!write && static_cast<uint64_t>(offset) + n > static_cast<uint64_t>(now.st_size)) {
      Unpin(f);
      return Fail(StrCat(op, " ", name, ": reading ", n, " bytes at offset ", offset,
                         " runs past the end of the file (", now.st_size, " bytes)"));
    }
    if (n == 0) {
      Unpin(f);
      if (mode == Mode::kSync) {
        const int earlier = WaitNoGil(raise);
        return earlier < 0 ? -1 : 1 + earlier;
      }
      return mode == Mode::kAsync ? 0 : 1;
    }
    Result<allocator::Ticket> t =
        write ? engine->SubmitWrite(f->id, static_cast<uint64_t>(offset), data, n)
              : engine->SubmitRead(f->id, static_cast<uint64_t>(offset), data, n);
    if (!t.ok()) {
      Unpin(f);
      return Fail(StrCat(op, " ", name, ": ", t.status().ToString()));
    }
    std::unique_lock<std::mutex> lock(mu_);
    Pending p{*t, next_seq_++, StrCat(op, " ", name), f, buffer};
    outstanding_.insert(p.seq);
    if (mode == Mode::kAsync) {
      pending_.push_back(std::move(p));  // f stays pinned by the op until it is waited for
      return 0;
    }
    lock.unlock();
    // A sync op is never in pending_, so another thread's wait() cannot take it (or its error).
    const uint64_t own = p.seq;
    std::vector<Pending> one;
    one.push_back(std::move(p));
    const std::string error = Finish(engine.get(), &one);
    // kSync: then the async ops submitted before it, as wait() does (DeepSpeed's _wait_locked()),
    // never those other threads submitted while it ran: those are their wait()'s.
    const int earlier = mode == Mode::kSync ? WaitNoGil(raise, own) : 0;
    if (!error.empty()) return Fail(error);
    return earlier < 0 ? -1 : 1 + earlier;
  }

  // Waits for `ops` without the lock; then retires them (seq done, file unpinned). Returns the
  // first error as "<op> <file>: <status>", or "".
  std::string Finish(allocator::IoEngine* engine, std::vector<Pending>* ops) {
    std::string first_error;
    for (Pending& p : *ops) {
      const Status st = p.done ? p.status : engine->Wait(p.ticket);
      if (!st.ok() && first_error.empty()) first_error = StrCat(p.what, ": ", st.ToString());
    }
    for (Pending& p : *ops) {
      if (!p.done) Unpin(p.file);  // early ones were unpinned when they completed
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const Pending& p : *ops) outstanding_.erase(p.seq);
    }
    done_.notify_all();
    return first_error;
  }

  // The caller's descriptor, dup'd at the time of the call: the op writes the file the number named
  // then, whatever the caller does with the number afterwards. Closed when the op finished.
  // `now`, when given, receives the file's fstat (reads need its size).
  Result<FilePtr> DupFd(const std::shared_ptr<allocator::IoEngine>& engine, int fd,
                        struct stat* now) {
    const int dup = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) {
      return Status::FromErrno(StatusCode::kInvalidArgument, errno,
                               StrCat("fd ", fd, " is not an open descriptor"));
    }
    if (now != nullptr && ::fstat(dup, now) != 0) {
      const int err = errno;
      ::close(dup);
      return Status::FromErrno(StatusCode::kIoError, err, "fstat");
    }
    auto f = Register(engine, dup, StrCat("fd ", fd), 1);
    if (f.ok()) (*f)->in_table = false;
    return f;
  }

  // Registers `fd` (ours: closed on failure) and returns it pinned for the caller.
  static Result<FilePtr> Register(const std::shared_ptr<allocator::IoEngine>& engine, int fd,
                                  std::string name, uint32_t alignment) {
    auto id = engine->RegisterFile(fd, std::move(name), alignment);
    if (!id.ok()) {
      ::close(fd);
      return id.status();
    }
    auto f = std::make_shared<OpenFile>();
    f->fd = fd;
    f->id = *id;
    f->engine = engine;
    f->users = 1;
    return f;
  }

  // The table's descriptor for `filename`, if it still names the file the path names now
  // (st_dev/st_ino: a rename, an unlink or a re-creation since it was opened makes a new one);
  // else a new descriptor, entered in the table. Pinned for the caller (Unpin when done). `now`
  // receives the file's stat as of this call.
  Result<FilePtr> OpenNamed(const std::shared_ptr<allocator::IoEngine>& engine,
                            const std::string& filename, bool write, bool direct,
                            struct stat* now) {
    const std::string key = StrCat(write ? "w" : "r", direct ? "d:" : ":", filename);
    FilePtr cached;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = files_.find(key);
      if (it != files_.end()) {
        cached = it->second;
        cached->users++;
        cached->last_use = ++use_clock_;
      }
    }
    if (cached != nullptr) {
      if (::stat(filename.c_str(), now) == 0 && now->st_dev == cached->dev &&
          now->st_ino == cached->ino) {
        return cached;
      }
      Retire(cached);  // the path names another file now (or none): leave the table
      Unpin(cached);
    }
    const int mode = (write ? O_WRONLY | O_CREAT : O_RDONLY) | O_CLOEXEC | (direct ? O_DIRECT : 0);
    int fd = ::open(filename.c_str(), mode, 0600);
    if (fd < 0 && direct && errno == EINVAL) {
      // The filesystem has no O_DIRECT (tmpfs, some overlays): buffered from now on, said once.
      if (direct_ok_.exchange(false)) {
        Log(LogLevel::kInfo, StrCat("aio_handle: ", filename,
                                    " does not support O_DIRECT; this handle "
                                    "uses buffered I/O from now on"));
      }
      return OpenNamed(engine, filename, write, false, now);
    }
    if (fd < 0)
      return Status::Make(StatusCode::kIoError, StrCat("cannot open: ", ErrnoText(errno)), errno);
    if (::fstat(fd, now) != 0) {
      const int err = errno;
      ::close(fd);
      return Status::FromErrno(StatusCode::kIoError, err, "fstat");
    }
    SPILLWAY_ASSIGN_OR_RETURN(FilePtr f, Register(engine, fd, filename, direct ? kDirectAlign : 1));
    f->dev = now->st_dev;
    f->ino = now->st_ino;
    f->key = key;
    std::vector<FilePtr> evicted;
    std::vector<Pending> early;  // async ops of an evicted file, completed here to free its slot
    {
      std::lock_guard<std::mutex> lock(mu_);
      f->last_use = ++use_clock_;
      auto it = files_.find(key);
      if (it != files_.end()) {  // another thread opened it meanwhile: ours replaces it
        it->second->in_table = false;
        evicted.push_back(it->second);
        files_.erase(it);
      }
      while (files_.size() >= kMaxOpenFiles) {
        // The least recently used file nobody is using; failing that, the least recently used one
        // whose users are async ops still waiting for wait(): those are completed now (their
        // results wait for wait()), so its descriptor and fixed-file slot can go.
        auto lru = files_.end(), lru_busy = files_.end();
        for (auto i = files_.begin(); i != files_.end(); ++i) {
          auto& best = i->second->users == 0 ? lru : lru_busy;
          if (best == files_.end() || i->second->last_use < best->second->last_use) best = i;
        }
        if (lru == files_.end()) lru = lru_busy;
        if (lru == files_.end()) break;
        for (auto p = pending_.begin(); p != pending_.end();) {
          if (p->file == lru->second) {
            early.push_back(
                {p->ticket, p->seq, p->what, p->file, torch::Tensor(), true, false, Status()});
            done_early_.push_back(std::move(*p));  // visible to wait()/close() from now on
            done_early_.back().done = true;
            done_early_.back().ready = false;
            p = pending_.erase(p);
          } else {
            ++p;
          }
        }
        lru->second->in_table = false;
        evicted.push_back(lru->second);
        files_.erase(lru);
      }
      files_[key] = f;
    }
    for (Pending& p : early) {
      p.status = engine->Wait(p.ticket);
      Unpin(p.file);
    }
    if (!early.empty()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (const Pending& e : early) {
          for (Pending& d : done_early_) {
            if (d.seq == e.seq) {
              d.status = e.status;
              d.ready = true;
            }
          }
          outstanding_.erase(e.seq);  // finished; its result waits in done_early_ for a wait()
        }
      }
      done_.notify_all();
    }
    for (const FilePtr& e : evicted) CloseIfUnused(e);
    return f;
  }

  // Takes `f` out of the table (if it is still there).
  void Retire(const FilePtr& f) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(f->key);
    if (it != files_.end() && it->second == f) files_.erase(it);
    f->in_table = false;
  }

  void Unpin(const FilePtr& f) {
    bool close = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      --f->users;
      close = ClaimReleaseLocked(f.get());
    }
    if (close) Release(f);
  }

  void CloseIfUnused(const FilePtr& f) {
    bool close = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      close = ClaimReleaseLocked(f.get());
    }
    if (close) Release(f);
  }

  // Whether the caller is the one to release `f` now: unused, out of the table, and not released
  // yet; marks it released (assumes mu_). One release per file: its number may be reused after.
  static bool ClaimReleaseLocked(OpenFile* f) {
    const bool claim = f->users == 0 && !f->in_table && !f->released;
    f->released |= claim;
    return claim;
  }

  // Unregisters and closes a file nobody uses any more (without the lock). A failed unregister
  // retires the engine's slot, which holds the open file itself, so closing our descriptor is safe
  // (logged; IoEngineRingTest.AFailedUnregisterRetiresTheSlotAndTheFdMayBeClosed).
  void Release(const FilePtr& f) {
    const Status st = f->engine->UnregisterFile(f->id);
    if (!st.ok()) {
      Log(LogLevel::kWarning,
          StrCat("aio_handle: unregistering ", f->key.empty() ? "an fd op's file" : f->key,
                 " failed: ", st.ToString()));
    }
    if (f->owned) ::close(f->fd);
  }

  void CloseNoGil() {
    std::vector<Pending> ops;
    std::vector<Pending> unclaimed;  // early-completed ops no wait() took; freed after the lock
    std::vector<FilePtr> files;
    std::shared_ptr<allocator::IoEngine> engine;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (closing_) {  // another thread is closing: return when it is done
        done_.wait(lock, [&] { return engine_ == nullptr; });
        return;
      }
      if (engine_ == nullptr) return;
      closing_ = true;  // no call submits from now on; those in progress finish submitting first
      done_.wait(lock, [&] { return active_ == 0; });
      engine = engine_;
      ops.swap(pending_);
    }
    (void)Finish(engine.get(), &ops);  // errors of ops never waited for: close() reports none
    {
      std::unique_lock<std::mutex> lock(mu_);
      done_.wait(lock, [&] { return outstanding_.empty(); });  // other threads' ops, too
      unclaimed.swap(done_early_);
      for (auto& [key, f] : files_) {
        f->in_table = false;
        files.push_back(f);
      }
      files_.clear();
      engine_.reset();  // the engine itself goes when the last file and op using it are done
      closing_ = false;
    }
    done_.notify_all();
    for (const FilePtr& f : files) CloseIfUnused(f);
  }

  const uint64_t block_size_;
  const int queue_depth_;
  const bool single_submit_, overlap_events_;
  const int intra_op_;
  const std::shared_ptr<PyArena> arena_;
  const allocator::ProcessTag process_;  // the process that made it (Note [Fork])
  std::atomic<bool> direct_ok_{true};

  std::mutex mu_;
  std::condition_variable done_;                 // an op finished (outstanding_ shrank)
  std::shared_ptr<allocator::IoEngine> engine_;  // guarded by mu_; null once closed
  std::map<std::string, FilePtr> files_;         // guarded by mu_
  std::vector<Pending> pending_;                 // guarded by mu_: submitted, not taken by a wait
  std::vector<Pending> done_early_;              // guarded by mu_: completed by an eviction
  bool closing_ = false;                         // guarded by mu_: close() in progress
  int active_ = 0;                  // guarded by mu_: calls between engine copy and submit
  std::set<uint64_t> outstanding_;  // guarded by mu_: submitted, not finished
  uint64_t next_seq_ = 0;           // guarded by mu_
  uint64_t use_clock_ = 0;          // guarded by mu_
  std::map<const void*, c10::Storage> locked_;  // guarded by mu_
  std::string last_error_;                      // guarded by mu_
};

}  // namespace

void BindAioHandle(
    py::module_& m,
    std::function<std::shared_ptr<PyArena>(std::shared_ptr<PyArena>)> arena_or_default) {
  py::class_<AioHandle>(m, "aio_handle")
      .def(py::init([arena_or_default](uint64_t bs, int qd, bool ss, bool oe, int iop,
                                       std::shared_ptr<PyArena> arena, const std::string& backend) {
             return std::make_unique<AioHandle>(bs, qd, ss, oe, iop,
                                                arena_or_default(std::move(arena)), backend);
           }),
           py::arg("block_size") = 1048576, py::arg("queue_depth") = 128,
           py::arg("single_submit") = false, py::arg("overlap_events") = false,
           py::arg("intra_op_parallelism") = 1, py::arg("arena") = nullptr,
           py::arg("backend") = "auto")
      .def("get_block_size", &AioHandle::block_size)
      .def("get_queue_depth", &AioHandle::queue_depth)
      .def("get_single_submit", &AioHandle::single_submit)
      .def("get_overlap_events", &AioHandle::overlap_events)
      .def("get_intra_op_parallelism", &AioHandle::intra_op_parallelism)
      .def("get_alignment", &AioHandle::alignment)
      .def("get_last_error", &AioHandle::last_error)
      .def("read", &AioHandle::Read, py::arg("buffer"), py::arg("filename"), py::arg("validate"),
           py::arg("file_offset") = 0)
      .def("write", &AioHandle::Write, py::arg("buffer"), py::arg("filename"), py::arg("validate"),
           py::arg("file_offset") = 0)
      .def("pread", &AioHandle::Pread, py::arg("buffer"), py::arg("filename"), py::arg("validate"),
           py::arg("async"), py::arg("file_offset") = 0)
      .def("pwrite", &AioHandle::Pwrite, py::arg("buffer"), py::arg("filename"),
           py::arg("validate"), py::arg("async"), py::arg("file_offset") = 0)
      .def(
          "sync_pread",
          [](AioHandle& h, const torch::Tensor& b, const std::string& f, int64_t o) {
            return h.Pread(b, f, false, false, o);
          },
          py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0)
      .def(
          "sync_pwrite",
          [](AioHandle& h, const torch::Tensor& b, const std::string& f, int64_t o) {
            return h.Pwrite(b, f, false, false, o);
          },
          py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0)
      .def(
          "async_pread",
          [](AioHandle& h, const torch::Tensor& b, const std::string& f, int64_t o) {
            return h.Pread(b, f, false, true, o);
          },
          py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0)
      .def(
          "async_pwrite",
          [](AioHandle& h, const torch::Tensor& b, const std::string& f, int64_t o) {
            return h.Pwrite(b, f, false, true, o);
          },
          py::arg("buffer"), py::arg("filename"), py::arg("file_offset") = 0)
      .def("async_pwrite", &AioHandle::PwriteFd, py::arg("buffer"), py::arg("fd"),
           py::arg("file_offset") = 0)
      .def("async_pread", &AioHandle::PreadFd, py::arg("buffer"), py::arg("fd"),
           py::arg("file_offset") = 0)
      .def("wait", &AioHandle::Wait)
      .def("new_cpu_locked_tensor", &AioHandle::NewLockedTensor, py::arg("num_elem"),
           py::arg("example_tensor"))
      .def("free_cpu_locked_tensor", &AioHandle::FreeLockedTensor)
      .def("is_pinned", &AioHandle::IsPinned)
      .def("close", &AioHandle::Close);
}

}  // namespace spillway::python
