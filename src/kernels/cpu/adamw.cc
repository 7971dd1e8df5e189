#include "kernels/cpu/adamw.h"

#include <omp.h>

#include <cmath>
#include <vector>

#include "core/profile.h"

namespace tetra::cpu {

namespace {

// The update of one element; bias corrections in double then rounded, as torch computes them on
// Python floats.
struct AdamWElement {
  float beta1, beta2, eps, grad_scale, step_size, bc2_sqrt;
  explicit AdamWElement(const AdamWStep& s)
      : beta1(s.beta1), beta2(s.beta2), eps(s.eps), grad_scale(s.grad_scale) {
    const double bc1 = 1.0 - std::pow(double(s.beta1), double(s.t));
    const double bc2 = 1.0 - std::pow(double(s.beta2), double(s.t));
    step_size = float(double(s.lr) / bc1);
    bc2_sqrt = float(std::sqrt(bc2));
  }
  void operator()(float& param, float grad, float& m, float& v, float decay_factor) const {
    const float g = grad * grad_scale;
    const float mi = beta1 * m + (1.0f - beta1) * g;
    const float vi = beta2 * v + (1.0f - beta2) * g * g;
    m = mi;
    v = vi;
    param = param * decay_factor - step_size * mi / (std::sqrt(vi) / bc2_sqrt + eps);
  }
};

}  // namespace

void adamw_update(float* params, const float* grads, float* m, float* v,
                  const std::vector<OwnedSegment>& segments, const AdamWStep& s) {
  const ProfileScope profile(ProfKind::adamw, "update");
  const AdamWElement update(s);
  const float decayed = 1.0f - s.lr * s.weight_decay;
#pragma omp parallel
  for (const OwnedSegment& g : segments) {
    float* p = params + g.param_pos;
    const float* gr = grads + g.grad_pos;
    float* mi = m + g.state_pos;
    float* vi = v + g.state_pos;
    const float decay_factor = g.decay ? decayed : 1.0f;
#pragma omp for simd schedule(static) nowait
    for (int64_t i = 0; i < int64_t(g.count); ++i) update(p[i], gr[i], mi[i], vi[i], decay_factor);
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
