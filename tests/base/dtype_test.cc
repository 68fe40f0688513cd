// DType: one enum, torch's names, the sizes the optimizer and the guard compute with.
#include "spillway/base/dtype.h"

#include <gtest/gtest.h>

#include <string>

namespace spillway {
namespace {

TEST(DTypeTest, NamesAreTorchsAndSizesAreTheElementBytes) {
  EXPECT_EQ(std::string(DTypeName(DType::kFp32)), "float32");
  EXPECT_EQ(std::string(DTypeName(DType::kBf16)), "bfloat16");
  EXPECT_EQ(std::string(DTypeName(DType::kFp16)), "float16");
  EXPECT_EQ(std::string(DTypeName(DType::kUInt8)), "uint8");
  EXPECT_EQ(std::string(DTypeName(DType::kInt64)), "int64");
  EXPECT_EQ(DTypeBytes(DType::kFp32), 4u);
  EXPECT_EQ(DTypeBytes(DType::kBf16), 2u);
  EXPECT_EQ(DTypeBytes(DType::kFp16), 2u);
  EXPECT_EQ(DTypeBytes(DType::kUInt8), 1u);
  EXPECT_EQ(DTypeBytes(DType::kInt64), 8u);
}

TEST(DTypeTest, TheFloatingTypesComeFirstInTheKernelsOrder) {
  // The SIMD and CUDA kernel tables index by the enum's value: fp32, bf16, fp16.
  EXPECT_EQ(static_cast<int>(DType::kFp32), 0);
  EXPECT_EQ(static_cast<int>(DType::kBf16), 1);
  EXPECT_EQ(static_cast<int>(DType::kFp16), 2);
  EXPECT_TRUE(IsFloatingDType(DType::kFp16));
  EXPECT_FALSE(IsFloatingDType(DType::kUInt8));
  EXPECT_FALSE(IsFloatingDType(DType::kInt64));
}

TEST(DTypeTest, AValueOutOfRangeIsNamedUnknownAndHasNoSize) {
  const auto bad = static_cast<DType>(9);
  EXPECT_EQ(std::string(DTypeName(bad)), "unknown dtype");
  EXPECT_EQ(DTypeBytes(bad), 0u);
  EXPECT_FALSE(IsFloatingDType(bad));
}

}  // namespace
}  // namespace spillway
