// The names of HostArena's pin modes and fork-safety modes, and their parsers (for options given as
// text: the Python module, the CLI, environment variables).
#include <array>
#include <string>
#include <string_view>

#include "spillway/allocator/host_arena.h"
#include "spillway/base/status.h"

namespace spillway::allocator {
namespace {

constexpr std::array<const char*, 4> kPinNames = {"auto", "cuda", "mlock", "pageable"};
constexpr std::array<const char*, 3> kForkNames = {"dontfork", "wipeonfork", "inherit"};

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
  SPILLWAY_ASSIGN_OR_RETURN(auto r, ParseIndex("pin mode", name, kPinNames));
  return static_cast<PinMode>(r);
}
Result<ForkSafety> ParseForkSafety(std::string_view name) {
  SPILLWAY_ASSIGN_OR_RETURN(auto r, ParseIndex("fork safety", name, kForkNames));
  return static_cast<ForkSafety>(r);
}

}  // namespace spillway::allocator
