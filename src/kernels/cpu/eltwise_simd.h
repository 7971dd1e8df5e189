// Explicitly vectorised f32 element-wise kernels (GELU, SwiGLU, softmax + cross-entropy), chosen by
// the CPU the process runs on, not the one it was built for.
//
// Why: GCC 12 vectorises the portable `#pragma omp simd` loops of elementwise.cc and
// cross_entropy.cc only when AVX-512 is enabled at build time. On an AVX2 target (an AMD Zen 3
// built with -march=native, or any -march=x86-64-v3 build such as the device bundle) the clamps in
// exp_approx are not if-converted, the loops stay scalar and GELU runs at ~0.2 G elements/s. The
// branches here are written with GCC vector types, so each one is vector code by construction, and
// each is compiled for its own ISA (target attributes) whatever -march the build used.
//
// The branch in use is the widest this CPU runs (cpuid and OS state, read once), capped by
// ONEDNN_MAX_CPU_ISA when that names a smaller ISA (AVX2..., SSE41, AVX), so `kernel_lab.py --isa
// avx2` and other runs that cap oneDNN at AVX2 run these kernels' AVX2 branch as well. Tests and
// benchmarks may force any branch this CPU supports with set_simd_isa.
#pragma once

#include <cstdint>
#include <type_traits>

namespace tetra::cpu {

// generic: the portable loops (what the compiler makes of them); avx2: AVX2 + FMA, 8 lanes;
// avx512: AVX-512F, 16 lanes.
enum class SimdIsa { generic, avx2, avx512 };

const char* simd_isa_name(SimdIsa isa);
/** Whether this CPU (and OS) can run the branch. */
bool simd_isa_supported(SimdIsa isa);
/** The branch the kernels run now. */
SimdIsa simd_isa();
/** Forces a branch this CPU supports (throws std::invalid_argument otherwise); for tests and
 *  benchmarks. Not thread-safe against kernels running at the same time. */
void set_simd_isa(SimdIsa isa);

// One thread's share of each kernel; elementwise.cc and cross_entropy.cc split the work between
// threads (in the same order as the portable loops) and call these.
struct SimdKernels {
  // out[i] = gelu(inp[i]), i < n.
  void (*gelu)(float* out, const float* inp, int64_t n);
  // dinp[i] = gelu'(inp[i]) * dout[i] (dinp may alias dout).
  void (*gelu_backward)(float* dinp, const float* inp, const float* dout, int64_t n);
  // rows (rows,OC): fch += bias, out = gelu(fch).
  void (*bias_gelu)(float* out, float* fch, const float* bias, int64_t rows, int OC);
  // rows (rows,OC): dinp = gelu'(inp) * dout (may alias dout), acc (OC) += column sums of dinp,
  // rows in order.
  void (*gelu_bias_backward)(float* dinp, float* acc, const float* inp, const float* dout,
                             int64_t rows, int OC);
  // out[i] = silu(gate[i]) * up[i], i < n.
  void (*swiglu)(float* out, const float* gate, const float* up, int64_t n);
  // dgate[i] = silu'(gate[i]) * up[i] * dout[i], dup[i] = silu(gate[i]) * dout[i] (dgate may
  // alias dout).
  void (*swiglu_backward)(float* dgate, float* dup, const float* dout, const float* gate,
                          const float* up, int64_t n);
  // max of x[0..n), n >= 1.
  float (*max)(const float* x, int n);
  // sum of exp(x[v] - shift), v < n; next[0..n) (the next row, or null) is prefetched meanwhile.
  float (*sum_exp)(const float* x, int n, float shift, const float* next);
  // x[v] = exp(x[v] - shift) in place; returns their sum; prefetches next like sum_exp.
  float (*exp_sum_inplace)(float* x, int n, float shift, const float* next);
  // x[v] *= s.
  void (*scale)(float* x, int n, float s);
};

/** The kernels of a vector branch; nullptr for SimdIsa::generic. */
const SimdKernels* simd_kernels(SimdIsa isa);
/** simd_kernels(simd_isa()). */
inline const SimdKernels* simd_kernels() { return simd_kernels(simd_isa()); }
/** The f32 vector branch in use for element type F, or nullptr: f64, or the portable loops. */
template <typename F>
const SimdKernels* vector_kernels() {
  if constexpr (std::is_same_v<F, float>) return simd_kernels();
  return nullptr;
}

}  // namespace tetra::cpu
