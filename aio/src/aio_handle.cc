// AioHandle: DeepSpeed's aio_handle contract on Spillway's I/O engine. Owns the file table (named
// files kept open, checked against the path on every use), the pending async ops, and the rules
// that make one handle safe to share between threads. Note [aio_handle] in docs/aio.md.
#include "spillway/aio/aio_handle.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
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

#include "spillway/allocator/io_engine.h"
#include "spillway/base/log.h"

namespace spillway::aio {
namespace {

// O_DIRECT's alignment of offsets, sizes and addresses, and the engine's chunk granule.
constexpr uint64_t kDirectAlign = 4096;

Status ClosedError() {
  return Status::Make(StatusCode::kFailedPrecondition, "aio_handle is closed; make a new one");
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
  std::shared_ptr<const void> keep;  // the buffer stays alive until the op is waited for
  bool done = false;  // completed early (to free its file's slot); `status` is its result
  bool ready = true;  // for done ops: false while the thread that completes it is still waiting
  Status status;
  // A DeepSpeed swap (SubmitSwap): the store's transfer, completed by the store, whose failure is
  // raised as a Status (a checksum mismatch names the swap file), not only reported as -1.
  std::shared_ptr<SwapStore> store;
  SwapStore::Transfer swap;
  std::string path;
};

// The first failed op of a batch: "<op> <file>: <status>" for last_error, and the Status of the
// first failed swap, which is raised.
struct Failure {
  std::string message;
  Status raise;
  void Note(const Pending& p, const Status& st) {
    if (st.ok()) return;
    if (message.empty()) message = StrCat(p.what, ": ", st.ToString());
    if (p.store != nullptr && raise.ok()) raise = st;
  }
};

}  // namespace

// The handle's state. mu_ is never held across a syscall, an engine call or a wait: lookups pin a
// file (users), the work happens unlocked, and the last user of a file that left the table
// unregisters and closes it.
//
// Invariants: every op submitted has a seq in outstanding_ until its wait finished; Wait() returns
// only when every op submitted before it, by any thread, has finished.
class AioHandleImpl {
 public:
  AioHandleImpl(int intra_op_parallelism, std::shared_ptr<allocator::IoEngine> engine)
      : intra_op_(intra_op_parallelism), engine_(std::move(engine)) {}

  // Open descriptors kept at most (half the engine's fixed-file slots): past that, the least
  // recently used one with no call in progress leaves the table (closed when its ops finish).
  static constexpr size_t kMaxOpenFiles = 128;

  // Wait()'s body: the ops submitted before it, or (a sync op's drain) before
  // seq `before` only. `raise` receives the error of a closed handle or of a failed swap.
  int Wait(Status* raise, uint64_t before = UINT64_MAX) {
    std::vector<Pending> ops;
    std::shared_ptr<allocator::IoEngine> engine;
    uint64_t horizon = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (engine_ == nullptr) {
        *raise = ClosedError();
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
    Failure failure = Finish(engine.get(), &ops);
    std::vector<Pending> late;  // destroyed after the lock (a buffer's deleter may free memory)
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return outstanding_.empty() || *outstanding_.begin() >= horizon; });
    // Ops submitted before this wait that another thread was completing early (to close their
    // file) when it began: finished now, so their results are this wait's, errors included.
    TakeReadyEarly(&late, horizon);
    for (const Pending& p : late) failure.Note(p, p.status);
    if (!failure.message.empty()) {
      last_error_ = failure.message;
      if (!failure.raise.ok()) *raise = failure.raise;
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

  int Fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(mu_);
    last_error_ = message;
    return -1;
  }

  // Submit's body: returns 0 (kAsync, submitted), the number of completed ops (kSync: 1 and the
  // async ops pending before it; kAlone: 1), or -1 with last_error. `raise` receives the error of
  // a closed handle.
  // `fd_op`: the op is on the caller's descriptor `fd`, else on the file `filename` names.
  int Transfer(AioBuffer buffer, bool fd_op, const std::string& filename, int fd, int64_t offset,
               bool write, AioMode mode, Status* raise) {
    void* const data = buffer.data;
    const uint64_t n = buffer.bytes;
    const char* op = write ? "pwrite" : "pread";
    const std::string name = fd_op ? StrCat("fd ", fd) : filename;
    if (offset < 0) return Fail(StrCat(op, " ", name, ": negative file offset ", offset));
    if (n % static_cast<uint64_t>(intra_op_) != 0) {
      return Fail(StrCat(op, " ", name, ": ", n, " bytes is not divisible by intra_op_parallelism=",
                         intra_op_, " (DeepSpeed's rule); pad the tensor or use 1"));
    }
    const std::shared_ptr<allocator::IoEngine> engine = BeginCall();
    if (engine == nullptr) {
      *raise = ClosedError();
      return -1;
    }
    Active active{this};
    if (fd_op && fd < 0) return Fail(StrCat(op, " ", name, ": not a descriptor"));
    // Page-aligned requests on a named file go through O_DIRECT (DeepSpeed's mode: no page cache,
    // no double copy); others through a buffered descriptor, so no size or offset is refused.
    const bool direct = !fd_op && direct_ok_.load() && offset % kDirectAlign == 0 &&
                        n % kDirectAlign == 0 &&
                        reinterpret_cast<uintptr_t>(data) % kDirectAlign == 0;
    struct stat now {};  // the file as it is at this call (its size, for reads)
    Result<FilePtr> file = fd_op ? DupFd(engine, fd, write ? nullptr : &now)
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
      if (mode == AioMode::kSync) {
        const int earlier = Wait(raise);
        return earlier < 0 ? -1 : 1 + earlier;
      }
      return mode == AioMode::kAsync ? 0 : 1;
    }
    Result<allocator::Ticket> t =
        write ? engine->SubmitWrite(f->id, static_cast<uint64_t>(offset), data, n)
              : engine->SubmitRead(f->id, static_cast<uint64_t>(offset), data, n);
    if (!t.ok()) {
      Unpin(f);
      return Fail(StrCat(op, " ", name, ": ", t.status().ToString()));
    }
    Pending p{*t, 0, StrCat(op, " ", name), f, std::move(buffer.keep)};
    return Track(engine.get(), std::move(p), mode, raise);
  }

  // SubmitSwap's body: the transfer queued by the store (on its engine), then tracked as any op.
  // A transfer that cannot be submitted raises its error (it names the swap file).
  int SwapTransfer(AioBuffer buffer, std::shared_ptr<SwapStore> store, const std::string& path,
                   bool write, allocator::Kind kind, AioMode mode, Status* raise) {
    const std::shared_ptr<allocator::IoEngine> engine = BeginCall();
    if (engine == nullptr) {
      *raise = ClosedError();
      return -1;
    }
    Active active{this};
    Result<SwapStore::Transfer> t = write
                                        ? store->SubmitWrite(path, buffer.data, buffer.bytes, kind)
                                        : store->SubmitRead(path, buffer.data, buffer.bytes);
    if (!t.ok()) {
      *raise = t.status();
      return Fail(StrCat(write ? "pwrite " : "pread ", path, ": ", t.status().ToString()));
    }
    Pending p{0, 0, StrCat(write ? "pwrite " : "pread ", path), nullptr, std::move(buffer.keep)};
    p.store = std::move(store);
    p.swap = *std::move(t);
    p.path = path;
    return Track(engine.get(), std::move(p), mode, raise);
  }

  // A call between BeginCall and its submission: close() waits for it.
  struct Active {
    AioHandleImpl* h;
    ~Active() {
      {
        std::lock_guard<std::mutex> lock(h->mu_);
        h->active_--;
      }
      h->done_.notify_all();
    }
  };

  // Transfer's entry under mu_: the engine, with this call counted in active_; null when the
  // handle is closed or closing.
  std::shared_ptr<allocator::IoEngine> BeginCall() {
    std::lock_guard<std::mutex> lock(mu_);
    if (engine_ == nullptr || closing_) return nullptr;
    active_++;  // close() waits for this call to have submitted (or failed)
    return engine_;
  }

  // Transfer's end: records the submitted op `p` (its seq outstanding, its file pinned by it until
  // it is waited for). kAsync leaves it to wait(); kSync and kAlone wait for it here, without mu_,
  // and kSync then for the async ops submitted before it. Returns as Transfer does.
  int Track(allocator::IoEngine* engine, Pending p, AioMode mode, Status* raise) {
    std::unique_lock<std::mutex> lock(mu_);
    p.seq = next_seq_++;
    outstanding_.insert(p.seq);
    if (mode == AioMode::kAsync) {
      pending_.push_back(std::move(p));  // f stays pinned by the op until it is waited for
      return 0;
    }
    lock.unlock();
    // A sync op is never in pending_, so another thread's wait() cannot take it (or its error).
    const uint64_t own = p.seq;
    std::vector<Pending> one;
    one.push_back(std::move(p));
    const Failure failure = Finish(engine, &one);
    // kSync: then the async ops submitted before it, as wait() does (DeepSpeed's _wait_locked()),
    // never those other threads submitted while it ran: those are their wait()'s.
    const int earlier = mode == AioMode::kSync ? Wait(raise, own) : 0;
    if (!failure.message.empty()) {
      if (!failure.raise.ok()) *raise = failure.raise;  // this op's failure before earlier ones'
      return Fail(failure.message);
    }
    return earlier < 0 ? -1 : 1 + earlier;
  }

  // Waits for `ops` without the lock (a swap is completed by its store); then retires them (seq
  // done, file unpinned). Returns the first failure.
  Failure Finish(allocator::IoEngine* engine, std::vector<Pending>* ops) {
    Failure failure;
    for (Pending& p : *ops) {
      const Status st = p.done               ? p.status
                        : p.store != nullptr ? p.store->Complete(p.swap, p.path)
                                             : engine->Wait(p.ticket);
      failure.Note(p, st);
    }
    for (Pending& p : *ops) {
      if (!p.done && p.file != nullptr)
        Unpin(p.file);  // early ones were unpinned when they completed
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const Pending& p : *ops) outstanding_.erase(p.seq);
    }
    done_.notify_all();
    return failure;
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
    FilePtr cached = PinCached(key);
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
      EnterLocked(key, f, &evicted, &early);
    }
    CompleteEarly(engine.get(), &early);
    for (const FilePtr& e : evicted) CloseIfUnused(e);
    return f;
  }

  // Pins, under mu_, the table's descriptor for `key`; null when there is none.
  FilePtr PinCached(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(key);
    if (it == files_.end()) return nullptr;
    FilePtr cached = it->second;
    cached->users++;
    cached->last_use = ++use_clock_;
    return cached;
  }

  // Assumes mu_. Enters `f` in the table under `key`, replacing one another thread entered
  // meanwhile and making room under kMaxOpenFiles. *evicted: the files that left the table (closed
  // by the caller once unused); *early: the async ops of an evicted file, which the caller
  // completes without mu_ (CompleteEarly) to free its fixed-file slot.
  void EnterLocked(const std::string& key, const FilePtr& f, std::vector<FilePtr>* evicted,
                   std::vector<Pending>* early) {
    f->last_use = ++use_clock_;
    auto it = files_.find(key);
    if (it != files_.end()) {  // another thread opened it meanwhile: ours replaces it
      it->second->in_table = false;
      evicted->push_back(it->second);
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
          early->push_back({p->ticket, p->seq, p->what, p->file, nullptr, true, false, Status()});
          done_early_.push_back(std::move(*p));  // visible to wait()/close() from now on
          done_early_.back().done = true;
          done_early_.back().ready = false;
          p = pending_.erase(p);
        } else {
          ++p;
        }
      }
      lru->second->in_table = false;
      evicted->push_back(lru->second);
      files_.erase(lru);
    }
    files_[key] = f;
  }

  // Without mu_: waits for the ops EnterLocked completed early, then records their results for
  // wait() under mu_ and wakes the waiters.
  void CompleteEarly(allocator::IoEngine* engine, std::vector<Pending>* early) {
    for (Pending& p : *early) {
      p.status = engine->Wait(p.ticket);
      Unpin(p.file);
    }
    if (!early->empty()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (const Pending& e : *early) {
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

  void Close() {
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

  std::shared_ptr<allocator::IoEngine> Engine() {
    std::lock_guard<std::mutex> lock(mu_);
    return engine_;
  }

  std::string LastError() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_error_;
  }

  // A forked child: the ring, its threads and the files are the parent's. Destroying them here
  // would join threads the child does not have and free buffers into the parent's arena, so they
  // are left to the child's exit.
  void Abandon() {
    new std::shared_ptr<allocator::IoEngine>(std::move(engine_));
    new std::map<std::string, FilePtr>(std::move(files_));
    new std::vector<Pending>(std::move(pending_));
    new std::vector<Pending>(std::move(done_early_));
  }

 private:
  const int intra_op_;
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
  std::string last_error_;          // guarded by mu_
};

Result<std::unique_ptr<AioHandle>> AioHandle::Create(const AioHandleOptions& options) {
  if (options.block_size == 0 || options.queue_depth <= 0 || options.intra_op_parallelism <= 0) {
    return Status::InvalidArgument(StrCat(
        "aio_handle(block_size=", options.block_size, ", queue_depth=", options.queue_depth,
        ", intra_op_parallelism=", options.intra_op_parallelism, "): each must be positive"));
  }
  const std::string& backend = options.backend;
  if (backend != "auto" && backend != "uring" && backend != "thread_pool") {
    return Status::InvalidArgument(
        StrCat("aio_handle(backend='", backend, "'): one of 'auto', 'uring', 'thread_pool'"));
  }
  if (options.bounce_buffers == 0 || options.bounce_buffers > allocator::kMaxBounceBuffers) {
    return Status::InvalidArgument(StrCat("aio_handle(bounce_buffers=", options.bounce_buffers,
                                          "): use 1..", allocator::kMaxBounceBuffers));
  }
  if (options.arena == nullptr) {
    return Status::InvalidArgument(
        "aio_handle: no arena for the engine's bounce buffers; pass one");
  }
  allocator::IoEngineOptions eo;
  eo.arena = options.arena;
  eo.block_size = (options.block_size + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  eo.queue_depth = static_cast<uint32_t>(options.queue_depth);
  eo.bounce_buffers = options.bounce_buffers;
  eo.force_thread_pool = backend == "thread_pool";
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<allocator::IoEngine> engine,
                            allocator::IoEngine::Create(eo));
  if (backend == "uring" && engine->Stats().backend != allocator::IoBackend::kUring) {
    return Status::Make(
        StatusCode::kUnavailable,
        StrCat("aio_handle(backend='uring'): io_uring is not available here (",
               engine->Stats().fallback_reason, "); use backend='auto' or 'thread_pool'"));
  }
  auto impl = std::make_unique<AioHandleImpl>(
      options.intra_op_parallelism, std::shared_ptr<allocator::IoEngine>(std::move(engine)));
  return std::unique_ptr<AioHandle>(new AioHandle(options, std::move(impl)));
}

AioHandle::AioHandle(const AioHandleOptions& options, std::unique_ptr<AioHandleImpl> impl)
    : options_(options), impl_(std::move(impl)) {}

AioHandle::~AioHandle() {
  if (!process_.InOwner()) {
    impl_->Abandon();
    // Not destroyed either: its condition variable may count waiters that were the parent's
    // threads, and destroying it would wait for them.
    (void)impl_.release();
    return;
  }
  impl_->Close();
}

// Every call in a process forked from the one that made the handle is refused: the child has no
// ring thread and must not touch the parent's ring, fixed files or buffers.
Status AioHandle::CheckProcess() const {
  if (process_.InOwner()) return Status::Ok();
  return Status::FailedPrecondition(
      StrCat("aio_handle was made in process ", process_.pid(), " and this is a forked child (pid ",
             ::getpid(),
             "); its ring and files belong to the parent. Make a new aio_handle in the child"));
}

Result<int> AioHandle::Submit(AioBuffer buffer, const std::string& filename, int64_t offset,
                              bool write, AioMode mode) {
  SPILLWAY_RETURN_IF_ERROR(CheckProcess());
  Status raise;
  const int rc = impl_->Transfer(std::move(buffer), /*fd_op=*/false, filename, -1, offset, write,
                                 mode, &raise);
  SPILLWAY_RETURN_IF_ERROR(raise);
  return rc;
}

Result<int> AioHandle::SubmitFd(AioBuffer buffer, int fd, int64_t offset, bool write) {
  SPILLWAY_RETURN_IF_ERROR(CheckProcess());
  Status raise;
  const int rc = impl_->Transfer(std::move(buffer), /*fd_op=*/true, "", fd, offset, write,
                                 AioMode::kAsync, &raise);
  SPILLWAY_RETURN_IF_ERROR(raise);
  return rc;
}

Result<int> AioHandle::SubmitSwap(AioBuffer buffer, std::shared_ptr<SwapStore> store,
                                  const std::string& path, bool write, allocator::Kind kind,
                                  AioMode mode) {
  SPILLWAY_RETURN_IF_ERROR(CheckProcess());
  if (store == nullptr) return Status::InvalidArgument(StrCat("swap ", path, ": no swap store"));
  Status raise;
  const int rc =
      impl_->SwapTransfer(std::move(buffer), std::move(store), path, write, kind, mode, &raise);
  SPILLWAY_RETURN_IF_ERROR(raise);
  return rc;
}

Result<std::shared_ptr<allocator::IoEngine>> AioHandle::engine() const {
  SPILLWAY_RETURN_IF_ERROR(CheckProcess());
  std::shared_ptr<allocator::IoEngine> engine = impl_->Engine();
  if (engine == nullptr) return ClosedError();
  return engine;
}

Result<int> AioHandle::Wait() {
  SPILLWAY_RETURN_IF_ERROR(CheckProcess());
  Status raise;
  const int rc = impl_->Wait(&raise);
  SPILLWAY_RETURN_IF_ERROR(raise);
  return rc;
}

Status AioHandle::Close() {
  SPILLWAY_RETURN_IF_ERROR(CheckProcess());
  impl_->Close();
  return Status::Ok();
}

Result<std::string> AioHandle::last_error() {
  SPILLWAY_RETURN_IF_ERROR(CheckProcess());
  return impl_->LastError();
}

}  // namespace spillway::aio
