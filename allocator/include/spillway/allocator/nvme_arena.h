// NvmeArena: exact extents in one preallocated, anonymous swap file (DeepSpeed's nvme_path), with
// the same owner tags, lifetimes, boundaries and budget as the host arena, and a CRC32C per extent
// written with it and verified on every read. I/O runs on a IoEngine. See docs/nvme.md.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "spillway/allocator/extent_map.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/ledger.h"
#include "spillway/allocator/live_stats.h"
#include "spillway/allocator/node_governor.h"
#include "spillway/allocator/owner.h"
#include "spillway/allocator/process.h"
#include "spillway/base/status.h"

namespace spillway::allocator {

class LiveTable;

// One-shot fault injection for tests: a non-zero errno makes the next fallocate fail with it.
struct NvmeArenaFaults {
  std::atomic<int> fallocate_errno{0};
};

struct NvmeArenaOptions {
  std::string name = "nvme";
  std::string directory;               // nvme_path: must exist and be writable
  uint64_t budget_bytes = 0;           // the most the swap file may grow to; required
  uint64_t grow_bytes = 256ull << 20;  // fallocate step
  EscapePolicy policy = EscapePolicy::kReport;
  bool checksum = true;      // CRC32C per extent, verified on read
  Ledger* ledger = nullptr;  // null = Ledger::Default()
  // The node's NVMe ledger (Note [Node governor]): each growth of the swap file is booked there
  // first and given back when the arena closes. Null: NodeGovernor::Current(), if any.
  std::shared_ptr<NodeGovernor> node;
  NvmeArenaFaults* faults = nullptr;  // test seam
};

struct NvmeArenaStats : LiveStats {
  EscapePolicy policy = EscapePolicy::kReport;
  uint64_t budget_bytes = 0;
  uint64_t capacity_bytes = 0;  // the file's preallocated size
  uint64_t free_bytes = 0;      // inside the file, not allocated
  uint64_t peak_capacity_bytes = 0;
  uint32_t alignment = 0;  // direct-I/O granule in force
  bool direct_io = true;
  bool checksum = true;
  uint64_t grow_count = 0;
  bool grows_without_fallocate =
      false;  // the filesystem refused fallocate: ftruncate grows the file
  uint64_t over_budget_count = 0;
  uint64_t no_space_count = 0;
  uint64_t checksum_failures = 0;
  uint64_t write_failures = 0;
  uint64_t read_failures = 0;
  uint64_t written_bytes = 0;  // through Write (verified complete)
  uint64_t read_bytes = 0;     // through Read (checksum verified)
};

// Thread-safe. mu_ guards the extent map, the live table and the checksum table; it is never held
// across fallocate or I/O.
// Invariants (Validate): capacity == live + free; every extent is a multiple of the alignment;
// capacity <= budget; each checksum belongs to a live extent.
class NvmeArena final : public Tier {
 public:
  // Opens the swap file. On error nothing is left on disk.
  static Result<std::unique_ptr<NvmeArena>> Create(NvmeArenaOptions options, IoEngine* engine);
  ~NvmeArena() override;
  NvmeArena(const NvmeArena&) = delete;
  NvmeArena& operator=(const NvmeArena&) = delete;

  // An extent of `bytes` rounded up to the alignment; returns its file offset.
  Result<uint64_t> Allocate(uint64_t bytes, const OwnerTag& tag);
  Status Free(uint64_t offset);

  // Writes the whole extent at `offset` from `src` (exactly the size it was allocated with) and
  // records its checksum once the write completed. On error the extent holds no valid data and
  // `src` is untouched: the caller's copy is still the only good one.
  Status Write(uint64_t offset, const void* src, uint64_t bytes);
  // Reads the whole extent into `dst` and verifies its checksum. A mismatch is kChecksumMismatch
  // naming the owner; an extent never written (or whose last write failed) is an error too.
  Status Read(uint64_t offset, void* dst, uint64_t bytes);

  // Write and Read in two halves, for callers that keep several whole-extent transfers in flight
  // on the engine (the aio handle's DeepSpeed swaps): Submit* checks the extent and queues the
  // transfer; Complete waits for it, then records the checksum (a write) or verifies it (a read),
  // with Write's and Read's errors and counts. Each submitted transfer is completed exactly once;
  // its buffer stays valid, and unmodified for a write, until then.
  struct Transfer {
    Ticket ticket = 0;
    uint64_t offset = 0;
    uint64_t bytes = 0;
    uint64_t generation = 0;  // a write's (CommitWrite's rule: a newer one wins)
    uint32_t crc = 0;         // a write's checksum (computed at submit), a read's expected one
    bool write = false;
    const void* data = nullptr;
    std::string what;  // the extent, for messages
  };
  Result<Transfer> SubmitWrite(uint64_t offset, const void* src, uint64_t bytes);
  Result<Transfer> SubmitRead(uint64_t offset, void* dst, uint64_t bytes);
  Status Complete(const Transfer& t);

  // Chunked access, for the transfer pipeline that streams an extent through staging buffers.
  // Ranges start on the alignment; only the last may end unaligned (at the extent's end).
  // The checksum an extent's data must have; FAILED_PRECONDITION when it holds no valid data.
  // Checking it is the caller's job (it sees the chunks in order: Crc32cExtend).
  Result<uint32_t> ExpectedChecksum(uint64_t offset, uint64_t bytes) const;
  Result<Ticket> SubmitReadRange(uint64_t offset, uint64_t range_offset, void* dst,
                                 uint64_t length);
  // A chunked write: BeginWrite invalidates the extent and returns the write's generation,
  // SubmitWriteRange queues pieces, CommitWrite records the checksum of the whole once every piece
  // completed (or leaves it invalid on error). An extent freed, re-allocated or written again
  // since BeginWrite has a newer generation: CommitWrite then refuses (FAILED_PRECONDITION) and
  // records nothing, so an old write never validates a new owner's extent.
  Result<uint64_t> BeginWrite(uint64_t offset, uint64_t bytes);
  Result<Ticket> SubmitWriteRange(uint64_t offset, uint64_t range_offset, const void* src,
                                  uint64_t length);
  Status CommitWrite(uint64_t offset, uint64_t bytes, uint32_t crc, uint64_t generation);
  // Collects a SubmitReadRange or SubmitWriteRange ticket (IoEngine::Wait).
  Status Wait(Ticket ticket) { return engine_->Wait(ticket); }
  bool checksum_enabled() const { return options_.checksum; }

  NvmeArenaStats Stats() const;
  Status Validate() const;
  uint32_t alignment() const { return alignment_; }
  // The swap file's descriptor, for tests that corrupt it on purpose.
  int fd_for_testing() const { return fd_; }

  const std::string& tier_name() const override { return options_.name; }
  Status CollectBoundary(BoundaryKind kind, int64_t epoch, int64_t step, TierReport* out) override;
  void ReleaseScope(ScopeId scope, TierReport* out) override;

 private:
  struct Check {
    bool valid = false;  // the last write completed
    uint32_t crc = 0;
    uint64_t generation = 0;  // of the allocation or write that last set it
  };
  // mu_ held. The extent at `offset` starts a new owner or write: invalid, with a new generation.
  uint64_t NewGenerationLocked(uint64_t offset);
  NvmeArena(NvmeArenaOptions options, IoEngine* engine, Ledger* ledger, int fd, int file_id,
            uint32_t alignment, bool direct);
  // Grows the file by fallocate so that `need` more bytes fit. Without mu_.
  Status Grow(uint64_t need);
  // mu_ held: checks that `offset` is a live extent of exactly `bytes` requested bytes and fills
  // `what` with a description for messages ("param owner 3 (1.00 MiB at offset 8192)").
  Status CheckExtentLocked(uint64_t offset, uint64_t bytes, const char* verb,
                           std::string* what) const;
  // mu_ held: checks [range_offset, +length) against the extent at `offset`.
  Status CheckRangeLocked(uint64_t offset, uint64_t range_offset, uint64_t length,
                          const char* verb) const;

  NvmeArenaOptions options_;  // options_.node: null, or the node this arena books its growth in
  IoEngine* const engine_;
  Ledger* const ledger_;
  const int fd_;
  const int file_id_;
  const uint32_t alignment_;
  const bool direct_;

  const ProcessTag process_;  // Note [Fork]: every entry point refuses in a forked child
  mutable std::mutex mu_;
  ForkSafeCondition grown_cv_;                  // a growth finished
  std::atomic<bool> without_fallocate_{false};  // set once fallocate said EOPNOTSUPP
  bool growing_ = false;                        // guarded by mu_: one fallocate at a time
  ExtentMap extents_;                           // guarded by mu_: one span, the whole file
  std::unique_ptr<LiveTable> live_;             // guarded by mu_
  std::unordered_map<uint64_t, Check> checks_;  // guarded by mu_: by extent offset
  uint64_t next_generation_ = 0;                // guarded by mu_
  NvmeArenaStats stats_;                        // guarded by mu_
};

}  // namespace spillway::allocator
