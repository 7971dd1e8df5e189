// Whole-model checks on a tiny Llama (docs/llama.md): finite differences in double precision
// through RMSNorm, rotary embeddings, grouped-query attention, SwiGLU and the untied head; the f32
// model against the f64 one; recomputation changing no number; tensor names and init; decoding
// with a key/value cache that holds only the key/value heads agreeing with the full forward; and
// the shape errors the issue names.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/gpt.h"
#include "tests/model/test_model.h"
#include "tests/test_util.h"

namespace tetra {
namespace {

using testing::error_of;
using testing::TestModel;
using testing::tokens;

// V=37 pads to Vp=64; NH=4 query heads share KVH=2 key/value heads (hs 6); ffn 40.
GptConfig tiny_llama(bool tied = false, int kv_heads = 2) {
  GptConfig c = GptConfig::make(37, 2, 4, 24, 12, 64);
  LlamaShape l;
  l.n_kv_head = kv_heads;
  l.ffn = 40;
  l.rope_theta = 500.0;  // turns visibly within a few positions
  l.norm_eps = 1e-6;
  l.tie_embeddings = tied;
  c.set_llama(l);
  return c;
}

TEST(Llama, WholeModelGradientMatchesFiniteDifferences) {
  for (bool tied : {false, true}) {
    const int B = 2, T = 7;
    TestModel<double> m(tiny_llama(tied), B, T);
    m.randomise(3);
    auto in = tokens(B * T, 37, 5), tg = tokens(B * T, 37, 6);
    m.store.grads().zero();
    m.model.forward_backward(in.data(), tg.data(), 1.0f);
    const double worst = testing::finite_difference_error(
        m, [&] { return m.model.forward_loss(in.data(), tg.data()); }, 1e-5, 24,
        [&](const std::string& name, double rel) {
          EXPECT_LT(rel, 1e-6) << name << (tied ? " (tied)" : " (untied)");
        });
    for (TensorId id = 0; id < TensorId(m.store.tensors().size()); ++id) {
      for (int64_t i = m.real_elements(id); i < m.store.tensor(id).numel(); ++i) {
        EXPECT_EQ(m.store.grad(id)[i], 0.0) << m.store.tensor(id).spec.name;
      }
    }
    RecordProperty(tied ? "max_relative_error_tied" : "max_relative_error", std::to_string(worst));
  }
}

TEST(Llama, TensorsAreHuggingFaceLlamaNames) {
  TestModel<float> m(tiny_llama(), 1, 4);
  std::vector<std::string> names;
  for (const ParamEntry& e : m.store.tensors()) names.push_back(e.spec.name);
  const std::vector<std::string> layer1 = {
      "model.layers.1.mlp.down_proj.weight",    "model.layers.1.mlp.up_proj.weight",
      "model.layers.1.mlp.gate_proj.weight",    "model.layers.1.post_attention_layernorm.weight",
      "model.layers.1.self_attn.o_proj.weight", "model.layers.1.self_attn.v_proj.weight",
      "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.q_proj.weight",
      "model.layers.1.input_layernorm.weight"};
  ASSERT_EQ(names.size(), 2 * layer1.size() + 3);
  for (size_t i = 0; i < layer1.size(); ++i) EXPECT_EQ(names[i], layer1[i]);
  const std::vector<std::string> root(names.end() - 3, names.end());
  EXPECT_EQ(root, (std::vector<std::string>{"model.embed_tokens.weight", "lm_head.weight",
                                            "model.norm.weight"}));
  auto shape = [&](const std::string& n) { return m.store.tensor(m.store.find(n)).spec.shape; };
  EXPECT_EQ(shape("model.layers.0.self_attn.k_proj.weight"), (Shape{12, 24}));  // KVH·hs = 2·6
  EXPECT_EQ(shape("model.layers.0.mlp.gate_proj.weight"), (Shape{40, 24}));
  EXPECT_EQ(shape("model.layers.0.mlp.down_proj.weight"), (Shape{24, 40}));
  EXPECT_EQ(shape("lm_head.weight"), (Shape{64, 24}));
  // Tied: no lm_head; no biases and no learned positions either way.
  TestModel<float> t(tiny_llama(true), 1, 4);
  EXPECT_LT(t.store.find("lm_head.weight"), 0);
  for (const ParamEntry& e : t.store.tensors()) {
    EXPECT_FALSE(e.spec.name.ends_with("bias")) << e.spec.name;
    EXPECT_EQ(e.spec.name.find("wpe"), std::string::npos) << e.spec.name;
  }
  // HF's init: every matrix N(0, 0.02), every norm weight 1.
  m.store.init(5);
  for (TensorId id = 0; id < TensorId(m.store.tensors().size()); ++id) {
    const ParamEntry& e = m.store.tensor(id);
    const float* d = m.store.param(id);
    double sq = 0;
    for (int64_t i = 0; i < m.real_elements(id); ++i) sq += double(d[i]) * d[i];
    const double std = std::sqrt(sq / double(m.real_elements(id)));
    if (e.spec.shape.size() == 1) {
      EXPECT_EQ(std, 1.0) << e.spec.name;
    } else {
      EXPECT_NEAR(std, 0.02, 0.004) << e.spec.name;
    }
  }
}

TEST(Llama, FloatModelTracksDouble) {
  const int B = 2, T = 12;
  TestModel<double> d(tiny_llama(), B, T);
  TestModel<float> f(tiny_llama(), B, T);
  d.randomise(9);
  for (size_t i = 0; i < f.store.flat_size(); ++i) f.store.params()[i] = float(d.store.params()[i]);
  auto in = tokens(B * T, 37, 10), tg = tokens(B * T, 37, 11);
  const double ld = d.model.forward_backward(in.data(), tg.data(), 1.0f);
  const double lf = f.model.forward_backward(in.data(), tg.data(), 1.0f);
  EXPECT_NEAR(lf, ld, 1e-6 * ld);
  for (TensorId id = 0; id < TensorId(f.store.tensors().size()); ++id) {
    double max_diff = 0, max_ref = 1e-30;
    for (int64_t i = 0; i < f.store.tensor(id).numel(); ++i) {
      const double a = f.store.grad(id)[i], b = d.store.grad(id)[i];
      max_diff = std::max(max_diff, std::abs(a - b));
      max_ref = std::max(max_ref, std::abs(b));
    }
    EXPECT_LT(max_diff / max_ref, 1e-4) << f.store.tensor(id).spec.name;
  }
}

TEST(Llama, RecomputationChangesNoNumber) {
  const int B = 2, T = 8;
  auto in = tokens(B * T, 37, 21), tg = tokens(B * T, 37, 22);
  std::vector<std::vector<float>> grads;
  std::vector<double> losses;
  for (Recompute r : {Recompute::none, Recompute::selective, Recompute::full}) {
    TestModel<float> m(tiny_llama(), B, T, r);
    m.randomise(5);
    losses.push_back(m.model.forward_backward(in.data(), tg.data(), 0.5f));
    losses.push_back(m.model.forward_backward(in.data(), tg.data(), 0.5f));
    grads.emplace_back(m.store.grads().data(), m.store.grads().data() + m.store.flat_size());
  }
  for (size_t k = 1; k < 3; ++k) {
    EXPECT_EQ(losses[2 * k], losses[0]) << recompute_name(Recompute(k));
    EXPECT_EQ(losses[2 * k + 1], losses[1]) << recompute_name(Recompute(k));
    EXPECT_EQ(std::memcmp(grads[k].data(), grads[0].data(), grads[0].size() * sizeof(float)), 0)
        << recompute_name(Recompute(k));
  }
}

TEST(Llama, DecodingWithTheKeyValueHeadsCacheMatchesTheFullForward) {
  const int T = 9;
  TestModel<double> m(tiny_llama(false, 1), 1, T);  // one key/value head for all four queries
  m.randomise(4);
  const auto in = tokens(T, 37, 8);
  const double* full = m.model.forward_logits(in.data());
  const std::vector<double> want(full, full + size_t(T) * 64);
  auto st = m.model.make_decode_state(1);
  double worst = 0;
  for (int t = 0; t < T; ++t) {
    const double* step = m.model.decode(*st, &in[size_t(t)], t);
    for (int v = 0; v < 37; ++v) {
      worst = std::max(worst, std::abs(step[v] - want[size_t(t) * 64 + size_t(v)]));
    }
  }
  EXPECT_LT(worst, 1e-12);
}

TEST(Llama, ShapeErrorsSayWhatToChange) {
  LlamaShape l;
  l.n_kv_head = 3;
  std::string m = error_of([&] { GptConfig::make(37, 2, 4, 24, 8, 64).set_llama(l); });
  EXPECT_NE(m.find("model.n_kv_head=3 does not divide model.n_head=4"), std::string::npos) << m;
  EXPECT_NE(m.find("use n_kv_head in {1, 2, 4}"), std::string::npos) << m;

  l.n_kv_head = 2;  // tp 4 cannot split 2 key/value heads
  m = error_of([&] { GptConfig::make(37, 2, 4, 32, 8, 64, 4).set_llama(l); });
  EXPECT_NE(m.find("parallel.tp=4 does not divide model.n_kv_head=2"), std::string::npos) << m;
  EXPECT_NE(m.find("use parallel.tp in {1, 2}"), std::string::npos) << m;

  l.n_kv_head = 0;  // head size 30/2 = 15 is odd: RoPE turns pairs of channels
  m = error_of([&] { GptConfig::make(37, 2, 2, 30, 8, 64).set_llama(l); });
  EXPECT_NE(m.find("head size d_model/n_head = 30/2 = 15 must be even"), std::string::npos) << m;

  l.ffn = 50;  // tp 4 does not split 50 SwiGLU channels
  m = error_of([&] { GptConfig::make(37, 2, 4, 32, 8, 64, 4).set_llama(l); });
  EXPECT_NE(m.find("parallel.tp=4 does not divide the MLP width model.ffn=50"), std::string::npos)
      << m;

  // The default width is 8C/3 rounded up to a multiple of 64: SwiGLU's three matrices then hold
  // about as many parameters as GPT-2's two 4C ones.
  GptConfig c = GptConfig::make(37, 2, 4, 96, 8, 64);
  c.set_llama({});
  EXPECT_EQ(c.ffn, 256);
  EXPECT_EQ(c.n_kv_head, 4);
  EXPECT_EQ(c.local_qkv_width(), 3 * 96);
}

}  // namespace
}  // namespace tetra
