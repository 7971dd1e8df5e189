// Blockwise attention for context parallelism (kernels/kernels.h, AttentionBlock) in f32: one
// warp per row, no scores stored, no atomics.
//
// A warp owns one query row of one head (forward, delta, dq) or one key row of one key/value head
// (dk, dv). The row's own vectors (q, dout, or k and v) sit in shared memory; the warp walks the
// other side's rows 32 at a time, lane t taking row t of the 32: it computes its whole score (and
// dp) by a loop over the head dimensions, the 32 probabilities are combined by warp reductions,
// and then, for each of the 32 rows in order, the probability is broadcast by a shuffle and every
// lane adds it times the row's values at its own head dimensions (lane + 32u, u < 4, so hs <=
// 128): those reads are coalesced. Rows are numbered position fastest, so a thread block's 8
// warps take (mostly) 8 consecutive rows of one head, which walk the same rows of the other side
// together and share them through the L1 cache. Every sum runs in a fixed order (warp_max and
// warp_sum give all lanes the same bits), so results repeat bit for bit.
//
// Forward merges the block into the running (out, lse) of its row; a masked key (causal, j > i)
// is skipped, never weighted. Backward recomputes p = exp(scale·q·k - lse) from the merged lse.
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"

namespace tetra::cuda::launch {

namespace {

constexpr int kWarps = 8;  // rows per thread block
constexpr int kThreads = 32 * kWarps;
constexpr int kSlots = kAttentionMaxHeadSize / 32;  // head dimensions per lane: lane + 32u

struct Sizes {
  int B, Tq, Tk, NH, G, hs;
  bool causal;
  float scale;
  // The keys query i sees: [0, keys(i)).
  __device__ __forceinline__ int keys(int i) const { return causal ? i + 1 : Tk; }
  // The queries key j is seen by: [first(j), Tq).
  __device__ __forceinline__ int first(int j) const { return causal ? j : 0; }
};

__device__ __forceinline__ const float* at(RowsIn r, int b, int t) {
  return r.p + int64_t(b) * r.batch + int64_t(t) * r.row;
}
__device__ __forceinline__ float* at(RowsOut r, int b, int t) {
  return r.p + int64_t(b) * r.batch + int64_t(t) * r.row;
}

// x (hs) into shared s, scaled.
__device__ __forceinline__ void stage(float* s, const float* x, int hs, float scale) {
  for (int c = int(threadIdx.x & 31); c < hs; c += 32) s[c] = x[c] * scale;
}

__device__ __forceinline__ float dot(const float* s, const float* x, int hs) {
  float acc = 0.0f;
  for (int c = 0; c < hs; ++c) acc = fmaf(s[c], x[c], acc);
  return acc;
}

// acc (this lane's slots of an hs-wide row) += coef_t · row t's elements for the count rows t of a
// tile, where lane t holds coef_t.
__device__ __forceinline__ void add_tile(float (&acc)[kSlots], float coef, int count, int hs,
                                         const float* first, int64_t stride) {
  const int lane = int(threadIdx.x & 31);
  for (int t = 0; t < count; ++t) {
    const float ct = __shfl_sync(kFullMask, coef, t);
    const float* row = first + t * stride;
#pragma unroll
    for (int u = 0; u < kSlots; ++u) {
      const int c = lane + 32 * u;
      if (c < hs) acc[u] = fmaf(ct, row[c], acc[u]);
    }
  }
}

// This warp's query row i of head h of sequence b (i fastest); valid: the row exists.
struct QueryRow {
  int lane, warp, i = 0, h = 0, b = 0;
  bool valid;
  __device__ __forceinline__ explicit QueryRow(const Sizes& z)
      : lane(int(threadIdx.x & 31)), warp(int(threadIdx.x >> 5)) {
    const int64_t row = int64_t(blockIdx.x) * kWarps + warp;
    valid = row < int64_t(z.B) * z.Tq * z.NH;
    if (valid) i = int(row % z.Tq), h = int(row / z.Tq % z.NH), b = int(row / z.Tq / z.NH);
  }
};

// A warp per query row i of head h of sequence b, i fastest (see the file comment).
__global__ void __launch_bounds__(kThreads)
    block_forward_kernel(RowsOut out, RowsOut lse, RowsIn q, RowsIn k, RowsIn v, Sizes z) {
  __shared__ float sq[kWarps][kAttentionMaxHeadSize];
  const QueryRow w(z);
  if (!w.valid) return;
  const int lane = w.lane, warp = w.warp, i = w.i, h = w.h, b = w.b;
  const int hs = z.hs, kv = (h / z.G) * hs, n = z.keys(i);
  float* qs = sq[warp];
  stage(qs, at(q, b, i) + int64_t(h) * hs, hs, z.scale);
  __syncwarp();

  float m = -INFINITY, l = 0.0f, acc[kSlots] = {};
  for (int j0 = 0; j0 < n; j0 += 32) {
    const int j = j0 + lane, count = min(32, n - j0);
    const float s = j < n ? dot(qs, at(k, b, j) + kv, hs) : -INFINITY;
    const float m_new = fmaxf(m, warp_max(s));  // finite: key j0 is visible
    const float corr = expf(m - m_new);         // 0 on the first tile (m = -inf)
    const float p = j < n ? expf(s - m_new) : 0.0f;
    l = l * corr + warp_sum(p);
    m = m_new;
#pragma unroll
    for (int u = 0; u < kSlots; ++u) acc[u] *= corr;
    add_tile(acc, p, count, hs, at(v, b, j0) + kv, v.row);
  }
  // Merge with the running result: lse_new = logaddexp(lse, lse_blk), out = out·exp(lse -
  // lse_new) + out_blk·exp(lse_blk - lse_new), out_blk = acc / l. A running lse of -inf (nothing
  // merged yet) takes the block alone, never reading out's old values.
  float* lp = at(lse, b, i) + h;
  const float old = *lp, blk = m + logf(l);
  __syncwarp();  // every lane has read the old lse before lane 0 replaces it
  float* o = at(out, b, i) + int64_t(h) * hs;
  if (old == -INFINITY) {
#pragma unroll
    for (int u = 0; u < kSlots; ++u) {
      const int c = lane + 32 * u;
      if (c < hs) o[c] = acc[u] / l;
    }
    if (lane == 0) *lp = blk;
    return;
  }
  const float mx = fmaxf(old, blk);
  const float e_old = expf(old - mx), e_blk = expf(blk - mx), sum = e_old + e_blk;
  const float keep = e_old / sum, add = e_blk / (sum * l);
#pragma unroll
  for (int u = 0; u < kSlots; ++u) {
    const int c = lane + 32 * u;
    if (c < hs) o[c] = o[c] * keep + acc[u] * add;
  }
  if (lane == 0) *lp = mx + logf(sum);
}

// delta (b, i, h) = dout · out over the head's hs channels; a warp per row.
__global__ void __launch_bounds__(kThreads)
    block_delta_kernel(RowsOut delta, RowsIn dout, RowsIn out, int B, int Tq, int NH, int hs) {
  const int lane = int(threadIdx.x & 31), warp = int(threadIdx.x >> 5);
  const int64_t row = int64_t(blockIdx.x) * kWarps + warp;
  if (row >= int64_t(B) * Tq * NH) return;
  const int h = int(row % NH), i = int(row / NH % Tq), b = int(row / NH / Tq);
  const float* dy = at(dout, b, i) + int64_t(h) * hs;
  const float* y = at(out, b, i) + int64_t(h) * hs;
  float acc = 0.0f;
  for (int c = lane; c < hs; c += 32) acc = fmaf(dy[c], y[c], acc);
  acc = warp_sum(acc);
  if (lane == 0) at(delta, b, i)[h] = acc;
}

// dq += scale · sum_j dS_ij k_j with dS_ij = p_ij (dout_i · v_j - delta_i); a warp per query row
// i of head h of sequence b, i fastest.
__global__ void __launch_bounds__(kThreads)
    block_backward_q_kernel(RowsOut dq, RowsIn dout, RowsIn delta, RowsIn lse, RowsIn q, RowsIn k,
                            RowsIn v, Sizes z) {
  __shared__ float sq[kWarps][kAttentionMaxHeadSize], sdy[kWarps][kAttentionMaxHeadSize];
  const QueryRow w(z);
  if (!w.valid) return;
  const int lane = w.lane, warp = w.warp, i = w.i, h = w.h, b = w.b;
  const int hs = z.hs, kv = (h / z.G) * hs, n = z.keys(i);
  float* qs = sq[warp];
  float* dys = sdy[warp];
  stage(qs, at(q, b, i) + int64_t(h) * hs, hs, z.scale);
  stage(dys, at(dout, b, i) + int64_t(h) * hs, hs, 1.0f);
  __syncwarp();
  const float l = at(lse, b, i)[h], dl = at(delta, b, i)[h];

  float acc[kSlots] = {};
  for (int j0 = 0; j0 < n; j0 += 32) {
    const int j = j0 + lane, count = min(32, n - j0);
    float ds = 0.0f;
    if (j < n) {
      const float p = expf(dot(qs, at(k, b, j) + kv, hs) - l);
      ds = p * (dot(dys, at(v, b, j) + kv, hs) - dl);
    }
    add_tile(acc, ds, count, hs, at(k, b, j0) + kv, k.row);
  }
  float* g = at(dq, b, i) + int64_t(h) * hs;
#pragma unroll
  for (int u = 0; u < kSlots; ++u) {
    const int c = lane + 32 * u;
    if (c < hs) g[c] += z.scale * acc[u];
  }
}

// dv_j += sum_i p_ij dout_i and dk_j += scale · sum_i dS_ij q_i over the query heads of key/value
// head g (in order) and the queries that see key j; a warp per key row j of head g of
// sequence b, j fastest.
__global__ void __launch_bounds__(kThreads)
    block_backward_kv_kernel(RowsOut dk, RowsOut dv, RowsIn dout, RowsIn delta, RowsIn lse,
                             RowsIn q, RowsIn k, RowsIn v, Sizes z) {
  __shared__ float sk[kWarps][kAttentionMaxHeadSize], sv[kWarps][kAttentionMaxHeadSize];
  const int KVH = z.NH / z.G;
  const int lane = int(threadIdx.x & 31), warp = int(threadIdx.x >> 5);
  const int64_t row = int64_t(blockIdx.x) * kWarps + warp;
  if (row >= int64_t(z.B) * z.Tk * KVH) return;
  const int j = int(row % z.Tk), g = int(row / z.Tk % KVH), b = int(row / z.Tk / KVH);
  const int hs = z.hs, kv = g * hs, i_first = z.first(j);
  float* ks = sk[warp];
  float* vs = sv[warp];
  stage(ks, at(k, b, j) + kv, hs, z.scale);
  stage(vs, at(v, b, j) + kv, hs, 1.0f);
  __syncwarp();

  float adk[kSlots] = {}, adv[kSlots] = {};
  for (int h = g * z.G; h < (g + 1) * z.G; ++h) {
    const int64_t qc = int64_t(h) * hs;
    for (int i0 = i_first; i0 < z.Tq; i0 += 32) {
      const int i = i0 + lane, count = min(32, z.Tq - i0);
      float p = 0.0f, ds = 0.0f;
      if (i < z.Tq) {
        p = expf(dot(ks, at(q, b, i) + qc, hs) - at(lse, b, i)[h]);
        ds = p * (dot(vs, at(dout, b, i) + qc, hs) - at(delta, b, i)[h]);
      }
      add_tile(adv, p, count, hs, at(dout, b, i0) + qc, dout.row);
      add_tile(adk, ds, count, hs, at(q, b, i0) + qc, q.row);
    }
  }
  float* gk = at(dk, b, j) + kv;
  float* gv = at(dv, b, j) + kv;
#pragma unroll
  for (int u = 0; u < kSlots; ++u) {
    const int c = lane + 32 * u;
    if (c < hs) {
      gk[c] += z.scale * adk[u];
      gv[c] += adv[u];
    }
  }
}

Sizes sizes(int B, int Tq, int Tk, int C, int NH, int KVH, bool causal) {
  const int hs = C / NH;
  return {B, Tq, Tk, NH, NH / KVH, hs, causal, 1.0f / std::sqrt(float(hs))};
}

unsigned blocks(int64_t rows) { return unsigned((rows + kWarps - 1) / kWarps); }

}  // namespace

void attention_block_forward(RowsOut out, RowsOut lse, RowsIn q, RowsIn k, RowsIn v, int B, int Tq,
                             int Tk, int C, int NH, int KVH, bool causal) {
  const int64_t rows = int64_t(B) * Tq * NH;
  if (rows == 0 || Tk == 0) return;
  block_forward_kernel<<<blocks(rows), kThreads, 0, compute_stream()>>>(
      out, lse, q, k, v, sizes(B, Tq, Tk, C, NH, KVH, causal));
  check_launch("attention block forward");
}

void attention_block_delta(RowsOut delta, RowsIn dout, RowsIn out, int B, int Tq, int C, int NH) {
  const int64_t rows = int64_t(B) * Tq * NH;
  if (rows == 0) return;
  block_delta_kernel<<<blocks(rows), kThreads, 0, compute_stream()>>>(delta, dout, out, B, Tq, NH,
                                                                      C / NH);
  check_launch("attention block delta");
}

void attention_block_backward(RowsOut dq, RowsOut dk, RowsOut dv, RowsIn dout, RowsIn delta,
                              RowsIn lse, RowsIn q, RowsIn k, RowsIn v, int B, int Tq, int Tk,
                              int C, int NH, int KVH, bool causal) {
  if (int64_t(B) * Tq * Tk == 0) return;
  const Sizes z = sizes(B, Tq, Tk, C, NH, KVH, causal);
  block_backward_q_kernel<<<blocks(int64_t(B) * Tq * NH), kThreads, 0, compute_stream()>>>(
      dq, dout, delta, lse, q, k, v, z);
  check_launch("attention block backward dq");
  block_backward_kv_kernel<<<blocks(int64_t(B) * Tk * KVH), kThreads, 0, compute_stream()>>>(
      dk, dv, dout, delta, lse, q, k, v, z);
  check_launch("attention block backward dk, dv");
}

}  // namespace tetra::cuda::launch
