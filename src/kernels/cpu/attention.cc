#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>

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

template <typename F>
void product(const char* role, int B, int NH, int64_t M, int64_t N, int64_t K, const F* a,
             Strides sa, const F* b, Strides sb, F* c, Strides sc, bool accumulate = false) {
  MatmulArgs x;
  x.role = role;
  x.accumulate = accumulate;
  x.b0 = B, x.b1 = NH, x.M = M, x.N = N, x.K = K;
  x.a = {a, sa, dtype_of<F>()};
  x.b = {b, sb, dtype_of<F>()};
  x.c = c;
  x.c_strides = sc;
  matmul(x);
}

}  // namespace

template <typename F>
void attention_probs(F* att, const F* qkv, int B, int T, int C, int NH) {
  const ProfileScope profile(ProfKind::attention, "causal softmax");
  const int hs = C / NH;
  const int64_t TT = int64_t(T) * T;
  const Strides att_s{NH * TT, TT, T, 1};
  const int64_t C3 = 3 * int64_t(C);
  // preatt (B,NH,T,T) = q · k^T, the causal part only (row block [q0,q1) against keys [0,q1))
  for (int q0 = 0; q0 < T; q0 += kCausalBlock) {
    const int q1 = std::min(T, q0 + kCausalBlock);
    product<F>("attention q.k^T", B, NH, q1 - q0, q1, hs, qkv + q0 * C3,
               qkv_strides(T, C, hs, false), qkv + C, qkv_strides(T, C, hs, true),
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
  }
}

template <typename F>
void attention_apply(F* out, const F* att, const F* qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  const int64_t TT = int64_t(T) * T;
  const Strides att_s{NH * TT, TT, T, 1};
  // out (B,T,NH,hs) = att · v
  for (int q0 = 0; q0 < T; q0 += kCausalBlock) {
    const int q1 = std::min(T, q0 + kCausalBlock);
    product<F>("attention att.v", B, NH, q1 - q0, hs, q1, att + int64_t(q0) * T, att_s, qkv + 2 * C,
               qkv_strides(T, C, hs, false), out + int64_t(q0) * C, {int64_t(T) * C, hs, C, 1});
  }
}

template <typename F>
void attention_forward(F* out, F* att, const F* qkv, int B, int T, int C, int NH) {
  attention_probs(att, qkv, B, T, C, NH);
  attention_apply(out, att, qkv, B, T, C, NH);
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
                        int C, int NH) {
  const ProfileScope profile(ProfKind::attention, "softmax backward");
  const int hs = C / NH;
  const int64_t TT = int64_t(T) * T;
  const Strides att_s{NH * TT, TT, T, 1}, att_t{NH * TT, TT, 1, T};
  const Strides dout_s{int64_t(T) * C, hs, C, 1};
  const Strides part = qkv_strides(T, C, hs, false), part_t = qkv_strides(T, C, hs, true);

  const int64_t C3 = 3 * int64_t(C);
  // Blocks are visited last to first: the last block meets every key, so its dv and dk products
  // write all T rows and the earlier blocks accumulate into their key prefix.
  for (int q0 = (T - 1) / kCausalBlock * kCausalBlock; q0 >= 0; q0 -= kCausalBlock) {
    const int q1 = std::min(T, q0 + kCausalBlock);
    const bool first = q1 == T;
    // datt = dout · v^T
    product<F>("attention datt = dy.v^T", B, NH, q1 - q0, q1, hs, dout + int64_t(q0) * C, dout_s,
               qkv + 2 * C, part_t, datt + int64_t(q0) * T, att_s);
    // dv = att^T · dout
    product<F>("attention dv = att^T.dy", B, NH, q1, hs, q1 - q0, att + int64_t(q0) * T, att_t,
               dout + int64_t(q0) * C, dout_s, dqkv + 2 * C, part, !first);
  }

  // softmax backward with the scale folded in: dpre = scale * p * (datt - sum(p * datt))
  const F scale = F(1) / std::sqrt(F(hs));
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < int64_t(B) * NH * T; ++row) {
    int t = int(row % T);
    const F* p = att + row * T;
    F* d = datt + row * T;
    F dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int j = 0; j <= t; ++j) dot += p[j] * d[j];
    for (int j = 0; j <= t; ++j) d[j] = scale * p[j] * (d[j] - dot);
    for (int j = t + 1; j < T; ++j) d[j] = 0;
  }

  for (int q0 = (T - 1) / kCausalBlock * kCausalBlock; q0 >= 0; q0 -= kCausalBlock) {
    const int q1 = std::min(T, q0 + kCausalBlock);
    const bool first = q1 == T;
    // dq = dpre · k
    product<F>("attention dq = datt.k", B, NH, q1 - q0, hs, q1, datt + int64_t(q0) * T, att_s,
               qkv + C, part, dqkv + q0 * C3, part);
    // dk = dpre^T · q
    product<F>("attention dk = datt^T.q", B, NH, q1, hs, q1 - q0, datt + int64_t(q0) * T, att_t,
               qkv + q0 * C3, part, dqkv + C, part, !first);
  }
}

#define TETRA_INSTANTIATE(F)                                                    \
  template void attention_probs<F>(F*, const F*, int, int, int, int);           \
  template void attention_apply<F>(F*, const F*, const F*, int, int, int, int); \
  template void attention_forward<F>(F*, F*, const F*, int, int, int, int);     \
  template void attention_decode<F>(F*, const F*, F*, F*, F*, int, int, int, int, int, int);
TETRA_INSTANTIATE(float)
TETRA_INSTANTIATE(double)
#undef TETRA_INSTANTIATE
template void attention_backward<float>(float*, float*, const float*, const float*, const float*,
                                        int, int, int, int);
template void attention_backward<double>(double*, double*, const double*, const double*,
                                         const double*, int, int, int, int);

}  // namespace tetra::cpu
