// Whole-model checks on a tiny GPT-2: finite differences in double precision, the f32 model
// against the f64 one, the gradient-ready callback, and init keyed by tensor names.
#include "model/gpt.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/error.h"

namespace tetra {
namespace {

// V=37 pads to Vp=64: the padding path is exercised.
GptConfig tiny() { return GptConfig::make(37, 2, 2, 16, 8, 64); }

std::vector<int32_t> tokens(int n, int V, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(gen() % V);
  return t;
}

TEST(Gpt, WholeModelGradientMatchesFiniteDifferences) {
  const int B = 2, T = 5;
  GptT<double> model(tiny(), B, T);
  model.init(3);
  // Nonzero biases and LN params so that every path carries signal.
  std::mt19937 gen(4);
  std::normal_distribution<double> noise(0.0, 0.1);
  for (auto& p : model.params()) {
    double* d = model.data_of(p);
    int64_t n = p.padded_rows ? int64_t(37) * 16 : p.view.numel();
    for (int64_t i = 0; i < n; ++i) d[i] += noise(gen);
  }
  auto in = tokens(B * T, 37, 5), tg = tokens(B * T, 37, 6);
  model.zero_grads();
  model.forward(in.data());
  model.backward(tg.data(), 1.0f);
  std::vector<double> grads(model.grad_data(), model.grad_data() + model.num_elements());
  auto loss = [&] {
    model.forward(in.data());
    return model.loss(tg.data());
  };
  const double eps = 1e-5;
  double worst = 0;
  for (auto& p : model.params()) {
    double* d = model.data_of(p);
    int64_t n = p.padded_rows ? int64_t(37) * 16 : p.view.numel();
    double max_diff = 0, max_ref = 1e-12;
    for (int64_t k = 0; k < std::min<int64_t>(n, 24); ++k) {
      int64_t i = (k * 7919) % n;  // spread over the tensor
      double saved = d[i];
      d[i] = saved + eps;
      double up = loss();
      d[i] = saved - eps;
      double down = loss();
      d[i] = saved;
      double numeric = (up - down) / (2 * eps);
      max_diff = std::max(max_diff, std::abs(numeric - grads[p.view.offset + i]));
      max_ref = std::max(max_ref, std::abs(numeric));
    }
    double rel = max_diff / max_ref;
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 1e-6) << p.view.name;
    if (p.padded_rows) {
      for (int64_t i = n; i < p.view.numel(); ++i) EXPECT_EQ(grads[p.view.offset + i], 0.0);
    }
  }
  RecordProperty("max_relative_error", std::to_string(worst));
}

TEST(Gpt, FloatModelTracksDouble) {
  const int B = 2, T = 8;
  GptT<double> d(tiny(), B, T);
  Gpt f(tiny(), B, T);
  d.init(9);
  f.init(9);
  for (size_t i = 0; i < f.num_elements(); ++i)
    EXPECT_EQ(float(d.param_data()[i]), f.param_data()[i]);
  auto in = tokens(B * T, 37, 10), tg = tokens(B * T, 37, 11);
  d.zero_grads();
  f.zero_grads();
  d.forward(in.data());
  f.forward(in.data());
  double ld = d.backward(tg.data(), 1.0f), lf = f.backward(tg.data(), 1.0f);
  EXPECT_NEAR(lf, ld, 1e-6 * ld);
  for (const auto& p : f.params()) {
    double max_diff = 0, max_ref = 1e-30;
    for (int64_t i = 0; i < p.view.numel(); ++i) {
      double a = f.grad_of(p)[i], b = d.grad_data()[p.view.offset + i];
      max_diff = std::max(max_diff, std::abs(a - b));
      max_ref = std::max(max_ref, std::abs(b));
    }
    EXPECT_LT(max_diff / max_ref, 1e-4) << p.view.name;
  }
}

TEST(Gpt, GradientsBecomeReadyInBackwardOrder) {
  Gpt model(tiny(), 1, 4);
  model.init(1);
  auto in = tokens(4, 37, 1), tg = tokens(4, 37, 2);
  std::vector<size_t> ready;
  model.forward(in.data());
  model.backward(tg.data(), 1.0f, [&](size_t n) { ready.push_back(n); });
  ASSERT_EQ(ready.size(), 2u + 2u);  // ln_f, two blocks, embeddings
  for (size_t i = 1; i < ready.size(); ++i) EXPECT_GT(ready[i], ready[i - 1]);
  EXPECT_EQ(ready.back(), model.num_elements());
  EXPECT_EQ(model.params().front().view.name, "transformer.ln_f.weight");
  EXPECT_EQ(model.params().back().view.name, "transformer.wte.weight");
}

TEST(Gpt, InitDependsOnNamesNotShapes) {
  // The same weights whatever the micro-batch, and the GPT-2 init statistics.
  Gpt a(tiny(), 1, 4), b(tiny(), 3, 8);
  a.init(77);
  b.init(77);
  for (size_t i = 0; i < a.num_elements(); ++i) ASSERT_EQ(a.param_data()[i], b.param_data()[i]);
  GptConfig big = GptConfig::make(64, 4, 4, 64, 16, 64);
  Gpt m(big, 1, 4);
  m.init(5);
  for (const auto& p : m.params()) {
    const float* d = m.data_of(p);
    double sq = 0;
    for (int64_t i = 0; i < p.view.numel(); ++i) sq += double(d[i]) * d[i];
    double std = std::sqrt(sq / double(p.view.numel()));
    const std::string& n = p.view.name;
    if (n.ends_with("bias")) {
      EXPECT_EQ(std, 0.0) << n;
    } else if (n.ends_with("ln_1.weight") || n.ends_with("ln_2.weight") ||
               n.ends_with("ln_f.weight")) {
      EXPECT_EQ(std, 1.0) << n;
    } else if (n.ends_with("c_proj.weight")) {
      EXPECT_NEAR(std, 0.02 / std::sqrt(8.0), 0.002) << n;
    } else {
      EXPECT_NEAR(std, 0.02, 0.002) << n;
    }
  }
}

TEST(Gpt, ShapeErrorsSayWhatToChange) {
  try {
    GptConfig::make(100, 2, 5, 64, 8, 64);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("model.n_head=5 does not divide model.d_model=64"), std::string::npos) << m;
    EXPECT_NE(m.find("use n_head=4 or 8"), std::string::npos) << m;
  }
  EXPECT_THROW(Gpt(tiny(), 1, 9), Error);  // T > max_seq
  EXPECT_EQ(GptConfig::make(50257, 12, 12, 768, 1024, 64).padded_vocab, 50304);
  EXPECT_EQ(GptConfig::make(50257, 12, 12, 768, 1024, 64).num_params(), 124439808);
}

}  // namespace
}  // namespace tetra
