// Ledger: boundary state machine, scope table and report formatting.
#include "spillway/allocator/ledger.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>

namespace spillway::allocator {

uint64_t BoundaryReport::escape_count() const {
  uint64_t n = 0;
  for (const auto& t : tiers) n += t.escape_count;
  return n;
}
uint64_t BoundaryReport::escaped_bytes() const {
  uint64_t n = 0;
  for (const auto& t : tiers) n += t.escaped_bytes;
  return n;
}
uint64_t BoundaryReport::live_bytes() const {
  uint64_t n = 0;
  for (const auto& t : tiers) n += t.live_bytes;
  return n;
}
uint64_t ScopeReleaseReport::freed_bytes() const {
  uint64_t n = 0;
  for (const auto& t : tiers) n += t.reclaimed_bytes;
  return n;
}

std::string BoundaryReport::ToString() const {
  std::string out = StrCat(kind == BoundaryKind::kEpoch ? "end of epoch " : "end of step ",
                           kind == BoundaryKind::kEpoch ? epoch : step, " (epoch ", epoch,
                           ", step ", step, ")\n");
  char line[256];
  std::snprintf(line, sizeof(line), "  %-6s %-16s %14s %14s %14s\n", "tier", "kind", "persistent",
                "epoch", "step");
  out += line;
  for (const auto& t : tiers) {
    for (int k = 0; k < kKindCount; ++k) {
      if (t.live_by_kind[k] == 0) continue;
      // Lifetime split per kind is not tracked; print the kind's total under its bytes column.
      std::snprintf(line, sizeof(line), "  %-6s %-16s %14" PRIu64 "\n", t.tier.c_str(),
                    KindName(static_cast<Kind>(k)), t.live_by_kind[k]);
      out += line;
    }
    std::snprintf(line, sizeof(line),
                  "  %-6s %-16s %14" PRIu64 " %14" PRIu64 " %14" PRIu64 "   live %" PRIu64
                  " B in %" PRIu64 " allocations\n",
                  t.tier.c_str(), "(by lifetime)", t.live_by_lifetime[0], t.live_by_lifetime[1],
                  t.live_by_lifetime[2], t.live_bytes, t.live_allocations);
    out += line;
    std::snprintf(line, sizeof(line),
                  "  %-6s escapes %" PRIu64 " (%" PRIu64 " B), reclaimed %" PRIu64 " (%" PRIu64
                  " B), policy %s\n",
                  t.tier.c_str(), t.escape_count, t.escaped_bytes, t.reclaimed_count,
                  t.reclaimed_bytes, EscapePolicyName(t.policy));
    out += line;
    for (const auto& e : t.escapes) {
      out += StrCat("    escape: ", KindName(e.kind), "/", LifetimeName(e.lifetime), " owner ",
                    e.owner_id, " scope '", e.scope_name, "' ", e.bytes, " B born epoch ",
                    e.birth_epoch, " step ", e.birth_step, e.site.empty() ? "" : " at ", e.site,
                    e.reclaimed ? " [reclaimed]" : "", "\n");
    }
    if (t.escape_count > t.escapes.size()) {
      out += StrCat("    ... and ", t.escape_count - t.escapes.size(), " more escapes\n");
    }
  }
  return out;
}

Ledger::Ledger() {
  scope_names_.emplace_back("process");
  scope_state_[kProcessScope].store(kScopeLive, std::memory_order_release);
}

Ledger::~Ledger() = default;

Ledger& Ledger::Default() {
  static Ledger* ledger = new Ledger();  // never destroyed: arenas may outlive static destructors
  return *ledger;
}

Status Ledger::BeginEpoch(int64_t epoch) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("Ledger", "BeginEpoch"));
  std::lock_guard<std::mutex> lock(mu_);
  if (in_epoch_.load()) {
    return Status::FailedPrecondition(StrCat("BeginEpoch(", epoch, "): epoch ", epoch_.load(),
                                             " is still open; call EndEpoch first"));
  }
  if (in_step_.load()) {
    return Status::FailedPrecondition(StrCat("BeginEpoch(", epoch, "): step ", step_.load(),
                                             " is still open; call EndStep first"));
  }
  if (epoch <= epoch_.load() || epoch < 0) {
    return Status::InvalidArgument(StrCat("BeginEpoch(", epoch,
                                          "): epoch numbers must be >= 0 and increase; the last "
                                          "epoch was ",
                                          epoch_.load()));
  }
  epoch_.store(epoch, std::memory_order_release);
  in_epoch_.store(true, std::memory_order_release);
  return Status::Ok();
}

Status Ledger::BeginStep(int64_t step) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("Ledger", "BeginStep"));
  std::lock_guard<std::mutex> lock(mu_);
  if (in_step_.load()) {
    return Status::FailedPrecondition(
        StrCat("BeginStep(", step, "): step ", step_.load(), " is still open; call EndStep first"));
  }
  if (step <= step_.load() || step < 0) {
    return Status::InvalidArgument(
        StrCat("BeginStep(", step, "): step numbers must be >= 0 and increase; the last step was ",
               step_.load()));
  }
  step_.store(step, std::memory_order_release);
  in_step_.store(true, std::memory_order_release);
  return Status::Ok();
}

Status Ledger::EndStep(BoundaryReport* report) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("Ledger", "EndStep"));
  int64_t epoch, step;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!in_step_.load()) {
      return Status::FailedPrecondition(StrCat("EndStep without BeginStep (the last step was ",
                                               step_.load(),
                                               "); call BeginStep(n) at the start of each step"));
    }
    in_step_.store(false, std::memory_order_release);
    epoch = epoch_.load();
    step = step_.load();
  }
  return RunBoundary(BoundaryKind::kStep, epoch, step, report);
}

Status Ledger::EndEpoch(BoundaryReport* report) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("Ledger", "EndEpoch"));
  int64_t epoch, step;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!in_epoch_.load()) {
      return Status::FailedPrecondition(StrCat("EndEpoch without BeginEpoch (the last epoch was ",
                                               epoch_.load(),
                                               "); call BeginEpoch(n) at the start of each epoch"));
    }
    if (in_step_.load()) {
      return Status::FailedPrecondition(
          StrCat("EndEpoch while step ", step_.load(), " is open; call EndStep first"));
    }
    in_epoch_.store(false, std::memory_order_release);
    epoch = epoch_.load();
    step = step_.load();
  }
  return RunBoundary(BoundaryKind::kEpoch, epoch, step, report);
}

std::vector<Tier*> Ledger::PinTiers() {
  std::lock_guard<std::mutex> lock(mu_);
  ++active_walks_;
  return tiers_;
}

void Ledger::UnpinTiers() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--active_walks_ == 0) tiers_idle_.notify_all();
}

Status Ledger::RunBoundary(BoundaryKind kind, int64_t epoch, int64_t step, BoundaryReport* report) {
  BoundaryReport local;
  local.kind = kind;
  local.epoch = epoch;
  local.step = step;
  Status first_error;
  for (Tier* tier : PinTiers()) {
    TierReport tr;
    Status st = tier->CollectBoundary(kind, epoch, step, &tr);
    if (!st.ok() && first_error.ok()) first_error = st;
    local.tiers.push_back(std::move(tr));
  }
  UnpinTiers();
  if (report != nullptr) *report = std::move(local);
  return first_error;
}

Result<ScopeId> Ledger::CreateScope(std::string_view name) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("Ledger", "CreateScope"));
  std::lock_guard<std::mutex> lock(mu_);
  if (scope_names_.size() >= kMaxScopes) {
    return Status::ResourceExhausted(
        StrCat("CreateScope('", name, "'): all ", kMaxScopes,
               " scope ids are used; scopes are never reused, so reuse a scope "
               "for objects that are rebuilt"));
  }
  const auto id = static_cast<ScopeId>(scope_names_.size());
  scope_names_.emplace_back(name);
  scope_state_[id].store(kScopeLive, std::memory_order_release);
  return id;
}

Result<ScopeReleaseReport> Ledger::ReleaseScope(ScopeId scope) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("Ledger", "ReleaseScope"));
  ScopeReleaseReport report;
  report.scope = scope;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (scope == kProcessScope) {
      return Status::InvalidArgument("ReleaseScope(0): the process scope cannot be released");
    }
    if (scope >= scope_names_.size()) {
      return Status::InvalidArgument(StrCat("ReleaseScope(", scope, "): no such scope"));
    }
    report.name = scope_names_[scope];
    uint8_t expected = kScopeLive;
    // Mark first: an allocation that races with the sweep sees the mark under its arena lock.
    if (!scope_state_[scope].compare_exchange_strong(expected, kScopeReleased,
                                                     std::memory_order_seq_cst)) {
      return Status::FailedPrecondition(
          StrCat("ReleaseScope(", scope, "): scope '", report.name, "' was already released"));
    }
  }
  for (Tier* tier : PinTiers()) {
    TierReport tr;
    tier->ReleaseScope(scope, &tr);
    report.tiers.push_back(std::move(tr));
  }
  UnpinTiers();
  return report;
}

bool Ledger::scope_live(ScopeId scope) const {
  return scope < kMaxScopes && scope_state_[scope].load(std::memory_order_seq_cst) == kScopeLive;
}

bool Ledger::scope_exists(ScopeId scope) const {
  return scope < kMaxScopes && scope_state_[scope].load(std::memory_order_acquire) != kScopeUnused;
}

std::string Ledger::scope_name(ScopeId scope) const {
  std::lock_guard<std::mutex> lock(mu_);
  return scope < scope_names_.size() ? scope_names_[scope] : StrCat("<scope ", scope, ">");
}

void Ledger::Attach(Tier* tier) {
  std::lock_guard<std::mutex> lock(mu_);
  tiers_.push_back(tier);
}

void Ledger::Detach(Tier* tier) {
  // In a forked child the mutex may have been held by a parent thread at fork time, and a boundary
  // walk the parent had in flight never ends here: touch nothing (the child's ledger refuses).
  if (!process_.InOwner()) return;
  std::unique_lock<std::mutex> lock(mu_);
  tiers_.erase(std::remove(tiers_.begin(), tiers_.end(), tier), tiers_.end());
  tiers_idle_.wait(lock, [this] { return active_walks_ == 0; });
}

}  // namespace spillway::allocator
