// Owner tags: who an allocation belongs to, how long it may live, and where it was made.
// Every byte in every Spillway arena carries one. See docs/allocator.md, Note [Ownership].
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "spillway/base/status.h"

namespace spillway::allocator {

// What the bytes are. Bounded on purpose: these are Prometheus label values.
enum class Kind : uint8_t {
  kParam = 0,       // 16-bit parameter partition
  kGrad,            // gradient partition
  kMasterWeight,    // fp32 master weights
  kOptimizerState,  // Adam moments
  kSwapBuffer,      // staging / bounce buffers for NVMe I/O
  kCheckpoint,      // checkpoint streaming buffers
  kTransient,       // gather buffers and other per-step scratch
};
inline constexpr int kKindCount = 7;

// How long the bytes may live. A `step` allocation alive at EndStep, or a `step`/`epoch` allocation
// alive at EndEpoch, is an escape.
enum class Lifetime : uint8_t { kPersistent = 0, kEpoch, kStep };
inline constexpr int kLifetimeCount = 3;

// What a boundary does with escapes.
enum class EscapePolicy : uint8_t {
  kReport = 0,  // list them in the boundary report, leave them alive
  kReclaim,     // free them and count them
  kFail,        // list them and return StatusCode::kEscaped
};

const char* KindName(Kind kind);
const char* LifetimeName(Lifetime lifetime);
const char* EscapePolicyName(EscapePolicy policy);
// Parsers name the allowed values when the string is not one of them.
Result<Kind> ParseKind(std::string_view name);
Result<Lifetime> ParseLifetime(std::string_view name);
Result<EscapePolicy> ParseEscapePolicy(std::string_view name);

// A named owner group, e.g. one engine instance. Releasing a scope frees everything it owns in
// every tier. Scope 0 is the process scope and is never released.
using ScopeId = uint32_t;
inline constexpr ScopeId kProcessScope = 0;

struct OwnerTag {
  Kind kind = Kind::kTransient;
  Lifetime lifetime = Lifetime::kStep;
  uint64_t owner_id = 0;  // chosen by the caller, e.g. a partition id
  ScopeId scope = kProcessScope;
  const char* site = nullptr;  // static string with static storage (SPILLWAY_SITE), or null
};

// Fixed-size per-kind / per-lifetime byte counters used by every stats struct.
using KindBytes = std::array<uint64_t, kKindCount>;
using LifetimeBytes = std::array<uint64_t, kLifetimeCount>;

}  // namespace spillway::allocator
