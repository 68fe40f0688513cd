// The only place host-arena code calls the CUDA runtime: device probing and host registration.
// Built as stubs that return kUnavailable when SPILLWAY_WITH_CUDA is off.
#pragma once

#include <cstddef>
#include <string>

#include "spillway/base/status.h"

namespace spillway::allocator::cuda {

// True when the CUDA runtime reports at least one device. Otherwise `why` says what is missing.
bool DeviceAvailable(std::string* why);
// cudaHostRegister in pieces of at most kMaxRegisterBytes (one call of >= 512 GiB fails on r580+).
Status HostRegister(void* base, size_t bytes);
Status HostUnregister(void* base, size_t bytes);
// The calling thread's CUDA device (cudaGetDevice, which makes no context), or -1 without CUDA.
int CurrentDevice();
// Makes `device` the calling thread's (a Spillway thread that unregisters a region, so the CUDA
// runtime does not make a context on device 0 for it). Does nothing for -1.
void SetDevice(int device);

inline constexpr size_t kMaxRegisterBytes = size_t{256} << 30;

}  // namespace spillway::allocator::cuda
