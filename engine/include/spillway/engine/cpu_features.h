// Which SIMD paths this CPU (and its OS) can run, found at run time from CPUID and XGETBV, never
// from build flags: one binary runs the best path on every x86-64 machine.
#pragma once

#include <string>
#include <vector>

#include "spillway/base/status.h"

namespace spillway::engine {

enum class Isa : int { kAuto = -1, kScalar = 0, kAvx2, kAvx512, kAvx512Bf16 };
const char* IsaName(Isa isa);  // "scalar", "avx2", "avx512", "avx512_bf16"

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512_bf16 = false;
  bool os_avx = false, os_avx512 = false;  // XCR0 says the OS saves the ymm / zmm state
};

const CpuFeatures& DetectCpu();
bool IsaSupported(Isa isa);
Isa BestIsa();
// Every path this machine can run, scalar first.
std::vector<Isa> SupportedIsas();
// kAuto resolves to BestIsa(); an unsupported request is INVALID_ARGUMENT naming what is missing.
Result<Isa> ResolveIsa(Isa requested);
// "avx2" / "avx512" / ... / "auto" -> Isa (for flags and the SPILLWAY_ISA environment variable).
Result<Isa> ParseIsa(const std::string& name);

}  // namespace spillway::engine
