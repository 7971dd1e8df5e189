// config.json of a Hugging Face model directory (ckpt/hf_config.h): what tetra and the Hub write
// is read; every field that is out of range, of the wrong type or not what tetra's GPT-2 computes
// is refused naming the key (the CLI cases are tests/train/hf_dir_test.cc).
#include "ckpt/hf_config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

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
            "1024 (layers, model.n_layer); the file is damaged or describes a model tetra cannot "
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

}  // namespace
}  // namespace tetra
