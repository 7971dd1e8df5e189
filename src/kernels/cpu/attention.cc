#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/error.h"
#include "core/profile.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/vec_math.h"

namespace tetra::cpu {

namespace {

using Strides = std::array<int64_t, 4>;

// The shape itself, once checked: NH must divide C and KVH divide NH.
const AttentionShape& checked(const AttentionShape& s) {
  const int kvh = s.kv_heads();
  TETRA_CHECK(
      s.NH > 0 && s.C % s.NH == 0 && kvh > 0 && s.NH % kvh == 0,
      "[attention] C = {}, NH = {}, {} key/value heads: NH must divide C, and the key/value "
      "heads must divide NH",
      s.C, s.NH, kvh);
  return s;
}

// The sizes of one call. Query head h = kvh·G + j reads key/value head kvh.
struct Geometry {
  int B, T, C, NH, KVH, G, hs;
  int64_t W, KV, TT;  // a row of qkv; the columns of k (and of v); T·T

  explicit Geometry(const AttentionShape& s)
      : B(checked(s).B),
        T(s.T),
        C(s.C),
        NH(s.NH),
        KVH(s.kv_heads()),
        G(s.NH / s.kv_heads()),
        hs(s.head_size()),
        W(s.width()),
        KV(s.kv_width()),
        TT(int64_t(s.T) * s.T) {}
  // (b, head, t, d) strides of heads `head` apart in rows of `width`; transposed swaps t and d.
  Strides heads(int64_t width, int64_t head, bool transposed = false) const {
    return transposed ? Strides{T * width, head, 1, width} : Strides{T * width, head, width, 1};
  }
  // The query heads j, j + G, ... of qkv (or dqkv) batched over (B, KVH), and the key or value
  // heads.
  Strides q() const { return heads(W, int64_t(G) * hs); }
  Strides kv(bool transposed = false) const { return heads(W, hs, transposed); }
  // The probabilities (B,NH,T,T) of query heads j, j + G, ...
  Strides att(bool transposed = false) const {
    return transposed ? Strides{NH * TT, G * TT, 1, T} : Strides{NH * TT, G * TT, T, 1};
  }
};

// Query rows are processed in blocks of kCausalBlock: block [q0, q1) only meets keys [0, q1), so
// the products skip most of the masked upper triangle (25% of the work at T = 128, ~47% at 1024).
constexpr int kCausalBlock = 64;

// The columns of (.., T) row t that its block's products read: [0, end of the block).
int block_end(int t, int T) { return std::min(T, (t / kCausalBlock + 1) * kCausalBlock); }

// A product operand's base: `data` of dtype `t` (the model's F, or bf16 under mixed precision);
// at(n) is the same buffer n elements on. Each product gives its own strides.
struct Operand {
  const void* data;
  DType t;
  Operand at(int64_t offset) const {
    return {static_cast<const char*>(data) + offset * int64_t(dtype_size(t)), t};
  }
};

template <typename F>
Operand operand(const F* p) {
  return {p, dtype_of<F>()};
}

void product(const char* role, int B, int heads, int64_t M, int64_t N, int64_t K, Operand a,
             Strides sa, Operand b, Strides sb, void* c, Strides sc, bool accumulate = false) {
  MatmulArgs x;
  x.role = role;
  x.accumulate = accumulate;
  x.b0 = B, x.b1 = heads, x.M = M, x.N = N, x.K = K;
  x.a = {a.data, sa, a.t};
  x.b = {b.data, sb, b.t};
  x.c = c;
  x.c_strides = sc;
  matmul(x);
}

// Mixed precision: scratch for the bf16 copies of qkv (B,T,W) in forward, or of v (B,T,KVH·hs)
// and dout (B,T,C) in backward, in one region, and of the probabilities (B,NH,T,T) in the other.
struct Bf16Scratch {
  bf16 *rows, *att;
};

Bf16Scratch take(Bf16Operands& ops, const Geometry& g) {
  const auto [rows, att] =
      ops.take(size_t(g.B) * g.T * g.W, size_t(g.B) * g.NH * g.TT);  // attention_bf16_elements
  return {rows, att};
}

template <typename F>
void check_bf16(const Bf16Operands* bf16) {
  constexpr bool f32 = std::is_same_v<F, float>;
  TETRA_CHECK(!bf16 || f32, "[attention] mixed precision takes f32 activations");
}

// preatt = q · k^T by causal blocks, then the scaled causal softmax in place. `qkv` is the model's
// buffer or its bf16 copy; att16 (null in f32) receives the probabilities rounded to bf16 as well.
template <typename F>
void probs(F* att, Operand qkv, bf16* att16, const Geometry& g) {
  const ProfileScope profile(ProfKind::attention, "causal softmax");
  const int T = g.T;
  // preatt (B,NH,T,T) = q · k^T, the causal part only (row block [q0,q1) against keys [0,q1))
  for (int q0 = 0; q0 < T; q0 += kCausalBlock) {
    const int q1 = std::min(T, q0 + kCausalBlock);
    for (int j = 0; j < g.G; ++j) {
      product("attention q.k^T", g.B, g.KVH, q1 - q0, q1, g.hs, qkv.at(q0 * g.W + j * g.hs), g.q(),
              qkv.at(g.C), g.kv(true), att + int64_t(q0) * T + j * g.TT, g.att());
    }
  }

  const F scale = F(1) / std::sqrt(F(g.hs));
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < int64_t(g.B) * g.NH * T; ++row) {
    int t = int(row % T);
    F* a = att + row * T;
    F mx = a[0] * scale;
#pragma omp simd reduction(max : mx)
    for (int j = 1; j <= t; ++j) mx = std::max(mx, a[j] * scale);
    F sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j <= t; ++j) {
      F e = exp_approx(a[j] * scale - mx);
      a[j] = e;
      sum += e;
    }
    F inv = F(1) / sum;
    for (int j = 0; j <= t; ++j) a[j] *= inv;
    for (int j = t + 1; j < T; ++j) a[j] = 0;
    if constexpr (std::is_same_v<F, float>) {
      if (att16) {
        uint16_t* a16 = &att16[row * T].bits;
        const int end = block_end(t, T);
#pragma omp simd
        for (int j = 0; j < end; ++j) a16[j] = round_bf16(a[j]);
      }
    }
  }
}

// out (B,T,NH,hs) = att · v, by causal blocks.
void apply(void* out, DType out_t, Operand att, Operand qkv, const Geometry& g) {
  const int T = g.T;
  const int64_t es = int64_t(dtype_size(out_t));
  const Strides out_s = g.heads(g.C, int64_t(g.G) * g.hs);
  for (int q0 = 0; q0 < T; q0 += kCausalBlock) {
    const int q1 = std::min(T, q0 + kCausalBlock);
    for (int j = 0; j < g.G; ++j) {
      product("attention att.v", g.B, g.KVH, q1 - q0, g.hs, q1, att.at(int64_t(q0) * T + j * g.TT),
              g.att(), qkv.at(g.C + g.KV), g.kv(),
              static_cast<char*>(out) + (int64_t(q0) * g.C + j * g.hs) * es, out_s);
    }
  }
}

}  // namespace

size_t attention_bf16_elements(const AttentionShape& s) {
  const Geometry g(s);
  return (size_t(g.B) * g.T * g.W + 31) / 32 * 32 + size_t(g.B) * g.NH * g.TT;
}

template <typename F>
void attention_probs(F* att, const F* qkv, const AttentionShape& s, Bf16Operands* bf16) {
  check_bf16<F>(bf16);
  const Geometry g(s);
  if constexpr (std::is_same_v<F, float>) {
    if (bf16) {
      const Bf16Scratch scratch = take(*bf16, g);
      round_to_bf16(scratch.rows, qkv, size_t(g.B) * g.T * g.W, "attention q, k, v to bf16");
      return probs(att, {scratch.rows, DType::bf16}, nullptr, g);
    }
  }
  probs(att, operand(qkv), nullptr, g);
}

template <typename F>
void attention_forward(F* out, F* att, const F* qkv, const AttentionShape& s, Bf16Operands* bf16) {
  check_bf16<F>(bf16);
  const Geometry g(s);
  if constexpr (std::is_same_v<F, float>) {
    if (bf16) {
      const Bf16Scratch scratch = take(*bf16, g);
      round_to_bf16(scratch.rows, qkv, size_t(g.B) * g.T * g.W, "attention q, k, v to bf16");
      const Operand qkv16{scratch.rows, DType::bf16};
      probs(att, qkv16, scratch.att, g);
      return apply(out, DType::f32, {scratch.att, DType::bf16}, qkv16, g);
    }
  }
  probs(att, operand(qkv), nullptr, g);
  apply(out, dtype_of<F>(), operand<F>(att), operand(qkv), g);
}

template <typename F>
void attention_decode(F* out, const F* qkv, F* kcache, F* vcache, F* scores, int pos0,
                      const AttentionShape& s, int maxT) {
  const Geometry g(s);
  const int T = g.T, C = g.C, hs = g.hs;
  const int64_t W = g.W, KV = g.KV;
  const F scale = F(1) / std::sqrt(F(hs));
  for (int b = 0; b < g.B; ++b) {
    F* keys = kcache + int64_t(b) * maxT * KV;  // (maxT, KVH·hs)
    F* values = vcache + int64_t(b) * maxT * KV;
    for (int t = 0; t < T; ++t) {
      const F* row = qkv + (int64_t(b) * T + t) * W;
      std::copy(row + C, row + C + KV, keys + int64_t(pos0 + t) * KV);
      std::copy(row + C + KV, row + C + 2 * KV, values + int64_t(pos0 + t) * KV);
    }
    for (int t = 0; t < T; ++t) {
      const F* q0 = qkv + (int64_t(b) * T + t) * W;
      const int last = pos0 + t;  // causal: positions 0..last
      for (int h = 0; h < g.NH; ++h) {
        const F* q = q0 + h * hs;
        const int64_t kv_col = int64_t(h / g.G) * hs;
        F mx = -INFINITY;
        for (int j = 0; j <= last; ++j) {
          const F* k = keys + int64_t(j) * KV + kv_col;
          F dot = 0;
          for (int d = 0; d < hs; ++d) dot += q[d] * k[d];
          scores[j] = dot * scale;
          mx = std::max(mx, scores[j]);
        }
        F sum = 0;
        for (int j = 0; j <= last; ++j) {
          scores[j] = exp_approx(scores[j] - mx);
          sum += scores[j];
        }
        F* y = out + (int64_t(b) * T + t) * C + h * hs;
        std::fill(y, y + hs, F(0));
        for (int j = 0; j <= last; ++j) {
          const F p = scores[j] / sum;
          const F* v = values + int64_t(j) * KV + kv_col;
          for (int d = 0; d < hs; ++d) y[d] += p * v[d];
        }
      }
    }
  }
}

template <typename F>
void attention_backward(F* dqkv, F* datt, const F* dout, const F* qkv, const F* att,
                        const AttentionShape& s, Bf16Operands* bf16) {
  check_bf16<F>(bf16);
  const ProfileScope profile(ProfKind::attention, "softmax backward");
  const Geometry g(s);
  const int T = g.T, C = g.C, hs = g.hs;
  const int64_t W = g.W, KV = g.KV, BT = int64_t(g.B) * T, rows = int64_t(g.B) * g.NH * T;

  // datt and dv read v, dy and the probabilities: the model's buffers, or (mixed precision) bf16
  // copies made once here, v (B,T,KVH·hs) and dy (B,T,C) dense.
  Operand v = operand(qkv).at(C + KV), dy = operand(dout), p = operand(att);
  int64_t v_width = W;
  if constexpr (std::is_same_v<F, float>) {
    if (bf16) {
      const Bf16Scratch scratch = take(*bf16, g);
      {
        const ProfileScope cast(ProfKind::bf16_cast, "attention v to bf16");
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < BT; ++r) {
          const float* in = qkv + r * W + C + KV;
          uint16_t* out = &scratch.rows[r * KV].bits;
#pragma omp simd
          for (int64_t c = 0; c < KV; ++c) out[c] = round_bf16(in[c]);
        }
      }
      round_to_bf16(scratch.rows + BT * KV, dout, size_t(BT) * C, "attention dy to bf16");
      {
        const ProfileScope cast(ProfKind::bf16_cast, "attention probabilities to bf16");
#pragma omp parallel for schedule(static)
        for (int64_t row = 0; row < rows; ++row) {
          const float* in = att + row * T;
          uint16_t* out = &scratch.att[row * T].bits;
          const int end = block_end(int(row % T), T);
#pragma omp simd
          for (int j = 0; j < end; ++j) out[j] = round_bf16(in[j]);
        }
      }
      v = {scratch.rows, DType::bf16}, dy = {scratch.rows + BT * KV, DType::bf16};
      p = {scratch.att, DType::bf16};
      v_width = KV;
    }
  }
  const Strides dy_s = g.heads(C, int64_t(g.G) * hs), v_t = g.heads(v_width, hs, true);

  // Blocks are visited last to first: the last block meets every key, so its first dv and dk
  // products write all T rows and every later one (the other members of the groups, the earlier
  // blocks) accumulates into them.
  for (int q0 = (T - 1) / kCausalBlock * kCausalBlock; q0 >= 0; q0 -= kCausalBlock) {
    const int q1 = std::min(T, q0 + kCausalBlock);
    for (int j = 0; j < g.G; ++j) {
      const bool first = q1 == T && j == 0;
      // datt = dout · v^T
      product("attention datt = dy.v^T", g.B, g.KVH, q1 - q0, q1, hs,
              dy.at(int64_t(q0) * C + j * hs), dy_s, v, v_t, datt + int64_t(q0) * T + j * g.TT,
              g.att());
      // dv = att^T · dout
      product("attention dv = att^T.dy", g.B, g.KVH, q1, hs, q1 - q0,
              p.at(int64_t(q0) * T + j * g.TT), g.att(true), dy.at(int64_t(q0) * C + j * hs), dy_s,
              dqkv + C + KV, g.kv(), !first);
    }
  }

  // softmax backward with the scale folded in: dpre = scale * p * (datt - sum(p * datt))
  const F scale = F(1) / std::sqrt(F(hs));
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    int t = int(row % T);
    const F* pr = att + row * T;
    F* d = datt + row * T;
    F dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int j = 0; j <= t; ++j) dot += pr[j] * d[j];
    for (int j = 0; j <= t; ++j) d[j] = scale * pr[j] * (d[j] - dot);
    for (int j = t + 1; j < T; ++j) d[j] = 0;
  }

  // dq and dk from dpre in the model's precision, even under mixed precision: each row of dpre
  // sums to zero, which makes the key bias's gradient exactly zero; rounded to bf16 the rows
  // would not, and AdamW turns that noise into updates of order lr (docs/parity.md, "bf16").
  const Operand q = operand(qkv), k = operand(qkv).at(C);
  for (int q0 = (T - 1) / kCausalBlock * kCausalBlock; q0 >= 0; q0 -= kCausalBlock) {
    const int q1 = std::min(T, q0 + kCausalBlock);
    for (int j = 0; j < g.G; ++j) {
      const bool first = q1 == T && j == 0;
      const Operand dpre = operand<F>(datt + int64_t(q0) * T + j * g.TT);
      // dq = dpre · k
      product("attention dq = datt.k", g.B, g.KVH, q1 - q0, hs, q1, dpre, g.att(), k, g.kv(),
              dqkv + q0 * W + j * hs, g.q());
      // dk = dpre^T · q
      product("attention dk = datt^T.q", g.B, g.KVH, q1, hs, q1 - q0, dpre, g.att(true),
              q.at(q0 * W + j * hs), g.q(), dqkv + C, g.kv(), !first);
    }
  }
}

#define TETRA_INSTANTIATE(F)                                                                       \
  template void attention_probs<F>(F*, const F*, const AttentionShape&, Bf16Operands*);            \
  template void attention_forward<F>(F*, F*, const F*, const AttentionShape&, Bf16Operands*);      \
  template void attention_decode<F>(F*, const F*, F*, F*, F*, int, const AttentionShape&, int);    \
  template void attention_backward<F>(F*, F*, const F*, const F*, const F*, const AttentionShape&, \
                                      Bf16Operands*);
TETRA_INSTANTIATE(float)
TETRA_INSTANTIATE(double)
#undef TETRA_INSTANTIATE

}  // namespace tetra::cpu
