// Every vector branch of the f32 element-wise kernels (kernels/cpu/eltwise_simd.h) that this CPU
// runs, forced in turn, against the f64 kernels (the portable loops in double precision, which the
// conformance suite checks against its own references). The conformance suite runs only the
// branch the machine picks; this test runs the others too, with sizes that leave every vector
// tail non-empty. Each test prints the branches it ran; a branch this CPU lacks is reported, not
// failed.
#include "kernels/cpu/eltwise_simd.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/vec_math.h"

namespace tetra::cpu {
namespace {

constexpr SimdIsa kIsas[] = {SimdIsa::generic, SimdIsa::avx2, SimdIsa::avx512};

// Restores the branch the process picked when a test ends.
class Branches : public ::testing::Test {
 protected:
  void TearDown() override { set_simd_isa(picked_); }
  // Runs `body` with each branch this CPU supports forced; records which ran.
  template <typename Body>
  void each(Body body) {
    std::string ran, skipped;
    for (SimdIsa isa : kIsas) {
      if (!simd_isa_supported(isa)) {
        skipped += std::string(" ") + simd_isa_name(isa);
        continue;
      }
      set_simd_isa(isa);
      SCOPED_TRACE(simd_isa_name(isa));
      body();
      ran += std::string(" ") + simd_isa_name(isa);
    }
    std::printf("branches run:%s; not supported here:%s\n", ran.c_str(),
                skipped.empty() ? " none" : skipped.c_str());
  }
  SimdIsa picked_ = simd_isa();
};

std::vector<float> uniform(size_t n, float lo, float hi, unsigned seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(g);
  return v;
}
std::vector<double> wide(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// The conformance suite's f32 bound (Tol::arith): relative error, or absolute below magnitude 1.
void expect_near(const std::vector<float>& got, const std::vector<double>& want, const char* what,
                 double bound = 1e-5) {
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::abs(got[i] - want[i]) / std::max(1.0, std::abs(want[i])));
  EXPECT_LT(worst, bound) << what;
}

TEST_F(Branches, GeluForwardAndBackward) {
  each([] {
    for (int64_t N : {1, 15, 17, 1000, 40001}) {
      // |x| up to 12 reaches exp's clamps through -2u.
      const std::vector<float> x = uniform(size_t(N), -12, 12, unsigned(N)),
                               dy = uniform(size_t(N), -1, 1, unsigned(N + 1));
      std::vector<double> rx = wide(x), rdy = wide(dy), rout(static_cast<size_t>(N)),
                          rdx(static_cast<size_t>(N));
      gelu_forward(rout.data(), rx.data(), N);
      gelu_backward(rdx.data(), rx.data(), rdy.data(), N);
      std::vector<float> out(static_cast<size_t>(N)), dx(static_cast<size_t>(N)), alias = dy;
      gelu_forward(out.data(), x.data(), N);
      gelu_backward(dx.data(), x.data(), dy.data(), N);
      gelu_backward(alias.data(), x.data(), alias.data(), N);
      expect_near(out, rout, "gelu_forward");
      expect_near(dx, rdx, "gelu_backward");
      EXPECT_EQ(alias, dx) << "gelu_backward with dinp aliasing dout";
    }
  });
}

TEST_F(Branches, SwigluForwardAndBackward) {
  each([] {
    for (int64_t N : {1, 15, 17, 1000, 40001}) {
      // |gate| up to 100 reaches exp's clamps.
      const std::vector<float> gate = uniform(size_t(N), -100, 100, unsigned(N + 2)),
                               up = uniform(size_t(N), -2, 2, unsigned(N + 3)),
                               dy = uniform(size_t(N), -1, 1, unsigned(N + 4));
      std::vector<double> rg = wide(gate), ru = wide(up), rdy = wide(dy),
                          rout(static_cast<size_t>(N)), rdg(static_cast<size_t>(N)),
                          rdu(static_cast<size_t>(N));
      swiglu_forward(rout.data(), rg.data(), ru.data(), N);
      swiglu_backward(rdg.data(), rdu.data(), rdy.data(), rg.data(), ru.data(), N);
      std::vector<float> out(static_cast<size_t>(N)), dg(static_cast<size_t>(N)),
          du(static_cast<size_t>(N)), du2(static_cast<size_t>(N)), alias = dy;
      swiglu_forward(out.data(), gate.data(), up.data(), N);
      swiglu_backward(dg.data(), du.data(), dy.data(), gate.data(), up.data(), N);
      swiglu_backward(alias.data(), du2.data(), alias.data(), gate.data(), up.data(), N);
      expect_near(out, rout, "swiglu_forward");
      expect_near(dg, rdg, "swiglu_backward dgate");
      expect_near(du, rdu, "swiglu_backward dup");
      EXPECT_EQ(alias, dg) << "swiglu_backward with dgate aliasing dout";
      EXPECT_EQ(du2, du) << "swiglu_backward dup with dgate aliasing dout";
    }
  });
}

TEST_F(Branches, BiasGeluAndItsGradient) {
  each([] {
    for (auto [N, OC] : {std::pair{3, 1}, {5, 31}, {37, 70}, {64, 129}, {33, 1024}}) {
      const size_t n = size_t(N) * OC;
      const std::vector<float> fch0 = uniform(n, -6, 6, unsigned(n)),
                               bias = uniform(size_t(OC), -1, 1, unsigned(OC)),
                               dy = uniform(n, -1, 1, unsigned(n + 7));
      std::vector<double> rfch = wide(fch0), rb = wide(bias), rout(n), rdy = wide(dy), rdx(n),
                          rdb(static_cast<size_t>(OC), 0.5);
      bias_gelu_forward(rout.data(), rfch.data(), rb.data(), N, OC);
      std::vector<float> fch = fch0, out(n);
      bias_gelu_forward(out.data(), fch.data(), bias.data(), N, OC);
      expect_near(fch, rfch, "bias_gelu_forward fch");
      expect_near(out, rout, "bias_gelu_forward out");
      // The gradient at the f32 pre-activations the kernel left, so both sides see one input.
      std::vector<double> rin = wide(fch);
      gelu_bias_backward(rdx.data(), rdb.data(), rin.data(), rdy.data(), N, OC);
      std::vector<float> dx(n), db(static_cast<size_t>(OC), 0.5f),
          db2(static_cast<size_t>(OC), 0.5f), alias = dy;
      gelu_bias_backward(dx.data(), db.data(), fch.data(), dy.data(), N, OC);
      expect_near(dx, rdx, "gelu_bias_backward dinp");
      expect_near(db, rdb, "gelu_bias_backward dbias");
      gelu_bias_backward(alias.data(), db2.data(), fch.data(), alias.data(), N, OC);
      EXPECT_EQ(alias, dx) << "dinp aliasing dout";
      EXPECT_EQ(db2, db) << "the same thread count gives the same bits";
    }
  });
}

// Logits ~ U(-8, 8), the padding at 40 (it must not reach the softmax).
TEST_F(Branches, SoftmaxCrossEntropy) {
  each([] {
    for (auto [N, V, Vp] : {std::tuple{1, 2, 2}, {3, 17, 24}, {7, 100, 128}, {5, 4096, 4096}}) {
      std::vector<float> logits = uniform(size_t(N) * Vp, -8, 8, unsigned(N * V));
      std::vector<int32_t> targets(static_cast<size_t>(N));
      for (int i = 0; i < N; ++i) {
        targets[size_t(i)] = (i * 7919) % V;
        for (int v = V; v < Vp; ++v) logits[size_t(i) * Vp + v] = 40;
      }
      std::vector<double> rl = wide(logits), rloss(static_cast<size_t>(N)),
                          rfwd(static_cast<size_t>(N));
      const double rsum =
          softmax_xent_forward_backward(rloss.data(), rl.data(), targets.data(), N, V, Vp, 0.25);
      softmax_xent_forward(rfwd.data(), wide(logits).data(), targets.data(), N, V, Vp);
      std::vector<float> g = logits, loss(static_cast<size_t>(N)), fwd(static_cast<size_t>(N));
      const double sum =
          softmax_xent_forward_backward(loss.data(), g.data(), targets.data(), N, V, Vp, 0.25f);
      const double fsum = softmax_xent_forward(fwd.data(), logits.data(), targets.data(), N, V, Vp);
      expect_near(loss, rloss, "losses");
      expect_near(fwd, rfwd, "forward losses");
      expect_near(g, rl, "dlogits");
      EXPECT_NEAR(sum, rsum, 1e-5 * std::max(1.0, std::abs(rsum)));
      EXPECT_NEAR(fsum, rsum, 1e-5 * std::max(1.0, std::abs(rsum)));

      // The vocabulary-parallel kernel with a group of one holding the whole padded row.
      const GroupReduce<float> none = [](float*, int64_t) {};
      std::vector<float> vg = logits, vloss(static_cast<size_t>(N));
      const double vsum = softmax_xent_vocab_parallel(vloss.data(), vg.data(), targets.data(), N,
                                                      Vp, 0, V, true, 0.25f, none, none);
      expect_near(vloss, rloss, "vocab-parallel losses");
      expect_near(vg, rl, "vocab-parallel dlogits");
      EXPECT_NEAR(vsum, rsum, 1e-5 * std::max(1.0, std::abs(rsum)));
      std::vector<float> untouched = logits;
      softmax_xent_vocab_parallel(vloss.data(), untouched.data(), targets.data(), N, Vp, 0, V,
                                  false, 0.25f, none, none);
      EXPECT_EQ(untouched, logits) << "vocab-parallel forward leaves the logits";
      expect_near(vloss, rloss, "vocab-parallel forward losses");
    }
  });
}

// Non-finite and huge inputs give what the portable loops give (exactly where not finite): the
// branches clamp exp's argument with minps/maxps, whose NaN rule (the second operand) is the
// portable loops' `a < b ? a : b`. GELU's NaN stays NaN through x; a +inf logit (the row max) gives
// the same loss in every branch.
TEST_F(Branches, NonFiniteInputsGiveWhatThePortableLoopsGive) {
  const float inf = std::numeric_limits<float>::infinity(),
              nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> specials = {nan, inf, -inf, 1e30f, -1e30f, 100.0f, -100.0f, 0.0f};
  std::vector<float> x(37, 0.5f), dy(37, 1.0f);  // a vector body and a tail at both widths
  for (size_t i = 0; i < specials.size(); ++i) {
    x[i] = specials[i];
    x[36 - i] = specials[i];
  }
  std::vector<float> logits(2 * 40, 1.0f);
  logits[3] = inf;  // row 0's max
  const std::vector<int32_t> targets = {5, 7};
  struct Out {
    std::vector<float> gelu, grad, loss;
  };
  auto run = [&] {
    Out o{std::vector<float>(x.size()), std::vector<float>(x.size()), std::vector<float>(2)};
    gelu_forward(o.gelu.data(), x.data(), int64_t(x.size()));
    gelu_backward(o.grad.data(), x.data(), dy.data(), int64_t(x.size()));
    softmax_xent_forward(o.loss.data(), logits.data(), targets.data(), 2, 40, 40);
    return o;
  };
  // Non-finite values must match exactly (NaN for NaN, the same infinity); finite ones to the
  // rounding the branches' fused multiply-adds change (1e-5 relative).
  auto same = [](const std::vector<float>& got, const std::vector<float>& want, const char* what) {
    for (size_t i = 0; i < got.size(); ++i) {
      const bool ok = std::isfinite(got[i]) && std::isfinite(want[i])
                          ? std::abs(got[i] - want[i]) <= 1e-5f * std::abs(want[i])
                          : (std::isnan(got[i]) && std::isnan(want[i])) || got[i] == want[i];
      EXPECT_TRUE(ok) << what << " [" << i << "]: " << got[i] << " against " << want[i];
    }
  };
  set_simd_isa(SimdIsa::generic);
  const Out want = run();
  EXPECT_TRUE(std::isnan(want.gelu[0]) && std::isnan(want.grad[0])) << "NaN stays NaN";
  each([&] {
    const Out got = run();
    same(got.gelu, want.gelu, "gelu_forward");
    same(got.grad, want.grad, "gelu_backward");
    same(got.loss, want.loss, "softmax_xent_forward");
  });
}

TEST_F(Branches, ForcingAnUnsupportedBranchThrows) {
  for (SimdIsa isa : kIsas) {
    if (!simd_isa_supported(isa)) {
      EXPECT_THROW(set_simd_isa(isa), std::invalid_argument);
    }
  }
  EXPECT_TRUE(simd_isa_supported(SimdIsa::generic));
  EXPECT_TRUE(simd_isa_supported(simd_isa()));
}

}  // namespace
}  // namespace tetra::cpu
