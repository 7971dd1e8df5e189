#include "kernels/cpu/adamw.h"

#include <omp.h>

#include <cmath>
#include <vector>

#include "core/profile.h"

namespace tetra::cpu {

void adamw_update(float* params, const float* grads, float* m, float* v, int64_t N,
                  const AdamWStep& s, bool decay) {
  const ProfileScope profile(ProfKind::adamw, "update");
  // Bias corrections in double then rounded, as torch computes them on Python floats.
  double bc1 = 1.0 - std::pow(double(s.beta1), double(s.t));
  double bc2 = 1.0 - std::pow(double(s.beta2), double(s.t));
  float step_size = float(double(s.lr) / bc1);
  float bc2_sqrt = float(std::sqrt(bc2));
  float decay_factor = decay ? 1.0f - s.lr * s.weight_decay : 1.0f;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    float g = grads[i] * s.grad_scale;
    float mi = s.beta1 * m[i] + (1.0f - s.beta1) * g;
    float vi = s.beta2 * v[i] + (1.0f - s.beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    float p = params[i] * decay_factor;
    params[i] = p - step_size * mi / (std::sqrt(vi) / bc2_sqrt + s.eps);
  }
}

double sum_squares(const float* x, int64_t N) {
  const ProfileScope profile(ProfKind::grad_norm, "sum of squares");
  // Each thread sums a static chunk in double with a vectorised (lane-wise) reduction; the
  // partials are added in thread order: deterministic for a given thread count.
  int nthreads = omp_get_max_threads();
  std::vector<double> partial(nthreads, 0.0);
#pragma omp parallel
  {
    int t = omp_get_thread_num(), n = omp_get_num_threads();
    int64_t begin = N * t / n, end = N * (t + 1) / n;
    double acc = 0.0;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = begin; i < end; ++i) acc += double(x[i]) * double(x[i]);
    partial[t] = acc;
  }
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace tetra::cpu
