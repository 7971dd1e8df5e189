#include "kernels/cpu/eltwise_simd.h"

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <stdexcept>
#include <string>

#if defined(__x86_64__)
#define TETRA_SIMD_NS avx2
#define TETRA_SIMD_W 8
#define TETRA_SIMD_TARGET "avx2,fma,no-avx512f"
#include "kernels/cpu/eltwise_simd_impl.h"
#undef TETRA_SIMD_NS
#undef TETRA_SIMD_W
#undef TETRA_SIMD_TARGET

#define TETRA_SIMD_NS avx512
#define TETRA_SIMD_W 16
#define TETRA_SIMD_TARGET "avx512f,avx2,fma"
#include "kernels/cpu/eltwise_simd_impl.h"
#undef TETRA_SIMD_NS
#undef TETRA_SIMD_W
#undef TETRA_SIMD_TARGET
#endif

namespace tetra::cpu {

namespace {

// The widest branch the CPU runs, capped by ONEDNN_MAX_CPU_ISA (see eltwise_simd.h).
SimdIsa detect() {
  SimdIsa best = SimdIsa::generic;
  for (SimdIsa isa : {SimdIsa::avx2, SimdIsa::avx512})
    if (simd_isa_supported(isa)) best = isa;
  if (const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA")) {
    std::string c(cap);
    for (char& ch : c) ch = char(std::toupper(static_cast<unsigned char>(ch)));
    if (c.rfind("AVX2", 0) == 0 && best == SimdIsa::avx512) best = SimdIsa::avx2;
    if (c == "SSE41" || c == "AVX") best = SimdIsa::generic;
  }
  return best;
}

std::atomic<int> g_isa{-1};  // -1: not yet detected

}  // namespace

const char* simd_isa_name(SimdIsa isa) {
  switch (isa) {
    case SimdIsa::avx2:
      return "avx2";
    case SimdIsa::avx512:
      return "avx512";
    case SimdIsa::generic:
      break;
  }
  return "generic";
}

bool simd_isa_supported(SimdIsa isa) {
#if defined(__x86_64__)
  // __builtin_cpu_supports checks the OS saves the wider registers (XGETBV) as well as cpuid.
  switch (isa) {
    case SimdIsa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case SimdIsa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma");
    case SimdIsa::generic:
      return true;
  }
  return false;
#else
  return isa == SimdIsa::generic;
#endif
}

SimdIsa simd_isa() {
  int v = g_isa.load(std::memory_order_relaxed);
  if (v < 0) {
    v = int(detect());
    g_isa.store(v, std::memory_order_relaxed);
  }
  return SimdIsa(v);
}

void set_simd_isa(SimdIsa isa) {
  if (!simd_isa_supported(isa))
    throw std::invalid_argument(std::string("this CPU cannot run the ") + simd_isa_name(isa) +
                                " branch");
  g_isa.store(int(isa), std::memory_order_relaxed);
}

const SimdKernels* simd_kernels(SimdIsa isa) {
#if defined(__x86_64__)
  switch (isa) {
    case SimdIsa::avx2:
      return &avx2::kernels;
    case SimdIsa::avx512:
      return &avx512::kernels;
    case SimdIsa::generic:
      break;
  }
#else
  (void)isa;
#endif
  return nullptr;
}

}  // namespace tetra::cpu
