// Resolving the trainer's compute device (compute_device.h).
#include "spillway/trainer/compute_device.h"

#include <torch/torch.h>

#include <cstdlib>

namespace spillway::trainer {

Result<c10::Device> ResolveComputeDevice(const std::string& spec, int local_rank) {
  const auto not_a_device = [&] {
    return Status::InvalidArgument(
        StrCat("compute device '", spec, "' is not one of auto, cpu, cuda, cuda:N"));
  };
  if (spec == "cpu") return torch::Device(torch::kCPU);
  if (local_rank < 0) {
    return Status::InvalidArgument(StrCat("local rank ", local_rank, " is negative (LOCAL_RANK)"));
  }
  const bool cuda = torch::cuda::is_available();
  if (spec == "auto" && !cuda) return torch::Device(torch::kCPU);
  long index = local_rank;  // auto, cuda: one GPU per local rank, as torchrun lays ranks out
  const bool named = spec.rfind("cuda:", 0) == 0;
  if (named) {
    if (spec.size() == 5 || spec.size() > 9 ||
        spec.find_first_not_of("0123456789", 5) != std::string::npos) {
      return not_a_device();
    }
    index = std::strtol(spec.c_str() + 5, nullptr, 10);
  } else if (spec != "auto" && spec != "cuda") {
    return not_a_device();
  }
  if (!cuda) {
    return Status::Make(
        StatusCode::kUnavailable,
        StrCat("compute device '", spec, "' asked for, but libtorch sees no CUDA device ",
               "(a CPU build of torch, no driver, or no GPU); use auto or cpu"));
  }
  const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
  if (index >= count) {
    if (!named) {
      return Status::InvalidArgument(StrCat(
          "compute device '", spec, "' is the GPU of local rank ", local_rank,
          ", but libtorch sees ", count,
          " CUDA device(s); run at most one rank per GPU on a node (torchrun --nproc-per-node ",
          count, "), or name the device (cuda:N) or cpu"));
    }
    return Status::InvalidArgument(StrCat(
        "compute device '", spec, "' does not exist: libtorch sees ", count, " CUDA device(s)"));
  }
  return torch::Device(torch::kCUDA, static_cast<torch::DeviceIndex>(index));
}

offload::DeviceId ToDeviceId(const c10::Device& d) {
  return d.is_cuda() ? offload::DeviceId{offload::DeviceType::kCuda, d.has_index() ? d.index() : 0}
                     : offload::DeviceId{offload::DeviceType::kCpu, 0};
}

}  // namespace spillway::trainer
