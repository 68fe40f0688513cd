// Installing the router and the pinned allocator with torch (installation.h).
#include "spillway/torch_alloc/installation.h"

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <utility>

#include "spillway/torch_alloc/cpu_router.h"
#include "spillway/torch_alloc/pinned_allocator.h"

namespace spillway::torch_alloc {
namespace {

Status CheckInstallable(const std::shared_ptr<SharedArena>& host,
                        const std::shared_ptr<SharedArena>& pinned, uint64_t small_bytes,
                        int priority) {
  if (priority < 1 || priority > 255) {
    return Status::InvalidArgument(StrCat("spillway.install(priority=", priority,
                                          "): must be 1..255 "
                                          "(torch's own allocators register at 0)"));
  }
  if (Installation::Forked()) {
    return Status::FailedPrecondition(
        "spillway.install() in a process forked after install: install in the parent");
  }
  if (Installation::Installed()) {
    return Status::FailedPrecondition(
        "spillway.install() already ran in this process: torch's allocators are Spillway's; "
        "use spillway.installed() to get its arenas instead of installing again");
  }
  if (Installation::Get() != nullptr) {
    return Status::FailedPrecondition(
        "an earlier spillway.install() in this process failed (its error named the allocator that "
        "kept its place); start a new process to install again");
  }
  if (host == nullptr || pinned == nullptr) {
    return Status::InvalidArgument(
        "spillway.install(): the host and the pinned arena must both be given");
  }
  if (small_bytes == 0) {
    return Status::InvalidArgument("spillway.install(small_bytes=0): must be at least 1 byte");
  }
  return allocator::ForkTracking().WithContext("spillway.install()");
}

}  // namespace

Status Installation::Install(std::shared_ptr<SharedArena> host, std::shared_ptr<SharedArena> pinned,
                             uint64_t small_bytes, int priority) {
  SPILLWAY_RETURN_IF_ERROR(CheckInstallable(host, pinned, small_bytes, priority));
  const auto level = static_cast<uint8_t>(priority);
  auto* made = new Installation();  // never destroyed: torch keeps raw pointers to its allocators
  c10::Allocator* const previous_cpu = c10::GetCPUAllocator();
  made->router_ = new CpuRouter(previous_cpu, std::move(host), small_bytes);
  made->pinned_ = new PinnedAllocator(CurrentCudaHostAllocator(), std::move(pinned));
  // Published before torch can call them: once SetCPUAllocator returns, other threads may already
  // allocate, and raw frees reach the router through it.
  current_.store(made, std::memory_order_release);
  c10::SetCPUAllocator(made->router_, level);
  if (c10::GetCPUAllocator() != made->router_) {
    return Status::FailedPrecondition(StrCat(
        "spillway.install(): torch kept its CPU allocator; another one is registered at a priority "
        "above ",
        priority, ". Pass a higher priority= to spillway.install(). Nothing was installed"));
  }
  at::setHostAllocator(at::kCUDA, made->pinned_, level);
  if (CurrentCudaHostAllocator() != made->pinned_) {
    c10::SetCPUAllocator(previous_cpu, level);  // the router keeps serving what it handed out
    return Status::FailedPrecondition(StrCat(
        "spillway.install(): torch kept its pinned host allocator; another one is registered at a "
        "priority above ",
        priority, ". Pass a higher priority= to spillway.install(). Nothing was installed"));
  }
  made->installed_.store(true, std::memory_order_release);
  return Status::Ok();
}

Installation::Current Installation::TorchAllocatorsAreOurs() {
  Installation* i = Get();
  if (i == nullptr || !Installed()) return {};
  return {c10::GetCPUAllocator() == i->router_, CurrentCudaHostAllocator() == i->pinned_};
}

}  // namespace spillway::torch_alloc
