// Device guard: placement checks with errors that name the deciding config key.
#include "spillway/offload/device_guard.h"

namespace spillway::offload {

std::string DeviceId::ToString() const {
  return type == DeviceType::kCpu ? "cpu" : StrCat("cuda:", index);
}

ExpectedPlacement OptimizerStepPlacement(const Config& config, StateKind kind, DeviceId compute,
                                         DType dtype, uint64_t numel) {
  ExpectedPlacement p;
  p.dtype = dtype;
  p.numel = numel;
  // Offloaded optimizer state lives and updates on the CPU, and the step writes the 16-bit params
  // where the master weights are; without offload everything stays on the rank's device.
  const OffloadDevice d = config.offload_optimizer.device;
  p.device = d == OffloadDevice::kNone ? compute : DeviceId{DeviceType::kCpu, 0};
  p.decided_by = StrCat(
      "zero_optimization.offload_optimizer.device = \"", OffloadDeviceName(d), "\"",
      kind == StateKind::kParam ? " (the step writes 16-bit params where the master weights are)"
                                : "");
  return p;
}

Status CheckPlacement(const TensorDesc& t, const ExpectedPlacement& want) {
  std::vector<std::string> wrong;
  if (!(t.device == want.device)) {
    wrong.push_back(
        StrCat("it is on ", t.device.ToString(), " but must be on ", want.device.ToString()));
  }
  if (t.dtype != want.dtype) {
    wrong.push_back(StrCat("it is ", DTypeName(t.dtype), " but must be ", DTypeName(want.dtype)));
  }
  if (t.numel != want.numel) {
    wrong.push_back(StrCat("it has ", t.numel, " elements but the partition has ", want.numel));
  }
  if (!t.contiguous) wrong.push_back("it is not contiguous (call .contiguous() first)");
  if (wrong.empty()) return Status::Ok();
  std::string msg = StrCat("tensor '", t.name, "': ");
  for (size_t i = 0; i < wrong.size(); ++i) msg += StrCat(i ? "; " : "", wrong[i]);
  msg += StrCat(". Its placement is decided by ", want.decided_by,
                "; move the tensor there, or change that setting");
  return Status::InvalidArgument(msg);
}

Status CheckHostScalar(const std::string& name, DeviceId scalar_device, DeviceId math_device) {
  if (scalar_device == math_device || math_device.type != DeviceType::kCpu) return Status::Ok();
  return Status::InvalidArgument(StrCat(
      "scalar '", name, "' is on ", scalar_device.ToString(), " but the optimizer math runs on ",
      math_device.ToString(),
      " (zero_optimization.offload_optimizer.device = \"cpu\"). Pass it as a host value "
      "(.item() once per step); a device scalar here is the DeepSpeed 0.14.1 bug (PR #5256)"));
}

std::vector<AuditFinding> AuditPlacement(const std::vector<TensorDesc>& tensors,
                                         DeviceId expected) {
  std::vector<AuditFinding> out;
  for (const TensorDesc& t : tensors) {
    if (!(t.device == expected)) out.push_back({t.name, t.device});
  }
  return out;
}

Status AuditStatus(const std::vector<TensorDesc>& tensors, DeviceId expected,
                   const std::string& why) {
  const auto findings = AuditPlacement(tensors, expected);
  if (findings.empty()) return Status::Ok();
  std::string list;
  for (size_t i = 0; i < findings.size() && i < 8; ++i) {
    list += StrCat(i ? ", " : "", findings[i].name, " on ", findings[i].found.ToString());
  }
  if (findings.size() > 8) list += StrCat(", and ", findings.size() - 8, " more");
  return Status::InvalidArgument(StrCat(findings.size(), " of ", tensors.size(),
                                        " tensors are not on ", expected.ToString(), " (", why,
                                        "): ", list,
                                        ". A model spread over devices (device_map=\"auto\") "
                                        "cannot be trained with ZeRO-3; load it on one device"));
}

}  // namespace spillway::offload
