// Which device the trainer computes on, and the device guard's name for it. The one place a
// device string from the command line or a config becomes a torch::Device.
#pragma once

#include <c10/core/Device.h>

#include <string>

#include "spillway/base/status.h"
#include "spillway/offload/device_guard.h"

namespace spillway::trainer {

// Where the forward and backward math runs: "auto" (this local rank's CUDA device when libtorch
// sees one, else the CPU), "cpu", "cuda" (this local rank's) or "cuda:N". Local rank r takes
// cuda:r, torchrun's layout, so ranks on one node never share a GPU (NCCL refuses that); a local
// rank without a GPU of its own is an error, as is an explicit CUDA device that libtorch cannot
// use: never a silent fall back to the CPU.
Result<c10::Device> ResolveComputeDevice(const std::string& spec, int local_rank = 0);

// The device guard's name for a torch device (cpu, or cuda:N; a cuda device without an index is
// cuda:0). Other device types map to cpu: callers refuse them first.
offload::DeviceId ToDeviceId(const c10::Device& device);

}  // namespace spillway::trainer
