// PartitionStore: registration and home tiers, Acquire and Release, swap-in, the device views'
// fill and write-back, and the store's checks and stats. Handles are in handle.cc, OPT spill under
// the host budget in spill.cc, prefetch in store_prefetch.cc.
// Note [Spill] in docs/offload.md.
#include "spillway/offload/partition_store.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "device_views.h"
#include "prefetcher.h"
#include "spill_note.h"
#include "spillway/base/bytes.h"
#include "spillway/base/check.h"
#include "spillway/base/log.h"

namespace spillway::offload {

const char* StateKindName(StateKind kind) {
  static const char* kNames[] = {"param", "grad", "master_weight", "exp_avg", "exp_avg_sq"};
  return kNames[static_cast<int>(kind)];
}

const char* PlacementName(Placement placement) {
  switch (placement) {
    case Placement::kHost:
      return "host";
    case Placement::kNvme:
      return "nvme";
    case Placement::kDevice:
      return "device";
  }
  return "?";
}

Result<std::unique_ptr<PartitionStore>> PartitionStore::Create(const Config& config,
                                                               allocator::HostArena* host,
                                                               allocator::NvmeArena* nvme,
                                                               allocator::ScopeId scope,
                                                               uint32_t prefetch_window) {
  if (host == nullptr) return Status::InvalidArgument("PartitionStore: a host arena is required");
  if (config.any_nvme() && nvme == nullptr) {
    return Status::InvalidArgument(
        "PartitionStore: the config offloads to nvme (offload_param/offload_optimizer.device) "
        "but no NVMe arena was given");
  }
  std::unique_ptr<PartitionStore> store(
      new PartitionStore(config, host, nvme, scope, prefetch_window));
  PartitionStore* raw = store.get();
  // The thread first: Spill reads prefetcher_'s id, and the handler makes Spill reachable.
  if (prefetch_window > 0) {
    store->prefetcher_ =
        std::make_unique<Prefetcher>([raw](PartitionId id) { raw->PrefetchOne(id); });
    store->prefetcher_id_ = store->prefetcher_->thread_id();
  }
  host->SetSpillHandler(
      [raw](const allocator::HostArena::SpillRequest& request) { return raw->Spill(request); },
      raw);
  return store;
}

PartitionStore::PartitionStore(const Config& config, allocator::HostArena* host,
                               allocator::NvmeArena* nvme, allocator::ScopeId scope,
                               uint32_t prefetch_window)
    : config_(config), host_(host), nvme_(nvme), scope_(scope), prefetch_window_(prefetch_window) {}

PartitionStore::~PartitionStore() {
  alive_->store(false, std::memory_order_release);
  if (!process_.InOwner()) {
    // The parent's memory is not a forked child's to free (the prefetcher leaks its thread).
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  busy_cv_.notify_all();           // a Spill waiting for memory gives up
  prefetcher_.reset();             // drops the queue, waits for the swap-in in flight
  host_->ClearSpillHandler(this);  // only ours; waits for a Spill call in flight
  std::lock_guard<std::mutex> lock(mu_);
  if (!live_handles_.empty()) {
    Log(LogLevel::kWarning, StrCat("PartitionStore destroyed with ", live_handles_.size(),
                                   " live handles; their memory is freed now"));
  }
  for (Part& p : parts_) {
    // A destructor reports nothing; the arenas log what they cannot take back.
    if (p.device != nullptr) views_->Free(p.device).IgnoreError();
    if (p.host != nullptr) host_->Free(p.host).IgnoreError();
    if (p.nvme_off != kNoExtent) nvme_->Free(p.nvme_off).IgnoreError();
  }
}

Placement PartitionStore::HomeFor(StateKind kind) const {
  const OffloadDevice d =
      kind == StateKind::kParam ? config_.offload_param.device : config_.offload_optimizer.device;
  return d == OffloadDevice::kNvme ? Placement::kNvme : Placement::kHost;
}

allocator::OwnerTag PartitionStore::Tag(PartitionId id) const {
  static const allocator::Kind kKinds[] = {
      allocator::Kind::kParam, allocator::Kind::kGrad, allocator::Kind::kMasterWeight,
      allocator::Kind::kOptimizerState, allocator::Kind::kOptimizerState};
  return allocator::OwnerTag{kKinds[static_cast<int>(parts_[id].key.kind)],
                             allocator::Lifetime::kPersistent, id, scope_, SPILLWAY_SITE};
}

std::string PartitionStore::Describe(PartitionId id) const {
  const Part& p = parts_[id];
  return StrCat(StateKindName(p.key.kind), " rank ", p.key.rank, " group ", p.key.group,
                " (partition ", id, ", ", FormatBytes(p.bytes), ")");
}

Result<PartitionId> PartitionStore::Register(PartitionKey key, uint64_t bytes) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("PartitionStore", "Register"));  // Note [Fork]
  if (bytes == 0)
    return Status::InvalidArgument("PartitionStore::Register: a partition of 0 bytes");
  if (static_cast<int>(key.kind) > static_cast<int>(StateKind::kExpAvgSq)) {
    return Status::InvalidArgument("PartitionStore::Register: state kind out of range");
  }
  PartitionId id;
  allocator::OwnerTag tag;
  Placement home = HomeFor(key.kind);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Part& p : parts_) {
      if (!p.tombstone && p.key.rank == key.rank && p.key.group == key.group &&
          p.key.kind == key.kind) {
        return Status::InvalidArgument(StrCat("PartitionStore::Register: ", StateKindName(key.kind),
                                              " rank ", key.rank, " group ", key.group,
                                              " is already registered"));
      }
    }
    id = static_cast<PartitionId>(parts_.size());
    Part p;
    p.key = key;
    p.bytes = bytes;
    p.home = home;
    MarkBusy(p);  // until placed
    parts_.push_back(p);
    tag = Tag(id);
  }
  Status st;
  void* host = nullptr;
  uint64_t off = kNoExtent;
  if (home == Placement::kHost) {
    BeginStoreAllocation(this, memory_wait());
    auto r = host_->Allocate(bytes, tag);  // may spill others to make room
    if (r.ok()) {
      host = *r;
      std::memset(host, 0, bytes);
    } else {
      st = r.status();
    }
  } else {
    auto r = nvme_->Allocate(bytes, tag);
    if (r.ok()) {
      off = *r;
    } else {
      st = r.status();
    }
  }
  const std::string note = home == Placement::kHost ? SpillShortfallNote() : std::string();
  std::lock_guard<std::mutex> lock(mu_);
  ClearBusyLocked(id);
  Part& p = parts_[id];
  if (!st.ok()) {
    p.bytes = 0;  // a tombstone: the id stays, nothing is held, and the key may be registered again
    p.tombstone = true;
    if (!note.empty()) st = st.WithContext(note);
    return st.WithContext(StrCat("registering ", StateKindName(key.kind), " rank ", key.rank,
                                 " group ", key.group, " in its home tier ", PlacementName(home)));
  }
  p.host = host;
  p.nvme_off = off;
  p.dirty = host != nullptr;  // a zero-filled host copy the NVMe tier has never seen
  stats_.partitions++;
  return id;
}

Status PartitionStore::SetSchedule(std::vector<PartitionId> order) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("PartitionStore", "SetSchedule"));  // Note [Fork]
  std::lock_guard<std::mutex> lock(mu_);
  for (PartitionId id : order) {
    if (id >= parts_.size() || !Placed(parts_[id])) {  // a tombstone, or its Register is running
      return Status::InvalidArgument(StrCat("SetSchedule: partition ", id, " is not registered"));
    }
  }
  SPILLWAY_RETURN_IF_ERROR(schedule_.Set(std::move(order), parts_.size()));
  if (prefetcher_ != nullptr) prefetcher_->Clear();  // positions of the old schedule
  return Status::Ok();
}

Status PartitionStore::AttachDevice(TransferPipeline* pipeline) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("PartitionStore", "AttachDevice"));  // Note [Fork]
  if (pipeline == nullptr) {
    return Status::InvalidArgument(
        "AttachDevice: the pipeline is null; pass the TransferPipeline device views copy through");
  }
  auto views = std::make_unique<DeviceViews>(pipeline);
  std::lock_guard<std::mutex> lock(mu_);
  if (views_ != nullptr) {
    if (views_->pipeline() == pipeline) return Status::Ok();
    return Status::FailedPrecondition(
        "AttachDevice: a different pipeline is already attached; a store's device views copy "
        "through one pipeline for its lifetime (attach the one Tiers::OpenDevicePipeline made)");
  }
  views_ = std::move(views);
  return Status::Ok();
}

void PartitionStore::set_memory_wait(std::chrono::milliseconds wait) {
  std::lock_guard<std::mutex> lock(mu_);
  memory_wait_ = wait;
}

std::chrono::milliseconds PartitionStore::memory_wait() const {
  std::lock_guard<std::mutex> lock(mu_);
  return memory_wait_;
}

void PartitionStore::SetHooksForTesting(StoreHooks* hooks) {
  std::lock_guard<std::mutex> lock(mu_);
  hooks_ = hooks;
}

void PartitionStore::TakeBusyLocked(std::unique_lock<std::mutex>& lock, PartitionId id) {
  busy_cv_.wait(lock, [&] { return !parts_[id].busy; });
  MarkBusy(parts_[id]);
}

void PartitionStore::MarkBusy(Part& p) {
  p.busy = true;
  p.busy_by = std::this_thread::get_id();
}

void PartitionStore::ClearBusyLocked(PartitionId id) {
  Part& p = parts_[id];
  if (!p.busy || p.busy_by != std::this_thread::get_id()) {
    Log(LogLevel::kError, StrCat("PartitionStore: ", Describe(id),
                                 " was cleared by a thread that "
                                 "does not own its busy mark (internal error)"));
  }
  p.busy = false;
  p.busy_by = std::thread::id();
  busy_cv_.notify_all();
}

void PartitionStore::HeldBytesLocked(uint64_t* by_others, uint64_t* by_me) const {
  const std::thread::id me = std::this_thread::get_id();
  std::vector<uint8_t> mine(parts_.size(), 0), theirs(parts_.size(), 0);
  for (const auto& [handle, info] : live_handles_) (info.thread == me ? mine : theirs)[info.id] = 1;
  *by_others = 0;
  *by_me = 0;
  for (PartitionId i = 0; i < parts_.size(); ++i) {
    const Part& p = parts_[i];
    if (mine[i]) {
      *by_me += p.host != nullptr ? p.bytes : 0;
    } else if ((theirs[i] && p.host != nullptr) || (p.busy && p.busy_by != me)) {
      // Host memory another thread's handles pin, or a partition in another thread's spill or
      // swap-in (once swapped in and released, it can spill). A device-only handle holds none.
      *by_others += p.bytes;
    }
  }
}

Result<Handle> PartitionStore::Acquire(PartitionId id, Access access, Placement where) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("PartitionStore", "Acquire"));  // Note [Fork]
  const bool device = where == Placement::kDevice;
  const bool host_write = !device && access == Access::kReadWrite;  // counted in write_pins
  uint64_t handle_id;
  bool need_io = false;  // a swap-in (host) or a fill (device), `id` busy for this thread
  {
    std::unique_lock<std::mutex> lock(mu_);
    SPILLWAY_ASSIGN_OR_RETURN(handle_id, PinLocked(lock, id, access, where, &need_io));
  }
  if (need_io) {
    Status st = device ? FillDevice(id) : SwapIn(id);
    std::lock_guard<std::mutex> lock(mu_);
    ClearBusyLocked(id);
    if (!st.ok()) {
      UnpinLocked(id, device, host_write, handle_id);
      return st.WithContext(StrCat("acquiring ", Describe(id), " on ", PlacementName(where)));
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  Handle h;
  h.store_ = this;
  h.store_alive_ = alive_;
  h.handle_id_ = handle_id;
  h.id_ = id;
  h.data_ = device ? parts_[id].device : parts_[id].host;
  h.bytes_ = parts_[id].bytes;
  h.write_ = access == Access::kReadWrite;
  h.device_ = device;
  return h;
}

Result<uint64_t> PartitionStore::PinLocked(std::unique_lock<std::mutex>& lock, PartitionId id,
                                           Access access, Placement where, bool* io) {
  const bool device = where == Placement::kDevice;
  const bool host_write = !device && access == Access::kReadWrite;
  if (id >= parts_.size() || parts_[id].bytes == 0) {
    return Status::InvalidArgument(StrCat("Acquire: partition ", id, " is not registered"));
  }
  if (where == Placement::kNvme) {
    return Status::InvalidArgument(
        "Acquire: a view is host or device memory; kNvme is a home "
        "tier, not a view");
  }
  if (device && views_ == nullptr) {
    return Status::FailedPrecondition(
        "Acquire on the device tier: no device attached; call AttachDevice with a pipeline");
  }
  busy_cv_.wait(lock, [&] { return !parts_[id].busy; });
  Part& p = parts_[id];
  const std::thread::id me = std::this_thread::get_id();
  const uint32_t other_tier_pins = device ? p.pins - p.device_pins : p.device_pins;
  if (!device && p.device != nullptr && p.device_pins == 0) {
    // Only a kept view is here with no device handle: its write-back failed, and it holds the
    // only good copy. A host copy made now would read what NVMe or the host had before it.
    return Status::FailedPrecondition(StrCat(
        "Acquire of ", Describe(id),
        " on host: its device view holds the newest bytes and "
        "writing them back failed; acquire it on the device tier and release it to retry the "
        "write-back"));
  }
  if (other_tier_pins > 0) {
    return Status::FailedPrecondition(
        StrCat("Acquire of ", Describe(id), " on ", PlacementName(where), ": it is in use on ",
               PlacementName(device ? Placement::kHost : Placement::kDevice), " by ",
               other_tier_pins, " handles; a partition is used in one tier at a time"));
  }
  // Advance the schedule cursor to this use. A device view (taken ahead of use by the trainer's
  // helper thread) does not: the host-tier schedule is the store's own order.
  if (schedule_.Has(id) && off_schedule_ == 0 && !device) {
    schedule_.Advance(id);
    QueuePrefetchLocked();
  }
  p.pins++;
  p.last_use = ++use_clock_;
  if (device) p.device_pins++;
  if (device ? p.device == nullptr : p.host == nullptr) {
    MarkBusy(p);
    *io = true;
  }
  if (host_write) p.write_pins++;
  const uint64_t handle_id = next_handle_id_++;
  live_handles_.emplace(handle_id, HandleInfo{id, me});
  stats_.live_handles = live_handles_.size();
  return handle_id;
}

void PartitionStore::UnpinLocked(PartitionId id, bool device, bool host_write, uint64_t handle_id) {
  parts_[id].pins--;
  if (device) parts_[id].device_pins--;
  if (host_write) parts_[id].write_pins--;
  live_handles_.erase(handle_id);
  stats_.live_handles = live_handles_.size();
}

Status PartitionStore::FillDevice(PartitionId id) {
  DeviceViews* views;
  DeviceViews::Copies from;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Part& p = parts_[id];
    views = views_.get();
    from = {.host = p.host, .nvme_off = p.nvme_off, .nvme_valid = p.nvme_valid, .bytes = p.bytes};
  }
  SPILLWAY_ASSIGN_OR_RETURN(void* view, views->Fill(from));
  std::lock_guard<std::mutex> lock(mu_);
  parts_[id].device = view;
  parts_[id].device_dirty = false;
  stats_.device_fills++;
  return Status::Ok();
}

Status PartitionStore::WriteBackDevice(PartitionId id) {
  DeviceViews* views;
  void *host, *view;
  uint64_t bytes, off;
  bool dirty;
  allocator::OwnerTag tag;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Part& p = parts_[id];
    views = views_.get();
    host = p.host;
    view = p.device;
    bytes = p.bytes;
    off = p.nvme_off;
    dirty = p.device_dirty;
    tag = Tag(id);
  }
  const bool to_nvme = dirty && host == nullptr;
  if (to_nvme && off == kNoExtent) {
    if (nvme_ == nullptr) {
      return Status::FailedPrecondition(
          "no NVMe arena and no host copy to write the device view back to");
    }
    SPILLWAY_ASSIGN_OR_RETURN(off, nvme_->Allocate(bytes, tag));
    std::lock_guard<std::mutex> lock(mu_);
    parts_[id].nvme_off = off;
  }
  if (dirty) {
    if (Status st = views->WriteBack(view, host, off, bytes); !st.ok()) {
      // The device view is the only good copy: keep it, so a later release can retry.
      return st.WithContext(
          StrCat("writing back the device view of ", Describe(id), "; the device copy is kept"));
    }
  }
  if (Status f = views->Free(view); !f.ok()) {
    // The bytes are safe (written back or clean); only the device memory is lost to this process.
    Log(LogLevel::kError, StrCat("freeing the device view of ", Describe(id), ": ", f.ToString()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  Part& p = parts_[id];
  if (dirty && !to_nvme) p.dirty = true;  // the host copy is now newer than NVMe
  if (to_nvme) {
    p.nvme_valid = true;
    p.dirty = false;
  }
  p.device = nullptr;
  p.device_dirty = false;
  if (dirty) stats_.device_writebacks++;
  return Status::Ok();
}

Status PartitionStore::SwapIn(PartitionId id) {
  uint64_t bytes, off;
  bool valid;
  allocator::OwnerTag tag;
  {
    std::lock_guard<std::mutex> lock(mu_);
    bytes = parts_[id].bytes;
    off = parts_[id].nvme_off;
    valid = parts_[id].nvme_valid;
    tag = Tag(id);
  }
  BeginStoreAllocation(this, memory_wait());
  auto host = host_->Allocate(bytes, tag);  // may spill other partitions (never this busy one)
  std::string note = SpillShortfallNote();  // read (and cleared) on success too
  if (!host.ok()) {
    if (note.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      uint64_t pinned = 0;
      for (const Part& p : parts_) pinned += p.pins > 0 && p.host != nullptr ? p.bytes : 0;
      note = StrCat(FormatBytes(pinned),
                    " of host memory is held by partitions in use (live "
                    "handles) and cannot spill");
    }
    return host.status().WithContext(note);
  }
  if (valid) {
    Status st = nvme_->Read(off, *host, bytes);
    if (!st.ok()) {
      host_->Free(*host).IgnoreError();  // the read error is the one to report
      return st;                         // the NVMe copy is where it was; nothing changed
    }
  } else {
    std::memset(*host, 0, bytes);  // never written: a fresh partition reads as zeros
  }
  std::lock_guard<std::mutex> lock(mu_);
  parts_[id].host = *host;
  parts_[id].dirty = !valid;
  stats_.swap_ins++;
  stats_.swap_in_bytes += bytes;
  return Status::Ok();
}

Status PartitionStore::ReleaseHandle(uint64_t handle_id, PartitionId id, bool write, bool device,
                                     bool* ok) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  bool write_back = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (live_handles_.erase(handle_id) == 0) {
      stats_.refused_releases++;
      *ok = false;
      return Status::Ok();
    }
    *ok = true;
    stats_.live_handles = live_handles_.size();
    if (!device) {
      Part& p = parts_[id];
      if (write) {
        p.dirty = true;
        p.write_pins--;
      }
      if (--p.pins == 0) busy_cv_.notify_all();  // a spill may be waiting for this memory
      return Status::Ok();
    }
    if (write) parts_[id].device_dirty = true;
    // The busy mark has one owner: wait for whoever holds it (a flush, a spill of the host copy).
    busy_cv_.wait(lock, [&] { return !parts_[id].busy; });
    Part& p = parts_[id];
    if (p.device_pins > 1) {  // (again: another device handle may have come while we waited)
      p.device_pins--;
      p.pins--;
      return Status::Ok();
    }
    // The last device handle: write the view back (if dirty) and free it, outside the lock. The
    // partition stays pinned and busy until then, so nothing spills or re-reads it meanwhile.
    MarkBusy(p);
    write_back = true;
  }
  Status st = write_back ? WriteBackDevice(id) : Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  Part& p = parts_[id];
  p.device_pins--;
  p.pins--;
  ClearBusyLocked(id);
  return st;
}

Status PartitionStore::Release(Handle& handle) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("PartitionStore", "Release"));  // Note [Fork]
  if (handle.store_ == nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.refused_releases++;
    return Status::FailedPrecondition(StrCat("Release: the handle of partition ", handle.id_,
                                             " was already released; release each handle once"));
  }
  if (handle.store_ != this) {
    return Status::InvalidArgument("Release: the handle belongs to another PartitionStore");
  }
  bool ok;
  Status st = ReleaseHandle(handle.handle_id_, handle.id_, handle.write_, handle.device_, &ok);
  handle.store_ = nullptr;
  handle.data_ = nullptr;
  if (!ok) return Status::Internal("Release: a live handle was not in the live set");
  return st;
}

Status PartitionStore::Validate() const {
  if (!process_.InOwner()) return Status::Ok();  // a forked child walks nothing (Note [Fork])
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint32_t> handles(parts_.size(), 0);
  for (const auto& [hid, info] : live_handles_) {
    if (info.id >= parts_.size()) {
      return Status::Internal(
          StrCat("Validate: handle ", hid, " names partition ", info.id, " of ", parts_.size()));
    }
    handles[info.id]++;
  }
  if (stats_.live_handles != live_handles_.size()) {
    return Status::Internal(StrCat("Validate: stats count ", stats_.live_handles,
                                   " live handles, the table holds ", live_handles_.size()));
  }
  uint64_t registered = 0;
  for (PartitionId id = 0; id < parts_.size(); ++id) {
    const Part& p = parts_[id];
    auto fail = [&](const char* what) {
      return Status::Internal(
          StrCat("Validate: partition ", id, " (", StateKindName(p.key.kind), " rank ", p.key.rank,
                 " group ", p.key.group, "): ", what, " [pins ", p.pins, ", device_pins ",
                 p.device_pins, ", write_pins ", p.write_pins, ", handles ", handles[id], ", busy ",
                 p.busy, ", host ", p.host != nullptr, ", extent ", p.nvme_off != kNoExtent,
                 ", device ", p.device != nullptr, "]"));
    };
    if (handles[id] > p.pins) return fail("more live handles than pins");
    if (p.write_pins + p.device_pins > p.pins) return fail("write and device pins exceed pins");
    if (p.busy != (p.busy_by != std::thread::id())) return fail("busy and its owner disagree");
    if (p.nvme_valid && p.nvme_off == kNoExtent) return fail("valid on NVMe without an extent");
    if (p.dirty && p.host == nullptr) return fail("dirty without a host copy");
    if (p.tombstone) {
      if (p.host != nullptr || p.nvme_off != kNoExtent || p.device != nullptr || p.pins != 0 ||
          p.bytes != 0) {
        return fail("a tombstone holds something");
      }
      continue;
    }
    registered++;
    if (p.busy) continue;  // its mover owns the rest until it clears busy
    if (p.pins > p.device_pins && p.host == nullptr)
      return fail("a host handle without a host copy");
    if (p.device_pins > 0 && p.device == nullptr) return fail("device pins without a device view");
    // A view with no device pins is one kept after its write-back failed: the only good copy.
    if (p.device != nullptr && p.device_pins == 0 && !p.device_dirty) {
      return fail("an unpinned device view that is not dirty (it should have been freed)");
    }
    if (p.device_dirty && p.device == nullptr) return fail("device-dirty without a device view");
    if (!Placed(p)) return fail("its bytes are nowhere");
    if (handles[id] != p.pins && p.device_pins == 0) return fail("pins without live handles");
  }
  if (Status st = schedule_.Validate(); !st.ok()) return st.WithContext("Validate");
  for (PartitionId id : schedule_.order()) {
    if (!Placed(parts_[id])) {
      return Status::Internal(
          StrCat("Validate: the schedule names partition ", id, ", which is not placed"));
    }
  }
  if (stats_.partitions > registered) {
    return Status::Internal(StrCat("Validate: stats count ", stats_.partitions, " partitions, ",
                                   registered, " are registered"));
  }
  return Status::Ok();
}

uint64_t PartitionStore::bytes(PartitionId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return id < parts_.size() ? parts_[id].bytes : 0;
}

bool PartitionStore::resident(PartitionId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return id < parts_.size() && parts_[id].host != nullptr;
}

Placement PartitionStore::home(PartitionId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return parts_.at(id).home;
}

PartitionStoreStats PartitionStore::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  PartitionStoreStats s = stats_;
  s.resident_bytes = 0;
  s.nvme_bytes = 0;
  for (const Part& p : parts_) {
    if (p.host != nullptr) s.resident_bytes += p.bytes;
    if (p.nvme_off != kNoExtent) s.nvme_bytes += p.bytes;
  }
  return s;
}

}  // namespace spillway::offload
