#include "kernels/cpu/elementwise.h"

#include <omp.h>

#include <vector>

#include "core/profile.h"
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

}  // namespace

template <typename F>
void gelu_forward(F* out, const F* inp, int64_t N) {
  const ProfileScope profile(ProfKind::gelu, "forward");
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < N; ++i) out[i] = gelu(inp[i]);
}

template <typename F>
void gelu_backward(F* dinp, const F* inp, const F* dout, int64_t N) {
  const ProfileScope profile(ProfKind::gelu, "backward");
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < N; ++i) dinp[i] = gelu_grad(inp[i]) * dout[i];
}

template <typename F>
void bias_gelu_forward(F* out, F* fch, const F* bias, int64_t N, int OC) {
  const ProfileScope profile(ProfKind::gelu, "bias + forward");
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

#define TETRA_INSTANTIATE(F)                                                \
  template void gelu_forward<F>(F*, const F*, int64_t);                     \
  template void gelu_backward<F>(F*, const F*, const F*, int64_t);          \
  template void bias_backward<F>(F*, const F*, int64_t, int);               \
  template void residual_bias_add<F>(F*, const F*, const F*, int64_t, int); \
  template void bias_gelu_forward<F>(F*, F*, const F*, int64_t, int);       \
  template void gelu_bias_backward<F>(F*, F*, const F*, const F*, int64_t, int);
TETRA_INSTANTIATE(float)
TETRA_INSTANTIATE(double)
#undef TETRA_INSTANTIATE

}  // namespace tetra::cpu
