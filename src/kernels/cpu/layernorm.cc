#include "kernels/cpu/layernorm.h"

#include <omp.h>

#include <cmath>
#include <vector>

#include "core/profile.h"

namespace tetra::cpu {

template <typename F>
void layernorm_forward(F* out, F* mean, F* rstd, const F* inp, const F* weight, const F* bias,
                       int64_t N, int C) {
  const ProfileScope profile(ProfKind::layernorm, "forward");
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const F* x = inp + i * C;
    F m = 0;
#pragma omp simd reduction(+ : m)
    for (int c = 0; c < C; ++c) m += x[c];
    m /= C;
    F v = 0;
#pragma omp simd reduction(+ : v)
    for (int c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
    v /= C;
    F s = F(1) / std::sqrt(v + F(kLayerNormEps));
    F* o = out + i * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] = (x[c] - m) * s * weight[c] + bias[c];
    mean[i] = m;
    rstd[i] = s;
  }
}

template <typename F>
void layernorm_backward(F* dinp, F* dweight, F* dbias, const F* dout, const F* inp, const F* weight,
                        const F* mean, const F* rstd, int64_t N, int C) {
  const ProfileScope profile(ProfKind::layernorm, "backward");
  // Rows are independent for dinp; the parameter gradients are reduced per thread into private
  // partials and summed in thread order, which keeps results deterministic for a thread count.
  int nthreads = omp_get_max_threads();
  std::vector<F> partial(size_t(nthreads) * 2 * C, F(0));
#pragma omp parallel
  {
    int tid = omp_get_thread_num();
    F* pw = partial.data() + size_t(tid) * 2 * C;
    F* pb = pw + C;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const F* x = inp + i * C;
      const F* dy = dout + i * C;
      F* dx = dinp + i * C;
      F m = mean[i], s = rstd[i];
      F dnorm_mean = 0, dnorm_norm_mean = 0;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm_mean)
      for (int c = 0; c < C; ++c) {
        F norm = (x[c] - m) * s;
        F dnorm = weight[c] * dy[c];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * norm;
      }
      dnorm_mean /= C;
      dnorm_norm_mean /= C;
#pragma omp simd
      for (int c = 0; c < C; ++c) {
        F norm = (x[c] - m) * s;
        F dnorm = weight[c] * dy[c];
        pb[c] += dy[c];
        pw[c] += norm * dy[c];
        dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
      }
    }
  }
  for (int t = 0; t < nthreads; ++t) {
    const F* pw = partial.data() + size_t(t) * 2 * C;
    const F* pb = pw + C;
    for (int c = 0; c < C; ++c) {
      dweight[c] += pw[c];
      dbias[c] += pb[c];
    }
  }
}

template <typename F>
void rmsnorm_forward(F* out, F* rstd, const F* inp, const F* weight, int64_t N, int C, double eps) {
  const ProfileScope profile(ProfKind::layernorm, "rmsnorm forward");
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const F* x = inp + i * C;
    F ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int c = 0; c < C; ++c) ss += x[c] * x[c];
    const F s = F(1) / std::sqrt(ss / F(C) + F(eps));
    F* o = out + i * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] = x[c] * s * weight[c];
    rstd[i] = s;
  }
}

template <typename F>
void rmsnorm_backward(F* dinp, F* dweight, const F* dout, const F* inp, const F* weight,
                      const F* rstd, int64_t N, int C) {
  const ProfileScope profile(ProfKind::layernorm, "rmsnorm backward");
  // As layernorm_backward: dweight through per-thread partials summed in thread order.
  const int nthreads = omp_get_max_threads();
  std::vector<F> partial(size_t(nthreads) * C, F(0));
#pragma omp parallel
  {
    F* pw = partial.data() + size_t(omp_get_thread_num()) * C;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const F* x = inp + i * C;
      const F* dy = dout + i * C;
      F* dx = dinp + i * C;
      const F s = rstd[i];
      // d(rstd)/dx = -rstd³ x / C: the row's one coupling term is mean(w·dy·x) · rstd².
      F dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int c = 0; c < C; ++c) dot += weight[c] * dy[c] * x[c];
      const F k = dot * s * s / F(C);
#pragma omp simd
      for (int c = 0; c < C; ++c) {
        pw[c] += x[c] * s * dy[c];
        dx[c] += s * (weight[c] * dy[c] - x[c] * k);
      }
    }
  }
  for (int t = 0; t < nthreads; ++t) {
    const F* pw = partial.data() + size_t(t) * C;
    for (int c = 0; c < C; ++c) dweight[c] += pw[c];
  }
}

#define TETRA_INSTANTIATE(F)                                                                  \
  template void layernorm_forward<F>(F*, F*, F*, const F*, const F*, const F*, int64_t, int); \
  template void layernorm_backward<F>(F*, F*, F*, const F*, const F*, const F*, const F*,     \
                                      const F*, int64_t, int);                                \
  template void rmsnorm_forward<F>(F*, F*, const F*, const F*, int64_t, int, double);         \
  template void rmsnorm_backward<F>(F*, F*, const F*, const F*, const F*, const F*, int64_t, int);
TETRA_INSTANTIATE(float)
TETRA_INSTANTIATE(double)
#undef TETRA_INSTANTIATE

}  // namespace tetra::cpu
