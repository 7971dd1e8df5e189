// Attention for generation: the new positions' keys and values stored in the caches, then each
// new query over every cached position up to its own, one block per (head, query, sequence) with
// the online softmax over chunks of 128 keys (no scores kept anywhere). qkv rows (W columns) are
// [q (NH·hs) | k (KVH·hs) | v (KVH·hs)]; the caches (B,maxT,KVH·hs) hold only the key/value
// heads, and query head h reads kv head h / (NH/KVH) (grouped-query attention; KVH == NH is
// multi-head attention).
#include <cuda_runtime.h>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"

namespace tetra::cuda::launch {

namespace {

// kcache, vcache (B,maxT,KVW) rows pos0.. = the new keys and values of qkv (B,T,W), W = C + 2 KVW.
__global__ void decode_store_kernel(float* kcache, float* vcache, const float* qkv, int pos0, int T,
                                    int C, int KVW, int maxT, int64_t n) {
  const int64_t W = int64_t(C) + 2 * int64_t(KVW);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t bt = i / KVW;
    const int c = int(i - bt * KVW);
    const int64_t b = bt / T, t = bt % T;
    const float* row = qkv + bt * W;
    const int64_t dst = (b * maxT + pos0 + t) * KVW + c;
    kcache[dst] = row[C + c];
    vcache[dst] = row[C + KVW + c];
  }
}

constexpr int kDecodeThreads = 128;  // one key per thread per chunk; thread d owns output dim d
static_assert(kDecodeThreads >= kAttentionMaxHeadSize, "a thread per head dimension");

// grid (NH, T, B): new query t of sequence b, head h, over cached keys 0..pos0 + t of kv head
// h / (NH/KVH), in chunks of 128 keys with the online softmax.
__global__ void __launch_bounds__(kDecodeThreads)
    decode_kernel(float* out, const float* qkv, const float* kcache, const float* vcache, int pos0,
                  int T, int C, int NH, int KVH, int maxT, float scale) {
  __shared__ float q[kAttentionMaxHeadSize];
  __shared__ float p[kDecodeThreads];
  __shared__ float red[32];
  const int h = blockIdx.x, t = blockIdx.y, b = blockIdx.z;
  const int hs = C / NH, tid = threadIdx.x;
  const int KVW = KVH * hs, g = h / (NH / KVH);
  const int64_t W = int64_t(C) + 2 * int64_t(KVW);
  const float* qrow = qkv + (int64_t(b) * T + t) * W + h * hs;
  if (tid < hs) q[tid] = qrow[tid];
  __syncthreads();
  const int last = pos0 + t;
  const float* keys = kcache + int64_t(b) * maxT * KVW + g * hs;
  const float* values = vcache + int64_t(b) * maxT * KVW + g * hs;
  float m = -INFINITY, l = 0.0f, acc = 0.0f;
  for (int j0 = 0; j0 <= last; j0 += kDecodeThreads) {
    const int j = j0 + tid;
    float sc = -INFINITY;
    if (j <= last) {
      const float* k = keys + int64_t(j) * KVW;
      float dot = 0.0f;
      for (int d = 0; d < hs; ++d) dot = fmaf(q[d], k[d], dot);
      sc = dot * scale;
    }
    const float m_new = fmaxf(m, block_max(sc, red));  // finite: key 0 is in the first chunk
    const float alpha = m == -INFINITY ? 0.0f : expf(m - m_new);
    const float pj = j <= last ? expf(sc - m_new) : 0.0f;
    l = l * alpha + block_sum(pj, red);
    __syncthreads();  // the previous chunk's readers of p are done
    p[tid] = pj;
    __syncthreads();
    if (tid < hs) {
      acc *= alpha;
      const int n = min(kDecodeThreads, last - j0 + 1);
      for (int c = 0; c < n; ++c) acc = fmaf(p[c], values[int64_t(j0 + c) * KVW + tid], acc);
    }
    m = m_new;
  }
  if (tid < hs) out[(int64_t(b) * T + t) * C + h * hs + tid] = acc / l;
}

}  // namespace

void attention_decode(float* out, const float* qkv, float* kcache, float* vcache, int pos0, int B,
                      int T, int C, int NH, int KVH, int maxT) {
  if (B <= 0 || T <= 0) return;
  const cudaStream_t s = compute_stream();
  const int hs = C / NH, KVW = KVH * hs;
  const int64_t n = int64_t(B) * T * KVW;
  decode_store_kernel<<<grid_for(n, 256), 256, 0, s>>>(kcache, vcache, qkv, pos0, T, C, KVW, maxT,
                                                       n);
  check_launch("attention decode (cache store)");
  const float scale = 1.0f / sqrtf(float(hs));
  decode_kernel<<<dim3(unsigned(NH), unsigned(T), unsigned(B)), kDecodeThreads, 0, s>>>(
      out, qkv, kcache, vcache, pos0, T, C, NH, KVH, maxT, scale);
  check_launch("attention decode");
}

}  // namespace tetra::cuda::launch
