// Names and parsers for the owner-tag enums.
#include "spillway/allocator/owner.h"

namespace spillway::allocator {
namespace {

constexpr std::array<const char*, kKindCount> kKindNames = {
    "param", "grad", "master_weight", "optimizer_state", "swap_buffer", "checkpoint", "transient"};
constexpr std::array<const char*, kLifetimeCount> kLifetimeNames = {"persistent", "epoch", "step"};
constexpr std::array<const char*, 3> kPolicyNames = {"report", "reclaim", "fail"};

template <typename Enum, size_t N>
Result<Enum> ParseName(std::string_view what, std::string_view name,
                       const std::array<const char*, N>& names) {
  std::string allowed;
  for (size_t i = 0; i < N; ++i) {
    if (name == names[i]) return static_cast<Enum>(i);
    allowed += (i ? ", " : "");
    allowed += names[i];
  }
  return Status::InvalidArgument(
      StrCat("unknown ", what, " '", name, "'; allowed values: ", allowed));
}

}  // namespace

const char* KindName(Kind kind) { return kKindNames[static_cast<size_t>(kind)]; }
const char* LifetimeName(Lifetime lifetime) {
  return kLifetimeNames[static_cast<size_t>(lifetime)];
}
const char* EscapePolicyName(EscapePolicy policy) {
  return kPolicyNames[static_cast<size_t>(policy)];
}

Result<Kind> ParseKind(std::string_view name) { return ParseName<Kind>("kind", name, kKindNames); }
Result<Lifetime> ParseLifetime(std::string_view name) {
  return ParseName<Lifetime>("lifetime", name, kLifetimeNames);
}
Result<EscapePolicy> ParseEscapePolicy(std::string_view name) {
  return ParseName<EscapePolicy>("escape policy", name, kPolicyNames);
}

}  // namespace spillway::allocator
