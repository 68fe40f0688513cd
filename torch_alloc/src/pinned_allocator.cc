// The pinned allocator's view of the current stream, for the CUDA-graph pools' filters, and of
// torch's registered CUDA host allocator.
#include "spillway/torch_alloc/pinned_allocator.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace spillway::torch_alloc {

c10::Stream CurrentStream() {
  const c10::Stream host(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU));
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) return host;  // a CPU build of torch
  const c10::impl::DeviceGuardImplInterface* impl =
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  // A CUDA build of torch on a machine without a usable GPU: getDevice() would throw (no driver).
  if (impl->deviceCount() == 0) return host;
  return impl->getStream(impl->getDevice());
}

at::HostAllocator* CurrentCudaHostAllocator() {
  try {
    return at::getHostAllocator(at::kCUDA);
  } catch (const c10::Error&) {
    return nullptr;  // a CPU-only torch has none registered
  }
}

}  // namespace spillway::torch_alloc
