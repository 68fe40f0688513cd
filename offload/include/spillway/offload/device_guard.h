// Device guard: checks a buffer against where its partition's math is supposed to run, before any
// work starts, and says which config key decided it. It replaces PyTorch's "Expected all tensors to
// be on the same device, cpu and cuda" deep inside an optimizer step with an error that names the
// tensor, what it has, what it needs, and what to change (FIELD.md §1: DeepSpeed 0.14.1's CUDA grad
// norm against CPU-offloaded fp32 grads; HF device_map="auto" used for ZeRO-3 training).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spillway/base/dtype.h"
#include "spillway/base/status.h"
#include "spillway/offload/config.h"
#include "spillway/offload/partition_store.h"

namespace spillway::offload {

enum class DeviceType : uint8_t { kCpu = 0, kCuda };

struct DeviceId {
  DeviceType type = DeviceType::kCpu;
  int index = 0;  // cuda:N; 0 for cpu
  bool operator==(const DeviceId& o) const {
    return type == o.type && (type == DeviceType::kCpu || index == o.index);
  }
  std::string ToString() const;  // "cpu", "cuda:1"
};

// What a caller hands in: a description of a tensor or buffer (the torch edge fills it).
struct TensorDesc {
  std::string name;  // "model.layers.3.mlp.up_proj.weight", or a partition description
  DeviceId device;
  DType dtype = DType::kFp32;
  uint64_t numel = 0;
  bool contiguous = true;
};

// Where a partition's data must be for the work at hand, and why.
struct ExpectedPlacement {
  DeviceId device;
  DType dtype = DType::kFp32;
  uint64_t numel = 0;
  std::string decided_by;  // "zero_optimization.offload_optimizer.device = \"cpu\""
};

// The placement of a state kind's data for the host optimizer step under `config`, on `compute`
// (the rank's accelerator): offloaded optimizer states live and update on the CPU; without
// optimizer offload they stay on the device.
ExpectedPlacement OptimizerStepPlacement(const Config& config, StateKind kind, DeviceId compute,
                                         DType dtype, uint64_t numel);

// OK, or INVALID_ARGUMENT naming the tensor, what it has, what it needs, and the deciding key.
Status CheckPlacement(const TensorDesc& tensor, const ExpectedPlacement& expected);

// Scalars that enter host math (the combined unscale/clip factor, the global grad norm) are host
// values: a scalar that lives on an accelerator while the math runs on the CPU is the 0.14.1 bug.
Status CheckHostScalar(const std::string& name, DeviceId scalar_device, DeviceId math_device);

// Every tensor that is not on `expected`, before any work starts (the device_map="auto" case).
struct AuditFinding {
  std::string name;
  DeviceId found;
};
std::vector<AuditFinding> AuditPlacement(const std::vector<TensorDesc>& tensors, DeviceId expected);
// The audit as one status: OK when clean, else INVALID_ARGUMENT listing the first findings.
Status AuditStatus(const std::vector<TensorDesc>& tensors, DeviceId expected,
                   const std::string& why);

}  // namespace spillway::offload
