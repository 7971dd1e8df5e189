#include "kernels/cpu/elementwise.h"

#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "core/profile.h"
#include "kernels/cpu/eltwise_simd.h"
#include "kernels/cpu/vec_math.h"

namespace tetra::cpu {

namespace {

constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2/pi)

template <typename F>
inline F gelu(F x) {
  const F u = F(kGeluScale) * (x + F(0.044715) * x * x * x);
  // 0.5 (1 + tanh(u)) == sigmoid(2u): the sigmoid form has no cancellation for x << 0.
  return x / (F(1) + exp_approx(F(-2) * u));
}

// d gelu(x) / dx.
template <typename F>
inline F gelu_grad(F x) {
  const F k = F(kGeluScale), a = F(0.044715);
  const F u = k * (x + a * x * x * x);
  const F s = F(1) / (F(1) + exp_approx(F(-2) * u));  // sigmoid(2u) = 0.5 (1 + tanh(u))
  const F du = k * (F(1) + F(3) * a * x * x);
  return s + F(2) * x * s * (F(1) - s) * du;
}

// sigmoid(x) through exp_approx, whose clamps keep it finite at both ends.
template <typename F>
inline F sigmoid(F x) {
  return F(1) / (F(1) + exp_approx(-x));
}

// F* as float* where vector_kernels<F>() is not null (F is float); never used for f64.
template <typename P>
auto* f32(P* p) {
  using To = std::conditional_t<std::is_const_v<P>, const float, float>;
  return reinterpret_cast<To*>(p);
}

// This thread's share [begin, end) of n items split evenly in thread order, in multiples of
// `align` items (a cache line of floats for flat arrays) so that no two threads write one line.
inline void thread_range(int64_t n, int64_t align, int64_t* begin, int64_t* end) {
  const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
  const int64_t chunk = ((n + nt - 1) / nt + align - 1) / align * align;
  *begin = std::min(n, t * chunk);
  *end = std::min(n, *begin + chunk);
}

}  // namespace

template <typename F>
void gelu_forward(F* out, const F* inp, int64_t N) {
  const ProfileScope profile(ProfKind::gelu, "forward");
  if (const SimdKernels* k = vector_kernels<F>()) {
#pragma omp parallel
    {
      int64_t b, e;
      thread_range(N, 16, &b, &e);
      if (b < e) k->gelu(f32(out) + b, f32(inp) + b, e - b);
    }
    return;
  }
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < N; ++i) out[i] = gelu(inp[i]);
}

template <typename F>
void gelu_backward(F* dinp, const F* inp, const F* dout, int64_t N) {
  const ProfileScope profile(ProfKind::gelu, "backward");
  if (const SimdKernels* k = vector_kernels<F>()) {
#pragma omp parallel
    {
      int64_t b, e;
      thread_range(N, 16, &b, &e);
      if (b < e) k->gelu_backward(f32(dinp) + b, f32(inp) + b, f32(dout) + b, e - b);
    }
    return;
  }
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < N; ++i) dinp[i] = gelu_grad(inp[i]) * dout[i];
}

template <typename F>
void swiglu_forward(F* out, const F* gate, const F* up, int64_t N) {
  const ProfileScope profile(ProfKind::gelu, "swiglu forward");
  if (const SimdKernels* k = vector_kernels<F>()) {
#pragma omp parallel
    {
      int64_t b, e;
      thread_range(N, 16, &b, &e);
      if (b < e) k->swiglu(f32(out) + b, f32(gate) + b, f32(up) + b, e - b);
    }
    return;
  }
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < N; ++i) out[i] = gate[i] * sigmoid(gate[i]) * up[i];
}

template <typename F>
void swiglu_backward(F* dgate, F* dup, const F* dout, const F* gate, const F* up, int64_t N) {
  const ProfileScope profile(ProfKind::gelu, "swiglu backward");
  if (const SimdKernels* k = vector_kernels<F>()) {
#pragma omp parallel
    {
      int64_t b, e;
      thread_range(N, 16, &b, &e);
      if (b < e)
        k->swiglu_backward(f32(dgate) + b, f32(dup) + b, f32(dout) + b, f32(gate) + b, f32(up) + b,
                           e - b);
    }
    return;
  }
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    // dout is read before dgate, which may alias it, is written.
    const F g = gate[i], s = sigmoid(g), d = dout[i];
    dup[i] = d * g * s;
    dgate[i] = d * up[i] * s * (F(1) + g * (F(1) - s));
  }
}

template <typename F>
void bias_gelu_forward(F* out, F* fch, const F* bias, int64_t N, int OC) {
  const ProfileScope profile(ProfKind::gelu, "bias + forward");
  if (const SimdKernels* k = vector_kernels<F>()) {
#pragma omp parallel
    {
      int64_t b, e;
      thread_range(N, 1, &b, &e);
      if (b < e) k->bias_gelu(f32(out) + b * OC, f32(fch) + b * OC, f32(bias), e - b, OC);
    }
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    F* x = fch + i * OC;
    F* y = out + i * OC;
#pragma omp simd
    for (int o = 0; o < OC; ++o) {
      x[o] += bias[o];
      y[o] = gelu(x[o]);
    }
  }
}

template <typename F>
void gelu_bias_backward(F* dinp, F* dbias, const F* inp, const F* dout, int64_t N, int OC) {
  const ProfileScope profile(ProfKind::gelu, "backward + bias grad");
  // Rows are split over the threads; each thread sums its rows' bias gradients into a private
  // partial, and the partials are added in thread order: deterministic for a thread count.
  const int nthreads = omp_get_max_threads();
  std::vector<F> partial(size_t(nthreads) * OC, F(0));
  if (const SimdKernels* k = vector_kernels<F>()) {
#pragma omp parallel
    {
      int64_t b, e;
      thread_range(N, 1, &b, &e);
      if (b < e)
        k->gelu_bias_backward(f32(dinp) + b * OC,
                              f32(partial.data()) + size_t(omp_get_thread_num()) * OC,
                              f32(inp) + b * OC, f32(dout) + b * OC, e - b, OC);
    }
  } else {
#pragma omp parallel
    {
      F* acc = partial.data() + size_t(omp_get_thread_num()) * OC;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < N; ++i) {
        const F* x = inp + i * OC;
        const F* dy = dout + i * OC;
        F* dx = dinp + i * OC;
#pragma omp simd
        for (int o = 0; o < OC; ++o) {
          dx[o] = gelu_grad(x[o]) * dy[o];
          acc[o] += dx[o];
        }
      }
    }
  }
  for (int t = 0; t < nthreads; ++t) {
    const F* acc = partial.data() + size_t(t) * OC;
    for (int o = 0; o < OC; ++o) dbias[o] += acc[o];
  }
}

template <typename F>
void bias_backward(F* dbias, const F* dout, int64_t N, int OC) {
  const ProfileScope profile(ProfKind::bias_grad, "column sums");
  // Split columns across threads: each column's sum runs over rows in order (deterministic).
#pragma omp parallel for schedule(static)
  for (int o0 = 0; o0 < OC; o0 += 64) {
    int o1 = o0 + 64 < OC ? o0 + 64 : OC;
    F acc[64] = {};
    for (int64_t i = 0; i < N; ++i) {
      const F* d = dout + i * OC;
      for (int o = o0; o < o1; ++o) acc[o - o0] += d[o];
    }
    for (int o = o0; o < o1; ++o) dbias[o] += acc[o - o0];
  }
}

template <typename F>
void residual_bias_add(F* out, const F* residual, const F* bias, int64_t N, int C) {
  const ProfileScope profile(ProfKind::residual, "residual + bias");
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    F* o = out + i * C;
    const F* r = residual + i * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] += r[c] + bias[c];
  }
}

#define TETRA_INSTANTIATE(F)                                                       \
  template void gelu_forward<F>(F*, const F*, int64_t);                            \
  template void gelu_backward<F>(F*, const F*, const F*, int64_t);                 \
  template void swiglu_forward<F>(F*, const F*, const F*, int64_t);                \
  template void swiglu_backward<F>(F*, F*, const F*, const F*, const F*, int64_t); \
  template void bias_backward<F>(F*, const F*, int64_t, int);                      \
  template void residual_bias_add<F>(F*, const F*, const F*, int64_t, int);        \
  template void bias_gelu_forward<F>(F*, F*, const F*, int64_t, int);              \
  template void gelu_bias_backward<F>(F*, F*, const F*, const F*, int64_t, int);
TETRA_INSTANTIATE(float)
TETRA_INSTANTIATE(double)
#undef TETRA_INSTANTIATE

}  // namespace tetra::cpu
