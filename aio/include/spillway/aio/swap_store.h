// SwapStore: DeepSpeed's swap files as extents of one NvmeArena (an O_TMPFILE swap file in the swap
// folder's filesystem, CRC32C per extent, a budget), keyed by the path DeepSpeed names.
// spillway.deepspeed routes its swappers' async_pwrite/async_pread of those paths here
// (Note [DeepSpeed swap] in docs/deepspeed.md). No torch, no Python.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/ledger.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/allocator/owner.h"
#include "spillway/base/status.h"

namespace spillway::aio {

struct SwapStoreOptions {
  std::string directory;      // DeepSpeed's nvme_path (swap folder): must exist
  uint64_t budget_bytes = 0;  // 0: what the folder's filesystem has free now
  // Required: the engine the store's transfers run on; the store keeps it alive. spillway.deepspeed
  // passes the engine of the swapper's aio handle, so one engine serves DeepSpeed's swaps and its
  // other aio ops (AioHandle::engine()).
  std::shared_ptr<allocator::IoEngine> engine;
  allocator::Ledger* ledger = nullptr;  // required: its boundaries and scopes see the store
};

// Thread-safe. mu_ guards the path table only: no I/O and no arena call runs under it. DeepSpeed
// never has two transfers of one path in flight, and the store does not order them: two writes of
// one path and size share its extent, and the one completed last records its checksum, whichever
// bytes landed last (a later read's checksum check is what catches a mismatch); a read in flight
// across a rewrite fails its checksum check. A write that another write or a free overtook (the
// arena's generation check) is refused, never recorded as valid.
class SwapStore {
 public:
  static Result<std::unique_ptr<SwapStore>> Create(const SwapStoreOptions& options);
  ~SwapStore();
  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;

  // The whole buffer into the path's extent (made, or remade when the size changed), booked as
  // `kind`. A failure names the path; the store's other files are untouched. A rewrite with another
  // size frees the old extent first (DeepSpeed replaces the file whole), so a failed one drops the
  // path, and a failed write leaves its extent unwritten: read it again only after a good write.
  Status Write(const std::string& path, const void* data, uint64_t bytes, allocator::Kind kind);
  // The path's extent into the buffer, its checksum verified. The buffer must be the extent's
  // size: DeepSpeed writes and reads whole files.
  Status Read(const std::string& path, void* data, uint64_t bytes);
  // Write and Read in two halves, for the aio handle that keeps DeepSpeed's swaps in flight on
  // its engine (AioHandle::SubmitSwap): Submit* queues the transfer, Complete waits for it and
  // records or verifies its checksum. Errors are Write's and Read's, naming the path. Each
  // submitted transfer is completed exactly once; the buffer stays valid until then.
  using Transfer = allocator::NvmeArena::Transfer;
  Result<Transfer> SubmitWrite(const std::string& path, const void* data, uint64_t bytes,
                               allocator::Kind kind);
  Result<Transfer> SubmitRead(const std::string& path, void* data, uint64_t bytes);
  Status Complete(const Transfer& transfer, const std::string& path);
  bool Contains(const std::string& path) const;
  int64_t Size(const std::string& path) const;  // -1: no such file
  // Paths that start with `prefix`, sorted.
  std::vector<std::string> Paths(const std::string& prefix) const;
  // Forgets the files under `prefix` and frees their extents (DeepSpeed's rmtree of a folder).
  Result<size_t> Remove(const std::string& prefix);
  size_t files() const;

  // The arena, for its stats and for an exporter to watch (arena="deepspeed-swap:<nvme_path>").
  const allocator::NvmeArena& arena() const { return *arena_; }
  // Test seam: flips one byte of the path's extent on disk (behind the arena's back).
  Status CorruptForTesting(const std::string& path, uint64_t byte);

 private:
  struct Entry {
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  SwapStore() = default;
  // The path's extent of exactly `bytes`, made or remade.
  Result<uint64_t> ExtentFor(const std::string& path, uint64_t bytes, allocator::Kind kind);

  std::shared_ptr<allocator::IoEngine> engine_;  // declared first: outlives the arena on it
  std::unique_ptr<allocator::NvmeArena> arena_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> paths_;  // guarded by mu_
};

}  // namespace spillway::aio
