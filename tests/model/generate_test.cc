// Generation with a KV cache against the full-sequence forward, and the sampler's promises:
// a seed reproduces, top-k 1 is greedy, top-k restricts the draw.
#include "model/generate.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "core/error.h"
#include "tests/model/test_model.h"

namespace tetra {
namespace {

using testing::TestModel;
using testing::tokens;

class KvCache : public ::testing::TestWithParam<GptConfig> {};

TEST_P(KvCache, LogitsEqualTheFullForwardAtEveryPosition) {
  const GptConfig c = GetParam();
  const int T = c.max_seq;
  TestModel<float> full(c, 1, T);
  full.randomise(5);
  std::vector<int32_t> in = tokens(T, c.vocab_size, 9);
  const float* logits = full.model.forward_logits(in.data());
  Generator gen(full.model);
  double worst = 0;
  for (int t = 0; t < T; ++t) {
    const float* got = gen.step(in[size_t(t)]);
    const float* ref = logits + size_t(t) * c.padded_vocab;
    double diff = 0, scale = 0;
    for (int v = 0; v < c.vocab_size; ++v) {
      diff = std::max(diff, std::abs(double(got[v]) - ref[v]));
      scale = std::max(scale, std::abs(double(ref[v])));
    }
    worst = std::max(worst, diff / scale);
  }
  EXPECT_LE(worst, 1e-5) << c.describe();
  // prefill is the same as stepping through the prompt.
  const float* last = gen.prefill(in);
  const float* ref = logits + size_t(T - 1) * c.padded_vocab;
  for (int v = 0; v < c.vocab_size; ++v)
    EXPECT_NEAR(last[v], ref[v], 1e-5 * std::abs(ref[v]) + 1e-6);
}

// V=37 pads to 64; the second has several heads of 16 and a longer context.
INSTANTIATE_TEST_SUITE_P(Shapes, KvCache,
                         ::testing::Values(GptConfig::make(37, 2, 2, 16, 12, 64),
                                           GptConfig::make(300, 3, 4, 64, 48, 64)));

class Sampling : public ::testing::Test {
 protected:
  Sampling() : built_(GptConfig::make(50, 2, 2, 32, 40, 64), 1, 1) { built_.randomise(3); }
  TestModel<float> built_;
  Gpt& model_ = built_.model;
};

TEST_F(Sampling, TheSameSeedReproducesAndAnotherSeedDiffers) {
  Generator gen(model_);
  const std::vector<int32_t> prompt = {1, 2, 3};
  SamplingOptions o;
  o.temperature = 1.0f;
  o.top_k = 0;
  o.seed = 42;
  auto a = generate(gen, prompt, 30, o);
  auto b = generate(gen, prompt, 30, o);
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), 30u);
  o.seed = 43;
  EXPECT_NE(generate(gen, prompt, 30, o), a);
}

TEST_F(Sampling, TopKOneIsGreedy) {
  Generator gen(model_);
  const std::vector<int32_t> prompt = {7, 8};
  SamplingOptions greedy;
  greedy.temperature = 0.0f;
  SamplingOptions k1;
  k1.temperature = 1.5f;
  k1.top_k = 1;
  k1.seed = 999;
  auto a = generate(gen, prompt, 20, greedy);
  EXPECT_EQ(generate(gen, prompt, 20, k1), a);
  // And greedy is the argmax of the full-sequence forward at every step.
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), a.begin(), a.end());
  const int T = int(seq.size()) - 1;
  TestModel<float> full(model_.config(), 1, T);
  std::copy_n(built_.store.params().data(), built_.store.flat_size(), full.store.params().data());
  const float* logits = full.model.forward_logits(seq.data());
  const int Vp = model_.config().padded_vocab, V = model_.config().vocab_size;
  for (size_t i = 0; i < a.size(); ++i) {
    const float* row = logits + (prompt.size() - 1 + i) * Vp;
    EXPECT_EQ(a[i], int32_t(std::max_element(row, row + V) - row)) << "token " << i;
  }
}

TEST(SampleToken, TopKDrawsOnlyAmongTheKMostLikely) {
  std::vector<float> logits = {0.1f, 3.0f, -1.0f, 2.5f, 2.9f, 0.0f, 1.0f, -2.0f};
  SamplingOptions o;
  o.top_k = 3;
  o.temperature = 1.0f;
  std::set<int32_t> seen;
  for (uint64_t d = 0; d < 2000; ++d) seen.insert(sample_token(logits.data(), 8, o, d));
  EXPECT_EQ(seen, (std::set<int32_t>{1, 3, 4}));
  // A low temperature concentrates the draw on the largest logit.
  o.temperature = 0.01f;
  for (uint64_t d = 0; d < 200; ++d) EXPECT_EQ(sample_token(logits.data(), 8, o, d), 1);
}

TEST(SampleToken, FrequenciesFollowTheSoftmax) {
  std::vector<float> logits = {0.0f, std::log(3.0f)};  // p = 1/4, 3/4
  SamplingOptions o;
  int ones = 0;
  const int n = 20000;
  for (int d = 0; d < n; ++d) ones += sample_token(logits.data(), 2, o, uint64_t(d));
  EXPECT_NEAR(double(ones) / n, 0.75, 0.015);
}

TEST_F(Sampling, RefusesToRunPastMaxSeq) {
  Generator gen(model_);
  std::vector<int32_t> prompt(30, 1);
  try {
    generate(gen, prompt, 11, SamplingOptions{});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("lower --max-tokens to at most 10"));
  }
  EXPECT_EQ(generate(gen, prompt, 10, SamplingOptions{}).size(), 10u);
}

}  // namespace
}  // namespace tetra
