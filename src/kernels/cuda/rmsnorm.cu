// RMSNorm over the channel dimension (Llama): out = inp · rstd · weight with rstd = 1/sqrt(mean of
// inp² + eps). Forward: one warp per row, one pass (the f32 sum of squares) with a butterfly sum;
// rstd itself is formed in double from it, with eps as the caller gives it.
// Backward, as layernorm.cu: one warp per row for dinp, and dweight as deterministic column sums
// (each block sums a fixed chunk of rows for 32 columns, its 8 row lanes added in lane order; a
// second kernel adds the chunks' partials in chunk order). No float atomics, so repeated calls give
// identical bits.
#include <cuda_runtime.h>

#include "kernels/cuda/allocator.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"

namespace tetra::cuda::launch {

namespace {

constexpr int kWarps = 8;  // rows per block in the row kernels

__global__ void rmsnorm_forward_kernel(float* out, float* rstd, const float* inp,
                                       const float* weight, int64_t N, int C, double eps) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= N) return;  // the whole warp leaves together
  const float* x = inp + row * C;
  float s = 0.0f;
  for (int c = lane; c < C; c += 32) s = fmaf(x[c], x[c], s);
  const float ms = warp_sum(s) / float(C);
  const float r = float(1.0 / sqrt(double(ms) + eps));  // once per row: eps as given
  float* o = out + row * C;
  for (int c = lane; c < C; c += 32) o[c] = x[c] * r * weight[c];
  if (lane == 0) rstd[row] = r;
}

// With norm = inp · rstd and dnorm = weight · dout:
// dinp += (dnorm - norm · mean(dnorm · norm)) · rstd.
__global__ void rmsnorm_dinp_kernel(float* dinp, const float* dout, const float* inp,
                                    const float* weight, const float* rstd, int64_t N, int C) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= N) return;
  const float* x = inp + row * C;
  const float* dy = dout + row * C;
  const float s = rstd[row];
  float a = 0.0f;
  for (int c = lane; c < C; c += 32) a += weight[c] * dy[c] * (x[c] * s);
  const float dnorm_norm_mean = warp_sum(a) / float(C);
  float* dx = dinp + row * C;
  for (int c = lane; c < C; c += 32) {
    const float norm = x[c] * s;
    const float dnorm = weight[c] * dy[c];
    dx[c] += (dnorm - norm * dnorm_norm_mean) * s;
  }
}

// partial (chunks, C) = the chunk's column sums of norm · dout (dweight).
// Block (32, 8): 32 columns, 8 row lanes summed in lane order.
constexpr int kColTile = 32, kRowLanes = 8;

__global__ void rmsnorm_weight_partials_kernel(float* partial, const float* dout, const float* inp,
                                               const float* rstd, int64_t N, int C,
                                               int64_t chunk_rows) {
  __shared__ float red[kRowLanes][kColTile + 1];
  const int c = blockIdx.x * kColTile + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < N ? r0 + chunk_rows : N;
  float acc = 0.0f;
  if (c < C) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) {
      acc += (inp[r * C + c] * rstd[r]) * dout[r * C + c];
    }
  }
  red[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float total = 0.0f;
    for (int y = 0; y < kRowLanes; ++y) total += red[y][threadIdx.x];
    partial[int64_t(blockIdx.y) * C + c] = total;
  }
}

// dweight[c] += sum over chunks of partial[k][c], chunks in order.
__global__ void rmsnorm_weight_finish_kernel(float* dweight, const float* partial, int64_t chunks,
                                             int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float w = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) w += partial[k * C + c];
  dweight[c] += w;
}

}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int C, double eps) {
  if (N <= 0 || C <= 0) return;
  const unsigned blocks = unsigned((N + kWarps - 1) / kWarps);
  rmsnorm_forward_kernel<<<blocks, kWarps * 32, 0, compute_stream()>>>(out, rstd, inp, weight, N, C,
                                                                       eps);
  check_launch("rmsnorm_forward");
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int C) {
  if (N <= 0 || C <= 0) return;
  const cudaStream_t s = compute_stream();
  const unsigned blocks = unsigned((N + kWarps - 1) / kWarps);
  rmsnorm_dinp_kernel<<<blocks, kWarps * 32, 0, s>>>(dinp, dout, inp, weight, rstd, N, C);
  check_launch("rmsnorm_backward (dinp)");

  int64_t chunk_rows = 256;
  while ((N + chunk_rows - 1) / chunk_rows > 65535) chunk_rows *= 2;
  const int64_t chunks = (N + chunk_rows - 1) / chunk_rows;
  Scratch partial(size_t(chunks) * size_t(C) * sizeof(float));
  const dim3 grid((C + kColTile - 1) / kColTile, unsigned(chunks));
  rmsnorm_weight_partials_kernel<<<grid, dim3(kColTile, kRowLanes), 0, s>>>(
      partial.as<float>(), dout, inp, rstd, N, C, chunk_rows);
  check_launch("rmsnorm_backward (weight partials)");
  rmsnorm_weight_finish_kernel<<<(C + 255) / 256, 256, 0, s>>>(dweight, partial.as<float>(), chunks,
                                                               C);
  check_launch("rmsnorm_backward (weight sums)");
}

}  // namespace tetra::cuda::launch
