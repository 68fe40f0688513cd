// Entering and leaving tag scopes (tag_scope.h).
#include "spillway/torch_alloc/tag_scope.h"

#include <c10/util/Exception.h>

#include <string>

namespace spillway::torch_alloc {
namespace {
std::atomic<uint64_t> g_tag_serial{0};
}  // namespace

Result<std::shared_ptr<TagScope>> EnterTag(std::string_view kind, std::string_view lifetime,
                                           uint64_t owner) {
  SPILLWAY_ASSIGN_OR_RETURN(const allocator::Kind k, allocator::ParseKind(kind));
  SPILLWAY_ASSIGN_OR_RETURN(const allocator::Lifetime l, allocator::ParseLifetime(lifetime));
  auto scope = std::make_shared<TagScope>();
  scope->tag = allocator::OwnerTag{k, l, owner, allocator::kProcessScope, "spillway.tag"};
  scope->label = StrCat(kind, "/", lifetime);
  scope->serial = ++g_tag_serial;
  c10::ThreadLocalDebugInfo::_push(kTagKind, scope);
  g_open_scopes.fetch_add(1, std::memory_order_relaxed);
  return scope;
}

Status ExitTag(const std::shared_ptr<TagScope>& scope) {
  const TagScope* current = CurrentTag();
  if (current != scope.get()) {
    return Status::FailedPrecondition(StrCat(
        "spillway.tag('", scope->label, "') exited ",
        current == nullptr
            ? std::string("while no tag scope is open on this thread")
            : StrCat("while spillway.tag('", current->label, "'), entered after it, is still open"),
        "; exit tag scopes in the reverse order of entering them, on the thread that "
        "entered them. Nothing was changed"));
  }
  try {
    c10::ThreadLocalDebugInfo::_pop(kTagKind);
  } catch (const c10::Error&) {
    return Status::FailedPrecondition(StrCat(
        "spillway.tag('", scope->label,
        "') exited while another thread-local debug scope (a profiler record, say) entered inside "
        "it is still open; close that one first. Nothing was changed"));
  }
  g_open_scopes.fetch_sub(1, std::memory_order_relaxed);
  return Status::Ok();
}

}  // namespace spillway::torch_alloc
