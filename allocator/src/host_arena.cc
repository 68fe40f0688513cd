// HostArena: exact-size extents over pinned, fork-safe regions, with a budget, a bounded retained
// cache, owner tags and boundary escape checks. The lock covers bookkeeping only: regions are mapped,
// pinned, unpinned and unmapped outside it (Note [Lock discipline] in docs/allocator.md).
#include "spillway/allocator/host_arena.h"

#include <execinfo.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <memory>

#include "cuda_host.h"
#include "os_memory.h"
#include "spillway/allocator/log.h"

namespace spillway::allocator {
namespace {

constexpr std::array<const char*, 4> kPinNames = {"auto", "cuda", "mlock", "pageable"};
constexpr std::array<const char*, 3> kForkNames = {"dontfork", "wipeonfork", "inherit"};
constexpr int kMaxSpillRounds = 4;

uint64_t RoundUp(uint64_t v, uint64_t granule) { return (v + granule - 1) / granule * granule; }

std::string Hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%" PRIx64, v);
  return buf;
}

template <size_t N>
Result<uint8_t> ParseIndex(std::string_view what, std::string_view name,
                           const std::array<const char*, N>& names) {
  std::string allowed;
  for (size_t i = 0; i < N; ++i) {
    if (name == names[i]) return static_cast<uint8_t>(i);
    allowed += StrCat(i ? ", " : "", names[i]);
  }
  return Status::InvalidArgument(StrCat("unknown ", what, " '", name, "'; allowed: ", allowed));
}

}  // namespace

const char* PinModeName(PinMode mode) { return kPinNames[static_cast<size_t>(mode)]; }
const char* ForkSafetyName(ForkSafety mode) { return kForkNames[static_cast<size_t>(mode)]; }
Result<PinMode> ParsePinMode(std::string_view name) {
  auto r = ParseIndex("pin mode", name, kPinNames);
  if (!r.ok()) return r.status();
  return static_cast<PinMode>(*r);
}
Result<ForkSafety> ParseForkSafety(std::string_view name) {
  auto r = ParseIndex("fork safety", name, kForkNames);
  if (!r.ok()) return r.status();
  return static_cast<ForkSafety>(*r);
}

Result<std::unique_ptr<HostArena>> HostArena::Create(HostArenaOptions options) {
  const uint64_t page = os::PageSize();
  if (options.budget_bytes == 0) options.budget_bytes = os::PhysicalMemoryBytes() / 4 * 3;
  if (options.budget_bytes < page) {
    return Status::InvalidArgument(StrCat("host arena '", options.name, "': budget of ",
                                          options.budget_bytes, " bytes is below one page (",
                                          page, "); set host_budget_bytes to at least a page"));
  }
  if (options.region_bytes == 0) {
    return Status::InvalidArgument(StrCat("host arena '", options.name,
                                          "': region_bytes is 0; use e.g. 64 MiB"));
  }
  options.region_bytes = RoundUp(options.region_bytes, page);
  if (!(options.retain_fraction >= 0.0 && options.retain_fraction <= 1.0) ||
      !(options.peak_slack >= 0.0 && options.peak_slack <= 1.0) ||
      options.reuse_waste_divisor == 0 ||
      options.dedicated_divisor == 0) {
    return Status::InvalidArgument(StrCat("host arena '", options.name,
                                          "': retain_fraction and peak_slack must be in [0, 1], "
                                          "dedicated_divisor and reuse_waste_divisor at least 1"));
  }
  options.budget_bytes = options.budget_bytes / page * page;
  if (static_cast<size_t>(options.pin) >= kPinNames.size() ||
      static_cast<size_t>(options.fork_safety) >= kForkNames.size() ||
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
    return Status::Make(StatusCode::kUnavailable,
                        StrCat("host arena '", options.name, "': pin mode cuda needs a CUDA device, ",
                               "but ", why, "; use pin mode auto or mlock"));
  }
  Ledger* ledger = options.ledger != nullptr ? options.ledger : &Ledger::Default();
  std::unique_ptr<HostArena> arena(new HostArena(std::move(options), resolved, ledger));
  ledger->Attach(arena.get());
  return arena;
}

HostArena::HostArena(HostArenaOptions options, PinMode resolved, Ledger* ledger)
    : options_(std::move(options)), pin_mode_(resolved), ledger_(ledger), page_(os::PageSize()) {
  stats_.pin_mode = pin_mode_;
  stats_.fork_safety = options_.fork_safety;
  stats_.policy = options_.policy;
  stats_.budget_bytes = options_.budget_bytes;
  stats_.retain_limit_bytes = options_.retain_limit_bytes;
  tombstones_.resize(kMaxTombstones);
  live_nodes_.reserve(kMaxCachedNodes);
}

HostArena::~HostArena() {
  ledger_->Detach(this);
  std::vector<Region> regions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!live_.empty()) {
      Log(LogLevel::kWarning,
          StrCat("host arena '", options_.name, "' destroyed with ", live_.size(),
                 " live allocations (", FormatBytes(stats_.live_bytes), "); their memory is unmapped"));
    }
    for (auto& [base, region] : regions_) regions.push_back(region);
    regions_.clear();
  }
  ReleaseRegions(regions);
}

void HostArena::SetSpillHandler(SpillHandler handler) {
  std::lock_guard<std::mutex> lock(mu_);
  spill_handler_ = std::move(handler);
}

void HostArena::set_policy(EscapePolicy policy) {
  std::lock_guard<std::mutex> lock(mu_);
  options_.policy = policy;
  stats_.policy = policy;
}

Result<HostArena::Region> HostArena::MapRegion(uint64_t bytes) {
  auto mapped = os::MapAnonymous(bytes, options_.faults);
  if (!mapped.ok()) return mapped.status();
  void* base = *mapped;
  Status st = os::MarkForkSafety(base, bytes, options_.fork_safety);
  if (st.ok()) {
    switch (pin_mode_) {
      case PinMode::kCuda: st = cuda::HostRegister(base, bytes); break;
      case PinMode::kMlock: st = os::LockPages(base, bytes, options_.faults); break;
      case PinMode::kPageable:
      case PinMode::kAuto: break;
    }
  }
  if (!st.ok()) {
    (void)os::Unmap(base, bytes);
    return st;
  }
  return Region{base, bytes, pin_mode_};
}

void HostArena::ReleaseRegions(const std::vector<Region>& regions) {
  if (regions.empty()) return;
  uint64_t total = 0;
  for (const Region& r : regions) {
    if (r.pinned_with == PinMode::kCuda) {
      Status st = cuda::HostUnregister(r.base, r.bytes);
      if (!st.ok()) Log(LogLevel::kError, st.ToString());
    }
    Status st = os::Unmap(r.base, r.bytes);  // munmap also unlocks mlock'ed pages
    if (!st.ok()) Log(LogLevel::kError, st.ToString());
    total += r.bytes;
  }
  std::lock_guard<std::mutex> lock(mu_);
  pending_unmap_bytes_ -= total;
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
}

uint64_t HostArena::RetainLimit() const {
  const auto scaled = static_cast<uint64_t>(options_.retain_fraction *
                                            static_cast<double>(stats_.live_bytes));
  return std::min(options_.retain_limit_bytes, std::max(options_.region_bytes, scaled));
}

void HostArena::NoteCommitted() {
  stats_.reserved_bytes = stats_.committed_bytes;
  stats_.pinned_bytes = stats_.cuda_registered_bytes + stats_.mlocked_bytes;
  stats_.regions = regions_.size();
  stats_.peak_committed_bytes = std::max(stats_.peak_committed_bytes, stats_.committed_bytes);
}

Result<void*> HostArena::Allocate(uint64_t bytes, const OwnerTag& tag) {
  if (static_cast<int>(tag.kind) >= kKindCount ||
      static_cast<int>(tag.lifetime) >= kLifetimeCount) {
    return Status::InvalidArgument("HostArena::Allocate: owner tag kind or lifetime out of range");
  }
  if (bytes == 0) {
    return Status::InvalidArgument(StrCat("HostArena::Allocate: size 0 for ", KindName(tag.kind),
                                          " owner ", tag.owner_id,
                                          "; ask for at least 1 byte"));
  }
  if (bytes > UINT64_MAX - page_) {
    return Status::InvalidArgument(StrCat("HostArena::Allocate: size ", bytes,
                                          " overflows when rounded to a page; the size is "
                                          "probably a negative number cast to unsigned"));
  }
  const uint64_t rounded = RoundUp(bytes, page_);
  if (rounded > options_.budget_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.over_budget_count++;
    return Status::OverBudget(StrCat(
        "host arena '", options_.name, "': one request of ", FormatBytes(rounded), " for ",
        KindName(tag.kind), " owner ", tag.owner_id, " is larger than the whole host budget of ",
        FormatBytes(options_.budget_bytes),
        "; raise spillway.host_budget_bytes or split the tensor (sub_group_size)"));
  }
  if (!ledger_->scope_exists(tag.scope)) {
    return Status::InvalidArgument(StrCat("HostArena::Allocate: scope ", tag.scope,
                                          " was never created; call Ledger::CreateScope first"));
  }
  OwnerTag owned = tag;
  std::vector<void*> frames;
  if (options_.capture_backtraces) {
    frames.resize(16);
    frames.resize(static_cast<size_t>(backtrace(frames.data(), 16)));
  }

  // Small requests stay in shared regions (extents no larger than a region); large ones reuse an
  // extent only when it wastes at most 1/reuse_waste_divisor of it (Note [Regions]).
  const bool dedicated = rounded >= options_.region_bytes / options_.dedicated_divisor;
  const uint64_t max_extent =
      dedicated ? rounded + rounded / options_.reuse_waste_divisor : options_.region_bytes;
  uint64_t spill_need = 0;
  for (int round = 0;; ++round) {
    std::vector<Region> to_release;
    uint64_t map_bytes = 0;
    SpillHandler handler;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!ledger_->scope_live(owned.scope)) {
        return Status::FailedPrecondition(
            StrCat("HostArena::Allocate: scope ", owned.scope,
                   " was released; create a new scope for the rebuilt owner"));
      }
      if (auto addr = extents_.Allocate(rounded, max_extent)) {
        RecordLive(*addr, rounded, bytes, owned, &frames);
        return reinterpret_cast<void*>(*addr);
      }
      // No free extent fits: plan a new region within the budget, counting regions being mapped
      // or unmapped by other threads so the OS never holds more than the budget.
      auto headroom = [&] {
        const uint64_t held = stats_.committed_bytes + pending_map_bytes_ + pending_unmap_bytes_;
        return held >= options_.budget_bytes ? 0 : options_.budget_bytes - held;
      };
      if (headroom() < rounded) DetachEmptyRegions(0, &to_release);
      if (headroom() >= rounded) {
        // Large requests get an exact region; small ones share a region of region_bytes.
        map_bytes = dedicated ? rounded : options_.region_bytes;
        if (map_bytes > headroom()) map_bytes = rounded;  // a shared region would cross it
        // The retained cache must not raise the high-water mark: if this region would lift
        // committed bytes above their peak, give back retained regions first.
        // Anchored to the peak of what is needed (held minus the cache), so it cannot ratchet.
        const uint64_t held = stats_.committed_bytes + pending_map_bytes_ + pending_unmap_bytes_;
        need_peak_bytes_ =
            std::max(need_peak_bytes_, held - extents_.empty_span_bytes() + map_bytes);
        const auto ceiling = static_cast<uint64_t>(static_cast<double>(need_peak_bytes_) *
                                                   (1.0 + options_.peak_slack));
        if (held + map_bytes > ceiling && extents_.empty_span_bytes() > 0) {
          const uint64_t over = held + map_bytes - ceiling;
          const uint64_t keep =
              extents_.empty_span_bytes() > over ? extents_.empty_span_bytes() - over : 0;
          DetachEmptyRegions(keep, &to_release);
        }
        pending_map_bytes_ += map_bytes;
      } else {
        spill_need = rounded - headroom();
        handler = spill_handler_;
        if (handler && round < kMaxSpillRounds) stats_.spill_calls++;
      }
    }
    // Unmap before mapping: released regions are budget the new region may need.
    const bool released = !to_release.empty();
    ReleaseRegions(to_release);
    if (map_bytes == 0 && released) continue;  // the unmapped regions may have made room
    if (map_bytes != 0) {
      auto region = MapRegion(map_bytes);
      std::lock_guard<std::mutex> lock(mu_);
      pending_map_bytes_ -= map_bytes;
      if (!region.ok()) {
        return region.status().WithContext(
            StrCat("host arena '", options_.name, "': allocating ", FormatBytes(bytes), " for ",
                   KindName(owned.kind), " owner ", owned.owner_id));
      }
      const auto base = reinterpret_cast<uint64_t>(region->base);
      Status st = extents_.AddSpan(base, map_bytes);
      if (!st.ok()) return st;  // the kernel gave us overlapping memory: cannot happen
      regions_.emplace(base, *region);
      stats_.committed_bytes += map_bytes;
      if (pin_mode_ == PinMode::kCuda) stats_.cuda_registered_bytes += map_bytes;
      if (pin_mode_ == PinMode::kMlock) stats_.mlocked_bytes += map_bytes;
      stats_.region_map_count++;
      NoteCommitted();
      // Another thread may have taken the new region's space; then go round again.
      if (!ledger_->scope_live(owned.scope)) continue;
      if (auto addr = extents_.Allocate(rounded, max_extent)) {
        RecordLive(*addr, rounded, bytes, owned, &frames);
        return reinterpret_cast<void*>(*addr);
      }
      continue;
    }
    // Over budget: ask the spill handler (without any lock) to free room, a few rounds at most.
    uint64_t freed = 0;
    if (handler && round < kMaxSpillRounds) freed = handler(spill_need);
    std::lock_guard<std::mutex> lock(mu_);
    stats_.spilled_bytes += freed;
    if (freed > 0) continue;
    stats_.over_budget_count++;
    return Status::OverBudget(StrCat(
        "host arena '", options_.name, "': allocating ", FormatBytes(rounded), " for ",
        KindName(owned.kind), " owner ", owned.owner_id, " needs ", FormatBytes(spill_need),
        " more than the host budget of ", FormatBytes(options_.budget_bytes), " allows (",
        DescribeLive(), handler ? "; the spill handler freed nothing" : "; no spill handler is set",
        "). Raise spillway.host_budget_bytes, offload more state to nvme "
        "(offload_optimizer.device / offload_param.device), or free memory first"));
  }
}

void HostArena::RecordLive(uint64_t addr, uint64_t bytes, uint64_t requested,
                           const OwnerTag& tag, std::vector<void*>* frames) {
  Live live{bytes, requested, tag, ledger_->epoch(), ledger_->step()};
  if (!live_nodes_.empty()) {
    auto node = std::move(live_nodes_.back());
    live_nodes_.pop_back();
    node.key() = addr;
    node.mapped() = live;
    live_.insert(std::move(node));
  } else {
    live_.emplace(addr, live);
  }
  if (!frames->empty()) traces_[addr] = std::move(*frames);
  stats_.live_bytes += bytes;
  stats_.requested_bytes += requested;
  stats_.live_by_kind[static_cast<size_t>(tag.kind)] += bytes;
  stats_.live_by_lifetime[static_cast<size_t>(tag.lifetime)] += bytes;
  stats_.live_allocations++;
  stats_.alloc_count++;
  stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
  stats_.peak_requested_bytes = std::max(stats_.peak_requested_bytes, stats_.requested_bytes);
}

void HostArena::EraseLive(std::map<uint64_t, Live>::iterator it, FreeReason reason) {
  const uint64_t addr = it->first;
  const Live& live = it->second;
  extents_.Free(addr, live.bytes);
  stats_.live_bytes -= live.bytes;
  stats_.requested_bytes -= live.requested;
  stats_.live_by_kind[static_cast<size_t>(live.tag.kind)] -= live.bytes;
  stats_.live_by_lifetime[static_cast<size_t>(live.tag.lifetime)] -= live.bytes;
  stats_.live_allocations--;
  stats_.free_count++;
  AddTombstone(addr, live.bytes, reason, live.tag.scope);
  if (!traces_.empty()) traces_.erase(addr);
  if (live_nodes_.size() < kMaxCachedNodes) {
    live_nodes_.push_back(live_.extract(it));
  } else {
    live_.erase(it);
  }
}

void HostArena::AddTombstone(uint64_t addr, uint64_t bytes, FreeReason reason, ScopeId scope) {
  tombstones_[tombstone_next_] =
      Tombstone{addr, bytes, ledger_->epoch(), ledger_->step(), scope, reason};
  tombstone_next_ = (tombstone_next_ + 1) % kMaxTombstones;
}

Status HostArena::Free(void* ptr) {
  const auto addr = reinterpret_cast<uint64_t>(ptr);
  std::vector<Region> to_release;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(addr);
    if (it == live_.end()) {
      stats_.bad_free_count++;
      return Status::InvalidArgument(DescribeBadFree(addr));
    }
    EraseLive(it, FreeReason::kFreed);
    DetachEmptyRegions(RetainLimit(), &to_release);
    if (!to_release.empty()) stats_.trim_count++;
  }
  ReleaseRegions(to_release);
  return Status::Ok();
}

std::string HostArena::DescribeBadFree(uint64_t addr) const {
  const std::string where = StrCat("host arena '", options_.name, "': Free(", Hex(addr), ")");
  if (addr == 0) return StrCat(where, ": null pointer; nothing to free");
  // The newest record for this address wins: it may have been freed, reused and freed again.
  const Tombstone* found = nullptr;
  for (size_t i = 1; i <= kMaxTombstones && found == nullptr; ++i) {
    const Tombstone& t = tombstones_[(tombstone_next_ + kMaxTombstones - i) % kMaxTombstones];
    if (t.bytes != 0 && t.addr == addr) found = &t;
  }
  if (found != nullptr) {
    const Tombstone& ts = *found;
    switch (ts.reason) {
      case FreeReason::kFreed:
        return StrCat(where, ": double free; these ", ts.bytes,
                      " bytes were already freed in epoch ", ts.epoch, " step ", ts.step,
                      ". Free each allocation exactly once");
      case FreeReason::kReclaimed:
        return StrCat(where, ": these ", ts.bytes,
                      " bytes were already reclaimed as an escape at the boundary of epoch ",
                      ts.epoch, " step ", ts.step,
                      ". The owner outlived its lifetime: free it before the boundary or give it "
                      "a longer lifetime");
      case FreeReason::kScopeReleased:
        return StrCat(where, ": free after scope release; these ", ts.bytes,
                      " bytes belonged to scope '", ledger_->scope_name(ts.scope),
                      "', which was released and freed them. Drop pointers into a scope before "
                      "releasing it");
    }
  }
  auto next = live_.upper_bound(addr);
  if (next != live_.begin()) {
    auto prev = std::prev(next);
    if (addr < prev->first + prev->second.bytes) {
      return StrCat(where, ": interior pointer, ", addr - prev->first,
                    " bytes into the allocation at ", Hex(prev->first), " (",
                    KindName(prev->second.tag.kind), " owner ", prev->second.tag.owner_id, ", ",
                    prev->second.requested, " bytes). Free the pointer Allocate returned");
    }
  }
  if (extents_.FindSpan(addr) != nullptr) {
    return StrCat(where, ": the address lies inside this arena but is not a live allocation "
                         "(a double free whose record aged out, or a stale pointer)");
  }
  return StrCat(where, ": foreign pointer; this arena did not allocate it. Free it with the "
                       "allocator that made it");
}

std::string HostArena::DescribeLive() const {
  std::string out = StrCat("committed ", FormatBytes(stats_.committed_bytes), ", live");
  bool any = false;
  for (int k = 0; k < kKindCount; ++k) {
    if (stats_.live_by_kind[k] == 0) continue;
    out += StrCat(any ? ", " : " ", KindName(static_cast<Kind>(k)), " ",
                  FormatBytes(stats_.live_by_kind[k]));
    any = true;
  }
  if (!any) out += " nothing";
  out += StrCat(", free inside regions ", FormatBytes(extents_.free_bytes()));
  return out;
}

uint64_t HostArena::Trim() {
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
  return span != nullptr && addr + bytes <= span->base + span->size;
}

Result<uint64_t> HostArena::AllocationSize(const void* ptr) const {
  const auto addr = reinterpret_cast<uint64_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(addr);
  if (it == live_.end()) return Status::InvalidArgument(DescribeBadFree(addr));
  return it->second.requested;
}

std::vector<HostArena::RegionInfo> HostArena::Regions() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RegionInfo> out;
  out.reserve(regions_.size());
  for (const auto& [base, r] : regions_) out.push_back({r.base, r.bytes});
  return out;
}

HostArenaStats HostArena::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  HostArenaStats s = stats_;
  s.retain_limit_now_bytes = RetainLimit();
  s.retained_bytes = extents_.empty_span_bytes();
  s.fragment_bytes = extents_.free_bytes() - extents_.empty_span_bytes();
  return s;
}

Escape HostArena::MakeEscape(uint64_t addr, const Live& live) const {
  Escape e;
  e.kind = live.tag.kind;
  e.lifetime = live.tag.lifetime;
  e.owner_id = live.tag.owner_id;
  e.scope = live.tag.scope;
  e.bytes = live.bytes;
  e.address = addr;
  e.birth_epoch = live.birth_epoch;
  e.birth_step = live.birth_step;
  if (live.tag.site != nullptr) e.site = live.tag.site;
  return e;
}

void HostArena::FinishEscapes(std::vector<Escape>* escapes) const {
  for (Escape& e : *escapes) e.scope_name = ledger_->scope_name(e.scope);
}

Status HostArena::CollectBoundary(BoundaryKind kind, int64_t epoch, int64_t step,
                                  TierReport* out) {
  std::vector<Region> to_release;
  std::vector<std::pair<size_t, std::vector<void*>>> traces;  // escape index -> frames
  out->tier = options_.name;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out->policy = options_.policy;
    // Escapes: step allocations born at or before this step; at an epoch end, also epoch ones
    // born at or before this epoch. Allocations of a step that began after this boundary are not
    // touched (they carry a later birth step).
    // One pass over the live table: boundaries are rare, and keeping per-lifetime indexes would
    // cost every allocation two tree operations.
    std::vector<uint64_t> escaped;
    for (const auto& [addr, live] : live_) {
      const bool step_escape = live.tag.lifetime == Lifetime::kStep && live.birth_step <= step;
      const bool epoch_escape = kind == BoundaryKind::kEpoch &&
                                live.tag.lifetime == Lifetime::kEpoch && live.birth_epoch <= epoch;
      if (step_escape || epoch_escape) escaped.push_back(addr);
    }
    std::sort(escaped.begin(), escaped.end(), [this](uint64_t a, uint64_t b) {
      const Live& la = live_.at(a);
      const Live& lb = live_.at(b);
      return la.birth_step != lb.birth_step ? la.birth_step < lb.birth_step : a < b;
    });
    for (uint64_t addr : escaped) {
      auto it = live_.find(addr);
      out->escape_count++;
      out->escaped_bytes += it->second.bytes;
      const bool reclaim = options_.policy == EscapePolicy::kReclaim;
      if (out->escapes.size() < TierReport::kMaxListedEscapes) {
        out->escapes.push_back(MakeEscape(addr, it->second));
        out->escapes.back().reclaimed = reclaim;
        if (auto tr = traces_.find(addr); tr != traces_.end()) {
          traces.emplace_back(out->escapes.size() - 1, tr->second);
        }
      }
      if (reclaim) {
        out->reclaimed_count++;
        out->reclaimed_bytes += it->second.bytes;
        EraseLive(it, FreeReason::kReclaimed);
      }
    }
    stats_.escape_count += out->escape_count;
    stats_.escaped_bytes += out->escaped_bytes;
    stats_.reclaim_count += out->reclaimed_count;
    stats_.reclaimed_bytes += out->reclaimed_bytes;
    DetachEmptyRegions(RetainLimit(), &to_release);
    out->live_bytes = stats_.live_bytes;
    out->live_allocations = stats_.live_allocations;
    out->live_by_kind = stats_.live_by_kind;
    out->live_by_lifetime = stats_.live_by_lifetime;
    out->committed_bytes = stats_.committed_bytes;
  }
  ReleaseRegions(to_release);
  FinishEscapes(&out->escapes);
  for (auto& [index, frames] : traces) {
    char** symbols = backtrace_symbols(frames.data(), static_cast<int>(frames.size()));
    if (symbols == nullptr) continue;
    std::string trace = out->escapes[index].site;
    for (size_t i = 1; i < frames.size(); ++i) trace += StrCat(trace.empty() ? "" : " <- ", symbols[i]);
    out->escapes[index].site = trace;
    free(symbols);  // NOLINT: backtrace_symbols allocates with malloc
  }
  if (out->policy == EscapePolicy::kFail && out->escape_count > 0) {
    const Escape& first = out->escapes.front();
    return Status::Make(
        StatusCode::kEscaped,
        StrCat("host arena '", options_.name, "': ", out->escape_count, " allocations (",
               FormatBytes(out->escaped_bytes), ") outlived their lifetime at the end of ",
               kind == BoundaryKind::kEpoch ? StrCat("epoch ", epoch) : StrCat("step ", step),
               "; first: ", KindName(first.kind), "/", LifetimeName(first.lifetime), " owner ",
               first.owner_id, " (", first.bytes, " bytes, born epoch ", first.birth_epoch,
               " step ", first.birth_step, first.site.empty() ? "" : " at ", first.site,
               "). Free them before the boundary, give them a longer lifetime, or set the escape "
               "policy to report or reclaim"));
  }
  return Status::Ok();
}

void HostArena::ReleaseScope(ScopeId scope, TierReport* out) {
  std::vector<Region> to_release;
  out->tier = options_.name;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out->policy = options_.policy;
    for (auto it = live_.begin(); it != live_.end();) {
      auto next = std::next(it);
      if (it->second.tag.scope == scope) {
        out->reclaimed_count++;
        out->reclaimed_bytes += it->second.bytes;
        EraseLive(it, FreeReason::kScopeReleased);
      }
      it = next;
    }
    stats_.scope_freed_count += out->reclaimed_count;
    stats_.scope_freed_bytes += out->reclaimed_bytes;
    DetachEmptyRegions(RetainLimit(), &to_release);
    out->live_bytes = stats_.live_bytes;
    out->live_allocations = stats_.live_allocations;
    out->live_by_kind = stats_.live_by_kind;
    out->live_by_lifetime = stats_.live_by_lifetime;
    out->committed_bytes = stats_.committed_bytes;
  }
  ReleaseRegions(to_release);
}

Status HostArena::Validate() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<uint64_t, uint64_t>> allocated;
  allocated.reserve(live_.size());
  uint64_t live_sum = 0, requested_sum = 0;
  KindBytes by_kind{};
  LifetimeBytes by_lifetime{};
  for (const auto& [addr, live] : live_) {
    allocated.emplace_back(addr, live.bytes);
    live_sum += live.bytes;
    requested_sum += live.requested;
    by_kind[static_cast<size_t>(live.tag.kind)] += live.bytes;
    by_lifetime[static_cast<size_t>(live.tag.lifetime)] += live.bytes;
    if (live.bytes % page_ != 0) {
      return Status::Internal(StrCat("Validate: live extent at ", Hex(addr), " not page-sized"));
    }
  }
  SPILLWAY_RETURN_IF_ERROR(extents_.Validate(allocated));
  for (const auto& [addr, frames] : traces_) {
    if (!live_.count(addr)) return Status::Internal("Validate: a backtrace outlived its allocation");
  }
  if (live_sum != stats_.live_bytes || requested_sum != stats_.requested_bytes ||
      by_kind != stats_.live_by_kind || by_lifetime != stats_.live_by_lifetime ||
      live_.size() != stats_.live_allocations) {
    return Status::Internal("Validate: live counters disagree with the live table");
  }
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
    return Status::Internal(StrCat("Validate: committed ", stats_.committed_bytes,
                                   " != live ", live_sum, " + retained ", retained,
                                   " + fragment ", fragment));
  }
  if (stats_.committed_bytes > options_.budget_bytes) {
    return Status::Internal(StrCat("Validate: committed ", stats_.committed_bytes,
                                   " is over the budget ", options_.budget_bytes));
  }
  if (retained > RetainLimit() && pending_map_bytes_ == 0) {
    return Status::Internal(StrCat("Validate: retained ", retained, " is over the limit ",
                                   RetainLimit()));
  }
  return Status::Ok();
}

}  // namespace spillway::allocator
