// LayerNorm over the channel dimension (eps kLayerNormEps, biased variance), as
// kernels/cpu/layernorm.cc. Forward: one warp per row, two passes (mean, then the centred sum of
// squares) with butterfly sums. Backward: one warp per row for dinp, and the parameter gradients
// as deterministic column sums (per-chunk partials in a fixed order, then the chunks in order).
#include <cuda_runtime.h>

#include "kernels/cuda/allocator.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"

namespace tetra::cuda::launch {

namespace {

constexpr int kWarps = 8;      // rows per block in the row kernels
constexpr float kEps = 1e-5f;  // kernels.h's kLayerNormEps

__global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* inp,
                                         const float* weight, const float* bias, int64_t N, int C) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= N) return;  // the whole warp leaves together
  const float* x = inp + row * C;
  float s = 0.0f;
  for (int c = lane; c < C; c += 32) s += x[c];
  const float m = warp_sum(s) / float(C);
  float v = 0.0f;
  for (int c = lane; c < C; c += 32) {
    const float d = x[c] - m;
    v += d * d;
  }
  const float var = warp_sum(v) / float(C);
  const float r = 1.0f / sqrtf(var + kEps);
  float* o = out + row * C;
  for (int c = lane; c < C; c += 32) o[c] = (x[c] - m) * r * weight[c] + bias[c];
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// dinp += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd, dnorm = weight * dout.
__global__ void layernorm_dinp_kernel(float* dinp, const float* dout, const float* inp,
                                      const float* weight, const float* mean, const float* rstd,
                                      int64_t N, int C) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= N) return;
  const float* x = inp + row * C;
  const float* dy = dout + row * C;
  const float m = mean[row], s = rstd[row];
  float a = 0.0f, b = 0.0f;
  for (int c = lane; c < C; c += 32) {
    const float norm = (x[c] - m) * s;
    const float dnorm = weight[c] * dy[c];
    a += dnorm;
    b += dnorm * norm;
  }
  const float dnorm_mean = warp_sum(a) / float(C);
  const float dnorm_norm_mean = warp_sum(b) / float(C);
  float* dx = dinp + row * C;
  for (int c = lane; c < C; c += 32) {
    const float norm = (x[c] - m) * s;
    const float dnorm = weight[c] * dy[c];
    dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
  }
}

// partial (chunks, 2C): [0, C) the chunk's sums of norm * dout (dweight), [C, 2C) of dout (dbias).
// Block (32, 8): 32 columns, 8 row lanes summed in lane order.
constexpr int kColTile = 32, kRowLanes = 8;

__global__ void layernorm_params_partials_kernel(float* partial, const float* dout,
                                                 const float* inp, const float* mean,
                                                 const float* rstd, int64_t N, int C,
                                                 int64_t chunk_rows) {
  __shared__ float red_w[kRowLanes][kColTile + 1], red_b[kRowLanes][kColTile + 1];
  const int c = blockIdx.x * kColTile + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < N ? r0 + chunk_rows : N;
  float aw = 0.0f, ab = 0.0f;
  if (c < C) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) {
      const float dy = dout[r * C + c];
      const float norm = (inp[r * C + c] - mean[r]) * rstd[r];
      aw += norm * dy;
      ab += dy;
    }
  }
  red_w[threadIdx.y][threadIdx.x] = aw;
  red_b[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float tw = 0.0f, tb = 0.0f;
    for (int y = 0; y < kRowLanes; ++y) {
      tw += red_w[y][threadIdx.x];
      tb += red_b[y][threadIdx.x];
    }
    float* p = partial + int64_t(blockIdx.y) * 2 * C;
    p[c] = tw;
    p[C + c] = tb;
  }
}

// dweight[c] += sum over chunks of partial[k][c]; dbias[c] += ... partial[k][C + c]; chunk order.
__global__ void layernorm_params_finish_kernel(float* dweight, float* dbias, const float* partial,
                                               int64_t chunks, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float w = 0.0f, b = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) {
    w += partial[k * 2 * C + c];
    b += partial[k * 2 * C + C + c];
  }
  dweight[c] += w;
  dbias[c] += b;
}

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int C) {
  if (N <= 0 || C <= 0) return;
  const unsigned blocks = unsigned((N + kWarps - 1) / kWarps);
  layernorm_forward_kernel<<<blocks, kWarps * 32, 0, compute_stream()>>>(out, mean, rstd, inp,
                                                                         weight, bias, N, C);
  check_launch("layernorm_forward");
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int64_t N, int C) {
  if (N <= 0 || C <= 0) return;
  const cudaStream_t s = compute_stream();
  const unsigned blocks = unsigned((N + kWarps - 1) / kWarps);
  layernorm_dinp_kernel<<<blocks, kWarps * 32, 0, s>>>(dinp, dout, inp, weight, mean, rstd, N, C);
  check_launch("layernorm_backward (dinp)");

  int64_t chunk_rows = 256;
  while ((N + chunk_rows - 1) / chunk_rows > 65535) chunk_rows *= 2;
  const int64_t chunks = (N + chunk_rows - 1) / chunk_rows;
  Scratch partial(size_t(chunks) * 2 * size_t(C) * sizeof(float));
  const dim3 grid((C + kColTile - 1) / kColTile, unsigned(chunks));
  layernorm_params_partials_kernel<<<grid, dim3(kColTile, kRowLanes), 0, s>>>(
      partial.as<float>(), dout, inp, mean, rstd, N, C, chunk_rows);
  check_launch("layernorm_backward (parameter partials)");
  layernorm_params_finish_kernel<<<(C + 255) / 256, 256, 0, s>>>(dweight, dbias,
                                                                 partial.as<float>(), chunks, C);
  check_launch("layernorm_backward (parameter sums)");
}

}  // namespace tetra::cuda::launch
