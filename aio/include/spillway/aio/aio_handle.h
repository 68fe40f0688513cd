// AioHandle: DeepSpeed's aio_handle contract (deepspeed/ops/csrc/aio) over Spillway's I/O engine,
// in C++ with no torch and no Python. It owns the file table (named files kept open, checked
// against the path on every use), the pending async ops, and the rules that make one handle safe to
// share between threads. spillway.aio_handle (python/src/bind_aio.cc) is its binding.
// Note [aio_handle] in docs/aio.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "spillway/aio/swap_store.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/owner.h"
#include "spillway/allocator/process.h"
#include "spillway/base/status.h"

namespace spillway::aio {

struct AioHandleOptions {
  // DeepSpeed's aio settings, reported back unchanged. block_size is how DeepSpeed cuts an op;
  // the engine's chunks are whole pages, so it is rounded up to 4 KiB for the engine (a chunk size
  // changes no byte of a transfer). intra_op_parallelism: every op's bytes must divide by it.
  uint64_t block_size = 1 << 20;
  int queue_depth = 128;
  bool single_submit = false;
  bool overlap_events = false;
  int intra_op_parallelism = 1;
  // The arena the engine takes its bounce buffers from. Required; must outlive the handle.
  allocator::HostArena* arena = nullptr;
  // "auto" (io_uring, else the thread pool), "uring" (refused where io_uring is not available),
  // or "thread_pool".
  std::string backend = "auto";
  // Blocks of the arena the engine bounces a buffer outside it through (1..1024). A handle whose
  // buffers are all in the arena needs one: the default is DeepSpeed's swap pattern's.
  uint32_t bounce_buffers = 8;
};

// When a call returns. kAsync: once submitted; wait() waits for it. kSync: once it and every async
// op submitted before it by this handle have finished (DeepSpeed's pread/pwrite with async false).
// kAlone: once it has finished, leaving earlier async ops to wait() (DeepSpeed's read/write).
enum class AioMode : uint8_t { kAsync, kSync, kAlone };

// What an op writes from or reads into. `keep` is held until the op has been waited for (for a
// tensor, a reference to its storage), so the bytes cannot be freed under the op.
struct AioBuffer {
  void* data = nullptr;
  uint64_t bytes = 0;
  std::shared_ptr<const void> keep;
};

class AioHandleImpl;

// Thread-safe: any number of threads may submit, wait and close at once. No lock is held across a
// syscall, an engine call or a wait. Every op goes to the file its caller named at the time of the
// call: a path renamed, unlinked or re-created since the handle opened it is opened again, and an
// fd op writes through a dup of the descriptor taken at the call.
//
// Errors follow DeepSpeed's contract: an op that fails returns -1 and says why in last_error(); a
// call that cannot run at all (the handle is closed, or this is a process forked from the one that
// made it) returns a Status.
class AioHandle {
 public:
  static Result<std::unique_ptr<AioHandle>> Create(const AioHandleOptions& options);
  // Waits for every op still in flight and closes every file. In a forked child it touches nothing
  // of the parent's (the ring, its threads, the files): they are left to the child's exit.
  ~AioHandle();
  AioHandle(const AioHandle&) = delete;
  AioHandle& operator=(const AioHandle&) = delete;

  // One op on the file `filename` names now, at `offset`. Returns 0 (kAsync: submitted), the
  // number of ops completed (kSync: 1 and the earlier async ops; kAlone: 1), or -1.
  Result<int> Submit(AioBuffer buffer, const std::string& filename, int64_t offset, bool write,
                     AioMode mode);
  // An async op on the file `fd` names at this call (a dup, closed when the op has finished).
  Result<int> SubmitFd(AioBuffer buffer, int fd, int64_t offset, bool write);
  // One op on DeepSpeed's swap file `path`, held whole in `store` (Note [DeepSpeed swap] in
  // docs/deepspeed.md): queued on the store's engine and tracked with this handle's other ops, so
  // wait() counts it and a sync mode waits for it. Returns as Submit does; unlike a file op, a
  // swap that fails raises its Status (from this call, or from the Wait() or sync call that
  // completes it, once every op it takes has finished), as the store's errors name the file.
  Result<int> SubmitSwap(AioBuffer buffer, std::shared_ptr<SwapStore> store,
                         const std::string& path, bool write, allocator::Kind kind, AioMode mode);
  // Waits for this handle's async ops: those this call takes, and those other threads' Wait()
  // took that were submitted before this call. Returns how many it took, or -1 if any failed.
  Result<int> Wait();
  // Waits for the ops in flight (their errors are not reported), closes every file, and refuses
  // every later call. Another thread's Close() in progress is waited for.
  Status Close();

  // The last failed op, as "<op> <file>: <why>".
  Result<std::string> last_error();
  // FailedPrecondition in a process forked from the one that made the handle.
  Status CheckProcess() const;

  uint64_t block_size() const { return options_.block_size; }
  int queue_depth() const { return options_.queue_depth; }
  bool single_submit() const { return options_.single_submit; }
  bool overlap_events() const { return options_.overlap_events; }
  int intra_op_parallelism() const { return options_.intra_op_parallelism; }
  // DeepSpeed's get_alignment(): intra_op_parallelism sectors of 512 bytes.
  int alignment() const { return options_.intra_op_parallelism * 512; }
  allocator::HostArena* arena() const { return options_.arena; }
  // The I/O engine the handle's ops run on, for a SwapStore to share (one engine serves the
  // handle's files and DeepSpeed's swaps). FailedPrecondition once the handle is closed.
  Result<std::shared_ptr<allocator::IoEngine>> engine() const;

 private:
  AioHandle(const AioHandleOptions& options, std::unique_ptr<AioHandleImpl> impl);

  const AioHandleOptions options_;
  const allocator::ProcessTag process_;  // the process that made it (Note [Fork])
  std::unique_ptr<AioHandleImpl> impl_;
};

}  // namespace spillway::aio
