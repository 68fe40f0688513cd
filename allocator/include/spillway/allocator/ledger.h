// Ledger: the per-process record of epochs, steps and owner scopes that every arena reports to.
// A boundary (EndStep/EndEpoch) asks each attached tier for its escapes and returns one report that
// covers all tiers. See docs/allocator.md, Note [Boundaries].
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "spillway/allocator/owner.h"
#include "spillway/allocator/process.h"
#include "spillway/base/status.h"

namespace spillway::allocator {

enum class BoundaryKind : uint8_t { kStep, kEpoch };

// One allocation that outlived its lifetime.
struct Escape {
  Kind kind = Kind::kTransient;
  Lifetime lifetime = Lifetime::kStep;
  uint64_t owner_id = 0;
  ScopeId scope = kProcessScope;
  std::string scope_name;
  uint64_t bytes = 0;
  uint64_t address = 0;      // host address or NVMe file offset
  int64_t birth_epoch = -1;  // -1: before the first epoch
  int64_t birth_step = -1;   // -1: before the first step
  std::string site;          // "file:line" or a symbolized backtrace; empty when not recorded
  bool reclaimed = false;
};

// What one tier (host, nvme) looked like at a boundary, after its escape policy ran.
struct TierReport {
  std::string tier;
  EscapePolicy policy = EscapePolicy::kReport;
  uint64_t live_bytes = 0;
  uint64_t live_allocations = 0;
  KindBytes live_by_kind{};
  LifetimeBytes live_by_lifetime{};
  uint64_t committed_bytes = 0;
  uint64_t escape_count = 0;  // exact, even when `escapes` is cut short
  uint64_t escaped_bytes = 0;
  uint64_t reclaimed_count = 0;
  uint64_t reclaimed_bytes = 0;
  std::vector<Escape> escapes;  // at most kMaxListedEscapes, oldest first
  static constexpr size_t kMaxListedEscapes = 64;
};

struct BoundaryReport {
  BoundaryKind kind = BoundaryKind::kStep;
  int64_t epoch = -1;
  int64_t step = -1;
  std::vector<TierReport> tiers;

  uint64_t escape_count() const;
  uint64_t escaped_bytes() const;
  uint64_t live_bytes() const;
  bool clean() const { return escape_count() == 0; }
  // A table a person reads: live bytes by tier, kind and lifetime, then each listed escape.
  std::string ToString() const;
};

// What releasing a scope freed, per tier.
struct ScopeReleaseReport {
  ScopeId scope = kProcessScope;
  std::string name;
  std::vector<TierReport> tiers;  // reclaimed_count/bytes say what was freed
  uint64_t freed_bytes() const;
};

// Implemented by each arena. The ledger calls these without holding its own lock.
class Tier {
 public:
  virtual ~Tier() = default;
  virtual const std::string& tier_name() const = 0;
  // Finds allocations that outlived the boundary that just ended (lifetime step for a step
  // boundary, step or epoch for an epoch boundary, born at or before `epoch`/`step`), applies the
  // tier's policy, and fills `out`. Returns kEscaped under the `fail` policy when there were
  // escapes.
  virtual Status CollectBoundary(BoundaryKind kind, int64_t epoch, int64_t step,
                                 TierReport* out) = 0;
  // Frees every allocation owned by `scope` and fills out->reclaimed_*.
  virtual void ReleaseScope(ScopeId scope, TierReport* out) = 0;
};

// Thread-safe. Boundary calls must come in order (BeginEpoch, BeginStep, EndStep, ..., EndEpoch);
// out-of-order calls return kFailedPrecondition and change nothing.
//
// Lock order: Ledger::mu_ is never held while calling into a tier, and tiers never call into the
// ledger except through the lock-free readers (epoch(), step(), scope_live()).
class Ledger {
 public:
  Ledger();
  ~Ledger();
  Ledger(const Ledger&) = delete;
  Ledger& operator=(const Ledger&) = delete;

  // The process-wide ledger that arenas use unless told otherwise.
  static Ledger& Default();

  // Epoch and step numbers are chosen by the caller and must increase.
  Status BeginEpoch(int64_t epoch);
  Status EndEpoch(BoundaryReport* report);
  Status BeginStep(int64_t step);
  Status EndStep(BoundaryReport* report);

  // Scopes group owners (one engine instance, one optimizer). Ids are never reused.
  Result<ScopeId> CreateScope(std::string_view name);
  // Frees everything the scope owns in every attached tier. Later use of the scope, or a Free of
  // one of its old pointers, is an error that names the scope.
  Result<ScopeReleaseReport> ReleaseScope(ScopeId scope);
  bool scope_live(ScopeId scope) const;
  bool scope_exists(ScopeId scope) const;
  std::string scope_name(ScopeId scope) const;

  // Lock-free reads for the allocation hot path.
  int64_t epoch() const { return epoch_.load(std::memory_order_acquire); }
  int64_t step() const { return step_.load(std::memory_order_acquire); }
  bool in_epoch() const { return in_epoch_.load(std::memory_order_acquire); }
  bool in_step() const { return in_step_.load(std::memory_order_acquire); }

  // Arenas attach in their constructor and detach in their destructor. Detach waits for a boundary
  // that is running over the tier to finish.
  void Attach(Tier* tier);
  void Detach(Tier* tier);

  static constexpr uint32_t kMaxScopes = 1u << 16;

 private:
  enum : uint8_t { kScopeUnused = 0, kScopeLive = 1, kScopeReleased = 2 };
  Status RunBoundary(BoundaryKind kind, int64_t epoch, int64_t step, BoundaryReport* report);
  std::vector<Tier*> PinTiers();  // copies the tier list and marks a boundary in flight
  void UnpinTiers();

  const ProcessTag process_;  // Note [Fork]: refuses in a forked child
  mutable std::mutex mu_;
  ForkSafeCondition tiers_idle_;
  std::vector<Tier*> tiers_;              // guarded by mu_
  int active_walks_ = 0;                  // guarded by mu_: boundaries/releases walking tiers_
  std::vector<std::string> scope_names_;  // guarded by mu_; index = ScopeId
  std::array<std::atomic<uint8_t>, kMaxScopes> scope_state_{};  // lock-free liveness
  std::atomic<int64_t> epoch_{-1};
  std::atomic<int64_t> step_{-1};
  std::atomic<bool> in_epoch_{false};
  std::atomic<bool> in_step_{false};
};

}  // namespace spillway::allocator
