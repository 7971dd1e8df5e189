// Llama weights as files (model/gpt_io.h): LlamaForCausalLM's names and layouts written and read
// as they are, the vocabulary rows unpadded; a tied model takes a file's lm_head only when it is
// embed_tokens written twice; the shape read off the tensors (n_kv_head from k_proj's rows once
// the head count is known) and a shape that disagrees with them blamed field by field; the decode
// cache sized for the key/value heads alone.
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "model/gpt_io.h"
#include "tests/model/test_model.h"
#include "tests/test_util.h"

namespace tetra {
namespace {

using testing::error_of;
using testing::TestModel;

// V=37 (padded to 64), 2 layers, 4 query heads of 6 channels over `kv` key/value heads, ffn 40.
GptConfig llama(bool tied, int kv = 2) {
  GptConfig c = GptConfig::make(37, 2, 4, 24, 12, 64);
  LlamaShape l;
  l.n_kv_head = kv;
  l.ffn = 40;
  l.rope_theta = 5e5;
  l.norm_eps = 1e-6;
  l.tie_embeddings = tied;
  c.set_llama(l);
  return c;
}

SafeTensorsFile file_of(TestModel<float>& m) {
  return store_to_safetensors(m.store, m.store.params().data(), true);
}

TEST(LlamaIo, FilesHoldLlamaForCausalLMNamesAndUnpaddedRows) {
  for (bool tied : {false, true}) {
    TestModel<float> m(llama(tied), 1, 4);
    m.randomise(1);
    const SafeTensorsFile f = file_of(m);
    std::set<std::string> names;
    for (const auto& [n, t] : f.tensors) names.insert(n);
    std::set<std::string> want = {"model.embed_tokens.weight", "model.norm.weight"};
    if (!tied) want.insert("lm_head.weight");
    for (int l = 0; l < 2; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      for (const char* n : {"input_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                            "self_attn.v_proj", "self_attn.o_proj", "post_attention_layernorm",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}) {
        want.insert(p + n + ".weight");
      }
    }
    EXPECT_EQ(names, want) << (tied ? "tied" : "untied");
    EXPECT_EQ(f.tensors.at("model.embed_tokens.weight").shape, (Shape{37, 24}));
    if (!tied) {
      EXPECT_EQ(f.tensors.at("lm_head.weight").shape, (Shape{37, 24}));
    }
    EXPECT_EQ(f.tensors.at("model.layers.1.self_attn.k_proj.weight").shape, (Shape{12, 24}));
    EXPECT_EQ(f.tensors.at("model.layers.1.mlp.gate_proj.weight").shape, (Shape{40, 24}));
    EXPECT_EQ(f.tensors.at("model.layers.1.mlp.down_proj.weight").shape, (Shape{24, 40}));
  }
}

TEST(LlamaIo, LoadsFilesAndTakesALmHeadOnlyAsTheTiedEmbedding) {
  TestModel<float> a(llama(false), 1, 4);
  a.randomise(2);
  SafeTensorsFile f = file_of(a);
  // Older conversions carry RoPE's frequencies as a buffer: tetra computes them.
  f.tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] =
      safetensor_f32({3}, std::vector<float>(3).data());
  TestModel<float> b(llama(false), 1, 4);
  load_safetensors_into(b.store, f, "f.safetensors", "untied");
  EXPECT_EQ(std::memcmp(a.store.params().data(), b.store.params().data(),
                        a.store.params().size() * sizeof(float)),
            0);

  TestModel<float> tied(llama(true), 1, 4);
  EXPECT_EQ(error_of([&] { load_safetensors_into(tied.store, f, "f.safetensors", "tied L"); }),
            "[init] f.safetensors: the file holds an lm_head.weight that is not its "
            "model.embed_tokens.weight, i.e. an untied head, but this model (tied L) ties the head "
            "to the embedding; set model.tie_embeddings=false");
  f.tensors["lm_head.weight"] = f.tensors.at("model.embed_tokens.weight");
  EXPECT_EQ(error_of([&] { load_safetensors_into(tied.store, f, "f.safetensors", "tied L"); }),
            "<no error>");
  f.tensors.erase("lm_head.weight");
  TestModel<float> untied(llama(false), 1, 4);
  EXPECT_NE(error_of([&] {
              load_safetensors_into(untied.store, f, "f.safetensors", "untied L");
            }).find("missing 'lm_head.weight'"),
            std::string::npos);
  // Llama names are never given GPT-2's prefix.
  f.tensors["transformer.h.0.ln_1.weight"] = f.tensors.at("model.norm.weight");
  EXPECT_NE(error_of([&] {
              load_safetensors_into(tied.store, f, "f.safetensors", "tied L");
            }).find("tensors not in a model with this config: transformer.h.0.ln_1.weight"),
            std::string::npos);
}

TEST(LlamaIo, WeightsShapeSaysWhatTheTensorsHold) {
  TestModel<float> m(llama(false), 1, 4);
  m.randomise(3);
  SafeTensorsFile f = file_of(m);
  const WeightsShape w = weights_shape(f, "f", "generate");
  EXPECT_TRUE(w.llama);
  EXPECT_EQ(w.vocab_size, 37);
  EXPECT_EQ(w.d_model, 24);
  EXPECT_EQ(w.n_layer, 2);
  EXPECT_EQ(w.ffn, 40);
  EXPECT_EQ(w.kv_width, 12);
  EXPECT_EQ(w.max_seq, 0);
  EXPECT_TRUE(w.lm_head);
  EXPECT_FALSE(w.lm_head_is_embedding);
  EXPECT_EQ(
      weights_shape_overrides(w),
      (std::vector<std::string>{"model.arch=llama", "model.vocab_size=37", "model.d_model=24",
                                "model.n_layer=2", "model.ffn=40", "model.tie_embeddings=false",
                                "model.moe_experts=0", "model.moe_every=1"}));
  // k_proj's 12 rows are 2 heads of 24/4 = 6, 4 heads of 24/8 = 3; 24/5 is no head size.
  EXPECT_EQ(llama_kv_heads_override(w, 4), "model.n_kv_head=2");
  EXPECT_EQ(llama_kv_heads_override(w, 8), "model.n_kv_head=4");
  EXPECT_EQ(llama_kv_heads_override(w, 5), std::nullopt);
  f.tensors["lm_head.weight"] = f.tensors.at("model.embed_tokens.weight");
  EXPECT_TRUE(weights_shape(f, "f", "generate").lm_head_is_embedding);
  f.tensors.erase("lm_head.weight");
  EXPECT_FALSE(weights_shape(f, "f", "generate").lm_head);
  f.tensors.erase("model.layers.0.mlp.gate_proj.weight");
  EXPECT_EQ(error_of([&] { weights_shape(f, "f", "generate"); }),
            "[generate] f: no 2-D tensor 'model.layers.0.mlp.gate_proj.weight'; every "
            "LlamaForCausalLM file has it, so the file is damaged or incomplete");
  f.tensors["model.layers.7.mlp.gate_proj.weight"] = f.tensors.at("model.norm.weight");
  EXPECT_NE(error_of([&] {
              weights_shape(f, "f", "generate");
            }).find("the blocks are not numbered 0 .. 2: 3 blocks, the last model.layers.7"),
            std::string::npos);
}

TEST(LlamaIo, AShapeThatDisagreesWithTheWeightsIsBlamedFieldByField) {
  TestModel<float> m(llama(false), 1, 4);
  m.randomise(4);
  const WeightsShape w = weights_shape(file_of(m), "f", "generate");
  auto err = [&](const GptConfig& shape, const std::vector<std::string>& overrides = {}) {
    return error_of([&] {
      check_shape_matches_weights(shape, w, "w.safetensors", "", "w.safetensors", overrides,
                                  "generate");
    });
  };
  EXPECT_EQ(err(llama(false)), "<no error>");
  EXPECT_EQ(err(llama(false, 1)),
            "[generate] the model shape does not match the weights w.safetensors: model.n_kv_head "
            "in the tensor shapes is 1 but the weights have 2 key/value heads (k_proj's 12 rows / "
            "head size 6); they do not belong together: correct the tensor shapes, or give the "
            "weights it describes");
  EXPECT_NE(err(llama(false, 4), {"model.n_kv_head=4"})
                .find("--model.n_kv_head=4 but the weights have 2 key/value heads"),
            std::string::npos);
  EXPECT_NE(err(llama(true))
                .find("model.tie_embeddings in the tensor shapes is true but the "
                      "weights have an lm_head.weight of its own (an untied head)"),
            std::string::npos);
  EXPECT_NE(err(GptConfig::make(37, 2, 4, 24, 12, 64))
                .find("model.arch in the tensor shapes is gpt2 but the weights have Llama tensors "
                      "(model.embed_tokens, model.layers.N)"),
            std::string::npos);
  // 3 heads of 8 channels: k_proj's 12 rows are no whole number of them.
  GptConfig three = GptConfig::make(37, 2, 3, 24, 12, 64);
  LlamaShape l;
  l.n_kv_head = 1;
  l.ffn = 40;
  three.set_llama(l);
  EXPECT_NE(err(three).find("k_proj's 12 rows, not a whole number of heads of size 8 (d_model / "
                            "n_head)"),
            std::string::npos);
}

TEST(LlamaIo, TheDecodeCacheHoldsOnlyTheKeyValueHeads) {
  for (int kv : {1, 2, 4}) {
    TestModel<float> m(llama(false, kv), 1, 4);
    auto st = m.model.make_decode_state(3);
    // Per layer: keys then values, each (B, maxT, n_kv_head * hs).
    EXPECT_EQ(st->cache[0].values - st->cache[0].keys, 3 * 12 * kv * 6) << kv;
    EXPECT_EQ(st->cache[1].keys - st->cache[0].values, 3 * 12 * kv * 6) << kv;
  }
}

}  // namespace
}  // namespace tetra
