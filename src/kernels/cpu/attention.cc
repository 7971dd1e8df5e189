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

// (b, h, t, d) strides of q, k or v inside the fused (B,T,3C) buffer; transposed swaps t and d.
Strides qkv_strides(int T, int C, int hs, bool transposed) {
  int64_t C3 = 3 * int64_t(C);
  return transposed ? Strides{T * C3, hs, 1, C3} : Strides{T * C3, hs, C3, 1};
}

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

void product(const char* role, int B, int NH, int64_t M, int64_t N, int64_t K, Operand a,
             Strides sa, Operand b, Strides sb, void* c, Strides sc, bool accumulate = false) {
  MatmulArgs x;
  x.role = role;
  x.accumulate = accumulate;
  x.b0 = B, x.b1 = NH, x.M = M, x.N = N, x.K = K;
  x.a = {a.data, sa, a.t};
  x.b = {b.data, sb, b.t};
  x.c = c;
  x.c_strides = sc;
  matmul(x);
}

// Mixed precision: scratch for the bf16 copies of qkv (B,T,3C) in forward, or of v and dout (B,T,C)
// each in backward, in one region, and of the probabilities (B,NH,T,T) in the other.
struct Bf16Scratch {
  bf16 *rows, *att;
};

Bf16Scratch take(Bf16Operands& ops, int B, int T, int C, int NH) {
  const auto [rows, att] =
      ops.take(size_t(3) * B * T * C, size_t(B) * NH * T * T);  // attention_bf16_elements
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
void probs(F* att, Operand qkv, bf16* att16, int B, int T, int C, int NH) {
  const ProfileScope profile(ProfKind::attention, "causal softmax");
  const int hs = C / NH;
  const int64_t TT = int64_t(T) * T;
  const Strides att_s{NH * TT, TT, T, 1};
  const int64_t C3 = 3 * int64_t(C);
  // preatt (B,NH,T,T) = q · k^T, the causal part only (row block [q0,q1) against keys [0,q1))
  for (int q0 = 0; q0 < T; q0 += kCausalBlock) {
    const int q1 = std::min(T, q0 + kCausalBlock);
    product("attention q.k^T", B, NH, q1 - q0, q1, hs, qkv.at(q0 * C3),
            qkv_strides(T, C, hs, false), qkv.at(C), qkv_strides(T, C, hs, true),
            att + int64_t(q0) * T, att_s);
  }

  const F scale = F(1) / std::sqrt(F(hs));
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < int64_t(B) * NH * T; ++row) {
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
void apply(void* out, DType out_t, Operand att, Operand qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  const int64_t TT = int64_t(T) * T;
  const Strides att_s{NH * TT, TT, T, 1};
  const int64_t es = int64_t(dtype_size(out_t));
  for (int q0 = 0; q0 < T; q0 += kCausalBlock) {
    const int q1 = std::min(T, q0 + kCausalBlock);
    product("attention att.v", B, NH, q1 - q0, hs, q1, att.at(int64_t(q0) * T), att_s,
            qkv.at(2 * C), qkv_strides(T, C, hs, false),
            static_cast<char*>(out) + int64_t(q0) * C * es, {int64_t(T) * C, hs, C, 1});
  }
}

}  // namespace

size_t attention_bf16_elements(int B, int T, int C, int NH) {
  return (size_t(3) * B * T * C + 31) / 32 * 32 + size_t(B) * NH * T * T;
}

template <typename F>
void attention_probs(F* att, const F* qkv, int B, int T, int C, int NH, Bf16Operands* bf16) {
  check_bf16<F>(bf16);
  if constexpr (std::is_same_v<F, float>) {
    if (bf16) {
      const Bf16Scratch s = take(*bf16, B, T, C, NH);
      round_to_bf16(s.rows, qkv, size_t(B) * T * 3 * C, "attention q, k, v to bf16");
      return probs(att, {s.rows, DType::bf16}, nullptr, B, T, C, NH);
    }
  }
  probs(att, operand(qkv), nullptr, B, T, C, NH);
}

template <typename F>
void attention_forward(F* out, F* att, const F* qkv, int B, int T, int C, int NH,
                       Bf16Operands* bf16) {
  check_bf16<F>(bf16);
  if constexpr (std::is_same_v<F, float>) {
    if (bf16) {
      const Bf16Scratch s = take(*bf16, B, T, C, NH);
      round_to_bf16(s.rows, qkv, size_t(B) * T * 3 * C, "attention q, k, v to bf16");
      const Operand qkv16{s.rows, DType::bf16};
      probs(att, qkv16, s.att, B, T, C, NH);
      return apply(out, DType::f32, {s.att, DType::bf16}, qkv16, B, T, C, NH);
    }
  }
  probs(att, operand(qkv), nullptr, B, T, C, NH);
  apply(out, dtype_of<F>(), operand<F>(att), operand(qkv), B, T, C, NH);
}

template <typename F>
void attention_decode(F* out, const F* qkv, F* kcache, F* vcache, F* scores, int pos0, int B, int T,
                      int C, int NH, int maxT) {
  const int hs = C / NH;
  const F scale = F(1) / std::sqrt(F(hs));
  for (int b = 0; b < B; ++b) {
    F* keys = kcache + int64_t(b) * maxT * C;  // (maxT, C)
    F* values = vcache + int64_t(b) * maxT * C;
    for (int t = 0; t < T; ++t) {
      const F* row = qkv + (int64_t(b) * T + t) * 3 * C;
      std::copy(row + C, row + 2 * C, keys + int64_t(pos0 + t) * C);
      std::copy(row + 2 * C, row + 3 * C, values + int64_t(pos0 + t) * C);
    }
    for (int t = 0; t < T; ++t) {
      const F* q0 = qkv + (int64_t(b) * T + t) * 3 * C;
      const int last = pos0 + t;  // causal: positions 0..last
      for (int h = 0; h < NH; ++h) {
        const F* q = q0 + h * hs;
        F mx = -INFINITY;
        for (int j = 0; j <= last; ++j) {
          const F* k = keys + int64_t(j) * C + h * hs;
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
          const F* v = values + int64_t(j) * C + h * hs;
          for (int d = 0; d < hs; ++d) y[d] += p * v[d];
        }
      }
    }
  }
}

template <typename F>
void attention_backward(F* dqkv, F* datt, const F* dout, const F* qkv, const F* att, int B, int T,
                        int C, int NH, Bf16Operands* bf16) {
  check_bf16<F>(bf16);
  const ProfileScope profile(ProfKind::attention, "softmax backward");
  const int hs = C / NH;
  const int64_t TT = int64_t(T) * T, BT = int64_t(B) * T, rows = int64_t(B) * NH * T;
  const Strides att_s{NH * TT, TT, T, 1}, att_t{NH * TT, TT, 1, T};
  const Strides part = qkv_strides(T, C, hs, false);

  // datt and dv read v, dy and the probabilities: the model's buffers, or (mixed precision) bf16
  // copies made once here, v and dy dense (B,T,C).
  Operand v = operand(qkv).at(2 * C), dy = operand(dout), p = operand(att);
  int64_t v_width = 3 * int64_t(C);
  if constexpr (std::is_same_v<F, float>) {
    if (bf16) {
      const Bf16Scratch s = take(*bf16, B, T, C, NH);
      {
        const ProfileScope cast(ProfKind::bf16_cast, "attention v to bf16");
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < BT; ++r) {
          const float* in = qkv + r * 3 * C + 2 * C;
          uint16_t* out = &s.rows[r * C].bits;
#pragma omp simd
          for (int c = 0; c < C; ++c) out[c] = round_bf16(in[c]);
        }
      }
      round_to_bf16(s.rows + BT * C, dout, size_t(BT) * C, "attention dy to bf16");
      {
        const ProfileScope cast(ProfKind::bf16_cast, "attention probabilities to bf16");
#pragma omp parallel for schedule(static)
        for (int64_t row = 0; row < rows; ++row) {
          const float* in = att + row * T;
          uint16_t* out = &s.att[row * T].bits;
          const int end = block_end(int(row % T), T);
#pragma omp simd
          for (int j = 0; j < end; ++j) out[j] = round_bf16(in[j]);
        }
      }
      v = {s.rows, DType::bf16}, dy = {s.rows + BT * C, DType::bf16}, p = {s.att, DType::bf16};
      v_width = C;
    }
  }
  const Strides dy_s{int64_t(T) * C, hs, C, 1}, v_t{T * v_width, hs, 1, v_width};

  const int64_t C3 = 3 * int64_t(C);
  // Blocks are visited last to first: the last block meets every key, so its dv and dk products
  // write all T rows and the earlier blocks accumulate into their key prefix.
  for (int q0 = (T - 1) / kCausalBlock * kCausalBlock; q0 >= 0; q0 -= kCausalBlock) {
    const int q1 = std::min(T, q0 + kCausalBlock);
    const bool first = q1 == T;
    // datt = dout · v^T
    product("attention datt = dy.v^T", B, NH, q1 - q0, q1, hs, dy.at(int64_t(q0) * C), dy_s, v, v_t,
            datt + int64_t(q0) * T, att_s);
    // dv = att^T · dout
    product("attention dv = att^T.dy", B, NH, q1, hs, q1 - q0, p.at(int64_t(q0) * T), att_t,
            dy.at(int64_t(q0) * C), dy_s, dqkv + 2 * C, part, !first);
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
    const bool first = q1 == T;
    // dq = dpre · k
    product("attention dq = datt.k", B, NH, q1 - q0, hs, q1, operand<F>(datt + int64_t(q0) * T),
            att_s, k, part, dqkv + q0 * C3, part);
    // dk = dpre^T · q
    product("attention dk = datt^T.q", B, NH, q1, hs, q1 - q0, operand<F>(datt + int64_t(q0) * T),
            att_t, q.at(q0 * C3), part, dqkv + C, part, !first);
  }
}

#define TETRA_INSTANTIATE(F)                                                                    \
  template void attention_probs<F>(F*, const F*, int, int, int, int, Bf16Operands*);            \
  template void attention_forward<F>(F*, F*, const F*, int, int, int, int, Bf16Operands*);      \
  template void attention_decode<F>(F*, const F*, F*, F*, F*, int, int, int, int, int, int);    \
  template void attention_backward<F>(F*, F*, const F*, const F*, const F*, int, int, int, int, \
                                      Bf16Operands*);
TETRA_INSTANTIATE(float)
TETRA_INSTANTIATE(double)
#undef TETRA_INSTANTIATE

}  // namespace tetra::cpu
