// oneDNN products against the reference loop: plain, transposed, strided-batched (as attention
// uses them), with bias and accumulation, and bf16 operands on whichever path this CPU takes.
#include "kernels/cpu/matmul.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/attention.h"
#include "tests/kernels/cpu_products.h"
#include "tests/kernels/random_floats.h"

namespace tetra::cpu {
namespace {

using test_products::matmul_nn;
using test_products::matmul_nt;
using test_products::matmul_tn;

using testing::random_floats;

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

TEST(Matmul, TwoDimensionalHelpersMatchReference) {
  const int64_t M = 33, N = 17, K = 65;
  auto a = random_floats(M * K, 1), w = random_floats(N * K, 2), bias = random_floats(N, 3);
  std::vector<float> out(M * N, 0.5f), ref(M * N, 0.5f);
  matmul_nt(out.data(), a.data(), w.data(), bias.data(), M, N, K, /*accumulate=*/true);
  MatmulArgs x;
  x.M = M, x.N = N, x.K = K;
  x.a = {a.data(), {M * K, M * K, K, 1}};
  x.b = {w.data(), {N * K, N * K, 1, K}};
  x.c = ref.data();
  x.c_strides = {M * N, M * N, N, 1};
  x.bias = bias.data();
  x.accumulate = true;
  matmul_reference(x);
  EXPECT_LT(max_abs_diff(out, ref), 1e-4f);

  // a^T b with a (K, M)
  auto at = random_floats(K * M, 4), b = random_floats(K * N, 5);
  std::vector<float> tn(M * N), tn_ref(M * N, 0.0f);
  matmul_tn(tn.data(), at.data(), b.data(), M, N, K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) tn_ref[m * N + n] += at[k * M + m] * b[k * N + n];
  EXPECT_LT(max_abs_diff(tn, tn_ref), 1e-4f);
}

TEST(Matmul, StridedBatchesAsAttentionUsesThem) {
  const int64_t B = 2, NH = 3, T = 7, hs = 4, C = NH * hs;
  auto qkv = random_floats(B * T * 3 * C, 6);
  MatmulArgs x;
  x.b0 = B, x.b1 = NH, x.M = T, x.N = T, x.K = hs;
  x.a = {qkv.data(), {T * 3 * C, hs, 3 * C, 1}};      // q
  x.b = {qkv.data() + C, {T * 3 * C, hs, 1, 3 * C}};  // k^T
  std::vector<float> out(B * NH * T * T), ref(out.size());
  x.c = out.data();
  x.c_strides = {NH * T * T, T * T, T, 1};
  matmul(x);
  x.c = ref.data();
  matmul_reference(x);
  EXPECT_LT(max_abs_diff(out, ref), 1e-5f);
}

std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16::from_float(v[i]);
  return out;
}

std::vector<float> to_float(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = v[i].to_float();
  return out;
}

// The ISA cap the environment puts on oneDNN (ONEDNN_MAX_CPU_ISA, or its older name
// DNNL_MAX_CPU_ISA), lower-cased; empty when uncapped.
std::string isa_cap() {
  for (const char* name : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
    if (const char* v = std::getenv(name); v && *v) {
      std::string s(v);
      std::transform(s.begin(), s.end(), s.begin(),
                     [](unsigned char c) { return std::tolower(c); });
      return s;
    }
  }
  return "";
}

// oneDNN 2.6 creates bf16 matmuls from avx512_core up (with bf16 instructions from
// avx512_core_bf16, emulated below) and none for AVX2 and older ISAs. cpu_isa values are bit
// sets: an ISA includes avx512_core when it has all of avx512_core's bits.
TEST(Matmul, Bf16PathIsTheOneThisCpuSupports) {
  const Bf16MatmulPath& path = bf16_matmul_path();
  RecordProperty("bf16_path", path.describe());
  std::cout << "[ bf16     ] matmul path on this CPU: " << path.describe() << std::endl;
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto core = static_cast<unsigned>(dnnl::cpu_isa::avx512_core);
  EXPECT_EQ(path.native, (isa & core) == core) << path.describe();
  const std::string cap = isa_cap();
  if (cap == "avx2") {
    // The CTest entry kernels_tests_max_isa_avx2: the fallback must be the branch that ran.
    EXPECT_FALSE(path.native) << path.describe();
    EXPECT_EQ(path.isa, "avx2");
  } else if (cap.empty() && __builtin_cpu_supports("avx512bf16")) {
    // bf16 hardware: the bf16 primitive itself runs, not the widening fallback.
    EXPECT_TRUE(path.native) << path.describe();
    EXPECT_NE(path.isa.find("avx512_core_"), std::string::npos) << path.describe();
  }
}

TEST(Matmul, Bf16OperandsOnTheSameSeam) {
  std::cout << "[ bf16     ] " << bf16_matmul_path().describe() << std::endl;
  const int64_t M = 16, N = 32, K = 64;
  const auto a16 = to_bf16(random_floats(M * K, 7)), b16 = to_bf16(random_floats(K * N, 8));
  const auto bias = random_floats(N, 9);
  std::vector<float> out(M * N, 0.25f), ref(M * N, 0.25f);
  MatmulArgs x;
  x.M = M, x.N = N, x.K = K;
  x.a = {a16.data(), {M * K, M * K, K, 1}, DType::bf16};
  x.b = {b16.data(), {K * N, K * N, N, 1}, DType::bf16};
  x.c = out.data();
  x.c_strides = {M * N, M * N, N, 1};
  x.bias = bias.data();
  x.accumulate = true;
  matmul(x);
  // Reference on the bf16-rounded inputs: only accumulation order differs.
  const auto a = to_float(a16), b = to_float(b16);
  x.a = {a.data(), x.a.strides};
  x.b = {b.data(), x.b.strides};
  x.c = ref.data();
  matmul_reference(x);
  EXPECT_LT(max_abs_diff(out, ref), 1e-4f);
}

TEST(Matmul, Bf16StridedBatchesAsAttentionUsesThem) {
  const int64_t B = 2, NH = 3, T = 7, hs = 4, C = NH * hs;
  const auto qkv16 = to_bf16(random_floats(B * T * 3 * C, 10));
  const auto qkv = to_float(qkv16);
  MatmulArgs x;
  x.b0 = B, x.b1 = NH, x.M = T, x.N = T, x.K = hs;
  x.a = {qkv16.data(), {T * 3 * C, hs, 3 * C, 1}, DType::bf16};      // q
  x.b = {qkv16.data() + C, {T * 3 * C, hs, 1, 3 * C}, DType::bf16};  // k^T
  std::vector<float> out(B * NH * T * T), ref(out.size());
  x.c = out.data();
  x.c_strides = {NH * T * T, T * T, T, 1};
  matmul(x);
  x.a = {qkv.data(), x.a.strides};
  x.b = {qkv.data() + C, x.b.strides};
  x.c = ref.data();
  matmul_reference(x);
  EXPECT_LT(max_abs_diff(out, ref), 1e-5f);
}

std::vector<float> rounded_to_bf16(const std::vector<float>& v) { return to_float(to_bf16(v)); }

// Mixed precision (train.precision = bf16) exists only where the CPU has bf16 instructions:
// elsewhere the scratch refuses to be made, naming the ISA (kernels_tests_max_isa_avx2 runs that
// branch on every machine). Says which branch this run takes, and asserts the refusal in the
// second.
bool has_bf16_or_refuses() {
  const Bf16MatmulPath& path = bf16_matmul_path();
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto with_bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
  EXPECT_EQ(path.hardware, (isa & with_bf16) == with_bf16) << path.describe();
  if (isa_cap() == "avx2") {
    EXPECT_FALSE(path.hardware);
  }
  std::cout << "[ bf16     ] mixed precision " << (path.hardware ? "runs" : "is refused") << " on "
            << path.describe() << std::endl;
  if (path.hardware) return true;
  try {
    Bf16Operands ops(host_device(), 16);
    std::vector<float> a(4, 1.0f), out(4);
    matmul_nn(out.data(), a.data(), a.data(), 2, 2, 2, false, "test", &ops);
    ADD_FAILURE() << "mixed-precision product ran on " << path.describe();
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("[matmul] mixed-precision products need bf16 instructions"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("oneDNN ISA " + path.isa), std::string::npos) << what;
  }
  return false;
}

// The three layouts the model uses (A·W^T with bias and accumulation, A^T·B, A·B), with f32
// operands rounded to bf16 on the way in: equal to the f32 reference over the rounded operands
// (only the accumulation order differs), and measurably not the unrounded product.
TEST(Matmul, MixedPrecisionProductsRoundTheirOperandsToBf16) {
  if (!has_bf16_or_refuses()) return;
  const int64_t M = 33, N = 17, K = 65;
  Bf16Operands ops(host_device(), 8);  // grows to what each product needs
  const auto a = random_floats(M * K, 11), w = random_floats(N * K, 12),
             bias = random_floats(N, 13);
  const auto ar = rounded_to_bf16(a), wr = rounded_to_bf16(w);
  std::vector<float> out(M * N, 0.5f), ref(M * N, 0.5f), exact(M * N, 0.5f);
  matmul_nt(out.data(), a.data(), w.data(), bias.data(), M, N, K, true, "test", &ops);
  matmul_nt(ref.data(), ar.data(), wr.data(), bias.data(), M, N, K, true, "test");
  matmul_nt(exact.data(), a.data(), w.data(), bias.data(), M, N, K, true, "test");
  EXPECT_LT(max_abs_diff(out, ref), 1e-4f);
  EXPECT_GT(max_abs_diff(out, exact), 1e-3f);

  const auto at = random_floats(K * M, 14), b = random_floats(K * N, 15);
  const auto atr = rounded_to_bf16(at), br = rounded_to_bf16(b);
  std::vector<float> tn(M * N), tn_ref(M * N);
  matmul_tn(tn.data(), at.data(), b.data(), M, N, K, false, "test", &ops);
  matmul_tn(tn_ref.data(), atr.data(), br.data(), M, N, K, false, "test");
  EXPECT_LT(max_abs_diff(tn, tn_ref), 1e-4f);

  std::vector<float> nn(M * N), nn_ref(M * N);
  const auto bt = random_floats(K * N, 16);
  matmul_nn(nn.data(), a.data(), bt.data(), M, N, K, false, "test", &ops);
  matmul_nn(nn_ref.data(), ar.data(), rounded_to_bf16(bt).data(), M, N, K, false, "test");
  EXPECT_LT(max_abs_diff(nn, nn_ref), 1e-4f);
}

// Rounding is to nearest, ties to even, as torch's f32 -> bf16 conversion: A times the identity
// gives back the rounded A exactly.
TEST(Matmul, MixedPrecisionRoundsToNearestEven) {
  if (!has_bf16_or_refuses()) return;
  const float tie_down = 1.0f + 0x1p-8f;          // halfway between 1 and 1 + 2^-7: even is 1
  const float tie_up = 1.0f + 3 * 0x1p-8f;        // halfway between 1 + 2^-7 and 1 + 2^-6: up
  const float above = 1.0f + 0x1p-8f + 0x1p-20f;  // just past the tie: up
  const std::vector<float> a = {tie_down, tie_up, above, -tie_up};
  std::vector<float> eye(16, 0.0f), out(4);
  for (int i = 0; i < 4; ++i) eye[size_t(i) * 5] = 1.0f;
  Bf16Operands ops(host_device(), 32);
  matmul_nn(out.data(), a.data(), eye.data(), 1, 4, 4, false, "test", &ops);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 1.0f + 0x1p-6f);
  EXPECT_EQ(out[2], 1.0f + 0x1p-7f);
  EXPECT_EQ(out[3], -(1.0f + 0x1p-6f));
}

// Mixed-precision attention (kernels/cpu/attention.h) against a double-precision reference that
// rounds exactly where tetra says it does: q, k, v and dy to bf16, and the probabilities to bf16
// for att·v and dv; softmax, its backward, dq and dk (from the f32 qkv) and the results unrounded.
// The reference rounds tetra's own f32 probabilities (so that one f32 ulp cannot flip a rounding),
// after checking them. T = 70 spans two causal blocks. The f32 kernel against the same reference
// shows that the tolerances can fail.
TEST(Matmul, MixedPrecisionAttentionRoundsEachOperandOnce) {
  if (!has_bf16_or_refuses()) return;
  const int B = 2, T = 70, C = 16, NH = 2, hs = C / NH;
  const size_t BT = size_t(B) * T, TT = size_t(T) * T;
  const auto qkv = random_floats(BT * 3 * C, 21), dy = random_floats(BT * C, 22);
  Bf16Operands ops(host_device(), 8);
  std::vector<float> out(BT * C), att(size_t(B) * NH * TT), dqkv(qkv.size()), datt(att.size());
  const AttentionShape shape{B, T, C, NH};
  attention_forward(out.data(), att.data(), qkv.data(), shape, &ops);
  attention_backward(dqkv.data(), datt.data(), dy.data(), qkv.data(), att.data(), shape, &ops);
  std::vector<float> out32(out.size()), att32(att.size()), dqkv32(dqkv.size()), datt32(att.size());
  attention_forward(out32.data(), att32.data(), qkv.data(), shape);
  attention_backward(dqkv32.data(), datt32.data(), dy.data(), qkv.data(), att32.data(), shape);

  const auto r = rounded_to_bf16(qkv), dyr = rounded_to_bf16(dy);
  const auto round = [](double x) { return double(bf16::from_float(float(x)).to_float()); };
  const double scale = 1.0 / std::sqrt(double(hs));
  std::vector<double> out_ref(out.size(), 0.0), dqkv_ref(qkv.size(), 0.0);
  double att_err = 0;
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      const size_t base = (size_t(b) * NH + h) * TT;
      auto at = [&](const auto& x, int t, int part, int d) {
        return double(x[(size_t(b) * T + t) * 3 * C + part * C + h * hs + d]);
      };
      auto g = [&](int t, int d) { return double(dyr[(size_t(b) * T + t) * C + h * hs + d]); };
      auto grad = [&](int t, int part, int d) -> double& {
        return dqkv_ref[(size_t(b) * T + t) * 3 * C + part * C + h * hs + d];
      };
      for (int t = 0; t < T; ++t) {
        std::vector<double> s(size_t(t) + 1, 0.0), datt_ref(s.size(), 0.0);
        double mx = -1e300, sum = 0, dot = 0;
        for (int j = 0; j <= t; ++j) {
          for (int e = 0; e < hs; ++e) s[j] += at(r, t, 0, e) * at(r, j, 1, e);
          mx = std::max(mx, s[j] * scale);
        }
        for (int j = 0; j <= t; ++j) sum += std::exp(s[j] * scale - mx);
        for (int j = 0; j <= t; ++j) {
          const double p = att[base + size_t(t) * T + j];
          att_err = std::max(att_err, std::abs(p - std::exp(s[j] * scale - mx) / sum));
          for (int e = 0; e < hs; ++e) datt_ref[j] += g(t, e) * at(r, j, 2, e);
          dot += p * datt_ref[j];
        }
        for (int j = 0; j <= t; ++j) {
          const double p = att[base + size_t(t) * T + j], p16 = round(p);
          const double dpre = scale * p * (datt_ref[j] - dot);
          for (int e = 0; e < hs; ++e) {
            out_ref[(size_t(b) * T + t) * C + h * hs + e] += p16 * at(r, j, 2, e);
            grad(j, 2, e) += p16 * g(t, e);
            grad(t, 0, e) += dpre * at(qkv, j, 1, e);
            grad(j, 1, e) += dpre * at(qkv, t, 0, e);
          }
        }
      }
    }
  }
  const auto err = [](const std::vector<float>& got, const std::vector<double>& want) {
    double m = 0;
    for (size_t i = 0; i < got.size(); ++i) m = std::max(m, std::abs(got[i] - want[i]));
    return m;
  };
  EXPECT_LT(att_err, 1e-6);
  EXPECT_LT(err(out, out_ref), 1e-6);
  EXPECT_LT(err(dqkv, dqkv_ref), 1e-6);
  std::cout << "[ bf16     ] attention vs the rounded reference: out " << err(out, out_ref)
            << ", dqkv " << err(dqkv, dqkv_ref) << "; the f32 kernel: out " << err(out32, out_ref)
            << ", dqkv " << err(dqkv32, dqkv_ref) << std::endl;
  EXPECT_GT(err(out32, out_ref), 1e-4);
  EXPECT_GT(err(dqkv32, dqkv_ref), 1e-4);
}

TEST(Bf16Operands, KeptWeightsStayFreshUntilTheParametersMayHaveChanged) {
  std::vector<float> params(100, 1.0f), other(10);
  Bf16Operands ops(host_device(), 8);
  const float* p = params.data();
  EXPECT_EQ(ops.weights(p, 10).first, nullptr) << "nothing kept yet";
  ops.keep_weights(p, params.size());
  bf16* copies = ops.weight_copies(p);
  ASSERT_NE(copies, nullptr);
  EXPECT_EQ(ops.weight_copies(other.data()), nullptr) << "only the kept buffer has copies";
  auto round = [&](size_t first, size_t n) {
    const auto [at, must_round] = ops.weights(p + first, n);
    EXPECT_EQ(at, copies + first);
    return must_round;
  };
  EXPECT_TRUE(round(10, 20)) << "first read rounds";
  EXPECT_FALSE(round(10, 20)) << "second read does not";
  EXPECT_FALSE(round(15, 10)) << "inside a rounded range";
  EXPECT_TRUE(round(25, 10)) << "partly outside";
  EXPECT_FALSE(round(10, 25)) << "the two ranges merged";
  EXPECT_EQ(ops.weights(p + 95, 10).first, nullptr) << "past the kept parameters";
  ops.invalidate_weights();
  EXPECT_TRUE(round(10, 20)) << "a pass after a change rounds again";

  // An update that wrote the copies of two adjacent segments: fresh in every pass until the next
  // update, and only there.
  OwnedSegment a, b;
  a.param_pos = 0, a.count = 50;
  b.param_pos = 50, b.count = 30;
  ops.rounded_by_update({a, b});
  ops.invalidate_weights();
  EXPECT_FALSE(round(40, 30)) << "across the two updated segments";
  EXPECT_TRUE(round(70, 20)) << "beyond what the update wrote";
  ops.invalidate_weights();  // an evaluation pass: the update's ranges are still current
  EXPECT_FALSE(round(0, 80));
  EXPECT_TRUE(round(80, 10)) << "a range rounded in the last pass is stale again";
  ops.rounded_by_update({});  // an update that wrote no copies
  ops.invalidate_weights();
  EXPECT_TRUE(round(0, 10));
}

TEST(Matmul, PrimitivesAreCachedPerShape) {
  const int64_t M = 8, N = 8, K = 8;
  auto a = random_floats(M * K, 9), b = random_floats(K * N, 10);
  std::vector<float> c(M * N);
  matmul_nn(c.data(), a.data(), b.data(), M, N, K);
  size_t n = matmul_cache_size();
  for (int i = 0; i < 3; ++i) matmul_nn(c.data(), a.data(), b.data(), M, N, K);
  EXPECT_EQ(matmul_cache_size(), n);
  matmul_nn(c.data(), a.data(), b.data(), M, N - 1, K);
  EXPECT_EQ(matmul_cache_size(), n + 1);
}

}  // namespace
}  // namespace tetra::cpu
