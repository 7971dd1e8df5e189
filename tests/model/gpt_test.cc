// Whole-model checks on a tiny GPT-2: finite differences in double precision, the f32 model
// against the f64 one, the units the model reports in backward order, recomputation changing no
// number, and init keyed by tensor names.
#include "model/gpt.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "core/error.h"
#include "model/block_spec.h"
#include "tests/model/test_model.h"

namespace tetra {
namespace {

using testing::TestModel;
using testing::tokens;

// V=37 pads to Vp=64: the padding path is exercised.
GptConfig tiny() { return GptConfig::make(37, 2, 2, 16, 8, 64); }

TEST(Gpt, WholeModelGradientMatchesFiniteDifferences) {
  const int B = 2, T = 5;
  TestModel<double> m(tiny(), B, T);
  m.randomise(3);
  auto in = tokens(B * T, 37, 5), tg = tokens(B * T, 37, 6);
  m.store.grads().zero();
  m.model.forward_backward(in.data(), tg.data(), 1.0f);
  const double worst = testing::finite_difference_error(
      m, [&] { return m.model.forward_loss(in.data(), tg.data()); }, 1e-5, 24,
      [](const std::string& name, double rel) { EXPECT_LT(rel, 1e-6) << name; });
  // Padding rows of the vocabulary get no gradient.
  for (TensorId id = 0; id < TensorId(m.store.tensors().size()); ++id) {
    for (int64_t i = m.real_elements(id); i < m.store.tensor(id).numel(); ++i) {
      EXPECT_EQ(m.store.grad(id)[i], 0.0) << m.store.tensor(id).spec.name;
    }
  }
  RecordProperty("max_relative_error", std::to_string(worst));
}

TEST(Gpt, FloatModelTracksDouble) {
  const int B = 2, T = 8;
  TestModel<double> d(tiny(), B, T);
  TestModel<float> f(tiny(), B, T);
  d.store.init(9);
  f.store.init(9);
  for (size_t i = 0; i < f.store.flat_size(); ++i) {
    ASSERT_EQ(float(d.store.params()[i]), f.store.params()[i]) << i;
  }
  auto in = tokens(B * T, 37, 10), tg = tokens(B * T, 37, 11);
  double ld = d.model.forward_backward(in.data(), tg.data(), 1.0f);
  double lf = f.model.forward_backward(in.data(), tg.data(), 1.0f);
  EXPECT_NEAR(lf, ld, 1e-6 * ld);
  for (TensorId id = 0; id < TensorId(f.store.tensors().size()); ++id) {
    double max_diff = 0, max_ref = 1e-30;
    for (int64_t i = 0; i < f.store.tensor(id).numel(); ++i) {
      double a = f.store.grad(id)[i], b = d.store.grad(id)[i];
      max_diff = std::max(max_diff, std::abs(a - b));
      max_ref = std::max(max_ref, std::abs(b));
    }
    EXPECT_LT(max_diff / max_ref, 1e-4) << f.store.tensor(id).spec.name;
  }
}

// Records what the model tells its residency manager.
struct Recorder final : UnitHooks {
  std::vector<std::string> calls;
  void before_forward(int u, int next) override { add("bf", u, next); }
  void after_forward(int u) override { add("af", u); }
  void before_backward(int u, int next) override { add("bb", u, next); }
  void after_backward(int u) override { add("ab", u); }
  void end_forward_only() override { calls.push_back("end"); }
  void add(const char* what, int u, int next = -2) {
    calls.push_back(std::string(what) + std::to_string(u) +
                    (next == -2 ? "" : ">" + std::to_string(next)));
  }
};

TEST(Gpt, UnitsRunAndFinishInBackwardOrder) {
  TestModel<float> m(tiny(), 1, 4);
  m.store.init(1);
  const auto& units = m.store.units();
  // Blocks last to first, then the root: the embedding and ln_f, wte's gradient finished last.
  ASSERT_EQ(units.size(), 3u);
  EXPECT_EQ(units[0].name, "h.1");
  EXPECT_EQ(units[1].name, "h.0");
  EXPECT_EQ(units[2].name, "root");
  for (size_t u = 1; u < units.size(); ++u) {
    EXPECT_EQ(units[u].offset, units[u - 1].offset + units[u - 1].padded);
  }
  EXPECT_EQ(m.store.flat_size(), units.back().offset + units.back().padded);
  EXPECT_EQ(m.store.tensors().front().spec.name, "transformer.h.1.mlp.c_proj.weight");
  EXPECT_EQ(m.store.tensors().back().spec.name, "transformer.ln_f.bias");
  EXPECT_EQ(m.model.block_unit(1), 0);
  EXPECT_EQ(m.model.root_unit(), 2);

  Recorder r;
  m.model.set_hooks(&r);
  auto in = tokens(4, 37, 1), tg = tokens(4, 37, 2);
  m.model.forward_backward(in.data(), tg.data(), 1.0f);
  // Forward: root (embedding), h.0, h.1; the head reacquires the root for its forward and
  // backward; backward: h.1, h.0, then the root (embedding) is finished.
  const std::vector<std::string> train = {"bf2>1", "af2",   "bf1>0", "af1",    "bf0>2", "af0",
                                          "bb2>0", "bb0>1", "ab0",   "bb1>-1", "ab1",   "ab2"};
  EXPECT_EQ(r.calls, train);
  r.calls.clear();
  m.model.forward_loss(in.data(), tg.data());
  const std::vector<std::string> eval = {"bf2>1", "af2",    "bf1>0", "af1", "bf0>2",
                                         "af0",   "bf2>-1", "af2",   "end"};
  EXPECT_EQ(r.calls, eval);
}

TEST(Gpt, RecomputationChangesNoNumber) {
  const int B = 2, T = 8;
  auto in = tokens(B * T, 37, 21), tg = tokens(B * T, 37, 22);
  std::vector<std::vector<float>> grads;
  std::vector<double> losses;
  std::vector<size_t> activation_bytes;
  for (Recompute r : {Recompute::none, Recompute::selective, Recompute::full}) {
    TestModel<float> m(tiny(), B, T, r);
    m.randomise(5);
    losses.push_back(m.model.forward_backward(in.data(), tg.data(), 0.5f));
    losses.push_back(m.model.forward_backward(in.data(), tg.data(), 0.5f));  // accumulates
    grads.emplace_back(m.store.grads().data(), m.store.grads().data() + m.store.flat_size());
    activation_bytes.push_back(m.model.activation_bytes());
  }
  for (size_t k = 1; k < 3; ++k) {
    EXPECT_EQ(losses[2 * k], losses[0]) << recompute_name(Recompute(k));
    EXPECT_EQ(losses[2 * k + 1], losses[1]) << recompute_name(Recompute(k));
    EXPECT_EQ(std::memcmp(grads[k].data(), grads[0].data(), grads[0].size() * sizeof(float)), 0)
        << recompute_name(Recompute(k));
  }
  // Each mode keeps less for backward than the one before.
  EXPECT_LT(activation_bytes[1], activation_bytes[0]);
  EXPECT_LT(activation_bytes[2], activation_bytes[1]);
}

TEST(Gpt, InitDependsOnNamesNotShapes) {
  // The same weights whatever the micro-batch, and the GPT-2 init statistics.
  TestModel<float> a(tiny(), 1, 4), b(tiny(), 3, 8);
  a.store.init(77);
  b.store.init(77);
  for (size_t i = 0; i < a.store.flat_size(); ++i) {
    ASSERT_EQ(a.store.params()[i], b.store.params()[i]);
  }
  TestModel<float> m(GptConfig::make(64, 4, 4, 64, 16, 64), 1, 4);
  m.store.init(5);
  for (TensorId id = 0; id < TensorId(m.store.tensors().size()); ++id) {
    const ParamEntry& e = m.store.tensor(id);
    const float* d = m.store.param(id);
    double sq = 0;
    for (int64_t i = 0; i < e.numel(); ++i) sq += double(d[i]) * d[i];
    double std = std::sqrt(sq / double(e.numel()));
    const std::string& n = e.spec.name;
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
  ParamStore store;
  EXPECT_THROW(Gpt(cpu_backend(), tiny(), store, 1, 9), Error);  // T > max_seq
  EXPECT_EQ(GptConfig::make(50257, 12, 12, 768, 1024, 64).padded_vocab, 50304);
  // Its parameter count (124,439,808) is the planner's: tests/plan/presets_test.cc.
}

TEST(Gpt, TensorParallelSizeMustSplitTheHeadsAndPadsTheVocabulary) {
  try {
    GptConfig::make(100, 2, 12, 96, 8, 64, 5);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("parallel.tp=5 does not divide model.n_head=12"), std::string::npos) << m;
    EXPECT_NE(m.find("use parallel.tp in {1, 2, 3, 4, 6, 12}"), std::string::npos) << m;
  }
  // Every rank holds an equal slice of wte: Vp divides by tp x vocab_multiple.
  const GptConfig c = GptConfig::make(515, 2, 4, 32, 8, 1, 4);
  EXPECT_EQ(c.padded_vocab, 516);
  EXPECT_EQ(c.local_vocab(), 129);
  EXPECT_EQ(c.local_heads(), 1);
  EXPECT_EQ(c.local_width(), 8);
  EXPECT_EQ(c.local_hidden(), 32);
  EXPECT_EQ(GptConfig::make(50257, 12, 12, 768, 1024, 64, 2).padded_vocab, 50304);
  EXPECT_EQ(GptConfig::make(50257, 12, 12, 768, 1024, 64, 4).padded_vocab, 50432);
}

}  // namespace
// The model spec names every tensor the whole model registers, no more: a pipeline stage or an
// expert-parallel rank loading a file (init.from) checks the tensors it does not hold against
// these names (model_tensor_names) instead of building a second whole model.
TEST(Gpt, TheSpecNamesEveryTensorTheModelRegisters) {
  auto moe = [](int every) {
    MoeConfig m;
    m.experts = 4;
    m.every = every;
    return m;
  };
  auto llama = [](bool tied) {
    LlamaShape l;
    l.n_kv_head = 1;
    l.tie_embeddings = tied;
    return l;
  };
  std::vector<std::pair<std::string, GptConfig>> cases;
  cases.push_back({"GPT-2", GptConfig::make(37, 3, 2, 16, 8, 64)});
  cases.push_back({"GPT-2 MoE every 2", cases[0].second});
  cases.back().second.set_moe(moe(2));
  for (bool tied : {false, true}) {
    cases.push_back({tied ? "Llama tied" : "Llama", cases[0].second});
    cases.back().second.set_llama(llama(tied));
  }
  cases.push_back({"Mixtral", cases[2].second});
  cases.back().second.set_moe(moe(1));
  for (const auto& [name, c] : cases) {
    SCOPED_TRACE(name);
    ParamStoreT<float> store;
    GptT<float> model(cpu_backend(), c, store, 1, 8);
    std::vector<std::string> registered;
    for (const ParamEntry& e : store.tensors()) registered.push_back(e.spec.name);
    std::vector<std::string> named = model_tensor_names(c);
    std::sort(registered.begin(), registered.end());
    std::sort(named.begin(), named.end());
    EXPECT_EQ(named, registered);
  }
}

}  // namespace tetra
