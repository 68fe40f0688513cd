// LiveTable: owner records, tombstones and boundary sweeps shared by the host and NVMe arenas.
#include "live_table.h"

#include <execinfo.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>

#include "spillway/base/bytes.h"

namespace spillway::allocator {
namespace {

std::string Hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%" PRIx64, v);
  return buf;
}

}  // namespace

LiveTable::LiveTable(Ledger* ledger, std::string what)
    : ledger_(ledger), what_(std::move(what)), tombstones_(kMaxTombstones) {
  spare_nodes_.reserve(kMaxCachedNodes);
}

void LiveTable::Insert(uint64_t addr, uint64_t bytes, uint64_t requested, const OwnerTag& tag,
                       std::vector<void*>* frames) {
  Live live{bytes, requested, tag, ledger_->epoch(), ledger_->step()};
  if (!spare_nodes_.empty()) {
    auto node = std::move(spare_nodes_.back());
    spare_nodes_.pop_back();
    node.key() = addr;
    node.mapped() = live;
    live_.insert(std::move(node));
  } else {
    live_.emplace(addr, live);
  }
  if (frames != nullptr && !frames->empty()) traces_[addr] = std::move(*frames);
  stats_.live_bytes += bytes;
  stats_.requested_bytes += requested;
  stats_.live_by_kind[static_cast<size_t>(tag.kind)] += bytes;
  stats_.live_by_lifetime[static_cast<size_t>(tag.lifetime)] += bytes;
  stats_.live_allocations++;
  stats_.alloc_count++;
  stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
  stats_.peak_requested_bytes = std::max(stats_.peak_requested_bytes, stats_.requested_bytes);
}

LiveTable::Live LiveTable::Erase(uint64_t addr, FreeReason reason) {
  auto it = live_.find(addr);
  const Live live = it->second;
  stats_.live_bytes -= live.bytes;
  stats_.requested_bytes -= live.requested;
  stats_.live_by_kind[static_cast<size_t>(live.tag.kind)] -= live.bytes;
  stats_.live_by_lifetime[static_cast<size_t>(live.tag.lifetime)] -= live.bytes;
  stats_.live_allocations--;
  stats_.free_count++;
  tombstones_[tombstone_next_] =
      Tombstone{addr, live.bytes, ledger_->epoch(), ledger_->step(), live.tag.scope, reason};
  tombstone_next_ = (tombstone_next_ + 1) % kMaxTombstones;
  if (!traces_.empty()) traces_.erase(addr);
  if (spare_nodes_.size() < kMaxCachedNodes) {
    spare_nodes_.push_back(live_.extract(it));
  } else {
    live_.erase(it);
  }
  return live;
}

const LiveTable::Live* LiveTable::Find(uint64_t addr) const {
  auto it = live_.find(addr);
  return it == live_.end() ? nullptr : &it->second;
}

std::string LiveTable::DescribeBadFree(uint64_t addr, bool inside) const {
  const std::string where = StrCat(what_, ": Free(", Hex(addr), ")");
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
  if (addr == 0 && !inside) return StrCat(where, ": null pointer; nothing to free");
  auto next = live_.upper_bound(addr);
  if (next != live_.begin()) {
    auto prev = std::prev(next);
    if (addr < prev->first + prev->second.bytes) {
      return StrCat(where, ": interior pointer, ", addr - prev->first,
                    " bytes into the allocation at ", Hex(prev->first), " (",
                    KindName(prev->second.tag.kind), " owner ", prev->second.tag.owner_id, ", ",
                    prev->second.requested, " bytes). Free the address Allocate returned");
    }
  }
  if (inside) {
    return StrCat(where,
                  ": the address lies inside this arena but is not a live allocation "
                  "(a double free whose record aged out, or a stale pointer)");
  }
  return StrCat(where,
                ": foreign pointer; this arena did not allocate it. Free it with the "
                "allocator that made it");
}

void LiveTable::CollectEscapes(BoundaryKind kind, int64_t epoch, int64_t step, EscapePolicy policy,
                               TierReport* out, Traces* traces, const FreeExtentFn& free_extent) {
  out->policy = policy;
  // One pass over the live table: boundaries are rare, and per-lifetime indexes would cost every
  // allocation two more tree operations.
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
  const bool reclaim = policy == EscapePolicy::kReclaim;
  for (uint64_t addr : escaped) {
    const Live& live = live_.at(addr);
    out->escape_count++;
    out->escaped_bytes += live.bytes;
    const auto k = static_cast<size_t>(live.tag.kind);
    const auto l = static_cast<size_t>(live.tag.lifetime);
    stats_.escapes_by[k][l]++;
    stats_.escaped_bytes_by[k][l] += live.bytes;
    if (out->escapes.size() < TierReport::kMaxListedEscapes) {
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
      e.reclaimed = reclaim;
      out->escapes.push_back(std::move(e));
      if (auto tr = traces_.find(addr); tr != traces_.end() && traces != nullptr) {
        traces->emplace_back(out->escapes.size() - 1, tr->second);
      }
    }
    if (reclaim) {
      out->reclaimed_count++;
      out->reclaimed_bytes += live.bytes;
      const Live gone = Erase(addr, FreeReason::kReclaimed);
      free_extent(addr, gone.bytes);
    }
  }
  stats_.escape_count += out->escape_count;
  stats_.escaped_bytes += out->escaped_bytes;
  stats_.reclaim_count += out->reclaimed_count;
  stats_.reclaimed_bytes += out->reclaimed_bytes;
  FillLive(out);
}

void LiveTable::ReleaseScope(ScopeId scope, TierReport* out, const FreeExtentFn& free_extent) {
  std::vector<uint64_t> owned;
  for (const auto& [addr, live] : live_) {
    if (live.tag.scope == scope) owned.push_back(addr);
  }
  for (uint64_t addr : owned) {
    const Live gone = Erase(addr, FreeReason::kScopeReleased);
    out->reclaimed_count++;
    out->reclaimed_bytes += gone.bytes;
    free_extent(addr, gone.bytes);
  }
  stats_.scope_freed_count += out->reclaimed_count;
  stats_.scope_freed_bytes += out->reclaimed_bytes;
  FillLive(out);
}

void LiveTable::FillLive(TierReport* out) const {
  out->live_bytes = stats_.live_bytes;
  out->live_allocations = stats_.live_allocations;
  out->live_by_kind = stats_.live_by_kind;
  out->live_by_lifetime = stats_.live_by_lifetime;
}

std::vector<std::pair<uint64_t, uint64_t>> LiveTable::Extents() const {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  out.reserve(live_.size());
  for (const auto& [addr, live] : live_) out.emplace_back(addr, live.bytes);
  return out;
}

Status LiveTable::Validate() const {
  uint64_t live_sum = 0, requested_sum = 0;
  KindBytes by_kind{};
  LifetimeBytes by_lifetime{};
  for (const auto& [addr, live] : live_) {
    live_sum += live.bytes;
    requested_sum += live.requested;
    by_kind[static_cast<size_t>(live.tag.kind)] += live.bytes;
    by_lifetime[static_cast<size_t>(live.tag.lifetime)] += live.bytes;
    if (live.requested > live.bytes) {
      return Status::Internal(StrCat("Validate: record at ", Hex(addr), " is smaller than asked"));
    }
  }
  if (live_sum != stats_.live_bytes || requested_sum != stats_.requested_bytes ||
      by_kind != stats_.live_by_kind || by_lifetime != stats_.live_by_lifetime ||
      live_.size() != stats_.live_allocations) {
    return Status::Internal("Validate: live counters disagree with the live table");
  }
  for (const auto& [addr, frames] : traces_) {
    if (!live_.count(addr))
      return Status::Internal("Validate: a backtrace outlived its allocation");
  }
  return Status::Ok();
}

void LiveTable::FinishEscapes(const Ledger& ledger, const Traces& traces, TierReport* out) {
  for (Escape& e : out->escapes) e.scope_name = ledger.scope_name(e.scope);
  for (const auto& [index, frames] : traces) {
    char** symbols = backtrace_symbols(frames.data(), static_cast<int>(frames.size()));
    if (symbols == nullptr) continue;
    std::string trace = out->escapes[index].site;
    for (size_t i = 1; i < frames.size(); ++i) {
      trace += StrCat(trace.empty() ? "" : " <- ", symbols[i]);
    }
    out->escapes[index].site = trace;
    std::free(symbols);  // backtrace_symbols allocates with malloc
  }
}

Status LiveTable::EscapeError(const std::string& what, BoundaryKind kind, int64_t epoch,
                              int64_t step, const TierReport& report) {
  if (report.policy != EscapePolicy::kFail || report.escape_count == 0) return Status::Ok();
  const Escape& first = report.escapes.front();
  return Status::Make(
      StatusCode::kEscaped,
      StrCat(what, ": ", report.escape_count, " allocations (", FormatBytes(report.escaped_bytes),
             ") outlived their lifetime at the end of ",
             kind == BoundaryKind::kEpoch ? StrCat("epoch ", epoch) : StrCat("step ", step),
             "; first: ", KindName(first.kind), "/", LifetimeName(first.lifetime), " owner ",
             first.owner_id, " (", first.bytes, " bytes, born epoch ", first.birth_epoch, " step ",
             first.birth_step, first.site.empty() ? "" : " at ", first.site,
             "). Free them before the boundary, give them a longer lifetime, or set the escape "
             "policy to report or reclaim"));
}

}  // namespace spillway::allocator
