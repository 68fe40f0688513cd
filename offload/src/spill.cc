// PartitionStore, moving partitions off the host tier: the arena's spill handler (OPT's victims
// under the host budget), one partition's write-out, Flush and Evict. Note [Spill] in
// docs/offload.md.
#include <algorithm>
#include <cstring>

#include "device_views.h"
#include "prefetcher.h"
#include "spill_note.h"
#include "spillway/base/bytes.h"
#include "spillway/base/check.h"
#include "spillway/base/log.h"
#include "spillway/offload/partition_store.h"

namespace spillway::offload {
namespace {

// Why a spill freed nothing when no other thread holds host memory: this thread's own handles
// (`by_me`) do, or allocations outside the store.
std::string NothingSpillableNote(uint64_t by_me) {
  return by_me > 0
             ? StrCat(FormatBytes(by_me),
                      " of host memory is held by this thread's own live "
                      "handles and nothing else can spill; release handles before acquiring more")
             : std::string(
                   "no partition can spill: the budget is held by allocations outside "
                   "the store (staging and bounce buffers, other users of the arena); "
                   "raise the host budget");
}

// Why a spill gave up after waiting `wait_ms` for the `by_others` bytes other threads hold.
std::string WaitedInVainNote(int64_t wait_ms, uint64_t by_others, uint64_t by_me) {
  return StrCat("waited ", wait_ms, " ms for the ", FormatBytes(by_others),
                " that other "
                "threads hold (live handles, spills or swap-ins in progress) and not enough "
                "came free; this thread's own handles hold ",
                FormatBytes(by_me),
                ". Release handles sooner, raise the host budget, or raise memory_wait");
}

}  // namespace

SpillNote& ThisThreadsSpillNote() {
  thread_local SpillNote note;
  return note;
}

std::string PartitionStore::SpillShortfallNote() const {
  SpillNote& mine = ThisThreadsSpillNote();
  std::string note;
  if (mine.store == this) note = std::move(mine.text);
  mine = SpillNote();
  return note;
}

// Victims: a partition at least as large as the request first (freeing it makes room by itself:
// its extent fits, or its region empties and is unmapped), then OPT's order (the next use
// furthest away; with spillway.eviction "lru", the use longest ago). Among the large enough, that
// order too. Freeing smaller ones scattered through
// shared regions may make room nowhere, however many bytes they add up to.
uint64_t PartitionStore::Spill(const allocator::HostArena::SpillRequest& request) {
  if (nvme_ == nullptr) return 0;
  const uint64_t need = request.bytes_needed;
  const uint64_t page =
      host_->page_bytes();  // the arena's granule: an extent is its bytes rounded up
  const std::thread::id me = std::this_thread::get_id();
  const bool may_wait = me != prefetcher_id_;  // prefetching is best effort: it never waits
  uint64_t freed = 0;
  std::string note;
  std::unique_lock<std::mutex> lock(mu_);
  // One deadline per allocation, not per call: the arena calls again while calls free something.
  const SpillNote& mine = ThisThreadsSpillNote();
  const bool ours = mine.store == this && mine.has_deadline;
  const auto deadline = ours ? mine.deadline : std::chrono::steady_clock::now() + memory_wait_;
  bool waited = false;
  while (freed < need && !stopping_) {
    PartitionId victim = 0;
    uint64_t best = 0;
    bool found = false, victim_fits = false;
    for (PartitionId i = 0; i < parts_.size(); ++i) {
      const Part& p = parts_[i];
      if (p.host == nullptr || p.pins > 0 || p.busy || p.bytes == 0) continue;
      const bool fits = (p.bytes + page - 1) / page * page >= request.request_bytes;
      // Larger goes first: the next use's distance (OPT), or the time since the last use (LRU).
      const uint64_t d = config_.spillway.eviction == Eviction::kLru ? use_clock_ - p.last_use
                                                                     : schedule_.NextUseDistance(i);
      if (!found || (fits && !victim_fits) || (fits == victim_fits && d > best)) {
        best = d;
        victim = i;
        victim_fits = fits;
        found = true;
      }
    }
    if (found) {
      MarkBusy(parts_[victim]);
      lock.unlock();
      Status st = SpillOne(victim, &freed);
      lock.lock();
      ClearBusyLocked(victim);
      if (!st.ok()) {
        note = st.WithContext("spilling to NVMe under the host budget").ToString();
        Log(LogLevel::kError, note);
        break;  // the victim keeps its host copy; the caller gets the budget error
      }
      if (victim_fits) break;  // its room is the request's
      continue;
    }
    // Nothing can be spilled now. Wait only for memory another thread will give back.
    uint64_t by_others = 0, by_me = 0;
    HeldBytesLocked(&by_others, &by_me);
    if (by_others == 0) {
      note = NothingSpillableNote(by_me);
      break;
    }
    if (!may_wait) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      stats_.memory_wait_timeouts++;
      note = WaitedInVainNote(memory_wait_.count(), by_others, by_me);
      break;
    }
    if (!waited) stats_.memory_waits++;
    waited = true;
    busy_cv_.wait_until(lock, deadline);  // woken when a partition's busy mark or last pin goes
  }
  ThisThreadsSpillNote() = SpillNote{this, std::move(note), ours, deadline};
  return freed;
}

void PartitionStore::SetSpillNotice(std::string notice) {
  std::lock_guard<std::mutex> lock(mu_);
  spill_notice_ = std::move(notice);
}

Status PartitionStore::SpillOne(PartitionId id, uint64_t* freed) {
  uint64_t bytes, off;
  void* host;
  bool write;
  allocator::OwnerTag tag;
  std::string notice;  // the first spill's warning, logged without mu_
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Part& p = parts_[id];
    bytes = p.bytes;
    off = p.nvme_off;
    host = p.host;
    write = p.dirty || !p.nvme_valid;
    tag = Tag(id);
  }
  if (off == kNoExtent) {
    SPILLWAY_ASSIGN_OR_RETURN(off, nvme_->Allocate(bytes, tag));
    std::lock_guard<std::mutex> lock(mu_);
    parts_[id].nvme_off = off;
  }
  if (write) {
    StoreHooks* hooks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      hooks = hooks_;
    }
    if (hooks != nullptr && hooks->before_spill_write) hooks->before_spill_write(id);
    // Nothing is lost: the host copy is freed only after the write completed in full.
    SPILLWAY_RETURN_IF_ERROR(nvme_->Write(off, host, bytes));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    Part& p = parts_[id];
    p.nvme_valid = true;
    p.dirty = false;
    p.host = nullptr;
    notice.swap(spill_notice_);
    stats_.spills++;
    stats_.spill_bytes += bytes;
    stats_.spill_writes += write ? 1 : 0;
  }
  if (!notice.empty()) Log(LogLevel::kWarning, notice);
  SPILLWAY_RETURN_IF_ERROR(host_->Free(host));
  *freed += bytes;
  return Status::Ok();
}

Status PartitionStore::Flush() {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("PartitionStore", "Flush"));  // Note [Fork]
  std::vector<PartitionId> todo;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (PartitionId i = 0; i < parts_.size(); ++i) {
      const Part& p = parts_[i];
      if (p.host != nullptr && p.dirty && (p.home == Placement::kNvme || p.nvme_off != kNoExtent)) {
        todo.push_back(i);
      }
    }
  }
  for (PartitionId id : todo) {
    void* host;
    uint64_t off, bytes;
    StoreHooks* hooks;
    {
      std::unique_lock<std::mutex> lock(mu_);
      TakeBusyLocked(lock, id);
      Part& p = parts_[id];
      // A live write handle may be writing the copy: flushing it now would read bytes in
      // flux. It stays dirty and goes out on a later flush or spill.
      if (p.host == nullptr || !p.dirty || p.write_pins > 0) {
        ClearBusyLocked(id);
        continue;
      }
      host = p.host;
      off = p.nvme_off;
      bytes = p.bytes;
      hooks = hooks_;
    }
    // No write handle can come while the partition is busy (Acquire waits), so nobody writes the
    // copy while it goes out.
    Status st = nvme_->Write(off, host, bytes);
    if (hooks != nullptr && hooks->after_flush_write) hooks->after_flush_write(id);
    std::lock_guard<std::mutex> lock(mu_);
    Part& p = parts_[id];
    ClearBusyLocked(id);
    if (!st.ok()) return st.WithContext(StrCat("flushing ", Describe(id)));
    p.dirty = false;
    p.nvme_valid = true;
    stats_.flush_writes++;
  }
  return Status::Ok();
}

Status PartitionStore::Evict(PartitionId id) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("PartitionStore", "Evict"));  // Note [Fork]
  if (nvme_ == nullptr) {
    return Status::FailedPrecondition("Evict: no NVMe arena to evict to; offload to nvme first");
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (id >= parts_.size() || parts_[id].bytes == 0) {
      return Status::InvalidArgument(StrCat("Evict: partition ", id, " is not registered"));
    }
    busy_cv_.wait(lock, [&] { return !parts_[id].busy; });
    Part& p = parts_[id];
    if (p.pins > 0) {
      return Status::FailedPrecondition(StrCat("Evict: ", Describe(id), " is in use by ", p.pins,
                                               " handles; release them first"));
    }
    if (p.host == nullptr) return Status::Ok();
    MarkBusy(p);
  }
  uint64_t freed = 0;
  Status st = SpillOne(id, &freed);
  std::lock_guard<std::mutex> lock(mu_);
  ClearBusyLocked(id);
  return st;
}

}  // namespace spillway::offload
