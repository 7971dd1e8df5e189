// Device-side helpers of the CUDA backend's kernels: deterministic warp and block reductions,
// bf16 rounding with the bits of kernels/cpu/matmul.h's round_bf16, launch sizing and checks.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/runtime.h"

namespace tetra::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

/** Grid size for a grid-stride loop over n items: enough blocks to fill the GPU several times,
 *  never more than the items need. */
inline unsigned grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  const int64_t cap = 8192;
  return unsigned(blocks < 1 ? 1 : (blocks < cap ? blocks : cap));
}

/** Throws tetra::Error if the launch just queued failed. */
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

// Butterfly reductions: every lane ends with the same bits, since each step adds the same two
// partial sums in every lane (float addition is commutative) and the tree does not depend on
// timing. That makes them deterministic, unlike atomics.
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

/** Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
 *  `red` is shared scratch of 32 elements; consecutive calls may reuse it. */
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* red) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();  // the previous call's readers are done with red
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < warps ? red[lane] : T(0);
  return warp_sum(v);
}

/** Max over the block, as block_sum. */
__device__ __forceinline__ float block_max(float v, float* red) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < warps ? red[lane] : -INFINITY;
  return warp_max(v);
}

/** f32 -> bf16 bits, nearest even, NaN kept quiet: the bits of cpu::round_bf16. */
__device__ __forceinline__ uint16_t bf16_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}
__device__ __forceinline__ float bf16_to_float(uint16_t b) {
  return __uint_as_float(uint32_t(b) << 16);
}
/** f rounded to the nearest bf16, kept as an f32. */
__device__ __forceinline__ float round_to_bf16(float f) { return bf16_to_float(bf16_bits(f)); }

}  // namespace tetra::cuda
