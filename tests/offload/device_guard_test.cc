// Device guard: the errors name the tensor, what it has, what it needs, and the config key.
#include "spillway/offload/device_guard.h"

#include <gtest/gtest.h>

namespace spillway::offload {
namespace {

bool Has(const Status& st, const std::string& text) {
  return st.message().find(text) != std::string::npos;
}

const DeviceId kCpu{DeviceType::kCpu, 0};
const DeviceId kCuda0{DeviceType::kCuda, 0};
const DeviceId kCuda1{DeviceType::kCuda, 1};

Config OptimizerOn(const char* device) {
  return *Config::Parse(
      StrCat(R"({"zero_optimization": {"offload_optimizer": {"device": ")", device, R"("}}})"));
}

TEST(DeviceGuardTest, AnOffloadedGradOnTheGpuNamesTheKeyThatPutItOnTheCpu) {
  const ExpectedPlacement want =
      OptimizerStepPlacement(OptimizerOn("cpu"), StateKind::kGrad, kCuda0, DType::kFp32, 1000);
  EXPECT_EQ(want.device, kCpu);
  Status st = CheckPlacement({"fp32 grad partition 3", kCuda0, DType::kFp32, 1000, true}, want);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(st, "tensor 'fp32 grad partition 3': it is on cuda:0 but must be on cpu"))
      << st.ToString();
  EXPECT_TRUE(Has(st, "zero_optimization.offload_optimizer.device = \"cpu\"")) << st.ToString();
}

TEST(DeviceGuardTest, WithoutOptimizerOffloadTheStateStaysOnTheRanksDevice) {
  const ExpectedPlacement want =
      OptimizerStepPlacement(OptimizerOn("none"), StateKind::kExpAvg, kCuda1, DType::kFp32, 10);
  EXPECT_EQ(want.device, kCuda1);
  EXPECT_TRUE(CheckPlacement({"exp_avg", kCuda1, DType::kFp32, 10, true}, want).ok());
  Status other = CheckPlacement({"exp_avg", kCuda0, DType::kFp32, 10, true}, want);
  EXPECT_TRUE(Has(other, "on cuda:0 but must be on cuda:1")) << other.ToString();
}

TEST(DeviceGuardTest, DtypeSizeAndContiguityAreCheckedTogether) {
  const ExpectedPlacement want = OptimizerStepPlacement(
      OptimizerOn("cpu"), StateKind::kMasterWeight, kCuda0, DType::kFp32, 64);
  Status st = CheckPlacement({"master", kCpu, DType::kBf16, 32, false}, want);
  EXPECT_TRUE(Has(st, "it is bfloat16 but must be float32")) << st.ToString();
  EXPECT_TRUE(Has(st, "it has 32 elements but the partition has 64")) << st.ToString();
  EXPECT_TRUE(Has(st, "not contiguous")) << st.ToString();
}

TEST(DeviceGuardTest, ADeviceScalarInHostMathIsTheDeepSpeed0141Bug) {
  Status st = CheckHostScalar("combined_scale", kCuda0, kCpu);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(st, "scalar 'combined_scale' is on cuda:0 but the optimizer math runs on cpu"))
      << st.ToString();
  EXPECT_TRUE(Has(st, "host value")) << st.ToString();
  EXPECT_TRUE(CheckHostScalar("combined_scale", kCpu, kCpu).ok());
  EXPECT_TRUE(CheckHostScalar("combined_scale", kCuda0, kCuda0).ok());
}

TEST(DeviceGuardTest, TheAuditFindsAModelSpreadOverDevices) {
  std::vector<TensorDesc> model;
  for (int l = 0; l < 12; ++l) {
    model.push_back(
        {StrCat("layers.", l, ".weight"), l < 6 ? kCuda0 : kCuda1, DType::kBf16, 100, true});
  }
  auto findings = AuditPlacement(model, kCuda0);
  ASSERT_EQ(findings.size(), 6u);
  EXPECT_EQ(findings[0].name, "layers.6.weight");
  Status st = AuditStatus(model, kCuda0, "rank 0's device");
  EXPECT_TRUE(Has(st, "6 of 12 tensors are not on cuda:0")) << st.ToString();
  EXPECT_TRUE(Has(st, "layers.6.weight on cuda:1")) << st.ToString();
  EXPECT_TRUE(Has(st, "device_map=\"auto\"")) << st.ToString();
  EXPECT_TRUE(AuditStatus({model[0]}, kCuda0, "x").ok());
}

}  // namespace
}  // namespace spillway::offload
