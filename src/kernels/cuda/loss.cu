// Softmax + cross-entropy over a padded vocabulary, whole rows and vocabulary-parallel, as
// kernels/cpu/cross_entropy.cc: one block per row, block reductions in a fixed tree (so the same
// inputs give the same bits), exp through expf.
#include <cuda_runtime.h>

#include <cfloat>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"

namespace tetra::cuda::launch {

namespace {

constexpr int kThreads = 512;

// losses[row] = logsumexp(x[0, V)) - x[y]; with `backward` x becomes dloss * (softmax - onehot)
// in [0, V) and 0 in the padding [V, Vp). A target outside [0, V) gives a NaN loss and no
// one-hot term, so a bad label shows in the loss instead of reading out of bounds.
__global__ void __launch_bounds__(kThreads)
    softmax_xent_kernel(float* losses, float* logits, const int32_t* targets, int V, int Vp,
                        bool backward, float dloss) {
  __shared__ float red[32];
  __shared__ float target_logit;
  const int64_t row = blockIdx.x;
  float* x = logits + row * Vp;
  const int y = targets[row];
  // Read before any thread overwrites the row (the reductions' barriers order it).
  if (threadIdx.x == 0) target_logit = (y >= 0 && y < V) ? x[y] : NAN;
  float mx = -INFINITY;
  for (int v = threadIdx.x; v < V; v += kThreads) mx = fmaxf(mx, x[v]);
  mx = block_max(mx, red);
  float s = 0.0f;
  for (int v = threadIdx.x; v < V; v += kThreads) s += expf(x[v] - mx);
  s = block_sum(s, red);
  const float lse = logf(s) + mx;
  if (threadIdx.x == 0) losses[row] = lse - target_logit;
  if (!backward) return;
  for (int v = threadIdx.x; v < Vp; v += kThreads) {
    float g = 0.0f;
    if (v < V) {
      g = dloss * expf(x[v] - lse);
      if (v == y) g -= dloss;
    }
    x[v] = g;
  }
}

__global__ void __launch_bounds__(kThreads)
    xent_row_max_kernel(float* mx, const float* logits, int Vl, int real) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const float* x = logits + row * Vl;
  // A rank holding only padding contributes the lowest float, as the CPU does.
  float m = -FLT_MAX;
  for (int v = threadIdx.x; v < real; v += kThreads) m = fmaxf(m, x[v]);
  m = block_max(m, red);
  if (threadIdx.x == 0) mx[row] = m;
}

__global__ void __launch_bounds__(kThreads)
    xent_row_sums_kernel(float* sums, const float* logits, const float* mx, const int32_t* targets,
                         int Vl, int real, int v0) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const float* x = logits + row * Vl;
  const float m = mx[row];
  float s = 0.0f;
  for (int v = threadIdx.x; v < real; v += kThreads) s += expf(x[v] - m);
  s = block_sum(s, red);
  if (threadIdx.x == 0) {
    const int y = targets[row] - v0;
    sums[2 * row] = s;
    sums[2 * row + 1] = (y >= 0 && y < real) ? x[y] : 0.0f;
  }
}

__global__ void __launch_bounds__(kThreads)
    xent_finish_kernel(float* losses, float* logits, const float* mx, const float* sums,
                       const int32_t* targets, int Vl, int real, int v0, bool backward,
                       float dloss) {
  const int64_t row = blockIdx.x;
  const float lse = logf(sums[2 * row]) + mx[row];
  if (threadIdx.x == 0) losses[row] = lse - sums[2 * row + 1];
  if (!backward) return;
  float* x = logits + row * Vl;
  const int y = targets[row] - v0;
  for (int v = threadIdx.x; v < Vl; v += kThreads) {
    float g = 0.0f;
    if (v < real) {
      g = dloss * expf(x[v] - lse);
      if (v == y) g -= dloss;
    }
    x[v] = g;
  }
}

}  // namespace

void softmax_xent(float* losses, float* logits, const int32_t* targets, int64_t N, int V, int Vp,
                  bool backward, float dloss) {
  if (N <= 0) return;
  softmax_xent_kernel<<<unsigned(N), kThreads, 0, compute_stream()>>>(losses, logits, targets, V,
                                                                      Vp, backward, dloss);
  check_launch("softmax_xent");
}

void xent_row_max(float* mx, const float* logits, int64_t N, int Vl, int real) {
  if (N <= 0) return;
  xent_row_max_kernel<<<unsigned(N), kThreads, 0, compute_stream()>>>(mx, logits, Vl, real);
  check_launch("softmax_xent_vocab_parallel (row max)");
}

void xent_row_sums(float* sums, const float* logits, const float* mx, const int32_t* targets,
                   int64_t N, int Vl, int real, int v0) {
  if (N <= 0) return;
  xent_row_sums_kernel<<<unsigned(N), kThreads, 0, compute_stream()>>>(sums, logits, mx, targets,
                                                                       Vl, real, v0);
  check_launch("softmax_xent_vocab_parallel (row sums)");
}

void xent_finish(float* losses, float* logits, const float* mx, const float* sums,
                 const int32_t* targets, int64_t N, int Vl, int real, int v0, bool backward,
                 float dloss) {
  if (N <= 0) return;
  xent_finish_kernel<<<unsigned(N), kThreads, 0, compute_stream()>>>(
      losses, logits, mx, sums, targets, Vl, real, v0, backward, dloss);
  check_launch("softmax_xent_vocab_parallel (losses)");
}

}  // namespace tetra::cuda::launch
