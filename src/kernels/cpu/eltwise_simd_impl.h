// One vector branch of eltwise_simd.h, included once per ISA by eltwise_simd.cc (so no include
// guard) with
//   TETRA_SIMD_NS      the branch's namespace (avx2, avx512),
//   TETRA_SIMD_W       its lanes of f32 (8, 16),
//   TETRA_SIMD_TARGET  its GCC target string.
// Every function carries the branch's target attribute: GCC only inlines a function into one with
// the same or a wider target, and the build's own -march may be wider (AVX-512 under
// -march=native on Intel) or narrower (x86-64-v3) than the branch. The AVX2 target says
// no-avx512f so that on an AVX-512 build machine it is still the code an AVX2-only CPU runs.
// fp-contract=fast lets a*b+c become one FMA: the project builds in ISO C++ mode, where GCC
// contracts nothing.
//
// The code uses GCC vector types, not intrinsics: the intrinsics' headers are compiled for the
// build's -march, which the AVX2 branch's target does not contain on an AVX-512 build machine.

#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/cpu/eltwise_simd.h"

namespace tetra::cpu::TETRA_SIMD_NS {
namespace {

#if defined(__clang__)
// Clang (the sanitizer stage's compiler) has no optimize attribute: the kernels contract as its
// default says, within the bounds the ISA paths' tests hold them to.
#define TETRA_SIMD_FN __attribute__((target(TETRA_SIMD_TARGET)))
#else
#define TETRA_SIMD_FN __attribute__((target(TETRA_SIMD_TARGET), optimize("fp-contract=fast")))
#endif
#define TETRA_SIMD_INLINE TETRA_SIMD_FN __attribute__((always_inline)) inline

constexpr int W = TETRA_SIMD_W;
constexpr int kCurrentRounding = 4;  // _MM_FROUND_CUR_DIRECTION
typedef float VF __attribute__((vector_size(W * sizeof(float))));
typedef int32_t VI __attribute__((vector_size(W * sizeof(int32_t))));

TETRA_SIMD_INLINE VF splat(float s) { return VF{} + s; }
TETRA_SIMD_INLINE VF load(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof(v));  // an unaligned vector load
  return v;
}
TETRA_SIMD_INLINE void store(float* p, VF v) { std::memcpy(p, &v, sizeof(v)); }
// The last n < W elements: lanes past n hold `fill` and are never stored.
TETRA_SIMD_INLINE VF load_tail(const float* p, int64_t n, float fill) {
  VF v = splat(fill);
  for (int64_t i = 0; i < n; ++i) v[i] = p[i];
  return v;
}
TETRA_SIMD_INLINE void store_tail(float* p, VF v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = v[i];
}
TETRA_SIMD_INLINE float hsum(VF v) {
  float s = 0;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}
// a < b ? a : b and a > b ? a : b, which are exactly what minps and maxps compute (the second
// operand where either is NaN); written as the conditional, GCC emits a compare and a blend, two
// instructions where one does: 15% of GELU's time.
TETRA_SIMD_INLINE VF vmin(VF a, VF b) {
#if TETRA_SIMD_W == 16 && defined(__clang__)
  return __builtin_ia32_minps512(a, b, kCurrentRounding);
#elif TETRA_SIMD_W == 16
  return __builtin_ia32_minps512_mask(a, b, a, static_cast<uint16_t>(0xFFFF), kCurrentRounding);
#else
  return __builtin_ia32_minps256(a, b);
#endif
}
TETRA_SIMD_INLINE VF vmax(VF a, VF b) {
#if TETRA_SIMD_W == 16 && defined(__clang__)
  return __builtin_ia32_maxps512(a, b, kCurrentRounding);
#elif TETRA_SIMD_W == 16
  return __builtin_ia32_maxps512_mask(a, b, a, static_cast<uint16_t>(0xFFFF), kCurrentRounding);
#else
  return __builtin_ia32_maxps256(a, b);
#endif
}

// exp_approx (vec_math.h) on W lanes, the same reduction and polynomial.
TETRA_SIMD_INLINE VF vexp(VF x) {
  x = vmax(vmin(x, splat(88.0f)), splat(-87.0f));
  const VF magic = splat(12582912.0f);
  const VF t = x * 1.44269504088896341f + magic;
  const VF n = t - magic;
  VF r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  VF p = splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const VI e = ((VI)t - (0x4B400000 - 127)) << 23;  // 2^n
  return p * (VF)e;
}

constexpr float kK = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kA = 0.044715f;

// x * sigmoid(2u) = 0.5 x (1 + tanh(u)), u = k (x + a x^3), as elementwise.cc's gelu.
TETRA_SIMD_INLINE VF gelu(VF x) {
  const VF u = x * (kK + (kK * kA) * (x * x));
  return x / (1.0f + vexp(-2.0f * u));
}
TETRA_SIMD_INLINE VF gelu_grad(VF x) {
  const VF x2 = x * x;
  const VF u = x * (kK + (kK * kA) * x2);
  const VF s = 1.0f / (1.0f + vexp(-2.0f * u));
  const VF du = kK + (3.0f * kK * kA) * x2;
  return s + 2.0f * x * s * (1.0f - s) * du;
}

TETRA_SIMD_FN void gelu_n(float* out, const float* inp, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store(out + i, gelu(load(inp + i)));
  if (i < n) store_tail(out + i, gelu(load_tail(inp + i, n - i, 0.0f)), n - i);
}

TETRA_SIMD_FN void gelu_backward_n(float* dinp, const float* inp, const float* dout, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store(dinp + i, gelu_grad(load(inp + i)) * load(dout + i));
  if (i < n) {
    const int64_t m = n - i;
    store_tail(dinp + i, gelu_grad(load_tail(inp + i, m, 0.0f)) * load_tail(dout + i, m, 0.0f), m);
  }
}

// sigmoid through vexp, as elementwise.cc's: finite at both ends thanks to the clamps.
TETRA_SIMD_INLINE VF sigmoid(VF x) { return 1.0f / (1.0f + vexp(-x)); }

TETRA_SIMD_FN void swiglu_n(float* out, const float* gate, const float* up, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const VF g = load(gate + i);
    store(out + i, g * sigmoid(g) * load(up + i));
  }
  if (i < n) {
    const int64_t m = n - i;
    const VF g = load_tail(gate + i, m, 0.0f);
    store_tail(out + i, g * sigmoid(g) * load_tail(up + i, m, 0.0f), m);
  }
}

TETRA_SIMD_INLINE void swiglu_grads(VF d, VF g, VF u, VF* dgate, VF* dup) {
  const VF s = sigmoid(g);
  *dup = d * g * s;
  *dgate = d * u * s * (1.0f + g * (1.0f - s));
}

TETRA_SIMD_FN void swiglu_backward_n(float* dgate, float* dup, const float* dout, const float* gate,
                                     const float* up, int64_t n) {
  int64_t i = 0;
  VF dg, du;
  for (; i + W <= n; i += W) {
    swiglu_grads(load(dout + i), load(gate + i), load(up + i), &dg, &du);
    store(dup + i, du);
    store(dgate + i, dg);
  }
  if (i < n) {
    const int64_t m = n - i;
    swiglu_grads(load_tail(dout + i, m, 0.0f), load_tail(gate + i, m, 0.0f),
                 load_tail(up + i, m, 0.0f), &dg, &du);
    store_tail(dup + i, du, m);
    store_tail(dgate + i, dg, m);
  }
}

TETRA_SIMD_FN void bias_gelu_rows(float* out, float* fch, const float* bias, int64_t rows, int OC) {
  for (int64_t r = 0; r < rows; ++r) {
    float* x = fch + r * OC;
    float* y = out + r * OC;
    int o = 0;
    for (; o + W <= OC; o += W) {
      const VF v = load(x + o) + load(bias + o);
      store(x + o, v);
      store(y + o, gelu(v));
    }
    if (o < OC) {
      const int m = OC - o;
      const VF v = load_tail(x + o, m, 0.0f) + load_tail(bias + o, m, 0.0f);
      store_tail(x + o, v, m);
      store_tail(y + o, gelu(v), m);
    }
  }
}

TETRA_SIMD_FN void gelu_bias_backward_rows(float* dinp, float* acc, const float* inp,
                                           const float* dout, int64_t rows, int OC) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = inp + r * OC;
    const float* dy = dout + r * OC;
    float* dx = dinp + r * OC;
    int o = 0;
    for (; o + W <= OC; o += W) {
      const VF d = gelu_grad(load(x + o)) * load(dy + o);
      store(dx + o, d);
      store(acc + o, load(acc + o) + d);
    }
    if (o < OC) {
      const int m = OC - o;
      const VF d = gelu_grad(load_tail(x + o, m, 0.0f)) * load_tail(dy + o, m, 0.0f);
      store_tail(dx + o, d, m);
      store_tail(acc + o, load_tail(acc + o, m, 0.0f) + d, m);
    }
  }
}

// The row reductions keep four (max) or two (sums) partial vectors, so that consecutive vectors
// do not wait on one another's result.
TETRA_SIMD_FN float max_n(const float* x, int n) {
  const float lowest = std::numeric_limits<float>::lowest();
  VF m0 = splat(lowest), m1 = m0, m2 = m0, m3 = m0;
  int v = 0;
  for (; v + 4 * W <= n; v += 4 * W) {
    m0 = vmax(m0, load(x + v));
    m1 = vmax(m1, load(x + v + W));
    m2 = vmax(m2, load(x + v + 2 * W));
    m3 = vmax(m3, load(x + v + 3 * W));
  }
  for (; v + W <= n; v += W) m0 = vmax(m0, load(x + v));
  if (v < n) m0 = vmax(m0, load_tail(x + v, n - v, lowest));
  const VF m = vmax(vmax(m0, m1), vmax(m2, m3));
  float r = m[0];
  for (int i = 1; i < W; ++i) r = r > m[i] ? r : m[i];
  return r;
}

// Asks for the cache line of next[v] (the next row, which the next max_n then reads from cache
// rather than memory while this pass computes its exponentials); nothing when next is null.
TETRA_SIMD_INLINE void prefetch_line(const float* next, int v) {
  if (next && v % 16 == 0) __builtin_prefetch(next + v, 0, 3);
}

TETRA_SIMD_FN float sum_exp_n(const float* x, int n, float shift, const float* next) {
  const VF s = splat(shift);
  VF a0 = {}, a1 = {};
  int v = 0;
  for (; v + 2 * W <= n; v += 2 * W) {
    prefetch_line(next, v);
    prefetch_line(next, v + W);
    a0 += vexp(load(x + v) - s);
    a1 += vexp(load(x + v + W) - s);
  }
  for (; v + W <= n; v += W) a0 += vexp(load(x + v) - s);
  float tail = 0;
  if (v < n) {
    // Lanes past the row are not added (exp_approx never returns exactly 0).
    const VF e = vexp(load_tail(x + v, n - v, shift) - s);
    for (int i = 0; i < n - v; ++i) tail += e[i];
  }
  return hsum(a0 + a1) + tail;
}

TETRA_SIMD_FN float exp_sum_inplace_n(float* x, int n, float shift, const float* next) {
  const VF s = splat(shift);
  VF a0 = {}, a1 = {};
  int v = 0;
  for (; v + 2 * W <= n; v += 2 * W) {
    prefetch_line(next, v);
    prefetch_line(next, v + W);
    const VF e0 = vexp(load(x + v) - s), e1 = vexp(load(x + v + W) - s);
    store(x + v, e0);
    store(x + v + W, e1);
    a0 += e0;
    a1 += e1;
  }
  for (; v + W <= n; v += W) {
    const VF e = vexp(load(x + v) - s);
    store(x + v, e);
    a0 += e;
  }
  float tail = 0;
  if (v < n) {
    const VF e = vexp(load_tail(x + v, n - v, shift) - s);
    store_tail(x + v, e, n - v);
    for (int i = 0; i < n - v; ++i) tail += e[i];
  }
  return hsum(a0 + a1) + tail;
}

TETRA_SIMD_FN void scale_n(float* x, int n, float s) {
  int v = 0;
  for (; v + W <= n; v += W) store(x + v, load(x + v) * s);
  for (; v < n; ++v) x[v] *= s;
}

#undef TETRA_SIMD_INLINE
#undef TETRA_SIMD_FN

}  // namespace

const SimdKernels kernels = {gelu_n,
                             gelu_backward_n,
                             bias_gelu_rows,
                             gelu_bias_backward_rows,
                             swiglu_n,
                             swiglu_backward_n,
                             max_n,
                             sum_exp_n,
                             exp_sum_inplace_n,
                             scale_n};

}  // namespace tetra::cpu::TETRA_SIMD_NS
