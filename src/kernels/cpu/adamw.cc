#include "kernels/cpu/adamw.h"

#include <omp.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/profile.h"
#include "kernels/cpu/matmul.h"

namespace tetra::cpu {

namespace {

// The update of one element; bias corrections in double then rounded, as torch computes them on
// Python floats.
template <typename F>
struct AdamWElement {
  F beta1, beta2, eps, grad_scale, step_size, bc2_sqrt;
  explicit AdamWElement(const AdamWStep& s)
      : beta1(s.beta1), beta2(s.beta2), eps(s.eps), grad_scale(s.grad_scale) {
    const double bc1 = 1.0 - std::pow(double(s.beta1), double(s.t));
    const double bc2 = 1.0 - std::pow(double(s.beta2), double(s.t));
    step_size = F(double(s.lr) / bc1);
    bc2_sqrt = F(std::sqrt(bc2));
  }
  void operator()(F& param, F grad, F& m, F& v, F decay_factor) const {
    const F g = grad * grad_scale;
    const F mi = beta1 * m + (F(1) - beta1) * g;
    const F vi = beta2 * v + (F(1) - beta2) * g * g;
    m = mi;
    v = vi;
    param = param * decay_factor - step_size * mi / (std::sqrt(vi) / bc2_sqrt + eps);
  }
};

}  // namespace

template <typename F>
void adamw_update(F* params, const F* grads, F* m, F* v, const std::vector<OwnedSegment>& segments,
                  const AdamWStep& s, bf16* rounded) {
  const ProfileScope profile(ProfKind::adamw, rounded ? "update + bf16 weights" : "update");
  TETRA_CHECK(!rounded || sizeof(F) == sizeof(float),
              "adamw_update: bf16 copies are of f32 parameters only");
  const AdamWElement<F> update(s);
  const F decayed = F(1) - F(s.lr) * F(s.weight_decay);
#pragma omp parallel
  for (const OwnedSegment& g : segments) {
    F* p = params + g.param_pos;
    const F* gr = grads + g.grad_pos;
    F* mi = m + g.state_pos;
    F* vi = v + g.state_pos;
    const F decay_factor = g.decay ? decayed : F(1);
    if (rounded) {
      uint16_t* r = &rounded[g.param_pos].bits;
#pragma omp for simd schedule(static) nowait
      for (int64_t i = 0; i < int64_t(g.count); ++i) {
        update(p[i], gr[i], mi[i], vi[i], decay_factor);
        r[i] = round_bf16(float(p[i]));
      }
    } else {
#pragma omp for simd schedule(static) nowait
      for (int64_t i = 0; i < int64_t(g.count); ++i) {
        update(p[i], gr[i], mi[i], vi[i], decay_factor);
      }
    }
  }
}

template <typename F>
double sum_squares(const F* x, int64_t N) {
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

template void adamw_update<float>(float*, const float*, float*, float*,
                                  const std::vector<OwnedSegment>&, const AdamWStep&, bf16*);
template void adamw_update<double>(double*, const double*, double*, double*,
                                   const std::vector<OwnedSegment>&, const AdamWStep&, bf16*);
template double sum_squares<float>(const float*, int64_t);
template double sum_squares<double>(const double*, int64_t);

}  // namespace tetra::cpu
