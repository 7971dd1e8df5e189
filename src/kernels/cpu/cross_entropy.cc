#include "kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/profile.h"
#include "kernels/cpu/eltwise_simd.h"
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

// One row of the fused loss with the vector branch k (F is float): the loss, and with `backward`
// x overwritten by dloss * (softmax - onehot) and 0 in the padding. Exponentials are computed once:
// exp(x - max) is stored in x and then scaled by dloss / sum. `next` (the thread's next row, or
// null) is fetched into the cache while the exponentials are computed, so the max pass of a long
// row (gpt2's 200 KB) does not wait on memory with the vector units idle.
template <typename F>
F xent_row(const SimdKernels& k, F* x, const F* next, int y, int V, int Vp, bool backward,
           F dloss) {
  float* xf = reinterpret_cast<float*>(x);  // F is float wherever k exists
  const float* nf = reinterpret_cast<const float*>(next);
  const float mx = k.max(xf, V), target = xf[y];
  const float sum = backward ? k.exp_sum_inplace(xf, V, mx, nf) : k.sum_exp(xf, V, mx, nf);
  const float loss = std::log(sum) + mx - target;
  if (backward) {
    k.scale(xf, V, float(dloss) / sum);
    xf[y] -= float(dloss);
    for (int v = V; v < Vp; ++v) xf[v] = 0;
  }
  return F(loss);
}

}  // namespace

template <typename F>
double softmax_xent_forward_backward(F* losses, F* logits, const int32_t* targets, int64_t N, int V,
                                     int Vp, F dloss) {
  const ProfileScope profile(ProfKind::softmax_loss, "forward + backward");
  double total = 0.0;
  if (const SimdKernels* k = vector_kernels<F>()) {
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < N; ++i) {
      const F* next = i + 1 < N ? logits + (i + 1) * Vp : nullptr;
      losses[i] = xent_row(*k, logits + i * Vp, next, targets[i], V, Vp, true, dloss);
      total += losses[i];
    }
    return total;
  }
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
  if (const SimdKernels* k = vector_kernels<F>()) {
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < N; ++i) {
      // The forward branch reads x only; the cast away from const is never written through.
      const F* next = i + 1 < N ? logits + (i + 1) * Vp : nullptr;
      losses[i] =
          xent_row(*k, const_cast<F*>(logits + i * Vp), next, targets[i], V, Vp, false, F(0));
      total += losses[i];
    }
    return total;
  }
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
  const SimdKernels* k = vector_kernels<F>();
  std::vector<F> mx(static_cast<size_t>(N)),
      sums(2 * static_cast<size_t>(N));  // sums: (N,2) = sum of exp, target logit
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const F* x = logits + i * Vl;
    F m = std::numeric_limits<F>::lowest();  // a rank holding only padding
    if (k) {
      if (real > 0) m = F(k->max(reinterpret_cast<const float*>(x), real));
    } else {
#pragma omp simd reduction(max : m)
      for (int v = 0; v < real; ++v) m = std::max(m, x[v]);
    }
    mx[size_t(i)] = m;
  }
  all_max(mx.data(), N);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    F* x = logits + i * Vl;
    const F m = mx[size_t(i)];
    const int y = targets[i] - v0;
    sums[2 * size_t(i) + 1] = y >= 0 && y < real ? x[y] : F(0);
    F sum = 0;
    if (k) {
      // With backward, exp(x - max) is kept in x for the last pass to scale (one exponential per
      // logit); forward leaves the logits untouched.
      float* xf = reinterpret_cast<float*>(x);  // F is float wherever k exists
      const float* next = i + 1 < N ? reinterpret_cast<const float*>(x + Vl) : nullptr;
      sum = F(backward ? k->exp_sum_inplace(xf, real, float(m), next)
                       : k->sum_exp(xf, real, float(m), next));
    } else {
#pragma omp simd reduction(+ : sum)
      for (int v = 0; v < real; ++v) sum += exp_approx(x[v] - m);
    }
    sums[2 * size_t(i)] = sum;
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
    if (k) {
      k->scale(reinterpret_cast<float*>(x), real, float(dloss) / float(sums[2 * size_t(i)]));
    } else {
#pragma omp simd
      for (int v = 0; v < real; ++v) x[v] = dloss * exp_approx(x[v] - lse);
    }
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
