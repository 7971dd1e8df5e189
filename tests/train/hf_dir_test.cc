// Hugging Face model directories under hostile use, through the tetra binary: an export that
// fails or is killed half way leaves the earlier export whole; a config.json is range-checked
// field by field and blamed (not the tokenizer) when it does not describe its weights; odd tensor
// names and prompts that are not UTF-8 are refused with what to change. Llama directories
// (LlamaForCausalLM) export and generate, from the directory or the bare weights file, and their
// config.json is held to what tetra's Llama computes.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

#include "ckpt/hf_config.h"
#include "ckpt/safetensors.h"
#include "data/bpe_train.h"
#include "kernels/backend.h"
#include "model/gpt.h"
#include "model/gpt_io.h"
#include "tests/train/run_tetra.h"
#include "train/train_config.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using testing::Ran;
using testing::run_command;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Every file of a folder (name -> xxh3) and the names beside it.
struct Snapshot {
  std::map<std::string, uint64_t> files;
  std::set<std::string> siblings;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const fs::path& dir) {
  Snapshot s;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string bytes = read_file(e.path());
    s.files[e.path().filename().string()] = XXH3_64bits(bytes.data(), bytes.size());
  }
  for (const auto& e : fs::directory_iterator(dir.parent_path())) {
    s.siblings.insert(e.path().filename().string());
  }
  return s;
}

class HfDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tetra_hf_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "in");
    fs::create_directories(dir_ / "out");
    write_weights(path("in/a.safetensors"), 1);
    write_weights(path("in/b.safetensors"), 2);
    // BPEs of 300 tokens (the second export's tokenizer, unlike the first's, byte) and of 400
    // (more than the model's vocabulary).
    BpeTrainer trainer(1);
    std::string text;
    uint32_t x = 1;
    for (int i = 0; i < 20000; ++i) {
      text += ' ';
      for (int k = 0; k < 2 + i % 5; ++k) {
        x = x * 1103515245u + 12345u;
        text += char('a' + (x >> 16) % 26);
      }
    }
    trainer.add_text(text);
    trainer.train(300).save(path("in/bpe.json"));
    trainer.train(400).save(path("in/bpe400.json"));
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Llama weights of vocabulary 300, 2 layers, 4 query heads of 8 channels over 2 key/value
  // heads, SwiGLU width 40, an untied head, 24 positions, rope_theta 5e5, norm_eps 1e-6.
  static GptConfig llama_shape() {
    GptConfig c = GptConfig::make(300, 2, 4, 32, 24, 64);
    LlamaShape l;
    l.n_kv_head = 2;
    l.ffn = 40;
    l.rope_theta = 5e5;
    l.norm_eps = 1e-6;
    c.set_llama(l);
    return c;
  }
  static void write_llama_weights(const std::string& file, uint64_t seed) {
    ParamStore store;
    Gpt model(cpu_backend(), llama_shape(), store, 1, 1);
    store.finalize({});
    store.init(seed);
    write_safetensors(file, store_to_safetensors(store, store.params().data(), true));
  }
  // What a bare Llama file cannot say, on the command line.
  static constexpr const char* kLlamaKeys =
      " --model.n_head=4 --model.max_seq=24 --model.rope_theta=5e5 --model.norm_eps=1e-6";

  // GPT-2 weights of vocabulary 300, 2 layers, 2 heads, width 32, 16 positions.
  static void write_weights(const std::string& file, uint64_t seed) {
    ParamStore store;
    Gpt model(cpu_backend(), GptConfig::make(300, 2, 2, 32, 16, 64), store, 1, 1);
    store.finalize({});
    store.init(seed);
    write_safetensors(file, store_to_safetensors(store, store.params().data(), true));
  }
  std::string tetra(const std::string& args) const {
    return std::string(TETRA_BINARY) + " " + args;
  }
  std::string export_to(const std::string& out, const std::string& weights,
                        const std::string& tokenizer) const {
    return tetra("export --hf " + out + " --model " + weights + " --tokenizer " + tokenizer +
                 " --model.n_head=2");
  }
  // Edits one key of DIR/config.json (raw JSON text as the value).
  void set_config_key(const std::string& dir, const std::string& key, const std::string& value) {
    nlohmann::ordered_json c =
        nlohmann::ordered_json::parse(read_file(fs::path(dir) / "config.json"));
    c[key] = nlohmann::ordered_json::parse(value);
    std::ofstream(fs::path(dir) / "config.json") << c.dump(2);
  }

  fs::path dir_;
};

// An export that fails half way (the file-size limit of a full disk: the small files are written,
// model.safetensors is not) or is killed there leaves the earlier export byte-identical: never its
// weights and config.json beside the new tokenizer.
TEST_F(HfDir, ExportFailingOrKilledHalfWayLeavesTheEarlierExportWhole) {
  const std::string out = path("out/model");
  Ran first = run_command(export_to(out, path("in/a.safetensors"), "byte"));
  ASSERT_EQ(first.code, 0) << first.output;
  const Snapshot before = snapshot(out);
  ASSERT_EQ(before.files.size(), 5u);
  ASSERT_LT(fs::file_size(path("in/bpe.json")), 60u << 10);
  ASSERT_GT(fs::file_size(fs::path(out) / "model.safetensors"), 100u << 10);

  // bash's ulimit -f counts KiB: 64 KiB holds every file but model.safetensors.
  const std::string second = export_to(out, path("in/b.safetensors"), path("in/bpe.json"));
  Ran full = run_command("bash -c 'ulimit -f 64; trap \"\" XFSZ; exec " + second + "'");
  EXPECT_REFUSED(full, "model.safetensors: write failed (File too large)");
  EXPECT_REFUSED(
      full, "(while writing the new model directory beside " + out + "; " + out + " is unchanged)");
  EXPECT_TRUE(snapshot(out) == before) << full.output;

  // A killed export (tetra ignores SIGXFSZ, so a kill is staged here) leaves only its staging
  // folder. The next export from this host removes the ones whose process is gone and leaves
  // those of a live process or of another host alone.
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof host - 1), 0);
  const pid_t gone = fork();
  if (gone == 0) _exit(0);
  ASSERT_EQ(waitpid(gone, nullptr, 0), gone);
  const std::string stem = path("out/.model.export-") + host + "-";
  for (const std::string& leftover :
       {stem + std::to_string(gone), stem + std::to_string(getpid()),
        path("out/.model.export-elsewhere-") + std::to_string(gone)}) {
    fs::create_directories(leftover);
    std::ofstream(fs::path(leftover) / "tokenizer.json") << "partial";
  }
  Ran ok = run_command(second);
  ASSERT_EQ(ok.code, 0) << ok.output;
  EXPECT_NE(ok.output.find("removed .model.export-" + std::string(host) + "-" +
                           std::to_string(gone) + ", left by an export that was killed"),
            std::string::npos)
      << ok.output;
  const Snapshot now = snapshot(out);
  std::set<std::string> siblings = before.siblings;
  siblings.insert(".model.export-" + std::string(host) + "-" + std::to_string(getpid()));
  siblings.insert(".model.export-elsewhere-" + std::to_string(gone));
  EXPECT_EQ(now.siblings, siblings);
  EXPECT_EQ(now.files.size(), 5u);
  for (const char* f : {"tokenizer.json", "model.safetensors", "config.json"}) {
    EXPECT_NE(now.files.at(f), before.files.at(f)) << f;
  }
  EXPECT_EQ(read_file(fs::path(out) / "tokenizer.json"),
            load_tokenizer(path("in/bpe.json"))->to_json(2));
}

TEST_F(HfDir, ExportRefusesATargetHoldingOtherFilesBeforeReadingTheWeights) {
  std::ofstream(path("out/notes.txt")) << "mine";
  std::ofstream(path("out/.hidden")) << "mine";
  Ran r = run_command(export_to(path("out"), path("in/missing.safetensors"), "byte"));
  EXPECT_REFUSED(r, "[export] " + path("out") +
                        " holds 'notes.txt' (and 1 more), which is not part of a model directory");
  EXPECT_EQ(read_file(path("out/notes.txt")), "mine");
  EXPECT_REFUSED(run_command(export_to("/", path("in/a.safetensors"), "byte")),
                 "[export] / is the root folder");
}

// A config.json that does not describe its weights is blamed, naming the key and the tensor,
// before the tokenizer is compared with it (vocab_size 200 < 257 once blamed the tokenizer).
TEST_F(HfDir, ConfigJsonThatDisagreesWithItsWeightsIsBlamedNotTheTokenizer) {
  const std::string model = path("out/model");
  ASSERT_EQ(run_command(export_to(model, path("in/a.safetensors"), "byte")).code, 0);
  // vocab_size alone edited: its ids beyond the new vocabulary are named first, as the
  // inconsistency within config.json it is.
  set_config_key(model, "vocab_size", "200");
  EXPECT_REFUSED(run_command(tetra("generate --model " + model + " --prompt hi")),
                 "config.json: bos_token_id is 256, out of range: token ids lie in 0 .. 199 "
                 "(vocab_size 200); one of the two is wrong");
  set_config_key(model, "bos_token_id", "100");
  set_config_key(model, "eos_token_id", "100");
  const std::string want = "the model shape does not match the weights " + model +
                           "/model.safetensors: vocab_size in " + model +
                           "/config.json is 200 but the weights have 300 wte's rows; they do not "
                           "belong together: correct " +
                           model + "/config.json, or give the weights it describes";
  Ran gen = run_command(tetra("generate --model " + model + " --prompt hi"));
  EXPECT_REFUSED(gen, "[generate] " + want);
  EXPECT_EQ(gen.output.find("tokenizer"), std::string::npos) << gen.output;
  EXPECT_REFUSED(run_command(tetra("export --hf " + path("out/again") + " --model " + model)),
                 "[export] " + want);
  set_config_key(model, "vocab_size", "300");
  set_config_key(model, "n_layer", "3");
  set_config_key(model, "n_positions", "32");
  EXPECT_REFUSED(run_command(tetra("generate --model " + model + " --prompt hi")),
                 "n_positions in " + model +
                     "/config.json is 32 but the weights have 16 wpe's "
                     "rows; n_layer in " +
                     model + "/config.json is 3 but the weights have 2 blocks h.N");
  // An override that disagrees is the override's fault, in tetra's key names.
  set_config_key(model, "n_layer", "2");
  set_config_key(model, "n_positions", "16");
  EXPECT_REFUSED(
      run_command(tetra("generate --model " + model + " --prompt hi --model.d_model=64")),
      "the model shape does not match the weights " + model +
          "/model.safetensors: --model.d_model=64 but the weights have 32 wte's "
          "columns; they do not belong together: correct --model.d_model=64, or give "
          "the weights it describes");
  EXPECT_REFUSED(run_command(tetra("generate --model " + path("in/a.safetensors") +
                                   " --tokenizer byte --prompt hi --model.n_head=2 "
                                   "--model.vocab_size=310")),
                 "--model.vocab_size=310 but the weights have 300 wte's rows");
  // With config.json and weights agreeing, a larger tokenizer is the tokenizer's fault.
  EXPECT_REFUSED(run_command(tetra("generate --model " + model + " --prompt hi --tokenizer " +
                                   path("in/bpe400.json"))),
                 "[generate] the tokenizer " + path("in/bpe400.json") +
                     " has 400 tokens but the model (" + model + "/model.safetensors) only 300");
}

TEST_F(HfDir, ConfigJsonFieldsAreRangeCheckedBeforeUse) {
  const std::string model = path("out/model");
  ASSERT_EQ(run_command(export_to(model, path("in/a.safetensors"), "byte")).code, 0);
  const std::string good = read_file(fs::path(model) / "config.json");
  struct Case {
    const char* key;
    const char* value;
    const char* message;
  };
  const Case cases[] = {
      {"n_layer", "4294967297",
       "n_layer is 4294967297, out of range: tetra's GPT-2 takes 1 .. 10000 (layers, "
       "model.n_layer); the file is damaged or describes a model tetra cannot run"},
      {"n_layer", "18446744073709551615", "n_layer is 18446744073709551615, out of range"},
      {"n_head", "0", "n_head is 0, out of range: tetra's GPT-2 takes 1 .. 131072"},
      {"vocab_size", "-300", "vocab_size is -300, out of range"},
      {"n_embd", "1e30", "n_embd is 1e+30; expected an integer in 1 .. 131072"},
      {"n_embd", "32.0", "n_embd is 32.0; expected an integer in 1 .. 131072"},
      {"n_positions", "\"16\"", "n_positions is \"16\"; expected an integer in 1 .. 1048576"},
      {"n_head", "3", "n_head 3 does not divide n_embd 32"},
      {"eos_token_id", "100000",
       "eos_token_id is 100000, out of range: token ids lie in 0 .. 299 (vocab_size 300)"},
      {"bos_token_id", "-1", "bos_token_id is -1, out of range: token ids lie in 0 .. 299"},
      {"eos_token_id", "[256, 300]", "eos_token_id[1] is 300, out of range"},
      {"pad_token_id", "\"eos\"", "pad_token_id is \"eos\"; expected a token id"},
      {"n_inner", "100", "n_inner is 100, but tetra's GPT-2 has 4 x n_embd = 128 MLP channels"},
      {"layer_norm_epsilon", "1e-6", "layer_norm_epsilon is 1e-06, but tetra's GPT-2 needs 1e-05"},
      {"tie_word_embeddings", "\"yes\"",
       "tie_word_embeddings is \"yes\", but tetra's GPT-2 needs true"},
      {"scale_attn_by_inverse_layer_idx", "true", "scale_attn_by_inverse_layer_idx is true"},
  };
  for (const Case& c : cases) {
    std::ofstream(fs::path(model) / "config.json") << good;
    set_config_key(model, c.key, c.value);
    Ran r = run_command(tetra("generate --model " + model + " --prompt hi"));
    EXPECT_REFUSED(r, "[generate] " + model + "/config.json: " + c.message);
  }
  // Text no plain parse would refuse.
  std::ofstream(fs::path(model) / "config.json") << "{\"model_type\": \"gpt2\", \"n_layer\": 2, "
                                                    "\"n_layer\": 40}";
  EXPECT_REFUSED(run_command(tetra("generate --model " + model + " --prompt hi")),
                 "config.json: key \"n_layer\" appears twice");
  std::ofstream(fs::path(model) / "config.json") << std::string(100, '[') + std::string(100, ']');
  EXPECT_REFUSED(run_command(tetra("generate --model " + model + " --prompt hi")),
                 "config.json: JSON nested deeper than 64 levels");
}

// The limits config.json is checked against are the model.* ranges of tetra train.
TEST(HfConfigLimits, AreTheTrainSchemasRanges) {
  const std::map<std::string, int64_t> limits = {{"model.vocab_size", HfConfigLimits::vocab_size},
                                                 {"model.max_seq", HfConfigLimits::n_positions},
                                                 {"model.d_model", HfConfigLimits::n_embd},
                                                 {"model.n_layer", HfConfigLimits::n_layer},
                                                 {"model.n_head", HfConfigLimits::n_head}};
  // Llama's SwiGLU width and key/value heads take 0 for a default, which config.json never
  // holds; their upper ends are the reader's.
  for (const KeySpec& spec : train_config_schema()) {
    if (spec.key == "model.ffn") {
      EXPECT_EQ(spec.valid, "[0, " + std::to_string(HfConfigLimits::intermediate_size) + "]");
    }
    if (spec.key == "model.n_kv_head") {
      EXPECT_EQ(spec.valid, "[0, " + std::to_string(HfConfigLimits::n_head) + "]");
    }
    if (spec.key == "model.rope_theta") {
      EXPECT_EQ(spec.valid, "(0, 1e12]");
    }
  }
  for (const auto& [key, max] : limits) {
    bool found = false;
    for (const KeySpec& spec : train_config_schema()) {
      if (spec.key != key) continue;
      found = true;
      EXPECT_EQ(spec.valid, "[1, " + std::to_string(max) + "]") << key;
    }
    EXPECT_TRUE(found) << key;
  }
}

// Block numbers are parsed without overflow: a name such as h.99999999999.* is named, not a
// crash ("unexpected: stoi").
TEST_F(HfDir, TensorNamesWithHugeOrMissingBlockNumbersAreNamed) {
  SafeTensorsFile f = read_safetensors(path("in/a.safetensors"));
  f.tensors["transformer.h.99999999999.ln_1.weight"] = f.tensors.at("transformer.h.0.ln_1.weight");
  write_safetensors(path("in/huge.safetensors"), f);
  EXPECT_REFUSED(run_command(tetra("generate --model " + path("in/huge.safetensors") +
                                   " --tokenizer byte --model.n_head=2 --prompt hi")),
                 "tensor 'transformer.h.99999999999.ln_1.weight' is not a block tensor h.N.* with "
                 "N in 0 .. 9999");
  f = read_safetensors(path("in/a.safetensors"));
  f.tensors["transformer.h.5.ln_1.weight"] = f.tensors.at("transformer.h.0.ln_1.weight");
  write_safetensors(path("in/gap.safetensors"), f);
  EXPECT_REFUSED(
      run_command(tetra("export --hf " + path("out/x") + " --model " + path("in/gap.safetensors") +
                        " --tokenizer byte --model.n_head=2")),
      "the blocks are not numbered 0 .. 2: 3 blocks, the last h.5");
}

// Prompts are text: bytes that are not UTF-8 are refused with their offset, as data prepare
// refuses them, before the weights are read.
TEST_F(HfDir, PromptsThatAreNotUtf8AreRefused) {
  const std::string base =
      tetra("generate --model " + path("in/a.safetensors") + " --tokenizer byte --model.n_head=2");
  EXPECT_REFUSED(run_command(base + " --prompt ok --prompt \"$(printf 'caf\\351 au lait')\""),
                 "[generate] --prompt 2 (of 2): byte 3 (0xe9) is not valid UTF-8; give the prompt "
                 "as UTF-8 text");
  EXPECT_REFUSED(run_command(base + " --prompt \"$(printf 'ab\\342\\202')\""),
                 "byte 2 (0xe2) is not valid UTF-8");  // a sequence cut short
  EXPECT_REFUSED(run_command(base + " --prompt \"$(printf '\\355\\240\\200')\""),
                 "byte 0 (0xed) is not valid UTF-8");  // a surrogate
  Ran ok = run_command(base + " --prompt 'caf\xc3\xa9 \xe6\x9d\xb1' --max-tokens 2", false);
  EXPECT_EQ(ok.code, 0) << ok.output;
  EXPECT_EQ(ok.output.rfind("caf\xc3\xa9 \xe6\x9d\xb1", 0), 0u) << ok.output;
}

// A Llama exported from a bare weights file (the head count and what no tensor holds given, the
// key/value heads read off k_proj) is a LlamaForCausalLM directory whose config.json alone lets
// tetra generate the same greedy text as from the bare file.
TEST_F(HfDir, LlamaExportsAndGeneratesFromTheDirectoryAndTheBareFile) {
  write_llama_weights(path("in/llama.safetensors"), 3);
  const std::string model = path("out/llama");
  Ran ex = run_command(tetra("export --hf " + model + " --model " + path("in/llama.safetensors") +
                             " --tokenizer " + path("in/bpe.json") + kLlamaKeys));
  ASSERT_EQ(ex.code, 0) << ex.output;
  const nlohmann::json c = nlohmann::json::parse(read_file(fs::path(model) / "config.json"));
  EXPECT_EQ(c["architectures"], nlohmann::json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(c["model_type"], "llama");
  EXPECT_EQ(c["hidden_size"], 32);
  EXPECT_EQ(c["intermediate_size"], 40);
  EXPECT_EQ(c["num_attention_heads"], 4);
  EXPECT_EQ(c["num_key_value_heads"], 2);
  EXPECT_EQ(c["max_position_embeddings"], 24);
  EXPECT_EQ(c["rope_theta"], 5e5);
  EXPECT_EQ(c["rms_norm_eps"], 1e-6);
  EXPECT_EQ(c["tie_word_embeddings"], false);
  EXPECT_TRUE(c["rope_scaling"].is_null());
  EXPECT_EQ(c["hidden_act"], "silu");
  EXPECT_EQ(c["torch_dtype"], "float32");
  const HfModelConfig back =
      read_hf_model_config((fs::path(model) / "config.json").string(), "test");
  ASSERT_TRUE(std::holds_alternative<HfLlamaConfig>(back));
  const SafeTensorsFile in = read_safetensors(path("in/llama.safetensors"));
  const SafeTensorsFile out = read_safetensors(model + "/model.safetensors");
  ASSERT_EQ(in.tensors.size(), out.tensors.size());
  for (const auto& [name, t] : in.tensors) EXPECT_EQ(out.tensors.at(name).bytes, t.bytes) << name;

  const std::string gen = " --prompt 'hello world' --temperature 0 --max-tokens 8";
  Ran from_dir = run_command(tetra("generate --model " + model + gen), false);
  ASSERT_EQ(from_dir.code, 0) << from_dir.output;
  Ran from_file = run_command(tetra("generate --model " + path("in/llama.safetensors") +
                                    " --tokenizer " + path("in/bpe.json") + kLlamaKeys + gen),
                              false);
  ASSERT_EQ(from_file.code, 0) << from_file.output;
  EXPECT_EQ(from_dir.output, from_file.output);
  EXPECT_EQ(from_dir.output.rfind("hello world", 0), 0u) << from_dir.output;
  // Without the head count the bare file is refused; without rope_theta and the rest it runs on
  // the defaults and says so.
  EXPECT_REFUSED(run_command(tetra("generate --model " + path("in/llama.safetensors") +
                                   " --tokenizer " + path("in/bpe.json") + gen)),
                 "[generate] the head count cannot be read off the weights");
  Ran defaults =
      run_command(tetra("generate --model " + path("in/llama.safetensors") + " --tokenizer " +
                        path("in/bpe.json") + " --model.n_head=4" + gen));
  EXPECT_EQ(defaults.code, 0) << defaults.output;
  EXPECT_NE(defaults.output.find("is a bare Llama weights file: its tensors do not hold the "
                                 "longest sequence, RoPE's base or RMSNorm's epsilon; using the "
                                 "defaults model.max_seq=128, model.rope_theta=10000, "
                                 "model.norm_eps=1e-05"),
            std::string::npos)
      << defaults.output;
  // The head count decides the key/value heads: 8 heads of 4 channels make k_proj's 16 rows 4.
  Ran eight = run_command(tetra("generate --model " + path("in/llama.safetensors") +
                                " --tokenizer " + path("in/bpe.json") + " --model.n_head=8" + gen));
  EXPECT_EQ(eight.code, 0) << eight.output;
  // Refusing GPT-2 weights for a Llama shape names the family.
  EXPECT_REFUSED(run_command(tetra("generate --model " + path("in/a.safetensors") +
                                   " --tokenizer byte --prompt hi --model.n_head=2 "
                                   "--model.arch=llama")),
                 "--model.arch=llama but the weights have GPT-2 tensors (transformer.wte, "
                 "transformer.h.N)");
}

// A Llama config.json is held to what tetra's Llama computes, naming the key and what would work,
// and blamed, key by key, when it does not describe its weights.
TEST_F(HfDir, LlamaConfigJsonIsCheckedAndBlamed) {
  write_llama_weights(path("in/llama.safetensors"), 4);
  const std::string model = path("out/llama");
  ASSERT_EQ(run_command(tetra("export --hf " + model + " --model " + path("in/llama.safetensors") +
                              " --tokenizer " + path("in/bpe.json") + kLlamaKeys))
                .code,
            0);
  const std::string good = read_file(fs::path(model) / "config.json");
  struct Case {
    const char* key;
    const char* value;
    std::string message;
  };
  const std::string cfg = model + "/config.json";
  const Case cases[] = {
      {"rope_scaling", R"({"rope_type": "llama3", "factor": 8.0})",
       cfg + ": rope_scaling is {\"factor\":8.0,\"rope_type\":\"llama3\"}: \"llama3\" scaling "
             "changes RoPE's frequencies or positions, and tetra computes plain RoPE"},
      {"rope_scaling", R"({"type": "dynamic", "factor": 2.0})",
       "removing rope_scaling from config.json gives the same model for prompts and generated "
       "tokens within max_position_embeddings (24) positions"},
      {"num_key_value_heads", "3",
       cfg + ": num_key_value_heads 3 does not divide num_attention_heads 4"},
      {"hidden_act", "\"gelu\"",
       cfg + ": hidden_act is \"gelu\", but tetra's Llama needs \"silu\"; this model cannot be "
             "loaded"},
      {"attention_bias", "true", cfg + ": attention_bias is true, but tetra's Llama needs false"},
      {"head_dim", "16",
       cfg + ": head_dim is 16, but tetra's Llama has hidden_size / "
             "num_attention_heads = 8 channels per head"},
      {"num_key_value_heads", "1",
       "num_key_value_heads in " + cfg +
           " is 1 but the weights have 2 key/value heads (k_proj's 16 rows / head size 8)"},
      {"intermediate_size", "64",
       "intermediate_size in " + cfg + " is 64 but the weights have 40 gate_proj's rows"},
      {"tie_word_embeddings", "true",
       "tie_word_embeddings in " + cfg +
           " is true but the weights have an lm_head.weight of its own (an untied head)"},
      {"model_type", "\"mistral\"",
       cfg + ": model_type is \"mistral\"; tetra reads \"gpt2\" (GPT2LMHeadModel), \"llama\""},
  };
  for (const Case& c : cases) {
    std::ofstream(fs::path(model) / "config.json") << good;
    set_config_key(model, c.key, c.value);
    EXPECT_REFUSED(run_command(tetra("generate --model " + model + " --prompt hi")), c.message);
  }
}

}  // namespace
}  // namespace tetra
