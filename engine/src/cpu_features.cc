// CPUID/XGETBV probing. See cpu_features.h.
#include "spillway/engine/cpu_features.h"

#include <cpuid.h>

#include <cstdint>

namespace spillway::engine {
namespace {

uint64_t ReadXcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

CpuFeatures Probe() {
  CpuFeatures f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = (c >> 27) & 1;
  f.fma = (c >> 12) & 1;
  f.f16c = (c >> 29) & 1;
  const bool avx = (c >> 28) & 1;
  if (osxsave) {
    const uint64_t xcr0 = ReadXcr0();
    f.os_avx = avx && (xcr0 & 0x6) == 0x6;            // xmm + ymm
    f.os_avx512 = f.os_avx && (xcr0 & 0xE0) == 0xE0;  // opmask + zmm hi256 + hi16 zmm
  }
  if (__get_cpuid_max(0, nullptr) >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = (b >> 5) & 1;
    f.avx512f = (b >> 16) & 1;
    f.avx512bw = (b >> 30) & 1;
    f.avx512vl = (b >> 31) & 1;
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512_bf16 = (a >> 5) & 1;
  }
  return f;
}

}  // namespace

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAuto:
      return "auto";
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
  }
  return "?";
}

const CpuFeatures& DetectCpu() {
  static const CpuFeatures features = Probe();
  return features;
}

bool IsaSupported(Isa isa) {
  const CpuFeatures& f = DetectCpu();
  const bool avx2 = f.os_avx && f.avx2 && f.fma && f.f16c;
  const bool avx512 = avx2 && f.os_avx512 && f.avx512f && f.avx512bw && f.avx512vl;
  switch (isa) {
    case Isa::kAuto:
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return avx2;
    case Isa::kAvx512:
      return avx512;
    case Isa::kAvx512Bf16:
      return avx512 && f.avx512_bf16;
  }
  return false;
}

Isa BestIsa() {
  for (Isa isa : {Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2}) {
    if (IsaSupported(isa)) return isa;
  }
  return Isa::kScalar;
}

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (IsaSupported(isa)) out.push_back(isa);
  }
  return out;
}

Result<Isa> ResolveIsa(Isa requested) {
  if (requested == Isa::kAuto) return BestIsa();
  if (IsaSupported(requested)) return requested;
  const CpuFeatures& f = DetectCpu();
  return Status::InvalidArgument(
      StrCat("this CPU cannot run the ", IsaName(requested), " optimizer path (avx2=", f.avx2,
             " fma=", f.fma, " f16c=", f.f16c, " avx512f=", f.avx512f, " avx512bw=", f.avx512bw,
             " avx512vl=", f.avx512vl, " avx512_bf16=", f.avx512_bf16, " os_avx512=", f.os_avx512,
             "); request isa=auto (best available: ", IsaName(BestIsa()), ")"));
}

Result<Isa> ParseIsa(const std::string& name) {
  for (Isa isa : {Isa::kAuto, Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (name == IsaName(isa)) return isa;
  }
  return Status::InvalidArgument(StrCat("unknown instruction set '", name,
                                        "'; use one of auto, scalar, avx2, avx512, avx512_bf16"));
}

}  // namespace spillway::engine
