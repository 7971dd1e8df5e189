// Rotary position embedding (Llama), in place on the q and k heads of a fused qkv buffer (B,T,W),
// Hugging Face's rotate_half convention: in each head the pairs (i, i + hs/2), i < hs/2, turn by
// the angle (pos0 + t) · theta^(-2i/hs):
//   x[i]        = x[i] · cos - x[i + hs/2] · sin
//   x[i + hs/2] = x[i + hs/2] · cos + x[i] · sin
// (sin negated for the inverse, the rotation's backward). q's NH heads and k's KVH heads are the
// first C + KVH·hs columns of a row, contiguous, so both are one run of NH + KVH heads; v follows
// and is not touched.
//
// One block per (position, sequence): its threads first form the token's hs/2 angles, cos and sin
// in double (as kernels.h asks) into shared memory, rounded once to f32, then rotate every pair of
// the row's q and k heads. Each element is read and written by one thread; no reductions.
#include <cuda_runtime.h>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"

namespace tetra::cuda::launch {

namespace {

constexpr int kThreads = 128;

// grid (T, min(B, 65535)): position t of sequences blockIdx.y, blockIdx.y + gridDim.y, ...
// Dynamic shared memory: cos (half), then sin (half).
__global__ void __launch_bounds__(kThreads)
    rope_kernel(float* qkv, int B, int T, int64_t W, int heads, int hs, int pos0, double theta,
                bool inverse) {
  extern __shared__ float trig[];
  const int half = hs / 2;
  float* cs = trig;
  float* sn = trig + half;
  const int t = blockIdx.x;
  const double pos = double(pos0) + double(t);
  for (int i = threadIdx.x; i < half; i += kThreads) {
    const double inv_freq = pow(theta, -2.0 * double(i) / double(hs));
    double s, c;
    sincos(pos * inv_freq, &s, &c);
    cs[i] = float(c);
    sn[i] = inverse ? -float(s) : float(s);
  }
  __syncthreads();
  const int64_t pairs = int64_t(heads) * half;
  for (int b = blockIdx.y; b < B; b += gridDim.y) {
    float* row = qkv + (int64_t(b) * T + t) * W;
    for (int64_t idx = threadIdx.x; idx < pairs; idx += kThreads) {
      const int64_t hh = idx / half;
      const int i = int(idx - hh * half);
      float* x = row + hh * hs;
      const float x0 = x[i], x1 = x[i + half];
      const float c = cs[i], s = sn[i];
      x[i] = x0 * c - x1 * s;
      x[i + half] = x1 * c + x0 * s;
    }
  }
}

}  // namespace

void rope(float* qkv, int B, int T, int C, int NH, int KVH, int pos0, double theta, bool inverse) {
  if (B <= 0 || T <= 0) return;
  const int hs = C / NH;
  const int64_t W = int64_t(C) + 2 * int64_t(KVH) * hs;
  const size_t smem = size_t(hs / 2) * 2 * sizeof(float);
  const dim3 grid(unsigned(T), unsigned(B < 65535 ? B : 65535));
  rope_kernel<<<grid, kThreads, smem, compute_stream()>>>(qkv, B, T, W, NH + KVH, hs, pos0, theta,
                                                          inverse);
  check_launch(inverse ? "rope (inverse)" : "rope");
}

}  // namespace tetra::cuda::launch
