// Tag scopes: `spillway.tag(...)` as torch debug info that follows work across threads (torch
// carries ThreadLocalDebugInfo into autograd's worker threads), read by the CPU router and the
// pinned allocator. Note [Torch allocators] in docs/deepspeed.md.
#pragma once

#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/version.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "spillway/allocator/owner.h"
#include "spillway/base/status.h"

namespace spillway::torch_alloc {

inline constexpr std::string_view kTagKindName = "spillway.tag";
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
inline const c10::DebugInfoKind kTagKind(&kTagKindName);
#else
// Before 2.13 the kinds are a closed enum; TEST_INFO_2 is the slot nothing in torch itself uses.
inline constexpr c10::DebugInfoKind kTagKind = c10::DebugInfoKind::TEST_INFO_2;
#endif

// One open tag scope. Immutable once pushed; shared by every thread the debug info was propagated
// to (autograd's workers hold it through ThreadLocalStateGuard).
struct TagScope final : c10::DebugInfoBase {
  allocator::OwnerTag tag;
  std::string label;  // "optimizer_state/persistent"
  uint64_t serial = 0;
};

// Tag scopes open in the process, on any thread. Zero (the state outside training code) lets the
// router forward without touching thread-local state: torch's ThreadLocalDebugInfo lives in
// libc10.so, whose thread-locals cost a __tls_get_addr call (measured: ~4 ns on a 77 ns
// allocation). A task torch launched inside a scope that outlives the scope's exit allocates
// untagged.
inline std::atomic<int64_t> g_open_scopes{0};

inline const TagScope* CurrentTag() {
  return static_cast<const TagScope*>(c10::ThreadLocalDebugInfo::get(kTagKind));
}

// Opens a scope on this thread: allocations inside it are booked as `kind`/`lifetime`, `owner`.
// An unknown kind or lifetime is refused by name (allocator::ParseKind, ParseLifetime).
Result<std::shared_ptr<TagScope>> EnterTag(std::string_view kind, std::string_view lifetime,
                                           uint64_t owner);
// Closes `scope`, which must be this thread's innermost debug scope; otherwise FAILED_PRECONDITION
// naming the scope that is open, and nothing changed.
Status ExitTag(const std::shared_ptr<TagScope>& scope);

}  // namespace spillway::torch_alloc
