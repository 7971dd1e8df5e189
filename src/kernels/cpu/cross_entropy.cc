#include "kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/profile.h"
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
  const ProfileScope profile(ProfKind::softmax_loss, "forward + backward");
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
  const ProfileScope profile(ProfKind::softmax_loss, "forward");
  double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : total)
  for (int64_t i = 0; i < N; ++i) {
    const F* x = logits + i * Vp;
    losses[i] = logsumexp(x, V) - x[targets[i]];
    total += losses[i];
  }
  return total;
}

template <typename F>
double softmax_xent_vocab_parallel(F* losses, F* logits, const int32_t* targets, int64_t N, int Vl,
                                   int v0, int V, bool backward, F dloss,
                                   const GroupReduce<F>& all_max, const GroupReduce<F>& all_sum) {
  const ProfileScope profile(ProfKind::softmax_loss, backward ? "vocab-parallel forward + backward"
                                                              : "vocab-parallel forward");
  const int real = std::clamp(V - v0, 0, Vl);  // this rank's real columns: [0, real)
  std::vector<F> mx(static_cast<size_t>(N)),
      sums(2 * static_cast<size_t>(N));  // sums: (N,2) = sum of exp, target logit
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const F* x = logits + i * Vl;
    F m = std::numeric_limits<F>::lowest();  // a rank holding only padding
#pragma omp simd reduction(max : m)
    for (int v = 0; v < real; ++v) m = std::max(m, x[v]);
    mx[size_t(i)] = m;
  }
  all_max(mx.data(), N);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const F* x = logits + i * Vl;
    const F m = mx[size_t(i)];
    F sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int v = 0; v < real; ++v) sum += exp_approx(x[v] - m);
    const int y = targets[i] - v0;
    sums[2 * size_t(i)] = sum;
    sums[2 * size_t(i) + 1] = y >= 0 && y < real ? x[y] : F(0);
  }
  all_sum(sums.data(), 2 * N);
  double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : total)
  for (int64_t i = 0; i < N; ++i) {
    const F lse = std::log(sums[2 * size_t(i)]) + mx[size_t(i)];
    losses[i] = lse - sums[2 * size_t(i) + 1];
    total += losses[i];
    if (!backward) continue;
    F* x = logits + i * Vl;
#pragma omp simd
    for (int v = 0; v < real; ++v) x[v] = dloss * exp_approx(x[v] - lse);
    for (int v = real; v < Vl; ++v) x[v] = 0;
    const int y = targets[i] - v0;
    if (y >= 0 && y < real) x[y] -= dloss;
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

template double softmax_xent_vocab_parallel<float>(float*, float*, const int32_t*, int64_t, int,
                                                   int, int, bool, float, const GroupReduce<float>&,
                                                   const GroupReduce<float>&);
template double softmax_xent_vocab_parallel<double>(double*, double*, const int32_t*, int64_t, int,
                                                    int, int, bool, double,
                                                    const GroupReduce<double>&,
                                                    const GroupReduce<double>&);

}  // namespace tetra::cpu
