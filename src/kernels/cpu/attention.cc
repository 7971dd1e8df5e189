#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>

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

template <typename F>
void product(int B, int NH, int64_t M, int64_t N, int64_t K, const F* a, Strides sa, const F* b,
             Strides sb, F* c, Strides sc) {
  MatmulArgs x;
  x.b0 = B, x.b1 = NH, x.M = M, x.N = N, x.K = K;
  x.a = {a, sa, dtype_of<F>()};
  x.b = {b, sb, dtype_of<F>()};
  x.c = c;
  x.c_strides = sc;
  matmul(x);
}

}  // namespace

template <typename F>
void attention_forward(F* out, F* att, const F* qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  const int64_t TT = int64_t(T) * T;
  const Strides att_s{NH * TT, TT, T, 1};
  // preatt (B,NH,T,T) = q · k^T
  product<F>(B, NH, T, T, hs, qkv, qkv_strides(T, C, hs, false), qkv + C,
             qkv_strides(T, C, hs, true), att, att_s);

  const F scale = F(1) / std::sqrt(F(hs));
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < int64_t(B) * NH * T; ++row) {
    int t = int(row % T);
    F* a = att + row * T;
    F mx = a[0] * scale;
#pragma omp simd reduction(max : mx)
    for (int j = 1; j <= t; ++j) mx = std::max(mx, a[j] * scale);
    F sum = 0;
    for (int j = 0; j <= t; ++j) {
      F e = exp_approx(a[j] * scale - mx);
      a[j] = e;
      sum += e;
    }
    F inv = F(1) / sum;
    for (int j = 0; j <= t; ++j) a[j] *= inv;
    for (int j = t + 1; j < T; ++j) a[j] = 0;
  }

  // out (B,T,NH,hs) = att · v
  product<F>(B, NH, T, hs, T, att, att_s, qkv + 2 * C, qkv_strides(T, C, hs, false), out,
             {int64_t(T) * C, hs, C, 1});
}

template <typename F>
void attention_backward(F* dqkv, F* datt, const F* dout, const F* qkv, const F* att, int B, int T,
                        int C, int NH) {
  const int hs = C / NH;
  const int64_t TT = int64_t(T) * T;
  const Strides att_s{NH * TT, TT, T, 1}, att_t{NH * TT, TT, 1, T};
  const Strides dout_s{int64_t(T) * C, hs, C, 1};
  const Strides part = qkv_strides(T, C, hs, false), part_t = qkv_strides(T, C, hs, true);

  product<F>(B, NH, T, T, hs, dout, dout_s, qkv + 2 * C, part_t, datt, att_s);  // datt = dout·v^T
  product<F>(B, NH, T, hs, T, att, att_t, dout, dout_s, dqkv + 2 * C, part);    // dv = att^T·dout

  // softmax backward with the scale folded in: dpre = scale * p * (datt - sum(p * datt))
  const F scale = F(1) / std::sqrt(F(hs));
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < int64_t(B) * NH * T; ++row) {
    int t = int(row % T);
    const F* p = att + row * T;
    F* d = datt + row * T;
    F dot = 0;
    for (int j = 0; j <= t; ++j) dot += p[j] * d[j];
    for (int j = 0; j <= t; ++j) d[j] = scale * p[j] * (d[j] - dot);
    for (int j = t + 1; j < T; ++j) d[j] = 0;
  }

  product<F>(B, NH, T, hs, T, datt, att_s, qkv + C, part, dqkv, part);  // dq = dpre · k
  product<F>(B, NH, T, hs, T, datt, att_t, qkv, part, dqkv + C, part);  // dk = dpre^T · q
}

template void attention_forward<float>(float*, float*, const float*, int, int, int, int);
template void attention_forward<double>(double*, double*, const double*, int, int, int, int);
template void attention_backward<float>(float*, float*, const float*, const float*, const float*,
                                        int, int, int, int);
template void attention_backward<double>(double*, double*, const double*, const double*,
                                         const double*, int, int, int, int);

}  // namespace tetra::cpu
