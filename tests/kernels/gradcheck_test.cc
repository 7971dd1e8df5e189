// Finite-difference checks of every kernel's backward, in double precision.
#include "tests/kernels/gradcheck.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
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
double attention_grad_error(int B, int T, int C, int NH, uint32_t seed) {
  Vec qkv = random_vector(size_t(B) * T * 3 * C, seed),
      r = random_vector(size_t(B) * T * C, seed + 1);
  Vec out(r.size()), att(size_t(B) * NH * T * T);
  auto loss = [&] {
    attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
    return dot(out, r);
  };
  loss();
  Vec dqkv(qkv.size()), datt(att.size());
  attention_backward(dqkv.data(), datt.data(), r.data(), qkv.data(), att.data(), B, T, C, NH);
  return max_grad_error(qkv, dqkv, loss);
}

TEST(GradCheck, CausalAttention) {
  EXPECT_LT(attention_grad_error(2, 5, 8, 2, 14), kGradTolerance);
}

TEST(GradCheck, CausalAttentionAcrossQueryBlocks) {
  // T = 70 spans two causal blocks (64 + 6 query rows): block-wise products and accumulation.
  EXPECT_LT(attention_grad_error(1, 70, 4, 2, 19), kGradTolerance);
}

TEST(GradCheck, FloatAttentionTracksDoubleAcrossBlocks) {
  // The oneDNN path with block offsets against the f64 reference path, forward and backward.
  const int B = 2, T = 130, C = 16, NH = 2;
  Vec qkv = random_vector(B * T * 3 * C, 21), r = random_vector(B * T * C, 22);
  Vec out(B * T * C), att(B * NH * T * T), dqkv(qkv.size()), datt(att.size());
  attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
  attention_backward(dqkv.data(), datt.data(), r.data(), qkv.data(), att.data(), B, T, C, NH);
  std::vector<float> qf(qkv.begin(), qkv.end()), rf(r.begin(), r.end()), of(out.size()),
      af(att.size()), dqf(qkv.size()), daf(att.size());
  attention_forward(of.data(), af.data(), qf.data(), B, T, C, NH);
  attention_backward(dqf.data(), daf.data(), rf.data(), qf.data(), af.data(), B, T, C, NH);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(of[i], out[i], 1e-5) << i;
  for (size_t i = 0; i < dqkv.size(); ++i) ASSERT_NEAR(dqf[i], dqkv[i], 1e-4) << i;
}

TEST(GradCheck, AttentionIsCausal) {
  // Changing the last position's k and v must not change any earlier output.
  const int B = 1, T = 4, C = 4, NH = 1;
  Vec qkv = random_vector(T * 3 * C, 16), out(T * C), out2(T * C), att(T * T);
  attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
  for (int c = C; c < 3 * C; ++c) qkv[(T - 1) * 3 * C + c] += 1.0;
  attention_forward(out2.data(), att.data(), qkv.data(), B, T, C, NH);
  for (int i = 0; i < (T - 1) * C; ++i) EXPECT_DOUBLE_EQ(out[i], out2[i]);
  for (int t = 0; t < T; ++t)
    for (int j = t + 1; j < T; ++j) EXPECT_EQ(att[t * T + j], 0.0);
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
