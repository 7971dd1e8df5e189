#include "kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/vec_math.h"

namespace tetra::cpu {

namespace {

// log(sum(exp(x))) over the first V entries of a row, shifted by the max for stability.
template <typename F>
F logsumexp(const F* x, int V) {
  F mx = x[0];
#pragma omp simd reduction(max : mx)
  for (int v = 1; v < V; ++v) mx = std::max(mx, x[v]);
  F sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int v = 0; v < V; ++v) sum += exp_approx(x[v] - mx);
  return std::log(sum) + mx;
}

}  // namespace

template <typename F>
double softmax_xent_forward_backward(F* losses, F* logits, const int32_t* targets, int64_t N, int V,
                                     int Vp, F dloss) {
  double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : total)
  for (int64_t i = 0; i < N; ++i) {
    F* x = logits + i * Vp;
    F lse = logsumexp(x, V);
    int y = targets[i];
    losses[i] = lse - x[y];
    total += losses[i];
#pragma omp simd
    for (int v = 0; v < V; ++v) x[v] = dloss * exp_approx(x[v] - lse);
    x[y] -= dloss;
    for (int v = V; v < Vp; ++v) x[v] = 0;
  }
  return total;
}

template <typename F>
double softmax_xent_forward(F* losses, const F* logits, const int32_t* targets, int64_t N, int V,
                            int Vp) {
  double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : total)
  for (int64_t i = 0; i < N; ++i) {
    const F* x = logits + i * Vp;
    losses[i] = logsumexp(x, V) - x[targets[i]];
    total += losses[i];
  }
  return total;
}

template double softmax_xent_forward_backward<float>(float*, float*, const int32_t*, int64_t, int,
                                                     int, float);
template double softmax_xent_forward_backward<double>(double*, double*, const int32_t*, int64_t,
                                                      int, int, double);
template double softmax_xent_forward<float>(float*, const float*, const int32_t*, int64_t, int,
                                            int);
template double softmax_xent_forward<double>(double*, const double*, const int32_t*, int64_t, int,
                                             int);

}  // namespace tetra::cpu
