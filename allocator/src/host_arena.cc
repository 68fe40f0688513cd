// HostArena: exact-size extents over pinned, fork-safe regions, with a budget, a bounded retained
// cache, owner tags and boundary escape checks. The lock covers bookkeeping only: regions are
// mapped, pinned, unpinned and unmapped outside it (Note [Lock discipline] in docs/allocator.md).
#include "spillway/allocator/host_arena.h"

#include <execinfo.h>

#include <algorithm>
#include <charconv>
#include <cinttypes>
#include <cstdio>
#include <initializer_list>
#include <memory>
#include <string_view>
#include <utility>

#include "cuda_host.h"
#include "live_table.h"
#include "os_memory.h"
#include "spillway/allocator/fork_fault.h"
#include "spillway/base/bytes.h"
#include "spillway/base/check.h"
#include "spillway/base/log.h"

namespace spillway::allocator {
namespace {

// Spill-handler calls per allocation. A call that frees memory another thread then takes sends the
// allocation round again; with several threads spilling at once that happens more than a few times.
constexpr int kMaxSpillRounds = 64;

std::string Hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%" PRIx64, v);
  return buf;
}

}  // namespace

Result<std::unique_ptr<HostArena>> HostArena::Create(HostArenaOptions options) {
  const uint64_t page = os::PageSize();
  if (options.budget_bytes == 0) options.budget_bytes = DefaultHostBudget();
  if (options.budget_bytes < page) {
    return Status::InvalidArgument(StrCat("host arena '", options.name, "': budget of ",
                                          options.budget_bytes, " bytes is below one page (", page,
                                          "); set host_budget_bytes to at least a page"));
  }
  if (options.region_bytes == 0) {
    return Status::InvalidArgument(
        StrCat("host arena '", options.name, "': region_bytes is 0; use e.g. 64 MiB"));
  }
  options.region_bytes = RoundUp(options.region_bytes, page);
  // Each refusal names the option and the value given (NaN fails every comparison).
  for (const auto& [what, value] :
       {std::pair<const char*, double>{"retain_fraction", options.retain_fraction},
        {"peak_slack", options.peak_slack}}) {
    if (!(value >= 0.0 && value <= 1.0)) {
      char shown[32];  // the shortest text that reads back as the value (1.0000001, not 1)
      const std::to_chars_result r = std::to_chars(shown, shown + sizeof(shown), value);
      return Status::InvalidArgument(StrCat("host arena '", options.name, "': ", what,
                                            " must be in [0, 1], not ",
                                            std::string_view(shown, r.ptr - shown)));
    }
  }
  for (const auto& [what, value] :
       {std::pair<const char*, uint64_t>{"dedicated_divisor", options.dedicated_divisor},
        {"reuse_waste_divisor", options.reuse_waste_divisor}}) {
    if (value == 0) {
      return Status::InvalidArgument(
          StrCat("host arena '", options.name, "': ", what, " must be at least 1, not 0"));
    }
  }
  options.budget_bytes = options.budget_bytes / page * page;
  if (static_cast<size_t>(options.pin) > static_cast<size_t>(PinMode::kPageable) ||
      static_cast<size_t>(options.fork_safety) > static_cast<size_t>(ForkSafety::kInherit) ||
      static_cast<size_t>(options.policy) > static_cast<size_t>(EscapePolicy::kFail)) {
    return Status::InvalidArgument("host arena: pin mode, fork safety or policy out of range");
  }
  PinMode resolved = options.pin;
  std::string why;
  if (options.pin == PinMode::kAuto) {
    resolved = cuda::DeviceAvailable(&why) ? PinMode::kCuda : PinMode::kMlock;
    Log(LogLevel::kInfo,
        StrCat("host arena '", options.name, "' pins with ", PinModeName(resolved),
               resolved == PinMode::kMlock ? StrCat(" (no CUDA device: ", why, ")") : ""));
  } else if (options.pin == PinMode::kCuda && !cuda::DeviceAvailable(&why)) {
    return Status::Make(
        StatusCode::kUnavailable,
        StrCat("host arena '", options.name, "': pin mode cuda needs a CUDA device, ", "but ", why,
               "; use pin mode auto or mlock"));
  }
  Ledger* ledger = options.ledger != nullptr ? options.ledger : &Ledger::Default();
  std::shared_ptr<NodeGovernor> node =
      options.node != nullptr ? options.node : NodeGovernor::Current();
  std::unique_ptr<HostArena> arena(new HostArena(std::move(options), resolved, ledger, node));
  ledger->Attach(arena.get());
  if (node != nullptr) {
    // Another rank short of node budget asks this one to give its retained regions back. On the
    // governor's watcher thread a CUDA arena first makes the device it last registered a region
    // from the thread's: unregistering on a thread without one would make a context on device 0
    // in every rank (Note [Node governor]).
    HostArena* a = arena.get();
    node->AddTrimmer(a, [a] {
      const int device = a->cuda_device_.load(std::memory_order_relaxed);
      if (device >= 0 && NodeGovernor::OnWatcherThread()) cuda::SetDevice(device);
      return a->Trim();
    });
  }
  return arena;
}

HostArena::HostArena(HostArenaOptions options, PinMode resolved, Ledger* ledger,
                     std::shared_ptr<NodeGovernor> node)
    : options_(std::move(options)),
      pin_mode_(resolved),
      ledger_(ledger),
      node_(std::move(node)),
      node_tier_(resolved == PinMode::kPageable ? NodeTier::kPageable : NodeTier::kPinned),
      page_(os::PageSize()),
      live_(std::make_unique<LiveTable>(ledger, StrCat("host arena '", options_.name, "'"))) {
  stats_.pin_mode = pin_mode_;
  stats_.fork_safety = options_.fork_safety;
  stats_.policy = options_.policy;
  stats_.budget_bytes = options_.budget_bytes;
  stats_.retain_limit_bytes = options_.retain_limit_bytes;
}

HostArena::~HostArena() {
  if (node_ != nullptr) node_->RemoveTrimmer(this);  // no trim of this arena runs after it
  ledger_->Detach(this);
  // In a forked child the regions are the parent's (MADV_DONTFORK: absent here; CUDA-registered:
  // not the child's to unregister). Leave them; the child's exit takes its copies.
  if (!process_.InOwner()) return;
  std::vector<Region> regions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (live_->stats().live_allocations != 0) {
      Log(LogLevel::kWarning,
          StrCat("host arena '", options_.name, "' destroyed with ",
                 live_->stats().live_allocations, " live allocations (",
                 FormatBytes(live_->stats().live_bytes), "); their memory is unmapped"));
    }
    for (auto& [base, region] : regions_) regions.push_back(region);
    regions_.clear();
  }
  ReleaseRegions(regions);
}

void HostArena::SetSpillHandler(SpillHandler handler, const void* owner) {
  std::lock_guard<std::mutex> lock(mu_);
  spill_handler_ = std::move(handler);
  spill_owner_ = owner;
}

void HostArena::ClearSpillHandler(const void* owner) {
  std::unique_lock<std::mutex> lock(mu_);
  if (spill_owner_ == owner) {
    spill_handler_ = nullptr;
    spill_owner_ = nullptr;
  }
  // A call copied out before the clear may still be running: the owner must outlive it.
  spill_idle_.wait(lock, [this] { return spill_calls_in_flight_ == 0; });
}

// Note [Region observers]: observers_mu_ is held while observers are called, so each sees every
// region's map and unmap in the order they happened, AddRegionObserver's replay included.
void HostArena::AddRegionObserver(RegionObserver* observer) {
  // A forked child: observers_mu_ may have been held by a parent thread at fork, and the regions
  // are the parent's (the child's engine then bounces its chunks; Note [Fork]).
  if (!process_.InOwner()) return;
  std::lock_guard<std::mutex> lock(observers_mu_);
  observers_.push_back(observer);
  const std::vector<RegionInfo> regions = Regions();
  if (options_.faults != nullptr && options_.faults->after_observer_snapshot) {
    options_.faults->after_observer_snapshot();
  }
  for (const RegionInfo& r : regions) observer->OnRegionMapped(r.base, r.bytes);
}

void HostArena::RemoveRegionObserver(RegionObserver* observer) {
  if (!process_.InOwner()) return;                  // never added there (AddRegionObserver)
  std::lock_guard<std::mutex> lock(observers_mu_);  // no call to it is in flight after this
  observers_.erase(std::remove(observers_.begin(), observers_.end(), observer), observers_.end());
}

void HostArena::NotifyObservers(bool mapped, void* base, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(observers_mu_);
  for (RegionObserver* o : observers_) {
    if (mapped) {
      o->OnRegionMapped(base, bytes);
    } else {
      o->OnRegionUnmapping(base, bytes);
    }
  }
}

void HostArena::set_policy(EscapePolicy policy) {
  std::lock_guard<std::mutex> lock(mu_);
  options_.policy = policy;
  stats_.policy = policy;
}

Result<HostArena::Region> HostArena::MapRegion(uint64_t bytes) {
  SPILLWAY_ASSIGN_OR_RETURN(void* base, os::MapAnonymous(bytes, options_.faults));
  Status st = os::MarkForkSafety(base, bytes, options_.fork_safety);
  if (st.ok()) {
    switch (pin_mode_) {
      case PinMode::kCuda:
        st = cuda::HostRegister(base, bytes);
        // The allocating thread's device, whose context now exists: the one a trim on the node
        // watcher's thread makes its own before unregistering.
        if (st.ok()) cuda_device_.store(cuda::CurrentDevice(), std::memory_order_relaxed);
        break;
      case PinMode::kMlock:
        st = os::LockPages(base, bytes, options_.faults);
        break;
      case PinMode::kPageable:
      case PinMode::kAuto:
        break;
    }
  }
  if (!st.ok()) {
    os::Unmap(base, bytes).IgnoreError();  // undoing a failed map: `st` is the error to report
    return st;
  }
  NotifyObservers(true, base, bytes);  // before anyone can be handed memory from it
  return Region{base, bytes, pin_mode_};
}

void HostArena::ReleaseRegions(const std::vector<Region>& regions) {
  if (regions.empty()) return;
  uint64_t total = 0;
  for (const Region& r : regions) {
    NotifyObservers(false, r.base, r.bytes);
    fork_fault::Unregister(r.base);
    if (r.pinned_with == PinMode::kCuda) {
      Status st = cuda::HostUnregister(r.base, r.bytes);
      if (!st.ok()) Log(LogLevel::kError, st.ToString());
    }
    Status st = os::Unmap(r.base, r.bytes);  // munmap also unlocks mlock'ed pages
    if (!st.ok()) Log(LogLevel::kError, st.ToString());
    total += r.bytes;
  }
  if (node_ != nullptr) node_->Release(node_tier_, total);
  std::lock_guard<std::mutex> lock(mu_);
  pending_unmap_bytes_ -= total;
  ++given_back_;
}

void HostArena::DetachEmptyRegions(uint64_t retain_limit, std::vector<Region>* out) {
  if (extents_.empty_span_bytes() <= retain_limit) return;
  for (const ExtentMap::Span& span : extents_.EmptySpans()) {
    if (extents_.empty_span_bytes() <= retain_limit) break;
    Status st = extents_.RemoveSpan(span.base);
    if (!st.ok()) {
      Log(LogLevel::kError, st.ToString());
      continue;
    }
    auto it = regions_.find(span.base);
    Region region = it->second;
    regions_.erase(it);
    stats_.committed_bytes -= region.bytes;
    if (region.pinned_with == PinMode::kCuda) stats_.cuda_registered_bytes -= region.bytes;
    if (region.pinned_with == PinMode::kMlock) stats_.mlocked_bytes -= region.bytes;
    stats_.region_unmap_count++;
    stats_.trimmed_bytes += region.bytes;
    pending_unmap_bytes_ += region.bytes;
    out->push_back(region);
  }
  NoteCommitted();  // regions, reserved and pinned bytes follow committed_bytes down too
}

uint64_t RetainLimitFor(const HostArenaOptions& options, uint64_t live_bytes) {
  const auto scaled =
      static_cast<uint64_t>(options.retain_fraction * static_cast<double>(live_bytes));
  return std::min(options.retain_limit_bytes, std::max(options.region_bytes, scaled));
}

uint64_t HostArena::RetainLimit() const {
  return RetainLimitFor(options_, live_->stats().live_bytes);
}

void HostArena::NoteCommitted() {
  stats_.reserved_bytes = stats_.committed_bytes;
  stats_.pinned_bytes = stats_.cuda_registered_bytes + stats_.mlocked_bytes;
  stats_.regions = regions_.size();
  stats_.peak_committed_bytes = std::max(stats_.peak_committed_bytes, stats_.committed_bytes);
  PublishToNode();
}

void HostArena::PublishToNode() {
  // Plain stores into the node segment (no lock, no system call): the node's report by kind.
  if (node_ != nullptr) node_->PublishKinds(node_tier_, live_->stats().live_by_kind);
}

bool HostArena::TakeSpillHandlerLocked(int round, SpillHandler* handler, uint64_t* given_back) {
  *given_back = given_back_;
  *handler = spill_handler_;
  if (!*handler || round >= kMaxSpillRounds) return false;
  stats_.spill_calls++;
  ++spill_calls_in_flight_;
  return true;
}

// One spill-handler call in flight (see ClearSpillHandler): released with mu_ not held.
class HostArena::SpillCallGuard {
 public:
  SpillCallGuard(HostArena* arena, bool active) : arena_(arena), active_(active) {}
  ~SpillCallGuard() {
    if (!active_) return;
    std::lock_guard<std::mutex> lock(arena_->mu_);
    if (--arena_->spill_calls_in_flight_ == 0) arena_->spill_idle_.notify_all();
  }
  SpillCallGuard(const SpillCallGuard&) = delete;
  SpillCallGuard& operator=(const SpillCallGuard&) = delete;

 private:
  HostArena* const arena_;
  const bool active_;
};

namespace {

// RoundUp to the page size, a power of two: a mask, where RoundUp divides (twice per allocation).
inline uint64_t RoundUpToPage(uint64_t v, uint64_t page) { return (v + page - 1) & ~(page - 1); }

}  // namespace

// One Allocate call's request, checked: the size rounded to pages, the owner, where the extent may
// come from, and the backtrace to record with it. Built by its constructor, not zero-filled and
// then assigned: it is made on every allocation, and the fill (a `rep stos`) showed in profiles.
struct HostArena::AllocRequest {
  AllocRequest(uint64_t bytes_in, uint64_t rounded_in, bool dedicated_in, uint64_t max_extent_in,
               const OwnerTag& owner_in)
      : bytes(bytes_in),
        rounded(rounded_in),
        dedicated(dedicated_in),
        max_extent(max_extent_in),
        owner(owner_in) {}
  uint64_t bytes;    // as asked
  uint64_t rounded;  // to pages
  // Small requests stay in shared regions (extents no larger than a region); large ones reuse an
  // extent only when it wastes at most 1/reuse_waste_divisor of it (Note [Regions]).
  bool dedicated;
  uint64_t max_extent;
  OwnerTag owner;
  std::vector<void*> frames;  // moved into the live record by the round that places it
};

// What one round of Allocate planned under mu_ and carries past it: regions to unmap, the region to
// map, and the spill-handler call it counted.
struct HostArena::AllocRound {
  std::vector<Region> to_release;
  uint64_t map_bytes = 0;   // 0: no region to map this round
  uint64_t spill_need = 0;  // the budget headroom missing, when it asks the spill handler
  SpillHandler handler;
  bool counted = false;  // this round holds one of spill_calls_in_flight_
  uint64_t given_back = 0;
  Status node_refusal;  // the node's budget refused the region (ok: it did not)
};

Result<void*> HostArena::Allocate(uint64_t bytes, const OwnerTag& tag) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("HostArena", "Allocate"));
  SPILLWAY_RETURN_IF_ERROR(CheckRequest(bytes, tag));
  AllocRequest req = MakeRequest(bytes, tag);
  if (options_.capture_backtraces) {  // here, not in a helper: the frames start at Allocate
    req.frames.resize(16);
    req.frames.resize(static_cast<size_t>(backtrace(req.frames.data(), 16)));
  }
  for (int round = 0;; ++round) {
    AllocRound r;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!ledger_->scope_live(req.owner.scope)) {
        return Status::FailedPrecondition(
            StrCat("HostArena::Allocate: scope ", req.owner.scope,
                   " was released; create a new scope for the rebuilt owner"));
      }
      if (void* got = TakeFreeExtent(&req)) return got;
      PlanRegion(req, round, &r);
    }
    // Unmap before mapping: released regions are budget the new region may need (the node's too).
    const bool released = !r.to_release.empty();
    ReleaseRegions(r.to_release);
    SPILLWAY_RETURN_IF_ERROR(BookOnNode(req, round, &r));
    // Gives the count back on every way out of this round, after any lock below is released
    // (it is constructed before them, so destroyed after them).
    SpillCallGuard spill_call(this, r.counted);
    if (r.map_bytes == 0 && released && r.node_refusal.ok()) continue;  // room may have come back
    if (r.map_bytes != 0) {
      SPILLWAY_ASSIGN_OR_RETURN(void* got, MapAndTake(&req, r.map_bytes));
      if (got != nullptr) return got;
      continue;
    }
    // Over budget: ask the spill handler (without any lock) to free room, a few rounds at most.
    uint64_t freed = 0;
    if (r.counted) freed = r.handler(SpillRequest{r.spill_need, req.rounded});
    std::lock_guard<std::mutex> lock(mu_);
    stats_.spilled_bytes += freed;
    if (freed > 0) continue;
    // The handler freed nothing itself, but other threads gave memory back meanwhile (a spill
    // handler may wait for them: the store waits for another thread's spill or Evict): try again.
    if (r.counted && given_back_ != r.given_back) continue;
    stats_.over_budget_count++;
    return OverBudgetError(req, r);
  }
}

Status HostArena::CheckRequest(uint64_t bytes, const OwnerTag& tag) {
  if (static_cast<int>(tag.kind) >= kKindCount ||
      static_cast<int>(tag.lifetime) >= kLifetimeCount) {
    return Status::InvalidArgument("HostArena::Allocate: owner tag kind or lifetime out of range");
  }
  if (bytes == 0) {
    return Status::InvalidArgument(StrCat("HostArena::Allocate: size 0 for ", KindName(tag.kind),
                                          " owner ", tag.owner_id, "; ask for at least 1 byte"));
  }
  if (bytes > UINT64_MAX - page_) {
    return Status::InvalidArgument(StrCat("HostArena::Allocate: size ", bytes,
                                          " overflows when rounded to a page; the size is "
                                          "probably a negative number cast to unsigned"));
  }
  const uint64_t rounded = RoundUpToPage(bytes, page_);
  if (rounded > options_.budget_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.over_budget_count++;
    return Status::OverBudget(
        StrCat("host arena '", options_.name, "': one request of ", FormatBytes(rounded), " for ",
               KindName(tag.kind), " owner ", tag.owner_id,
               " is larger than the whole host budget of ", FormatBytes(options_.budget_bytes),
               "; raise spillway.host_budget_bytes or split the tensor (sub_group_size)"));
  }
  if (!ledger_->scope_exists(tag.scope)) {
    return Status::InvalidArgument(StrCat("HostArena::Allocate: scope ", tag.scope,
                                          " was never created; call Ledger::CreateScope first"));
  }
  return Status::Ok();
}

HostArena::AllocRequest HostArena::MakeRequest(uint64_t bytes, const OwnerTag& tag) const {
  const uint64_t rounded = RoundUpToPage(bytes, page_);
  // rounded >= region_bytes / dedicated_divisor (floor), without a division on the fast path:
  // floor(R / d) <= x exactly when (x + 1) * d > R.
  uint64_t scaled = 0;
  const bool dedicated = __builtin_mul_overflow(rounded + 1, options_.dedicated_divisor, &scaled) ||
                         scaled > options_.region_bytes;
  const uint64_t max_extent =
      dedicated ? rounded + rounded / options_.reuse_waste_divisor : options_.region_bytes;
  return AllocRequest(bytes, rounded, dedicated, max_extent, tag);
}

void* HostArena::TakeFreeExtent(AllocRequest* req) {
  auto addr = extents_.Allocate(req->rounded, req->max_extent);
  if (!addr) return nullptr;
  live_->Insert(*addr, req->rounded, req->bytes, req->owner, &req->frames);
  return reinterpret_cast<void*>(*addr);
}

void HostArena::PlanRegion(const AllocRequest& req, int round, AllocRound* r) {
  // No free extent fits: plan a new region within the budget, counting regions being mapped
  // or unmapped by other threads so the OS never holds more than the budget.
  auto headroom = [&] {
    const uint64_t held = stats_.committed_bytes + pending_map_bytes_ + pending_unmap_bytes_;
    return held >= options_.budget_bytes ? 0 : options_.budget_bytes - held;
  };
  if (headroom() < req.rounded) DetachEmptyRegions(0, &r->to_release);
  if (headroom() < req.rounded) {
    r->spill_need = req.rounded - headroom();
    r->counted = TakeSpillHandlerLocked(round, &r->handler, &r->given_back);
    return;
  }
  // Large requests get an exact region; small ones share a region of region_bytes.
  uint64_t map_bytes = req.dedicated ? req.rounded : options_.region_bytes;
  if (map_bytes > headroom()) map_bytes = req.rounded;  // a shared region would cross it
  // The retained cache must not raise the high-water mark: if this region would lift
  // committed bytes above their peak, give back retained regions first.
  // Anchored to the peak of what is needed (held minus the cache), so it cannot ratchet.
  const uint64_t held = stats_.committed_bytes + pending_map_bytes_ + pending_unmap_bytes_;
  need_peak_bytes_ = std::max(need_peak_bytes_, held - extents_.empty_span_bytes() + map_bytes);
  const auto ceiling =
      static_cast<uint64_t>(static_cast<double>(need_peak_bytes_) * (1.0 + options_.peak_slack));
  if (held + map_bytes > ceiling && extents_.empty_span_bytes() > 0) {
    const uint64_t over = held + map_bytes - ceiling;
    const uint64_t keep =
        extents_.empty_span_bytes() > over ? extents_.empty_span_bytes() - over : 0;
    DetachEmptyRegions(keep, &r->to_release);
  }
  pending_map_bytes_ += map_bytes;
  r->map_bytes = map_bytes;
}

Status HostArena::BookOnNode(const AllocRequest& req, int round, AllocRound* r) {
  // The node's budget (Note [Node governor]): the region is booked there before it is mapped.
  // A shared region the node cannot hold is cut to the request; a request it cannot hold after
  // every rank trimmed goes to the spill handler, like a request over this arena's budget.
  if (r->map_bytes == 0 || node_ == nullptr) return Status::Ok();
  Status st = r->map_bytes > req.rounded ? node_->TryReserve(node_tier_, r->map_bytes)
                                         : node_->Reserve(node_tier_, r->map_bytes);
  uint64_t booked = r->map_bytes;
  if (!st.ok() && r->map_bytes > req.rounded && st.code() == StatusCode::kOverBudget) {
    booked = req.rounded;
    st = node_->Reserve(node_tier_, req.rounded);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (st.ok()) {
    pending_map_bytes_ -= r->map_bytes - booked;
    r->map_bytes = booked;
    return Status::Ok();
  }
  pending_map_bytes_ -= r->map_bytes;
  r->map_bytes = 0;
  if (st.code() != StatusCode::kOverBudget) {
    return st.WithContext(StrCat("host arena '", options_.name, "': allocating ",
                                 FormatBytes(req.bytes), " for ", KindName(req.owner.kind)));
  }
  stats_.node_refusals++;
  r->node_refusal = st;
  r->spill_need = req.rounded;
  r->counted = TakeSpillHandlerLocked(round, &r->handler, &r->given_back);
  return Status::Ok();
}

Result<void*> HostArena::MapAndTake(AllocRequest* req, uint64_t map_bytes) {
  auto region = MapRegion(map_bytes);
  std::vector<Region> unused;  // released after the lock below: see the scope check
  if (!region.ok() && node_ != nullptr) node_->Release(node_tier_, map_bytes);
  std::unique_lock<std::mutex> lock(mu_);
  pending_map_bytes_ -= map_bytes;
  if (!region.ok()) {
    return region.status().WithContext(
        StrCat("host arena '", options_.name, "': allocating ", FormatBytes(req->bytes), " for ",
               KindName(req->owner.kind), " owner ", req->owner.owner_id));
  }
  // Listed for the process's memory map; named if a forked child touches one kept out of it.
  fork_fault::Register(region->base, map_bytes, options_.name.c_str(), KindName(req->owner.kind),
                       options_.fork_safety == ForkSafety::kDontFork);
  const auto base = reinterpret_cast<uint64_t>(region->base);
  Status st = extents_.AddSpan(base, map_bytes);
  if (!st.ok()) return st;  // the kernel gave us overlapping memory: cannot happen
  regions_.emplace(base, *region);
  stats_.committed_bytes += map_bytes;
  if (pin_mode_ == PinMode::kCuda) stats_.cuda_registered_bytes += map_bytes;
  if (pin_mode_ == PinMode::kMlock) stats_.mlocked_bytes += map_bytes;
  stats_.region_map_count++;
  NoteCommitted();
  void* got = nullptr;
  // The scope may have been released while the region was mapped (the next round refuses),
  // or other threads may have taken the new region's space first (go round again).
  if (ledger_->scope_live(req->owner.scope)) {
    got = TakeFreeExtent(req);
    if (got != nullptr) PublishToNode();
  }
  // The new region can be left empty: the scope was released, or memory that another thread
  // freed while this one mapped fits the request better (best fit). Keep the retain limit
  // (the debug walker found retained > RetainLimit() here under HostArenaStressTest).
  DetachEmptyRegions(RetainLimit(), &unused);
  lock.unlock();
  ReleaseRegions(unused);
  return got;
}

Status HostArena::OverBudgetError(const AllocRequest& req, const AllocRound& r) const {
  if (!r.node_refusal.ok()) {
    return Status::OverBudget(StrCat(
        "host arena '", options_.name, "': allocating ", FormatBytes(req.rounded), " for ",
        KindName(req.owner.kind), " owner ", req.owner.owner_id, ": ", r.node_refusal.message(),
        !r.handler ? "" : "; this rank's spill handler freed nothing more"));
  }
  return Status::OverBudget(
      StrCat("host arena '", options_.name, "': allocating ", FormatBytes(req.rounded), " for ",
             KindName(req.owner.kind), " owner ", req.owner.owner_id, " needs ",
             FormatBytes(r.spill_need), " more than the host budget of ",
             FormatBytes(options_.budget_bytes), " allows (", DescribeLive(),
             !r.handler  ? "; no spill handler is set"
             : r.counted ? "; the spill handler freed nothing"
                         : StrCat("; memory came free ", kMaxSpillRounds,
                                  " times (the spill handler's, or other threads') and other "
                                  "allocations took it each time"),
             "). Raise spillway.host_budget_bytes, offload more state to nvme "
             "(offload_optimizer.device / offload_param.device), or free memory first"));
}

Status HostArena::Free(void* ptr) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("HostArena", "Free"));
  const auto addr = reinterpret_cast<uint64_t>(ptr);
  std::vector<Region> to_release;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const LiveTable::Live* live = live_->Find(addr);
    if (live == nullptr) {
      live_->NoteBadFree();
      return Status::InvalidArgument(
          live_->DescribeBadFree(addr, extents_.FindSpan(addr) != nullptr));
    }
    FreeExtent(addr, live_->Erase(addr, LiveTable::FreeReason::kFreed).bytes);
    DetachEmptyRegions(RetainLimit(), &to_release);
    if (!to_release.empty()) stats_.trim_count++;
  }
  ReleaseRegions(to_release);
  return Status::Ok();
}

std::string HostArena::DescribeLive() const {
  std::string out = StrCat("committed ", FormatBytes(stats_.committed_bytes), ", live");
  bool any = false;
  const KindBytes& by_kind = live_->stats().live_by_kind;
  for (int k = 0; k < kKindCount; ++k) {
    if (by_kind[k] == 0) continue;
    out += StrCat(any ? ", " : " ", KindName(static_cast<Kind>(k)), " ", FormatBytes(by_kind[k]));
    any = true;
  }
  if (!any) out += " nothing";
  out += StrCat(", free inside regions ", FormatBytes(extents_.free_bytes()));
  return out;
}

uint64_t HostArena::Trim() {
  SPILLWAY_VALIDATE_ON_EXIT(*this);   // first: runs after every lock below is released
  if (!process_.InOwner()) return 0;  // a forked child unmaps nothing of the parent's
  std::vector<Region> to_release;
  uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    DetachEmptyRegions(0, &to_release);
    stats_.trim_count++;
    for (const Region& r : to_release) bytes += r.bytes;
  }
  ReleaseRegions(to_release);
  return bytes;
}

bool HostArena::Contains(const void* ptr, uint64_t bytes) const {
  const auto addr = reinterpret_cast<uint64_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  const ExtentMap::Span* span = extents_.FindSpan(addr);
  // Written so that no sum can wrap: [addr, addr + bytes) lies inside the span.
  return span != nullptr && bytes <= span->base + span->size - addr;
}

Result<uint64_t> HostArena::AllocationSize(const void* ptr) const {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("HostArena", "AllocationSize"));
  const auto addr = reinterpret_cast<uint64_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  const LiveTable::Live* live = live_->Find(addr);
  if (live == nullptr) {
    return Status::InvalidArgument(
        live_->DescribeBadFree(addr, extents_.FindSpan(addr) != nullptr));
  }
  return live->requested;
}

std::vector<HostArena::RegionInfo> HostArena::Regions() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RegionInfo> out;
  out.reserve(regions_.size());
  for (const auto& [base, r] : regions_) out.push_back({r.base, r.bytes});
  return out;
}

void HostArena::ResetPeakStats() {
  std::lock_guard<std::mutex> lock(mu_);
  live_->ResetPeaks();
  stats_.peak_committed_bytes = stats_.committed_bytes;
}

HostArenaStats HostArena::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  HostArenaStats s = stats_;
  static_cast<LiveStats&>(s) = live_->stats();
  s.retain_limit_now_bytes = RetainLimit();
  s.retained_bytes = extents_.empty_span_bytes();
  s.fragment_bytes = extents_.free_bytes() - extents_.empty_span_bytes();
  return s;
}

Status HostArena::CollectBoundary(BoundaryKind kind, int64_t epoch, int64_t step, TierReport* out) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("HostArena", "CollectBoundary"));
  std::vector<Region> to_release;
  LiveTable::Traces traces;
  out->tier = options_.name;
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_->CollectEscapes(kind, epoch, step, options_.policy, out, &traces,
                          [this](uint64_t addr, uint64_t bytes) { FreeExtent(addr, bytes); });
    DetachEmptyRegions(RetainLimit(), &to_release);
    out->committed_bytes = stats_.committed_bytes;
    PublishToNode();
  }
  ReleaseRegions(to_release);
  LiveTable::FinishEscapes(*ledger_, traces, out);
  return LiveTable::EscapeError(StrCat("host arena '", options_.name, "'"), kind, epoch, step,
                                *out);
}

void HostArena::ReleaseScope(ScopeId scope, TierReport* out) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  if (!process_.InOwner()) return;   // a forked child frees nothing of the parent's
  std::vector<Region> to_release;
  out->tier = options_.name;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out->policy = options_.policy;
    live_->ReleaseScope(scope, out,
                        [this](uint64_t addr, uint64_t bytes) { FreeExtent(addr, bytes); });
    DetachEmptyRegions(RetainLimit(), &to_release);
    out->committed_bytes = stats_.committed_bytes;
  }
  ReleaseRegions(to_release);
}

Status HostArena::Validate() const {
  // A forked child has the parent's tables but not its threads: a lock one of them held at the
  // fork stays held here. It walks nothing (and may mutate nothing: every entry point refuses).
  if (!process_.InOwner()) return Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  SPILLWAY_RETURN_IF_ERROR(live_->Validate());
  const auto allocated = live_->Extents();
  for (const auto& [addr, bytes] : allocated) {
    if (bytes % page_ != 0) {
      return Status::Internal(StrCat("Validate: live extent at ", Hex(addr), " not page-sized"));
    }
  }
  SPILLWAY_RETURN_IF_ERROR(extents_.Validate(allocated));
  const uint64_t live_sum = live_->stats().live_bytes;
  uint64_t region_sum = 0;
  for (const auto& [base, r] : regions_) {
    region_sum += r.bytes;
    const ExtentMap::Span* span = extents_.FindSpan(base);
    if (span == nullptr || span->base != base || span->size != r.bytes) {
      return Status::Internal(StrCat("Validate: region ", Hex(base), " has no matching span"));
    }
  }
  if (region_sum != stats_.committed_bytes || region_sum != extents_.span_bytes() ||
      regions_.size() != extents_.span_count()) {
    return Status::Internal("Validate: committed bytes disagree with the regions");
  }
  const uint64_t retained = extents_.empty_span_bytes();
  const uint64_t fragment = extents_.free_bytes() - retained;
  if (stats_.committed_bytes != live_sum + retained + fragment) {
    return Status::Internal(StrCat("Validate: committed ", stats_.committed_bytes, " != live ",
                                   live_sum, " + retained ", retained, " + fragment ", fragment));
  }
  if (stats_.committed_bytes > options_.budget_bytes) {
    return Status::Internal(StrCat("Validate: committed ", stats_.committed_bytes,
                                   " is over the budget ", options_.budget_bytes));
  }
  if (retained > RetainLimit() && pending_map_bytes_ == 0) {
    return Status::Internal(
        StrCat("Validate: retained ", retained, " is over the limit ", RetainLimit()));
  }
  return Status::Ok();
}

}  // namespace spillway::allocator
