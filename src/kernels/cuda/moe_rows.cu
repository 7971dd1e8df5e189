// Mixture-of-experts row movement (kernels/kernels.h): gather by index, the gate-weighted combine
// and its backward. Each output element is written by one thread and each gate gradient reduced
// by one warp in a fixed order, so results are deterministic. No atomics.
#include <cuda_runtime.h>

#include "kernels/cuda/allocator.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"

namespace tetra::cuda::launch {

namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;

__global__ void gather_rows_kernel(float* out, const float* in, const int32_t* idx, int64_t rows,
                                   int C) {
  const int64_t n = rows * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / C, c = i - r * C;
    const int32_t src = idx[r];
    out[i] = src < 0 ? 0.0f : in[int64_t(src) * C + c];
  }
}

__global__ void moe_combine_kernel(float* out, const float* in, const int32_t* pos,
                                   const float* gate, int64_t N, int k, int C) {
  const int64_t n = N * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / C, c = i - t * C;
    float acc = out[i];
    for (int j = 0; j < k; ++j) {
      const int32_t p = pos[t * k + j];
      if (p >= 0) acc += (gate ? gate[t * k + j] : 1.0f) * in[int64_t(p) * C + c];
    }
    out[i] = acc;
  }
}

// One warp per (token, choice): din's row and the gate's dot product.
__global__ void moe_combine_backward_kernel(float* din, float* dgate, const float* dout,
                                            const float* in, const int32_t* pos, const float* gate,
                                            int64_t N, int k, int C) {
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / kWarp);
  const int lane = int(threadIdx.x) % kWarp;
  for (int64_t w = blockIdx.x * int64_t(blockDim.x / kWarp) + threadIdx.x / kWarp; w < N * k;
       w += warps) {
    const int32_t p = pos[w];
    if (p < 0) {
      if (lane == 0) dgate[w] = 0.0f;
      continue;
    }
    const float g = gate[w];
    const float* dy = dout + (w / k) * C;
    const float* x = in + int64_t(p) * C;
    float* dx = din + int64_t(p) * C;
    float dot = 0.0f;
    for (int c = lane; c < C; c += kWarp) {
      dx[c] = g * dy[c];
      dot += dy[c] * x[c];
    }
    dot = warp_sum(dot);
    if (lane == 0) dgate[w] = dot;
  }
}

}  // namespace

void gather_rows(float* out, const float* in, const int32_t* idx, int64_t rows, int C) {
  if (rows <= 0 || C <= 0) return;
  gather_rows_kernel<<<grid_for(rows * C, kThreads), kThreads, 0, compute_stream()>>>(out, in, idx,
                                                                                      rows, C);
  check_launch("gather_rows");
}

void moe_combine(float* out, const float* in, const int32_t* pos, const float* gate, int64_t N,
                 int k, int C) {
  if (N <= 0 || C <= 0) return;
  moe_combine_kernel<<<grid_for(N * C, kThreads), kThreads, 0, compute_stream()>>>(out, in, pos,
                                                                                   gate, N, k, C);
  check_launch("moe_combine");
}

void moe_combine_backward(float* din, float* dgate, const float* dout, const float* in,
                          const int32_t* pos, const float* gate, int64_t N, int k, int C) {
  if (N <= 0 || k <= 0) return;
  const int64_t threads = N * k * kWarp;
  moe_combine_backward_kernel<<<grid_for(threads, kThreads), kThreads, 0, compute_stream()>>>(
      din, dgate, dout, in, pos, gate, N, k, C);
  check_launch("moe_combine_backward");
}

}  // namespace tetra::cuda::launch
