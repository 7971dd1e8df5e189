// config.json of a Hugging Face model directory (ckpt/hf_config.h): what tetra and the Hub write
// is read, GPT-2 or Llama by model_type; every field that is out of range, of the wrong type or
// not what tetra's GPT-2 or Llama computes is refused naming the key, and a RoPE scaling says
// what would work (the CLI cases are tests/train/hf_dir_test.cc).
#include "ckpt/hf_config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <variant>

#include "tests/test_util.h"

namespace tetra {
namespace {

using testing::error_of;

std::string seed(const std::string& name) {
  std::ifstream in(std::string(TETRA_SOURCE_DIR) + "/fuzz/corpus/hf_config/" + name);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(HfConfig, ReadsTetrasAndTheHubsGpt2) {
  const HfGpt2Config t = parse_hf_gpt2_config(seed("valid_tetra.json"), "t/config.json", "test");
  EXPECT_EQ(t.vocab_size, 300);
  EXPECT_EQ(t.n_positions, 16);
  EXPECT_EQ(t.n_embd, 32);
  EXPECT_EQ(t.n_layer, 2);
  EXPECT_EQ(t.n_head, 2);
  EXPECT_EQ(t.bos_token_id, 299);
  EXPECT_EQ(t.eos_token_ids, std::vector<int>{299});
  // gpt2 on the Hub: no tie_word_embeddings (true by default), n_ctx, dropouts, nested params.
  const HfGpt2Config g = parse_hf_gpt2_config(seed("valid_gpt2_hub.json"), "gpt2", "test");
  EXPECT_EQ(g.vocab_size, 50257);
  EXPECT_EQ(g.n_layer, 12);
  EXPECT_EQ(g.eos_token_ids, std::vector<int>{50256});
  const HfGpt2Config l = parse_hf_gpt2_config(seed("valid_eos_list.json"), "l", "test");
  EXPECT_EQ(l.eos_token_ids, (std::vector<int>{6, 7}));
  EXPECT_FALSE(l.bos_token_id.has_value());
  EXPECT_EQ(l.pad_token_id, 0);
}

TEST(HfConfig, RefusesWhatIsOutOfRangeOrNotAGpt2Config) {
  const std::string base =
      R"({"model_type": "gpt2", "vocab_size": 300, "n_positions": 16, "n_embd": 32, )"
      R"("n_layer": 2, "n_head": 2)";
  auto err = [&](const std::string& extra) {
    return error_of([&] { parse_hf_gpt2_config(base + extra + "}", "d/config.json", "generate"); });
  };
  EXPECT_EQ(err(""), "<no error>");
  EXPECT_EQ(err(R"(, "n_layer": 4294967296)"),
            "[generate] d/config.json: key \"n_layer\" appears twice in one object; the file is "
            "damaged (which value is meant is unknown): keep one");
  EXPECT_EQ(err(R"(, "eos_token_id": 100000)"),
            "[generate] d/config.json: eos_token_id is 100000, out of range: token ids lie in 0 .. "
            "299 (vocab_size 300); one of the two is wrong: vocab_size is the rows of the weights' "
            "wte, and the id the tokenizer's <|endoftext|>");
  EXPECT_NE(err(R"(, "bos_token_id": -1)").find("bos_token_id is -1, out of range"),
            std::string::npos);
  EXPECT_NE(err(R"(, "bos_token_id": 9223372036854775808)").find("out of range"),
            std::string::npos);
  EXPECT_NE(err(R"(, "activation_function": "relu")")
                .find("activation_function is \"relu\", but tetra's GPT-2 needs \"gelu_new\"; "
                      "this model cannot be loaded"),
            std::string::npos);
  EXPECT_NE(err(R"(, "add_cross_attention": true)").find("add_cross_attention is true"),
            std::string::npos);
  EXPECT_EQ(err(R"(, "n_inner": 128)"), "<no error>");  // 4 x 32, what tetra computes
  EXPECT_NE(err(R"(, "n_inner": 64)").find("n_inner is 64, but tetra's GPT-2 has 4 x n_embd = 128"),
            std::string::npos);
  const std::string big = R"({"model_type": "gpt2", "vocab_size": 300, "n_positions": 16, )"
                          R"("n_embd": 32, "n_head": 2, "n_layer": 4294967296})";
  EXPECT_EQ(error_of([&] { parse_hf_gpt2_config(big, "d/config.json", "export"); }),
            "[export] d/config.json: n_layer is 4294967296, out of range: tetra's GPT-2 takes 1 .. "
            "10000 (layers, model.n_layer); the file is damaged or describes a model tetra cannot "
            "run");
  EXPECT_NE(error_of([&] {
              parse_hf_gpt2_config("[1, 2]", "d", "x");
            }).find("[x] d: the file holds [1,2]; expected a JSON object (GPT2Config)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_hf_gpt2_config("", "d", "x"); }).find("the file is empty"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              parse_hf_gpt2_config(R"({"model_type": "gpt2")", "d", "x");
            }).find("not valid JSON"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              parse_hf_gpt2_config(R"({"model_type": "llama"})", "d", "x");
            }).find("model_type is \"llama\", but tetra's GPT-2 needs \"gpt2\""),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              parse_hf_gpt2_config(R"({"model_type": "gpt2"})", "d", "x");
            }).find("no \"vocab_size\""),
            std::string::npos);
}

TEST(HfConfig, ReadsTetrasAndTheHubsLlama) {
  const HfLlamaConfig t = parse_hf_llama_config(seed("valid_llama_tetra.json"), "t", "test");
  EXPECT_EQ(t.vocab_size, 257);
  EXPECT_EQ(t.hidden_size, 48);
  EXPECT_EQ(t.intermediate_size, 100);
  EXPECT_EQ(t.num_hidden_layers, 2);
  EXPECT_EQ(t.num_attention_heads, 8);
  EXPECT_EQ(t.num_key_value_heads, 2);
  EXPECT_EQ(t.max_position_embeddings, 64);
  EXPECT_EQ(t.rms_norm_eps, 1e-6);
  EXPECT_EQ(t.rope_theta, 500000.0);
  EXPECT_FALSE(t.tie_word_embeddings);
  EXPECT_EQ(t.eos_token_ids, std::vector<int>{256});
  // TinyLlama on the Hub: GQA 32:4, bf16, rope_scaling null.
  const HfLlamaConfig h = parse_hf_llama_config(seed("valid_tinyllama_hub.json"), "h", "test");
  EXPECT_EQ(h.num_key_value_heads, 4);
  EXPECT_EQ(h.intermediate_size, 5632);
  EXPECT_EQ(h.rms_norm_eps, 1e-5);
  EXPECT_EQ(h.bos_token_id, 1);
  // Keys a LlamaConfig may leave out take its defaults: multi-head attention, eps 1e-6, theta
  // 1e4, an untied head.
  const HfLlamaConfig d = parse_hf_llama_config(
      R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 20,
          "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 8,
          "num_key_value_heads": null, "rope_scaling": {"rope_type": "default"}})",
      "d", "test");
  EXPECT_EQ(d.num_key_value_heads, 4);
  EXPECT_EQ(d.rms_norm_eps, 1e-6);
  EXPECT_EQ(d.rope_theta, 10000.0);
  EXPECT_FALSE(d.tie_word_embeddings);
}

TEST(HfConfig, DispatchesOnModelType) {
  EXPECT_TRUE(std::holds_alternative<HfGpt2Config>(
      parse_hf_model_config(seed("valid_tetra.json"), "g", "test")));
  EXPECT_TRUE(std::holds_alternative<HfLlamaConfig>(
      parse_hf_model_config(seed("valid_llama_tetra.json"), "l", "test")));
  EXPECT_EQ(error_of([] { parse_hf_model_config(R"({"model_type": "mistral"})", "m", "x"); }),
            "[x] m: model_type is \"mistral\"; tetra reads \"gpt2\" (GPT2LMHeadModel), \"llama\" "
            "(LlamaForCausalLM), \"mixtral\" (MixtralForCausalLM) and \"tetra_gpt2_moe\" "
            "(tetra's GPT-2 mixture of experts) model directories; this model cannot be loaded");
  // Without a model_type the file is read as GPT-2's, whose message asks for it.
  EXPECT_NE(error_of([] {
              parse_hf_model_config(R"({"n_embd": 4})", "m", "x");
            }).find("no \"model_type\"; is this a GPT-2 config.json?"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              parse_hf_model_config("7", "m", "x");
            }).find("expected a JSON object (GPT2Config, LlamaConfig or MixtralConfig)"),
            std::string::npos);
}

TEST(HfConfig, ReadsTheHubsMixtral) {
  // Mixtral-8x7B-v0.1's config.json: a Llama with every block's MLP 8 SwiGLU experts, top-2.
  const HfModelConfig m = parse_hf_model_config(seed("valid_mixtral_hub.json"), "mx", "test");
  ASSERT_TRUE(std::holds_alternative<HfLlamaConfig>(m));
  const HfLlamaConfig& c = std::get<HfLlamaConfig>(m);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.num_local_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.router_aux_loss_coef, 0.02);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_FALSE(c.tie_word_embeddings);
  // A dense Llama has no experts.
  EXPECT_EQ(
      std::get<HfLlamaConfig>(parse_hf_model_config(seed("valid_llama_tetra.json"), "l", "test"))
          .num_local_experts,
      0);
}

TEST(HfConfig, RefusesWhatTetrasMixtralDoesNotCompute) {
  const std::string base =
      R"({"model_type": "mixtral", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 50, )"
      R"("num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64, )"
      R"("num_local_experts": 4)";
  auto err = [&](const std::string& extra,
                 const std::string& top_k = R"(, "num_experts_per_tok": 2)") {
    return error_of(
        [&] { parse_hf_model_config(base + top_k + extra + "}", "d/config.json", "x"); });
  };
  EXPECT_EQ(err(""), "<no error>");
  EXPECT_EQ(err(R"(, "sliding_window": 64, "router_jitter_noise": 0.0)"), "<no error>");
  EXPECT_EQ(err(R"(, "sliding_window": 16)"),
            "[x] d/config.json: sliding_window is 16: attention over the last 16 positions only, "
            "and tetra's attention is full causal attention; a model whose window covers "
            "max_position_embeddings (64) computes the same, so set sliding_window to null or "
            "lower max_position_embeddings to the window");
  EXPECT_NE(err(R"(, "router_jitter_noise": 0.01)")
                .find("router_jitter_noise is 0.01, but "
                      "tetra's Mixtral needs 0.0"),
            std::string::npos);
  EXPECT_NE(err("", R"(, "num_experts_per_tok": 5)")
                .find("num_experts_per_tok is 5, out of range: "
                      "tetra's Mixtral takes 1 .. 4"),
            std::string::npos);
  const std::string no_experts = error_of([] {
    parse_hf_model_config(R"({"model_type": "mixtral", "vocab_size": 300, )"
                          R"("hidden_size": 32, "intermediate_size": 50, )"
                          R"("num_hidden_layers": 2, "num_attention_heads": 4, )"
                          R"("max_position_embeddings": 64})",
                          "d", "x");
  });
  EXPECT_NE(no_experts.find("no \"num_local_experts\""), std::string::npos) << no_experts;
}

TEST(HfConfig, RefusesWhatTetrasLlamaDoesNotCompute) {
  const std::string base =
      R"({"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 50, )"
      R"("num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64)";
  auto err = [&](const std::string& extra) {
    return error_of(
        [&] { parse_hf_model_config(base + extra + "}", "d/config.json", "generate"); });
  };
  auto has = [](const std::string& e, const std::string& what) {
    return e.find(what) != std::string::npos;
  };
  EXPECT_EQ(err(""), "<no error>");
  EXPECT_EQ(err(R"(, "num_key_value_heads": 2, "head_dim": 8, "rope_scaling": null, )"
                R"("attention_bias": false, "mlp_bias": false, "hidden_act": "silu")"),
            "<no error>");
  // RoPE scaling: named, with what works; dynamic NTK is exact within the original context.
  EXPECT_EQ(err(R"(, "rope_scaling": {"factor": 8.0, "rope_type": "llama3"})"),
            "[generate] d/config.json: rope_scaling is {\"factor\":8.0,\"rope_type\":\"llama3\"}: "
            "\"llama3\" scaling changes RoPE's frequencies or positions, and tetra computes plain "
            "RoPE (angle pos * rope_theta^(-2i/head_size) at every position); this model cannot "
            "be loaded. A model without rope_scaling loads (Llama 2, Llama 3.0, TinyLlama); "
            "removing rope_scaling from config.json would give a different model, since this "
            "scaling changes the rotation at every position, not only beyond the original context "
            "(do it only to experiment)");
  EXPECT_TRUE(has(err(R"(, "rope_scaling": {"type": "linear", "factor": 2.0})"),
                  "\"linear\" scaling changes RoPE's"));
  EXPECT_TRUE(has(err(R"(, "rope_scaling": {"rope_type": "yarn", "factor": 4.0})"),
                  "\"yarn\" scaling changes RoPE's"));
  EXPECT_TRUE(has(err(R"(, "rope_scaling": {"factor": 2.0})"), "a rope_scaling without a type"));
  EXPECT_TRUE(has(err(R"(, "rope_scaling": {"type": "dynamic", "factor": 2.0})"),
                  "\"dynamic\" scaling changes RoPE's frequencies or positions, and tetra "
                  "computes plain RoPE"));
  EXPECT_TRUE(has(err(R"(, "rope_scaling": {"type": "dynamic", "factor": 2.0})"),
                  "dynamic NTK scaling only acts on sequences longer than max_position_embeddings, "
                  "so removing rope_scaling from config.json gives the same model for prompts and "
                  "generated tokens within max_position_embeddings (64) positions"));
  // Llama 3.1 is refused for its scaling, before its 131072 positions.
  EXPECT_TRUE(
      has(error_of([] { parse_hf_model_config(seed("llama31_rope_scaling.json"), "l31", "x"); }),
          "\"llama3\" scaling"));
  // Grouped-query attention.
  EXPECT_EQ(err(R"(, "num_key_value_heads": 3)"),
            "[generate] d/config.json: num_key_value_heads 3 does not divide num_attention_heads "
            "4; grouped-query attention shares each key/value head among a whole number of query "
            "heads, so the file is damaged");
  EXPECT_TRUE(has(err(R"(, "num_key_value_heads": 8)"),
                  "num_key_value_heads is 8, out of range: tetra's Llama takes 1 .. 4"));
  EXPECT_TRUE(has(err(R"(, "num_key_value_heads": 0)"), "num_key_value_heads is 0, out of range"));
  EXPECT_TRUE(has(err(R"(, "num_key_value_heads": 2.0)"),
                  "num_key_value_heads is 2.0; expected an integer in 1 .. 4"));
  // What the block computes.
  EXPECT_EQ(err(R"(, "hidden_act": "gelu")"),
            "[generate] d/config.json: hidden_act is \"gelu\", but tetra's Llama needs \"silu\"; "
            "this model cannot be loaded");
  EXPECT_EQ(err(R"(, "attention_bias": true)"),
            "[generate] d/config.json: attention_bias is true, but tetra's Llama needs false; "
            "this model cannot be loaded");
  EXPECT_TRUE(has(err(R"(, "mlp_bias": true)"), "mlp_bias is true, but tetra's Llama needs false"));
  EXPECT_TRUE(has(err(R"(, "head_dim": 16)"),
                  "head_dim is 16, but tetra's Llama has hidden_size / num_attention_heads = 8 "
                  "channels per head"));
  EXPECT_TRUE(has(err(R"(, "hidden_size": 36, "num_attention_heads": 12)"),
                  "key \"hidden_size\" appears twice"));
  // Numbers.
  for (const char* eps : {"-1e-6", "1", "\"1e-6\"", "true"}) {
    const std::string e = err(std::string(R"(, "rms_norm_eps": )") + eps);
    EXPECT_TRUE(has(e, "rms_norm_eps is " +
                           std::string(eps == std::string("-1e-6") ? "-1e-06" : eps) +
                           "; expected a number in (0, 1)"))
        << e;
  }
  EXPECT_TRUE(has(err(R"(, "rms_norm_eps": 0)"),
                  "rms_norm_eps is 0; expected a number in (0, 1) (RMSNorm's epsilon, "
                  "model.norm_eps)"));
  EXPECT_TRUE(has(err(R"(, "rope_theta": 0)"), "rope_theta is 0; expected a number in (0, 1e+12]"));
  EXPECT_TRUE(has(err(R"(, "rope_theta": 1e13)"),
                  "rope_theta is 10000000000000.0; expected a number in (0, 1e+12]"));
  EXPECT_TRUE(has(err(R"(, "tie_word_embeddings": "yes")"),
                  "tie_word_embeddings is \"yes\"; expected true or false"));
  EXPECT_TRUE(has(err(R"(, "eos_token_id": [2, 300])"),
                  "eos_token_id[1] is 300, out of range: token ids lie in 0 .. 299 (vocab_size "
                  "300); one of the two is wrong: vocab_size is the rows of the weights' "
                  "embed_tokens"));
  EXPECT_TRUE(has(error_of([] {
                    parse_hf_model_config(
                        R"({"model_type": "llama", "vocab_size": 3, "hidden_size": 12, )"
                        R"("intermediate_size": 5, "num_hidden_layers": 1, )"
                        R"("num_attention_heads": 4, "max_position_embeddings": 8})",
                        "o", "x");
                  }),
                  "the head size hidden_size / num_attention_heads = 12 / 4 = 3 is odd"));
  EXPECT_EQ(error_of([] {
              parse_hf_model_config(R"({"model_type": "llama", "vocab_size": 3})", "o", "x");
            }),
            "[x] o: no \"hidden_size\" (channels, model.d_model); a Llama config.json has it: the "
            "file is damaged or not a LlamaConfig");
  EXPECT_TRUE(has(error_of([] {
                    parse_hf_model_config(
                        R"({"model_type": "llama", "vocab_size": 3, "hidden_size": 12, )"
                        R"("intermediate_size": 2000000})",
                        "o", "x");
                  }),
                  "intermediate_size is 2000000, out of range: tetra's Llama takes 1 .. 1048576 "
                  "(SwiGLU channels, model.ffn)"));
}

}  // namespace
}  // namespace tetra
