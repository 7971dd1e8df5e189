// Finite-difference checks of every kernel's backward, in double precision.
#include "tests/kernels/gradcheck.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_block.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rope.h"
#include "tests/kernels/cpu_products.h"

namespace tetra::cpu {
namespace {

using test_products::matmul_nn;
using test_products::matmul_nt;
using test_products::matmul_tn;

using testing::dot;
using testing::kGradTolerance;
using testing::max_grad_error;
using testing::random_vector;
using Vec = std::vector<double>;

TEST(GradCheck, LayerNorm) {
  const int N = 6, C = 10;
  Vec x = random_vector(N * C, 1, 2.0), w = random_vector(C, 2), b = random_vector(C, 3);
  Vec r = random_vector(N * C, 4);
  Vec out(N * C), mean(N), rstd(N);
  auto loss = [&] {
    layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    return dot(out, r);
  };
  loss();
  Vec dx(N * C, 0.0), dw(C, 0.0), db(C, 0.0);
  layernorm_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), mean.data(),
                     rstd.data(), N, C);
  EXPECT_LT(max_grad_error(x, dx, loss), kGradTolerance);
  EXPECT_LT(max_grad_error(w, dw, loss), kGradTolerance);
  EXPECT_LT(max_grad_error(b, db, loss), kGradTolerance);
}

TEST(GradCheck, LayerNormBackwardAccumulates) {
  const int N = 3, C = 8;
  Vec x = random_vector(N * C, 1), w = random_vector(C, 2), b = random_vector(C, 3);
  Vec r = random_vector(N * C, 4), out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  Vec dx1(N * C, 0.0), dw1(C, 0.0), db1(C, 0.0), dx2(N * C, 0.0), dw2(C, 0.0), db2(C, 0.0);
  layernorm_backward(dx1.data(), dw1.data(), db1.data(), r.data(), x.data(), w.data(), mean.data(),
                     rstd.data(), N, C);
  for (int k = 0; k < 2; ++k) {
    layernorm_backward(dx2.data(), dw2.data(), db2.data(), r.data(), x.data(), w.data(),
                       mean.data(), rstd.data(), N, C);
  }
  for (int i = 0; i < N * C; ++i) EXPECT_NEAR(dx2[i], 2 * dx1[i], 1e-12);
  for (int i = 0; i < C; ++i) EXPECT_NEAR(dw2[i], 2 * dw1[i], 1e-12);
}

TEST(GradCheck, RmsNorm) {
  const int N = 6, C = 10;
  for (double eps : {1e-5, 1e-6}) {
    Vec x = random_vector(N * C, 31, 2.0), w = random_vector(C, 32), r = random_vector(N * C, 33);
    Vec out(N * C), rstd(N);
    auto loss = [&] {
      rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
      return dot(out, r);
    };
    loss();
    // The contract's rstd and out, directly.
    for (int i = 0; i < N; ++i) {
      double ms = 0.0;
      for (int c = 0; c < C; ++c) ms += x[i * C + c] * x[i * C + c] / C;
      EXPECT_NEAR(rstd[i], 1.0 / std::sqrt(ms + eps), 1e-14 * rstd[i]);
      for (int c = 0; c < C; ++c) EXPECT_NEAR(out[i * C + c], x[i * C + c] * rstd[i] * w[c], 1e-14);
    }
    // Pre-filled: both gradients accumulate.
    const Vec dx0 = random_vector(N * C, 34), dw0 = random_vector(C, 35);
    Vec dx = dx0, dw = dw0;
    rmsnorm_backward(dx.data(), dw.data(), r.data(), x.data(), w.data(), rstd.data(), N, C);
    for (int i = 0; i < N * C; ++i) dx[i] -= dx0[i];
    for (int c = 0; c < C; ++c) dw[c] -= dw0[c];
    EXPECT_LT(max_grad_error(x, dx, loss), kGradTolerance) << "eps " << eps;
    EXPECT_LT(max_grad_error(w, dw, loss), kGradTolerance) << "eps " << eps;
  }
}

// silu(gate) · up against its formula, and its gradients against central differences; dgate may
// alias dout.
TEST(GradCheck, Swiglu) {
  const int N = 60;
  Vec gate = random_vector(N, 36, 3.0), up = random_vector(N, 37), r = random_vector(N, 38);
  gate[0] = -30, gate[1] = 30;  // the tails: silu ~ 0 far left, ~ x far right
  Vec out(N);
  auto loss = [&] {
    swiglu_forward(out.data(), gate.data(), up.data(), N);
    return dot(out, r);
  };
  loss();
  for (int i = 0; i < N; ++i)
    EXPECT_NEAR(out[i], gate[i] / (1.0 + std::exp(-gate[i])) * up[i],
                1e-14 * std::abs(gate[i] * up[i]));
  Vec dgate(N), dup(N);
  swiglu_backward(dgate.data(), dup.data(), r.data(), gate.data(), up.data(), N);
  EXPECT_LT(max_grad_error(gate, dgate, loss), kGradTolerance);
  EXPECT_LT(max_grad_error(up, dup, loss), kGradTolerance);
  Vec aliased = r, dup2(N);
  swiglu_backward(aliased.data(), dup2.data(), aliased.data(), gate.data(), up.data(), N);
  EXPECT_EQ(aliased, dgate);
  EXPECT_EQ(dup2, dup);
}

TEST(GradCheck, SwigluFloatTracksDouble) {
  // The f32 kernels (the vector branch this CPU picks) against f64, across exp's clamps.
  const int N = 1001;
  const Vec gd = random_vector(N, 39, 6.0), ud = random_vector(N, 40), rd = random_vector(N, 41);
  std::vector<float> g(gd.begin(), gd.end()), u(ud.begin(), ud.end()), rf(rd.begin(), rd.end());
  g[0] = -100.0f, g[1] = 100.0f;
  const Vec gw(g.begin(), g.end()), uw(u.begin(), u.end()), rw(rf.begin(), rf.end());
  Vec out(N), dg(N), du(N);
  swiglu_forward(out.data(), gw.data(), uw.data(), N);
  swiglu_backward(dg.data(), du.data(), rw.data(), gw.data(), uw.data(), N);
  std::vector<float> of(N), dgf(N), duf(N);
  swiglu_forward(of.data(), g.data(), u.data(), N);
  swiglu_backward(dgf.data(), duf.data(), rf.data(), g.data(), u.data(), N);
  for (int i = 0; i < N; ++i) {
    EXPECT_NEAR(of[i], out[i], 1e-6 * std::max(1.0, std::abs(out[i]))) << i;
    EXPECT_NEAR(dgf[i], dg[i], 1e-6 * std::max(1.0, std::abs(dg[i]))) << i;
    EXPECT_NEAR(duf[i], du[i], 1e-6 * std::max(1.0, std::abs(du[i]))) << i;
  }
}

TEST(GradCheck, Gelu) {
  const int N = 50;
  Vec x = random_vector(N, 5, 3.0), r = random_vector(N, 6), out(N);
  auto loss = [&] {
    gelu_forward(out.data(), x.data(), N);
    return dot(out, r);
  };
  Vec dx(N);
  gelu_backward(dx.data(), x.data(), r.data(), N);
  EXPECT_LT(max_grad_error(x, dx, loss), kGradTolerance);
}

// The fused bias + GELU pass: gradients of sum(gelu(x + b) * r) with respect to x and b.
TEST(GradCheck, BiasGelu) {
  const int N = 6, OC = 9;
  Vec x = random_vector(N * OC, 11, 3.0), b = random_vector(OC, 12), r = random_vector(N * OC, 13);
  Vec fch(N * OC), out(N * OC);
  auto loss = [&] {
    fch = x;
    bias_gelu_forward(out.data(), fch.data(), b.data(), N, OC);
    return dot(out, r);
  };
  loss();
  Vec dx(N * OC), db(OC, 0.0);
  gelu_bias_backward(dx.data(), db.data(), fch.data(), r.data(), N, OC);
  EXPECT_LT(max_grad_error(x, dx, loss), kGradTolerance);
  EXPECT_LT(max_grad_error(b, db, loss), kGradTolerance);
}

// The fused passes compute what the separate ones do: the same GELU values bit for bit, and the
// bias gradient up to summation order.
TEST(GradCheck, FusedGeluPassesMatchTheSeparateOnes) {
  const int N = 37, OC = 70;
  std::vector<float> x(N * OC), b(OC), r(N * OC);
  const Vec xd = random_vector(x.size(), 14, 3.0), bd = random_vector(OC, 15),
            rd = random_vector(r.size(), 16);
  std::copy(xd.begin(), xd.end(), x.begin());
  std::copy(bd.begin(), bd.end(), b.begin());
  std::copy(rd.begin(), rd.end(), r.begin());
  std::vector<float> fch = x, fused(N * OC), sep_in(N * OC), sep(N * OC);
  bias_gelu_forward(fused.data(), fch.data(), b.data(), N, OC);
  for (int i = 0; i < N; ++i)
    for (int o = 0; o < OC; ++o) sep_in[i * OC + o] = x[i * OC + o] + b[o];
  gelu_forward(sep.data(), sep_in.data(), int64_t(N) * OC);
  EXPECT_EQ(fch, sep_in);
  EXPECT_EQ(fused, sep);
  std::vector<float> dx(N * OC), db(OC, 0.0f), dx_sep(N * OC), db_sep(OC, 0.0f);
  gelu_bias_backward(dx.data(), db.data(), fch.data(), r.data(), N, OC);
  gelu_backward(dx_sep.data(), sep_in.data(), r.data(), int64_t(N) * OC);
  bias_backward(db_sep.data(), dx_sep.data(), N, OC);
  EXPECT_EQ(dx, dx_sep);
  for (int o = 0; o < OC; ++o) EXPECT_NEAR(db[o], db_sep[o], 1e-5f * std::sqrt(float(N))) << o;
}

TEST(GradCheck, GeluMatchesTheTanhFormulaInFloat) {
  for (float x = -8.0f; x <= 8.0f; x += 0.01f) {
    float out;
    gelu_forward(&out, &x, 1);
    double ref = 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
    EXPECT_NEAR(out, ref, 2e-7 * std::max(1.0, std::abs(ref))) << x;
  }
}

TEST(GradCheck, LinearWithBias) {
  const int M = 5, K = 7, N = 4;
  Vec x = random_vector(M * K, 7), w = random_vector(N * K, 8), b = random_vector(N, 9);
  Vec r = random_vector(M * N, 10), out(M * N);
  auto loss = [&] {
    matmul_nt(out.data(), x.data(), w.data(), b.data(), M, N, K);
    return dot(out, r);
  };
  Vec dx(M * K, 0.0), dw(N * K, 0.0), db(N, 0.0);
  matmul_nn(dx.data(), r.data(), w.data(), M, K, N);
  matmul_tn(dw.data(), r.data(), x.data(), N, K, M, true);
  bias_backward(db.data(), r.data(), M, N);
  EXPECT_LT(max_grad_error(x, dx, loss), kGradTolerance);
  EXPECT_LT(max_grad_error(w, dw, loss), kGradTolerance);
  EXPECT_LT(max_grad_error(b, db, loss), kGradTolerance);
}

TEST(GradCheck, Embedding) {
  const int B = 2, T = 5, C = 6, V = 7;
  std::vector<int32_t> tok = {1, 3, 3, 0, 6, 3, 2, 1, 1, 5};  // repeats on purpose
  Vec wte = random_vector(V * C, 11), wpe = random_vector(T * C, 12);
  Vec r = random_vector(B * T * C, 13), out(B * T * C);
  auto loss = [&] {
    embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
    return dot(out, r);
  };
  Vec dwte(V * C, 0.0), dwpe(T * C, 0.0);
  embedding_backward(dwte.data(), dwpe.data(), r.data(), tok.data(), B, T, C);
  EXPECT_LT(max_grad_error(wte, dwte, loss), kGradTolerance);
  EXPECT_LT(max_grad_error(wpe, dwpe, loss), kGradTolerance);
}

// Max relative error of attention's dqkv against central differences of sum(out * r).
double attention_grad_error(const AttentionShape& s, uint32_t seed) {
  Vec qkv = random_vector(size_t(s.B) * s.T * size_t(s.width()), seed),
      r = random_vector(size_t(s.B) * s.T * s.C, seed + 1);
  Vec out(r.size()), att(size_t(s.B) * s.NH * s.T * s.T);
  auto loss = [&] {
    attention_forward(out.data(), att.data(), qkv.data(), s);
    return dot(out, r);
  };
  loss();
  Vec dqkv(qkv.size()), datt(att.size());
  attention_backward(dqkv.data(), datt.data(), r.data(), qkv.data(), att.data(), s);
  return max_grad_error(qkv, dqkv, loss);
}

TEST(GradCheck, CausalAttention) {
  EXPECT_LT(attention_grad_error({2, 5, 8, 2}, 14), kGradTolerance);
}

TEST(GradCheck, CausalAttentionAcrossQueryBlocks) {
  // T = 70 spans two causal blocks (64 + 6 query rows): block-wise products and accumulation.
  EXPECT_LT(attention_grad_error({1, 70, 4, 2}, 19), kGradTolerance);
}

// Grouped-query attention: dk and dv sum over the query heads of each group (two groups of two,
// one group of four), also across the causal blocks.
TEST(GradCheck, GroupedQueryAttention) {
  EXPECT_LT(attention_grad_error({2, 5, 24, 4, 2}, 23), kGradTolerance);
  EXPECT_LT(attention_grad_error({2, 5, 24, 4, 1}, 25), kGradTolerance);
  EXPECT_LT(attention_grad_error({1, 70, 8, 4, 2}, 27), kGradTolerance);
  EXPECT_LT(attention_grad_error({1, 70, 6, 3, 1}, 29), kGradTolerance);
}

// Blockwise attention (context parallelism): the queries of chunk 1 of each sequence (positions
// T0..T0+T1) against chunk 0 whole, then against themselves causally, merged; the gradients of
// sum(out * r) with respect to the whole qkv buffer (B, T0 + T1, W) come from one delta and the
// two blocks' backward calls, through Rows into qkv.
double attention_block_grad_error(int B, int T0, int T1, int C, int NH, int KVH, uint32_t seed) {
  const AttentionShape s{B, T0 + T1, C, NH, KVH};
  const int64_t W = s.width(), KV = s.kv_width(), T = s.T;
  Vec qkv = random_vector(size_t(B * T * W), seed), r = random_vector(size_t(B) * T1 * C, seed + 1);
  Vec out(r.size()), lse(size_t(B) * T1 * NH), delta(lse.size());
  const AttentionBlock past{B, T1, T0, C, NH, KVH, false}, diag{B, T1, T1, C, NH, KVH, true};
  Vec scratch(
      std::max(attention_block_scratch_elements(past), attention_block_scratch_elements(diag)));
  auto in = [&](const Vec& x, int t0, int64_t col) {
    return Rows<const double>{x.data() + t0 * W + col, W, T * W};
  };
  const Rows<double> o{out.data(), C, int64_t(T1) * C}, l{lse.data(), NH, int64_t(T1) * NH};
  auto loss = [&] {
    std::fill(lse.begin(), lse.end(), -INFINITY);
    attention_block_forward(o, l, in(qkv, T0, 0), in(qkv, 0, C), in(qkv, 0, C + KV), past,
                            scratch.data());
    attention_block_forward(o, l, in(qkv, T0, 0), in(qkv, T0, C), in(qkv, T0, C + KV), diag,
                            scratch.data());
    return dot(out, r);
  };
  loss();
  const Rows<const double> dy{r.data(), C, int64_t(T1) * C}, d{delta.data(), NH, int64_t(T1) * NH},
      lc{lse.data(), NH, int64_t(T1) * NH};
  attention_block_delta(Rows<double>{delta.data(), NH, int64_t(T1) * NH}, dy,
                        Rows<const double>{out.data(), C, int64_t(T1) * C}, diag);
  Vec dqkv(qkv.size(), 0.0);
  auto grad = [&](int t0, int64_t col) {
    return Rows<double>{dqkv.data() + t0 * W + col, W, T * W};
  };
  attention_block_backward(grad(T0, 0), grad(0, C), grad(0, C + KV), dy, d, lc, in(qkv, T0, 0),
                           in(qkv, 0, C), in(qkv, 0, C + KV), past, scratch.data());
  attention_block_backward(grad(T0, 0), grad(T0, C), grad(T0, C + KV), dy, d, lc, in(qkv, T0, 0),
                           in(qkv, T0, C), in(qkv, T0, C + KV), diag, scratch.data());
  return max_grad_error(qkv, dqkv, loss);
}

TEST(GradCheck, AttentionBlocksMergedCausalAndPast) {
  EXPECT_LT(attention_block_grad_error(2, 3, 4, 8, 2, 0, 31), kGradTolerance);
  // Grouped-query attention: dk and dv of a key/value head sum over its query heads.
  EXPECT_LT(attention_block_grad_error(2, 5, 3, 12, 4, 2, 33), kGradTolerance);
}

// qkv (B,T,C + 2·KVH·hs) of grouped-query attention as multi-head qkv (B,T,3C): every key and
// value head repeated for the G query heads of its group (Hugging Face's repeat_kv).
template <typename F>
std::vector<F> repeat_kv(const std::vector<F>& qkv, const AttentionShape& s) {
  const int hs = s.head_size(), G = s.NH / s.kv_heads();
  const int64_t W = s.width(), KV = s.kv_width(), C = s.C;
  std::vector<F> mha(size_t(s.B) * s.T * 3 * C);
  for (int64_t r = 0; r < int64_t(s.B) * s.T; ++r) {
    const F* in = qkv.data() + r * W;
    F* out = mha.data() + r * 3 * C;
    std::copy(in, in + C, out);
    for (int h = 0; h < s.NH; ++h) {
      std::copy_n(in + C + (h / G) * hs, hs, out + C + h * hs);
      std::copy_n(in + C + KV + (h / G) * hs, hs, out + 2 * C + h * hs);
    }
  }
  return mha;
}

// Grouped-query attention is multi-head attention over repeated key and value heads: the same
// output and probabilities, the same dq, and dk, dv the sums of the repeated heads' gradients.
template <typename F>
void expect_gqa_is_repeated_mha(const AttentionShape& s, double tol) {
  const int hs = s.head_size(), G = s.NH / s.kv_heads();
  const int64_t W = s.width(), KV = s.kv_width(), C = s.C, BT = int64_t(s.B) * s.T;
  const AttentionShape mha{s.B, s.T, s.C, s.NH};
  const Vec qd = random_vector(size_t(BT * W), 51), rd = random_vector(size_t(BT * C), 52);
  const std::vector<F> qkv(qd.begin(), qd.end()), r(rd.begin(), rd.end());
  const std::vector<F> qkv_mha = repeat_kv(qkv, s);
  const size_t n_att = size_t(s.B) * s.NH * s.T * s.T;
  std::vector<F> out(size_t(BT * C)), att(n_att), dqkv(qkv.size()), datt(n_att);
  std::vector<F> out_m(out.size()), att_m(n_att), dqkv_m(qkv_mha.size()), datt_m(n_att);
  attention_forward(out.data(), att.data(), qkv.data(), s);
  attention_backward(dqkv.data(), datt.data(), r.data(), qkv.data(), att.data(), s);
  attention_forward(out_m.data(), att_m.data(), qkv_mha.data(), mha);
  attention_backward(dqkv_m.data(), datt_m.data(), r.data(), qkv_mha.data(), att_m.data(), mha);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], out_m[i], tol) << "out " << i;
  for (size_t i = 0; i < n_att; ++i) ASSERT_NEAR(att[i], att_m[i], tol) << "att " << i;
  for (int64_t row = 0; row < BT; ++row) {
    const F* g = dqkv.data() + row * W;
    const F* m = dqkv_m.data() + row * 3 * C;
    for (int64_t c = 0; c < C; ++c) ASSERT_NEAR(g[c], m[c], tol) << "dq " << row << "," << c;
    for (int64_t c = 0; c < KV; ++c) {
      double dk = 0.0, dv = 0.0;
      for (int j = 0; j < G; ++j) {
        const int64_t col = (c / hs * G + j) * hs + c % hs;  // query head kvh·G + j, channel c % hs
        dk += double(m[C + col]);
        dv += double(m[2 * C + col]);
      }
      ASSERT_NEAR(g[C + c], dk, tol) << "dk " << row << "," << c;
      ASSERT_NEAR(g[C + KV + c], dv, tol) << "dv " << row << "," << c;
    }
  }
}

TEST(GradCheck, GroupedQueryAttentionIsMultiHeadOverRepeatedKeysAndValues) {
  for (const AttentionShape& s :
       {AttentionShape{2, 5, 24, 4, 2}, AttentionShape{2, 5, 24, 4, 1},
        AttentionShape{2, 70, 48, 6, 2}, AttentionShape{1, 130, 64, 8, 2}}) {
    SCOPED_TRACE(::testing::Message() << "T " << s.T << " NH " << s.NH << " KVH " << s.KVH);
    expect_gqa_is_repeated_mha<double>(s, 1e-12);
    expect_gqa_is_repeated_mha<float>(s, 2e-5);
  }
}

TEST(GradCheck, FloatAttentionTracksDoubleAcrossBlocks) {
  // The oneDNN path with block offsets against the f64 reference path, forward and backward; with
  // KVH = 2 the grouped products (query head stride G·hs) as well.
  for (const AttentionShape& s :
       {AttentionShape{2, 130, 16, 2}, AttentionShape{2, 130, 32, 4, 2}}) {
    const int B = s.B, T = s.T, C = s.C, NH = s.NH;
    Vec qkv = random_vector(B * T * size_t(s.width()), 21), r = random_vector(B * T * C, 22);
    Vec out(B * T * C), att(B * NH * T * T), dqkv(qkv.size()), datt(att.size());
    attention_forward(out.data(), att.data(), qkv.data(), s);
    attention_backward(dqkv.data(), datt.data(), r.data(), qkv.data(), att.data(), s);
    std::vector<float> qf(qkv.begin(), qkv.end()), rf(r.begin(), r.end()), of(out.size()),
        af(att.size()), dqf(qkv.size()), daf(att.size());
    attention_forward(of.data(), af.data(), qf.data(), s);
    attention_backward(dqf.data(), daf.data(), rf.data(), qf.data(), af.data(), s);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(of[i], out[i], 1e-5) << i;
    for (size_t i = 0; i < dqkv.size(); ++i) ASSERT_NEAR(dqf[i], dqkv[i], 1e-4) << i;
  }
}

TEST(GradCheck, AttentionIsCausal) {
  // Changing the last position's k and v must not change any earlier output.
  const int B = 1, T = 4, C = 4, NH = 1;
  Vec qkv = random_vector(T * 3 * C, 16), out(T * C), out2(T * C), att(T * T);
  attention_forward(out.data(), att.data(), qkv.data(), {B, T, C, NH});
  for (int c = C; c < 3 * C; ++c) qkv[(T - 1) * 3 * C + c] += 1.0;
  attention_forward(out2.data(), att.data(), qkv.data(), {B, T, C, NH});
  for (int i = 0; i < (T - 1) * C; ++i) EXPECT_DOUBLE_EQ(out[i], out2[i]);
  for (int t = 0; t < T; ++t)
    for (int j = t + 1; j < T; ++j) EXPECT_EQ(att[t * T + j], 0.0);
}

// ---- rotary position embedding ----

// The rotation of qkv (B,T,W) from the contract, element by element: the pair (i, i + hs/2) of
// every q and k head at position pos0 + t turns by (pos0 + t) · theta^(-2i/hs).
Vec rope_direct(const Vec& qkv, const AttentionShape& s, int pos0, double theta, bool inverse) {
  const int hs = s.head_size(), half = hs / 2;
  const int64_t W = s.width();
  Vec y = qkv;
  for (int b = 0; b < s.B; ++b)
    for (int t = 0; t < s.T; ++t)
      for (int h = 0; h < s.NH + s.kv_heads(); ++h)
        for (int i = 0; i < half; ++i) {
          const double angle =
              (inverse ? -1.0 : 1.0) * (pos0 + t) / std::pow(theta, 2.0 * i / double(hs));
          const size_t x1 = size_t((int64_t(b) * s.T + t) * W + h * hs + i), x2 = x1 + half;
          y[x1] = qkv[x1] * std::cos(angle) - qkv[x2] * std::sin(angle);
          y[x2] = qkv[x2] * std::cos(angle) + qkv[x1] * std::sin(angle);
        }
  return y;
}

TEST(GradCheck, RopeMatchesTheRotationFormula) {
  struct Case {
    AttentionShape s;
    int pos0;
    double theta;
  };
  for (const Case& c : {Case{{2, 5, 32, 4, 2}, 0, 10000.0}, Case{{1, 3, 24, 2, 1}, 1000, 500000.0},
                        Case{{2, 4, 12, 3}, 7, 100.0}}) {
    const AttentionShape& s = c.s;
    const Vec x = random_vector(size_t(s.B) * s.T * size_t(s.width()), 61);
    for (bool inverse : {false, true}) {
      Vec y = x;
      rope(y.data(), s, c.pos0, c.theta, inverse);
      const Vec want = rope_direct(x, s, c.pos0, c.theta, inverse);
      for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], want[i], 1e-13) << i;
      // v untouched, bit for bit
      const int64_t W = s.width(), v0 = s.C + s.kv_width();
      for (size_t i = 0; i < y.size(); ++i) {
        if (int64_t(i) % W >= v0) {
          ASSERT_EQ(y[i], x[i]) << i;
        }
      }
      std::vector<float> yf(x.begin(), x.end());
      rope(yf.data(), s, c.pos0, c.theta, inverse);
      for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(yf[i], want[i], 1e-6) << i;
    }
  }
  // One unit vector per pair: the angle itself, at positions 0 and 37 and theta 10000 and 321.
  const AttentionShape s{1, 38, 8, 1};
  for (double theta : {10000.0, 321.0}) {
    for (int i = 0; i < 4; ++i) {
      Vec x(size_t(s.T) * size_t(s.width()), 0.0);
      for (int t = 0; t < s.T; ++t) x[size_t(t * s.width() + i)] = 1.0;
      rope(x.data(), s, 0, theta, false);
      for (int t : {0, 37}) {
        const double angle = t * std::pow(theta, -2.0 * i / 8);
        EXPECT_NEAR(x[size_t(t * s.width() + i)], std::cos(angle), 1e-15);
        EXPECT_NEAR(x[size_t(t * s.width() + i + 4)], std::sin(angle), 1e-15);
      }
    }
  }
}

// The inverse rotation is the exact adjoint (the backward): <rope(x), r> = <x, rope⁻¹(r)>, and a
// rotation followed by its inverse gives x back; also against central differences.
TEST(GradCheck, RopeInverseIsTheAdjoint) {
  const AttentionShape s{2, 7, 32, 4, 2};
  const int pos0 = 11;
  const double theta = 10000.0;
  Vec x = random_vector(size_t(s.B) * s.T * size_t(s.width()), 71), r = random_vector(x.size(), 72);
  Vec y = x, z = r;
  rope(y.data(), s, pos0, theta, false);
  rope(z.data(), s, pos0, theta, true);
  EXPECT_NEAR(dot(y, r), dot(x, z), 1e-12 * std::abs(dot(x, z)));
  Vec back = y;
  rope(back.data(), s, pos0, theta, true);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(back[i], x[i], 1e-14) << i;
  Vec out;
  auto loss = [&] {
    out = x;
    rope(out.data(), s, pos0, theta, false);
    return dot(out, r);
  };
  EXPECT_LT(max_grad_error(x, z, loss), kGradTolerance);
}

TEST(GradCheck, SoftmaxCrossEntropyOverPaddedVocab) {
  const int N = 4, V = 5, Vp = 8;
  Vec logits = random_vector(N * Vp, 17, 2.0);
  for (int i = 0; i < N; ++i)
    for (int v = V; v < Vp; ++v) logits[i * Vp + v] = 1e3;  // padding must never win
  std::vector<int32_t> y = {0, 4, 2, 2};
  Vec losses(N);
  const double dloss = 0.25;
  auto loss = [&] {
    return dloss * softmax_xent_forward(losses.data(), logits.data(), y.data(), N, V, Vp);
  };
  double fwd = loss();
  EXPECT_LT(fwd, 10.0);  // the 1e3 padded logits did not enter the softmax
  Vec grad = logits;
  double fused =
      softmax_xent_forward_backward(losses.data(), grad.data(), y.data(), N, V, Vp, dloss);
  EXPECT_NEAR(dloss * fused, fwd, 1e-12);
  for (int i = 0; i < N; ++i)
    for (int v = V; v < Vp; ++v) EXPECT_EQ(grad[i * Vp + v], 0.0);
  EXPECT_LT(max_grad_error(logits, grad, loss), kGradTolerance);
}

TEST(GradCheck, FloatKernelsTrackDouble) {
  // The f32 instantiation (vectorised exp/tanh) stays close to the f64 one.
  const int N = 64, V = 50, Vp = 64;
  Vec logits = random_vector(N * Vp, 18, 3.0);
  std::vector<float> lf(logits.begin(), logits.end());
  std::vector<int32_t> y(N);
  for (int i = 0; i < N; ++i) y[i] = (i * 7) % V;
  Vec ld(N);
  std::vector<float> lossf(N);
  double d = softmax_xent_forward_backward(ld.data(), logits.data(), y.data(), N, V, Vp, 1.0);
  double f = softmax_xent_forward_backward(lossf.data(), lf.data(), y.data(), N, V, Vp, 1.0f);
  EXPECT_NEAR(f, d, 1e-5 * std::abs(d));
  for (int i = 0; i < N * Vp; ++i) EXPECT_NEAR(lf[i], logits[i], 1e-6);
}

}  // namespace
}  // namespace tetra::cpu
