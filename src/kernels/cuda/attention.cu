// Causal flash attention in f32 on the SIMT cores: no T×T matrix is ever stored. Forward keeps
// the scaled row log-sum-exp (B,NH,T) for backward; backward recomputes the probabilities from it.
//
// Heads (Layout below): qkv rows are [q (NH·hs) | k (KVH·hs) | v (KVH·hs)], W columns; with
// grouped-query attention (KVH < NH) the G = NH/KVH query heads gG .. gG + G - 1 share key/value
// head g, so query head h reads kv head h / G. KVH == NH is multi-head attention (W = 3C).
//
// Tiling (all three kernels): a block of 256 threads owns one (batch, head) and a tile of 64 query
// or key rows; q, k, v and dout tiles (64, hs) are staged in shared memory with an odd row stride
// (hs | 1), so the 16 rows a warp reads at one head dimension fall in 16 different banks. Thread
// (tr, tc) = (tid / 16, tid % 16) computes the 4×4 scores of rows tr + 16i and columns tc + 16j
// (i, j < 4) and accumulates outputs for rows tr + 16i and head dimensions tc + 16jj (jj < 8, so
// hs <= 128). The 16 threads of a row are one half-warp: row maxima and sums are butterfly
// shuffles within it, which give every lane the same bits. Rows past T are loaded as zeros and
// masked, so any T and any hs from 1 to 128 work.
//
// Forward: per query tile, key tiles 0.. up to the diagonal with the online softmax (running max
// m and sum l per row, the output rescaled when m grows). A masked score is -inf and contributes
// exactly 0.
//
// Backward (FlashAttention-2 with D = rowsum(dout * out); under mixed precision D = rowsum(P * dP),
// see flash_backward_dvec_kernel), deterministic without atomics:
// one kernel per (key tile, kv head) walks, for each query head of the kv head's group in order,
// the query tiles from the diagonal down, and accumulates dK and dV of the whole group in
// registers (so grouped-query attention needs no atomics and no second reduction pass); a second
// kernel per (query tile, query head) walks the key tiles of its kv head and accumulates dQ. Each
// output element is summed by one thread in a fixed order, so results repeat bit for bit.
//
// Mixed precision (round_bf16): the operands of q·kᵀ, p·v, dout·vᵀ and pᵀ·dout are rounded to
// bf16 (as kernels/cpu/attention.cc rounds them for its bf16 products) and accumulated in f32;
// dq = dS·k and dk = dSᵀ·q take the f32 softmax gradient and f32 k and q, as the CPU does. The
// rounding happens while staging tiles, so the products themselves stay f32 FMAs.
#include <cuda_runtime.h>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"

namespace tetra::cuda::launch {

namespace {

constexpr int kTile = 64;                              // query and key rows per tile
constexpr int kThreads = 256;                          // 16 × 16
constexpr int kDimSlots = kAttentionMaxHeadSize / 16;  // head dimensions per thread: tc + 16 jj
constexpr int kPld = kTile + 1;  // row stride of the probability / score-gradient tile

static_assert(kThreads == 16 * 16 && kTile == 4 * 16, "thread (tr, tc) covers 4 rows × 4 columns");

// Where a head's columns lie in qkv (B,T,W) (and dqkv): offsets of row 0 of sequence b.
struct Layout {
  int T = 0, C = 0, NH = 0;
  int hs = 0;       // head size C / NH
  int group = 1;    // G: query heads per key/value head, NH / KVH
  int64_t W = 0;    // columns of a row: C + 2·KVH·hs
  int64_t kvw = 0;  // columns of k (and of v): KVH·hs

  Layout(int T_, int C_, int NH_, int KVH)
      : T(T_),
        C(C_),
        NH(NH_),
        hs(C_ / NH_),
        group(NH_ / KVH),
        W(int64_t(C_) + 2 * int64_t(KVH) * (C_ / NH_)),
        kvw(int64_t(KVH) * (C_ / NH_)) {}

  __device__ __forceinline__ int64_t row0(int b) const { return int64_t(b) * T * W; }
  /** Query head h. */
  __device__ __forceinline__ int64_t q(int b, int h) const { return row0(b) + int64_t(h) * hs; }
  /** Key head g (a kv head). */
  __device__ __forceinline__ int64_t k(int b, int g) const { return row0(b) + C + int64_t(g) * hs; }
  /** Value head g. */
  __device__ __forceinline__ int64_t v(int b, int g) const { return k(b, g) + kvw; }
  /** dout (B,T,C) and out: head h of sequence b, row 0. */
  __device__ __forceinline__ int64_t o(int b, int h) const {
    return int64_t(b) * T * C + int64_t(h) * hs;
  }
  /** The rows of (B,NH,T) statistics (lse, dvec) of sequence b, head h. */
  __device__ __forceinline__ int64_t stat(int b, int h) const { return (int64_t(b) * NH + h) * T; }
};

// Rows [t0, t0 + 64) of a (T, hs) slice with row stride `stride` (src points at row 0, column 0)
// into tile (64, ld); rows at or past T are zero. Columns past hs are never read.
__device__ __forceinline__ void load_tile(float* tile, int ld, const float* src, int64_t stride,
                                          int t0, int T, int hs, bool round) {
  for (int idx = threadIdx.x; idx < kTile * hs; idx += kThreads) {
    const int r = idx / hs, d = idx - r * hs;
    const int t = t0 + r;
    float v = 0.0f;
    if (t < T) v = src[int64_t(t) * stride + d];
    tile[r * ld + d] = round ? round_to_bf16(v) : v;
  }
}

// Reduction over the 16 lanes of a half-warp (lanes differing in the low 4 bits).
__device__ __forceinline__ float half_warp_max(float v) {
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}
__device__ __forceinline__ float half_warp_sum(float v) {
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

size_t forward_smem(int hs) {
  const int ld = hs | 1;
  return size_t(3 * kTile * ld + kTile * kPld) * sizeof(float);
}
size_t backward_kv_smem(int hs) {
  const int ld = hs | 1;
  return size_t(4 * kTile * ld + kTile * kPld + 2 * kTile) * sizeof(float);
}
size_t backward_q_smem(int hs) {
  const int ld = hs | 1;
  return size_t(4 * kTile * ld + kTile * kPld) * sizeof(float);
}

// grid (query tiles, NH, B); query tiles in reverse so the longest (last) start first.
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(float* out, float* lse, const float* qkv, const Layout lay, float scale,
                         bool round) {
  extern __shared__ float smem[];
  const int T = lay.T, hs = lay.hs, ld = hs | 1;
  const int64_t W = lay.W;
  float* Qs = smem;
  float* Ks = Qs + kTile * ld;
  float* Vs = Ks + kTile * ld;
  float* Ps = Vs + kTile * ld;
  const int tid = threadIdx.x, tr = tid >> 4, tc = tid & 15;
  const int h = blockIdx.y, b = blockIdx.z;
  const int q0 = int(gridDim.x - 1 - blockIdx.x) * kTile;
  const int g = h / lay.group;
  const float* qb = qkv + lay.q(b, h);  // row 0 of this head's q
  const float* kb = qkv + lay.k(b, g);  // ... of its kv head's k and v
  const float* vb = qkv + lay.v(b, g);
  const bool want_out = out != nullptr;

  load_tile(Qs, ld, qb, W, q0, T, hs, round);

  float m[4], l[4], o[4][kDimSlots];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
#pragma unroll
    for (int jj = 0; jj < kDimSlots; ++jj) o[i][jj] = 0.0f;
  }

  const int q_end = min(q0 + kTile, T);
  for (int k0 = 0; k0 < q_end; k0 += kTile) {
    __syncthreads();  // the previous tile's readers are done with Ks, Vs and Ps
    load_tile(Ks, ld, kb, W, k0, T, hs, round);
    if (want_out) load_tile(Vs, ld, vb, W, k0, T, hs, round);
    __syncthreads();

    float s[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) s[i][j] = 0.0f;
    }
    for (int d = 0; d < hs; ++d) {
      float qv[4], kv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) qv[i] = Qs[(tr + 16 * i) * ld + d];
#pragma unroll
      for (int j = 0; j < 4; ++j) kv[j] = Ks[(tc + 16 * j) * ld + d];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) s[i][j] = fmaf(qv[i], kv[j], s[i][j]);
      }
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int qi = q0 + tr + 16 * i;
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int kj = k0 + tc + 16 * j;
        s[i][j] = (qi < T && kj <= qi) ? __fmul_rn(s[i][j], scale) : -INFINITY;
        mx = fmaxf(mx, s[i][j]);
      }
      mx = half_warp_max(mx);
      const float m_new = fmaxf(m[i], mx);
      // m[i] = -inf only before the row's first key (then l and o are 0) or for rows past T.
      const float alpha = m[i] == -INFINITY ? 0.0f : expf(m[i] - m_new);
      float row_sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float p = s[i][j] == -INFINITY ? 0.0f : expf(s[i][j] - m_new);
        s[i][j] = p;
        row_sum += p;
      }
      l[i] = l[i] * alpha + row_sum;  // this thread's columns; summed over the row at the end
      m[i] = m_new;
#pragma unroll
      for (int jj = 0; jj < kDimSlots; ++jj) o[i][jj] *= alpha;
    }

    if (want_out) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          Ps[(tr + 16 * i) * kPld + tc + 16 * j] = round ? round_to_bf16(s[i][j]) : s[i][j];
        }
      }
      __syncthreads();
      const int k_rows = min(kTile, T - k0);
      for (int c = 0; c < k_rows; ++c) {
        float pv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) pv[i] = Ps[(tr + 16 * i) * kPld + c];
#pragma unroll
        for (int jj = 0; jj < kDimSlots; ++jj) {
          const int d = tc + 16 * jj;
          if (d < hs) {
            const float vv = Vs[c * ld + d];
#pragma unroll
            for (int i = 0; i < 4; ++i) o[i][jj] = fmaf(pv[i], vv, o[i][jj]);
          }
        }
      }
    }
  }

  const int64_t stat0 = lay.stat(b, h);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float l_row = half_warp_sum(l[i]);
    const int qi = q0 + tr + 16 * i;
    if (qi >= T) continue;
    if (tc == 0) lse[stat0 + qi] = m[i] + logf(l_row);
    if (want_out) {
      float* y = out + lay.o(b, h) + int64_t(qi) * lay.C;
      const float inv = 1.0f / l_row;
#pragma unroll
      for (int jj = 0; jj < kDimSlots; ++jj) {
        const int d = tc + 16 * jj;
        if (d < hs) y[d] = o[i][jj] * inv;
      }
    }
  }
}

// dvec (B,NH,T) = rowsum(dout * out) per head: one thread per (b, t, h), summing over d in order
// with FMAs exactly as the backward kernels form dP = dout . v. Where the softmax is one-hot
// (T = 1, or a row whose other probabilities underflow) out equals that value row bit for bit, so
// D equals dP and dS = P (dP - D) is exactly 0, as the CPU's softmax backward gives.
__global__ void attention_dvec_kernel(float* dvec, const float* dout, const float* out, int B,
                                      int T, int C, int NH) {
  const int64_t rows = int64_t(B) * T * NH;
  const int hs = C / NH;
  for (int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; row < rows;
       row += int64_t(gridDim.x) * blockDim.x) {
    const int h = int(row % NH);
    const int64_t bt = row / NH;
    const float* dy = dout + bt * C + h * hs;
    const float* y = out + bt * C + h * hs;
    float acc = 0.0f;
    for (int d = 0; d < hs; ++d) acc = fmaf(dy[d], y[d], acc);
    const int64_t b = bt / T, t = bt % T;
    dvec[(b * NH + h) * T + t] = acc;
  }
}

// The thread's scores s = q·kᵀ and dP = dout·vᵀ (rows tr + 16i, key columns tc + 16j) over the
// head dimensions, in order, from tiles in shared memory. Under mixed precision the operands are
// bf16 values: q and k are rounded here when their tile keeps them f32 for dK or dQ (round_q,
// round_k), dout and v were rounded when staged. Every backward kernel forms them with this one
// loop, so they agree bit for bit.
__device__ __forceinline__ void scores_and_dp(float (&s)[4][4], float (&dp)[4][4], const float* Qs,
                                              const float* dOs, const float* Ks, const float* Vs,
                                              int ld, int hs, int tr, int tc, bool round_q,
                                              bool round_k) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) s[i][j] = dp[i][j] = 0.0f;
  }
  for (int d = 0; d < hs; ++d) {
    float qv[4], ov[4], kv[4], vv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float q = Qs[(tr + 16 * i) * ld + d];
      qv[i] = round_q ? round_to_bf16(q) : q;
      ov[i] = dOs[(tr + 16 * i) * ld + d];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float k = Ks[(tc + 16 * j) * ld + d];
      kv[j] = round_k ? round_to_bf16(k) : k;
      vv[j] = Vs[(tc + 16 * j) * ld + d];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[i][j] = fmaf(qv[i], kv[j], s[i][j]);
        dp[i][j] = fmaf(ov[i], vv[j], dp[i][j]);
      }
    }
  }
}

// Mixed precision: dvec (B,NH,T) = rowsum(P * dP) over the row's keys, the probabilities and
// dP = dout · vᵀ exactly as the dK/dV and dQ kernels form them (bf16 operands, f32 sums, the same
// FMA order), so that every row of dS = P (dP - D) sums to zero but for rounding, as the CPU's
// softmax backward gives: rowsum(dout * out) differs from it by the bf16 rounding of the
// probabilities in forward's p·v, and the key bias (whose true gradient is the column sum of those
// rows, zero) would collect that noise for AdamW to turn into updates of order lr. grid (query
// tiles, NH, B), reversed as in forward; each thread sums its columns in key order, then the
// half-warp of a row adds the 16 partial sums in a fixed butterfly.
__global__ void __launch_bounds__(kThreads)
    flash_backward_dvec_kernel(float* dvec, const float* dout, const float* qkv, const float* lse,
                               const Layout lay, float scale) {
  extern __shared__ float smem[];
  const int T = lay.T, C = lay.C, hs = lay.hs, ld = hs | 1;
  const int64_t W = lay.W;
  float* Qs = smem;
  float* dOs = Qs + kTile * ld;
  float* Ks = dOs + kTile * ld;
  float* Vs = Ks + kTile * ld;
  const int tid = threadIdx.x, tr = tid >> 4, tc = tid & 15;
  const int h = blockIdx.y, b = blockIdx.z;
  const int q0 = int(gridDim.x - 1 - blockIdx.x) * kTile;
  const int g = h / lay.group;
  const float* qb = qkv + lay.q(b, h);
  const float* kb = qkv + lay.k(b, g);
  const float* vb = qkv + lay.v(b, g);
  const float* dy = dout + lay.o(b, h);
  const int64_t stat0 = lay.stat(b, h);

  load_tile(Qs, ld, qb, W, q0, T, hs, true);
  load_tile(dOs, ld, dy, C, q0, T, hs, true);
  float lrow[4], acc[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int qi = q0 + tr + 16 * i;
    lrow[i] = qi < T ? lse[stat0 + qi] : 0.0f;
    acc[i] = 0.0f;
  }
  const int q_end = min(q0 + kTile, T);
  for (int k0 = 0; k0 < q_end; k0 += kTile) {
    __syncthreads();
    load_tile(Ks, ld, kb, W, k0, T, hs, true);
    load_tile(Vs, ld, vb, W, k0, T, hs, true);
    __syncthreads();
    float s[4][4], dp[4][4];
    scores_and_dp(s, dp, Qs, dOs, Ks, Vs, ld, hs, tr, tc, false, false);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int qi = q0 + tr + 16 * i;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int kj = k0 + tc + 16 * j;
        if (qi < T && kj <= qi) {
          acc[i] = fmaf(expf(__fmul_rn(s[i][j], scale) - lrow[i]), dp[i][j], acc[i]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float D = half_warp_sum(acc[i]);
    const int qi = q0 + tr + 16 * i;
    if (tc == 0 && qi < T) dvec[stat0 + qi] = D;
  }
}

// dK and dV of one key tile of one kv head: grid (key tiles, KVH, B). For each query head of the
// kv head's group in order (G = NH/KVH; one with multi-head attention), walks the query tiles
// from the key tile's own (the first that can see its keys) to the end, accumulating into the
// same registers: the group's sum in a fixed order, written once.
__global__ void __launch_bounds__(kThreads)
    flash_backward_kv_kernel(float* dqkv, const float* dout, const float* qkv, const float* lse,
                             const float* dvec, const Layout lay, float scale, bool round) {
  extern __shared__ float smem[];
  const int T = lay.T, C = lay.C, hs = lay.hs, ld = hs | 1;
  const int64_t W = lay.W;
  float* Ks = smem;
  float* Vs = Ks + kTile * ld;
  float* Qs = Vs + kTile * ld;
  float* dOs = Qs + kTile * ld;
  float* Ps = dOs + kTile * ld;
  float* Ls = Ps + kTile * kPld;
  float* Ds = Ls + kTile;
  const int tid = threadIdx.x, tr = tid >> 4, tc = tid & 15;
  const int g = blockIdx.y, b = blockIdx.z;
  const int k0 = int(blockIdx.x) * kTile;

  // k and v only meet bf16 products; q stays f32 for dK and is rounded where q·kᵀ reads it.
  load_tile(Ks, ld, qkv + lay.k(b, g), W, k0, T, hs, round);
  load_tile(Vs, ld, qkv + lay.v(b, g), W, k0, T, hs, round);

  float dk[4][kDimSlots], dv[4][kDimSlots];  // key rows tr + 16i, dims tc + 16jj
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int jj = 0; jj < kDimSlots; ++jj) dk[i][jj] = dv[i][jj] = 0.0f;
  }

  const int h_end = (g + 1) * lay.group;
  for (int h = g * lay.group; h < h_end; ++h) {
    const float* qb = qkv + lay.q(b, h);
    const float* dy = dout + lay.o(b, h);
    const int64_t stat0 = lay.stat(b, h);
    for (int q0 = k0; q0 < T; q0 += kTile) {
      __syncthreads();  // the previous query tile's readers are done
      load_tile(Qs, ld, qb, W, q0, T, hs, false);
      load_tile(dOs, ld, dy, C, q0, T, hs, round);
      for (int r = tid; r < kTile; r += kThreads) {
        const int t = q0 + r;
        Ls[r] = t < T ? lse[stat0 + t] : 0.0f;
        Ds[r] = t < T ? dvec[stat0 + t] : 0.0f;
      }
      __syncthreads();

      // Scores (query rows tr + 16i, key columns tc + 16j) and dP = dout · vᵀ.
      float s[4][4], dp[4][4];
      scores_and_dp(s, dp, Qs, dOs, Ks, Vs, ld, hs, tr, tc, round, false);
      // P = exp(s * scale - lse); dS = scale * P * (dP - D), as the CPU's softmax backward.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int qr = tr + 16 * i, qi = q0 + qr;
        const float lse_r = Ls[qr], Dv = Ds[qr];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int kj = k0 + tc + 16 * j;
          float p = 0.0f, ds = 0.0f;
          if (qi < T && kj <= qi) {
            p = expf(__fmul_rn(s[i][j], scale) - lse_r);
            ds = __fmul_rn(scale, p) * (dp[i][j] - Dv);
          }
          s[i][j] = p;
          dp[i][j] = ds;
        }
      }

      // dV += Pᵀ · dout
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          Ps[(tr + 16 * i) * kPld + tc + 16 * j] = round ? round_to_bf16(s[i][j]) : s[i][j];
        }
      }
      __syncthreads();
      const int q_rows = min(kTile, T - q0);
      for (int r = 0; r < q_rows; ++r) {
        float pv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) pv[i] = Ps[r * kPld + tr + 16 * i];
#pragma unroll
        for (int jj = 0; jj < kDimSlots; ++jj) {
          const int d = tc + 16 * jj;
          if (d < hs) {
            const float go = dOs[r * ld + d];
#pragma unroll
            for (int i = 0; i < 4; ++i) dv[i][jj] = fmaf(pv[i], go, dv[i][jj]);
          }
        }
      }
      __syncthreads();

      // dK += dSᵀ · q (f32)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) Ps[(tr + 16 * i) * kPld + tc + 16 * j] = dp[i][j];
      }
      __syncthreads();
      for (int r = 0; r < q_rows; ++r) {
        float dsv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) dsv[i] = Ps[r * kPld + tr + 16 * i];
#pragma unroll
        for (int jj = 0; jj < kDimSlots; ++jj) {
          const int d = tc + 16 * jj;
          if (d < hs) {
            const float q = Qs[r * ld + d];
#pragma unroll
            for (int i = 0; i < 4; ++i) dk[i][jj] = fmaf(dsv[i], q, dk[i][jj]);
          }
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int kj = k0 + tr + 16 * i;
    if (kj >= T) continue;
    float* dk_row = dqkv + lay.k(b, g) + int64_t(kj) * W;
    float* dv_row = dqkv + lay.v(b, g) + int64_t(kj) * W;
#pragma unroll
    for (int jj = 0; jj < kDimSlots; ++jj) {
      const int d = tc + 16 * jj;
      if (d < hs) {
        dk_row[d] = dk[i][jj];
        dv_row[d] = dv[i][jj];
      }
    }
  }
}

// dQ of one query tile: grid (query tiles, NH, B), reversed as in forward. Walks the key tiles of
// the query head's kv head up to the diagonal.
__global__ void __launch_bounds__(kThreads)
    flash_backward_q_kernel(float* dqkv, const float* dout, const float* qkv, const float* lse,
                            const float* dvec, const Layout lay, float scale, bool round) {
  extern __shared__ float smem[];
  const int T = lay.T, C = lay.C, hs = lay.hs, ld = hs | 1;
  const int64_t W = lay.W;
  float* Qs = smem;
  float* dOs = Qs + kTile * ld;
  float* Ks = dOs + kTile * ld;
  float* Vs = Ks + kTile * ld;
  float* Ps = Vs + kTile * ld;
  const int tid = threadIdx.x, tr = tid >> 4, tc = tid & 15;
  const int h = blockIdx.y, b = blockIdx.z;
  const int q0 = int(gridDim.x - 1 - blockIdx.x) * kTile;
  const int g = h / lay.group;
  const float* kb = qkv + lay.k(b, g);
  const float* vb = qkv + lay.v(b, g);
  const float* dy = dout + lay.o(b, h);
  const int64_t stat0 = lay.stat(b, h);

  // q only meets q·kᵀ here; k stays f32 for dQ and is rounded where q·kᵀ reads it.
  load_tile(Qs, ld, qkv + lay.q(b, h), W, q0, T, hs, round);
  load_tile(dOs, ld, dy, C, q0, T, hs, round);
  float lrow[4], Dv[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int qi = q0 + tr + 16 * i;
    lrow[i] = qi < T ? lse[stat0 + qi] : 0.0f;
    Dv[i] = qi < T ? dvec[stat0 + qi] : 0.0f;
  }

  float dq[4][kDimSlots];  // query rows tr + 16i, dims tc + 16jj
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int jj = 0; jj < kDimSlots; ++jj) dq[i][jj] = 0.0f;
  }

  const int q_end = min(q0 + kTile, T);
  for (int k0 = 0; k0 < q_end; k0 += kTile) {
    __syncthreads();
    load_tile(Ks, ld, kb, W, k0, T, hs, false);
    load_tile(Vs, ld, vb, W, k0, T, hs, round);
    __syncthreads();

    float s[4][4], dp[4][4];
    scores_and_dp(s, dp, Qs, dOs, Ks, Vs, ld, hs, tr, tc, false, round);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int qi = q0 + tr + 16 * i;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int kj = k0 + tc + 16 * j;
        float ds = 0.0f;
        if (qi < T && kj <= qi) {
          const float p = expf(__fmul_rn(s[i][j], scale) - lrow[i]);
          ds = __fmul_rn(scale, p) * (dp[i][j] - Dv[i]);
        }
        Ps[(tr + 16 * i) * kPld + tc + 16 * j] = ds;
      }
    }
    __syncthreads();

    // dQ += dS · k (f32)
    const int k_rows = min(kTile, T - k0);
    for (int c = 0; c < k_rows; ++c) {
      float dsv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) dsv[i] = Ps[(tr + 16 * i) * kPld + c];
#pragma unroll
      for (int jj = 0; jj < kDimSlots; ++jj) {
        const int d = tc + 16 * jj;
        if (d < hs) {
          const float k = Ks[c * ld + d];
#pragma unroll
          for (int i = 0; i < 4; ++i) dq[i][jj] = fmaf(dsv[i], k, dq[i][jj]);
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int qi = q0 + tr + 16 * i;
    if (qi >= T) continue;
    float* row = dqkv + lay.q(b, h) + int64_t(qi) * W;
#pragma unroll
    for (int jj = 0; jj < kDimSlots; ++jj) {
      const int d = tc + 16 * jj;
      if (d < hs) row[d] = dq[i][jj];
    }
  }
}

// Opts each flash kernel in to the shared memory its largest head size needs, once; returns the
// device's per-block limit.
int configure_shared_memory() {
  static const int optin = [] {
    int device = 0, limit = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    check(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
          "cudaDeviceGetAttribute (shared memory per block)");
    const int hs = kAttentionMaxHeadSize;
    const size_t need[4] = {forward_smem(hs), backward_kv_smem(hs), backward_q_smem(hs),
                            backward_q_smem(hs)};
    const void* kernels[4] = {reinterpret_cast<const void*>(&flash_forward_kernel),
                              reinterpret_cast<const void*>(&flash_backward_kv_kernel),
                              reinterpret_cast<const void*>(&flash_backward_q_kernel),
                              reinterpret_cast<const void*>(&flash_backward_dvec_kernel)};
    for (int i = 0; i < 4; ++i) {
      const int bytes = int(need[i]) < limit ? int(need[i]) : limit;
      check(cudaFuncSetAttribute(kernels[i], cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
            "cudaFuncSetAttribute (attention shared memory)");
    }
    return limit;
  }();
  return optin;
}

// Every sm_80+ GPU has room for head size 128 (at most 149 KiB); a smaller one fails here with a
// CUDA error rather than launching with too little.
void check_smem(size_t bytes, const char* what) {
  if (bytes > size_t(configure_shared_memory())) check(cudaErrorInvalidConfiguration, what);
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH,
                       int KVH, bool round_bf16) {
  if (B <= 0 || T <= 0) return;
  const Layout layout(T, C, NH, KVH);
  const int hs = layout.hs;
  const size_t smem = forward_smem(hs);
  check_smem(smem, "attention forward: shared memory for this head size");
  const dim3 grid(unsigned((T + kTile - 1) / kTile), unsigned(NH), unsigned(B));
  const float scale = 1.0f / sqrtf(float(hs));
  flash_forward_kernel<<<grid, kThreads, smem, compute_stream()>>>(out, lse, qkv, layout, scale,
                                                                   round_bf16);
  check_launch(out ? "attention forward" : "attention recompute");
}

void attention_backward(float* dqkv, float* dvec, const float* dout, const float* qkv,
                        const float* out, const float* lse, int B, int T, int C, int NH, int KVH,
                        bool round_bf16) {
  if (B <= 0 || T <= 0) return;
  const cudaStream_t s = compute_stream();
  const Layout layout(T, C, NH, KVH);
  const int hs = layout.hs;
  const float scale = 1.0f / sqrtf(float(hs));
  const unsigned tiles = unsigned((T + kTile - 1) / kTile);
  const dim3 grid(tiles, unsigned(NH), unsigned(B));      // per query head
  const dim3 kv_grid(tiles, unsigned(KVH), unsigned(B));  // per kv head
  const size_t kv_smem = backward_kv_smem(hs), q_smem = backward_q_smem(hs);
  if (round_bf16) {
    check_smem(q_smem, "attention backward: shared memory for this head size");
    flash_backward_dvec_kernel<<<grid, kThreads, q_smem, s>>>(dvec, dout, qkv, lse, layout, scale);
    check_launch("attention backward (rowsum(P * dP))");
  } else {
    const int64_t rows = int64_t(B) * T * NH;
    attention_dvec_kernel<<<grid_for(rows, 256), 256, 0, s>>>(dvec, dout, out, B, T, C, NH);
    check_launch("attention backward (rowsum(dout * out))");
  }
  check_smem(kv_smem, "attention backward: shared memory for this head size");
  flash_backward_kv_kernel<<<kv_grid, kThreads, kv_smem, s>>>(dqkv, dout, qkv, lse, dvec, layout,
                                                              scale, round_bf16);
  check_launch("attention backward (dk, dv)");
  check_smem(q_smem, "attention backward: shared memory for this head size");
  flash_backward_q_kernel<<<grid, kThreads, q_smem, s>>>(dqkv, dout, qkv, lse, dvec, layout, scale,
                                                         round_bf16);
  check_launch("attention backward (dq)");
}

}  // namespace tetra::cuda::launch
