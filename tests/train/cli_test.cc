// `tetra train` end to end through the binary: bad input is refused before any compute with a
// message that says what to change; accumulation and repeat runs behave as promised.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "data/token_shard.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;

struct CliRun {
  int code;
  std::string output;
};

CliRun tetra(const std::string& args) {
  std::string cmd = std::string(TETRA_BINARY) + " " + args + " 2>&1";
  CliRun r{0, ""};
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) r.output.append(buf, n);
  int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

class TrainCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tetra_cli_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::vector<uint32_t> tokens(4096);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint32_t((i * 7 + i / 5) % 61);
    write_token_shard(path("train.bin"), tokens);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // A tiny model over the 64-token shard.
  std::string base() const {
    return "train --model.vocab_size=64 --model.n_layer=2 --model.n_head=2 --model.d_model=32 "
           "--model.max_seq=16 --train.seq_len=16 --train.micro_batch=4 --train.steps=3 "
           "--run.threads=1 --data.train=" +
           path("train.bin") + " --run.dir=" + path("run");
  }
  std::vector<nlohmann::json> metrics(const std::string& run_dir) const {
    std::vector<nlohmann::json> out;
    std::ifstream in(fs::path(run_dir) / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  }
  fs::path dir_;
};

#define EXPECT_REFUSED(run, text)                                                               \
  do {                                                                                          \
    EXPECT_EQ((run).code, 2) << (run).output;                                                   \
    EXPECT_NE((run).output.find(text), std::string::npos) << "missing '" << (text) << "' in:\n" \
                                                          << (run).output;                      \
    EXPECT_EQ((run).output.find("[train] step"), std::string::npos) << (run).output;            \
  } while (0)

TEST_F(TrainCli, TrainsAndWritesMetrics) {
  CliRun r = tetra(base());
  ASSERT_EQ(r.code, 0) << r.output;
  auto m = metrics(path("run"));
  ASSERT_EQ(m.size(), 3u);
  for (const char* key : {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_ms",
                          "mfu", "data_wait_ms"}) {
    EXPECT_TRUE(m[0].contains(key)) << key;
  }
  EXPECT_EQ(m[2]["step"], 3);
  EXPECT_EQ(m[2]["tokens"], 3 * 4 * 16);
  EXPECT_TRUE(fs::exists(path("run/config.toml")));
}

TEST_F(TrainCli, UnknownKeyGetsASuggestion) {
  EXPECT_REFUSED(tetra(base() + " --optim.learning_rate=1e-3"),
                 "unknown key 'optim.learning_rate'");
  EXPECT_REFUSED(tetra(base() + " --model.n_layers=3"), "Did you mean 'model.n_layer'");
}

TEST_F(TrainCli, HeadsMustDivideDModel) {
  EXPECT_REFUSED(tetra(base() + " --model.n_head=3"),
                 "model.n_head=3 does not divide model.d_model=32");
}

TEST_F(TrainCli, TokenIdBeyondVocabIsRefused) {
  EXPECT_REFUSED(tetra(base() + " --model.vocab_size=50"),
                 "holds token id 60 but model.vocab_size=50");
}

TEST_F(TrainCli, TruncatedAndForeignDataFilesAreRefused) {
  fs::copy_file(path("train.bin"), path("cut.bin"));
  fs::resize_file(path("cut.bin"), fs::file_size(path("cut.bin")) - 10);
  EXPECT_REFUSED(tetra(base() + " --data.train=" + path("cut.bin")), "truncated");
  std::ofstream(path("foreign.bin")) << std::string(2000, 'x');
  EXPECT_REFUSED(tetra(base() + " --data.train=" + path("foreign.bin")), "not a token shard");
  EXPECT_REFUSED(tetra(base() + " --data.train=" + path("missing.bin")), "missing.bin");
}

TEST_F(TrainCli, SafetensorsWithWrongNamesOrShapesAreRefused) {
  ASSERT_EQ(tetra(base() + " --save.final=" + path("w.safetensors")).code, 0);
  SafeTensorsFile f = read_safetensors(path("w.safetensors"));
  EXPECT_EQ(f.tensors.at("transformer.h.0.attn.c_attn.weight").shape, (Shape{32, 96}));
  EXPECT_EQ(f.tensors.at("transformer.wte.weight").shape, (Shape{64, 32}));
  // Loads back cleanly.
  EXPECT_EQ(tetra(base() + " --init.from=" + path("w.safetensors")).code, 0);

  SafeTensorsFile renamed = f;
  renamed.tensors["transformer.h.0.attn.c_atn.weight"] =
      renamed.tensors.at("transformer.h.0.attn.c_attn.weight");
  renamed.tensors.erase("transformer.h.0.attn.c_attn.weight");
  write_safetensors(path("renamed.safetensors"), renamed);
  EXPECT_REFUSED(tetra(base() + " --init.from=" + path("renamed.safetensors")), "c_atn");

  EXPECT_REFUSED(tetra(base() + " --model.d_model=64 --init.from=" + path("w.safetensors")),
                 "has shape (64, 32) but this model needs (64, 64)");
  EXPECT_REFUSED(tetra(base() + " --model.n_layer=1 --init.from=" + path("w.safetensors")),
                 "transformer.h.1.");
}

TEST_F(TrainCli, AccumulationMatchesTheLargerBatch) {
  // 4 sequences x 2 micro-batches and 8 sequences x 1 see the same samples per step.
  std::string common = base() + " --train.steps=4 --optim.lr=1e-2";
  ASSERT_EQ(tetra(common + " --train.micro_batch=8 --run.dir=" + path("a")).code, 0);
  ASSERT_EQ(
      tetra(common + " --train.micro_batch=4 --train.grad_accum=2 --run.dir=" + path("b")).code, 0);
  auto a = metrics(path("a")), b = metrics(path("b"));
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) {
    double la = a[i]["loss"], lb = b[i]["loss"];
    EXPECT_NEAR(la, lb, 1e-5 * la) << "step " << i + 1;
  }
}

TEST_F(TrainCli, RepeatRunsAreBitIdenticalAndKeepOldMetrics) {
  ASSERT_EQ(tetra(base()).code, 0);
  auto first = metrics(path("run"));
  ASSERT_EQ(tetra(base()).code, 0);
  auto second = metrics(path("run"));
  ASSERT_EQ(first.size(), second.size());
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(first[i]["loss"].get<double>(), second[i]["loss"].get<double>());
    EXPECT_EQ(first[i]["grad_norm"].get<double>(), second[i]["grad_norm"].get<double>());
  }
  EXPECT_TRUE(fs::exists(path("run/metrics.jsonl.1")));  // the first run's file was kept
}

}  // namespace
}  // namespace tetra
