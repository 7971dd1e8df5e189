// The memory ledger: for a GPT-2 model (4 layers of width 256, an 8192-token vocabulary: every
// category of gpt2-124m's ledger, at a size that runs in seconds) on 2 ranks (and ZeRO-3 on 4),
// what every ZeRO stage measures per rank in each category (the trainer's mem_* metrics) is within
// 5% of what `tetra plan` predicts for the same model and layout, and the stages divide the state
// as the seeds say: ZeRO-1 the optimizer state by N, ZeRO-2 also the gradients, ZeRO-3 also the
// parameters.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/token_shard.h"
#include "kernels/cpu/matmul.h"
#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::Ran;
using testing::run_command;
using testing::tetra_command;

constexpr int kB = 1, kT = 32, kV = 8192, kL = 4, kC = 256, kH = 4;
const char* const kCategories[] = {"params",      "grads", "optimizer",
                                   "activations", "comm",  "temporaries"};

class MemoryLedgerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("tetra_memory_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::vector<uint32_t> tokens(4096);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint32_t(i * 7919 % kV);
    write_token_shard((dir_ / "train.bin").string(), tokens);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  // The trainer's high-water marks per category after one step; `model` adds model keys (a Llama
  // model's).
  static json measured(int ranks, int stage, const std::string& recompute,
                       const std::string& precision = "fp32", const std::string& model = "") {
    const fs::path run = dir_ / fmt::format("run_{}_{}_{}_{}_{}", ranks, stage, recompute,
                                            precision, std::hash<std::string>{}(model));
    const Ran r = run_command(tetra_command(
        ranks, fmt::format("train --model.vocab_size={} --model.n_layer={} --model.n_head={} "
                           "--model.d_model={} --model.max_seq={} ",
                           kV, kL, kH, kC, kT) +
                   model + " --train.seq_len=" + std::to_string(kT) +
                   " --train.micro_batch=" + std::to_string(kB) +
                   " --train.steps=1 --run.threads=1 --run.peak_gflops=50 --zero.stage=" +
                   std::to_string(stage) + " --train.recompute=" + recompute +
                   " --train.precision=" + precision + " --data.train=" +
                   (dir_ / "train.bin").string() + " --run.dir=" + run.string()));
    EXPECT_EQ(r.code, 0) << r.output;
    std::ifstream in(run / "metrics.jsonl");
    std::string line;
    std::getline(in, line);
    return line.empty() ? json::object() : json::parse(line);
  }

  // `tetra plan`'s ledger of a tetra run for the same model and layout, by the same keys; `model`
  // adds model keys (a Llama model's), as on the run's command line.
  static json planned(int ranks, int stage, const std::string& recompute,
                      const std::string& precision = "fp32", const std::string& model = "") {
    const Ran r = run_command(
        tetra_command(1, "plan --json --config " + std::string(TETRA_SOURCE_DIR) +
                             "/configs/plan/gpt2-124m-cpu.toml --model.preset= --train.seq_len=" +
                             std::to_string(kT) +
                             fmt::format(" --model.vocab_size={} --model.n_layer={} "
                                         "--model.d_model={} --model.n_head={} ",
                                         kV, kL, kC, kH) +
                             model + " --cluster.gpus=" + std::to_string(ranks) +
                             " --cluster.gpus_per_node=" + std::to_string(ranks) +
                             " --training.global_batch=" + std::to_string(ranks * kT) +
                             " --train.micro_batch=" + std::to_string(kB) +
                             " --train.recompute=" + recompute + " --train.precision=" + precision +
                             " --parallel.tp=1 --parallel.pp=1 --parallel.dp=" +
                             std::to_string(ranks) + " --zero.stage=" + std::to_string(stage)),
        /*with_stderr=*/false);
    EXPECT_EQ(r.code, 0) << r.output;
    return json::parse(r.output)["memory"]["tetra_run"];
  }

  // Every category of a run's measured high-water marks within 5% of the plan (0 where it is 0);
  // with a `name`, each printed as measured / planned for the record.
  static void expect_matches_plan(const json& got, const json& want, const std::string& name = "") {
    std::string line = "[ ledger   ] " + name + ":";
    for (const char* c : kCategories) {
      const double m = got.value(std::string("mem_") + c, -1.0), p = want[c];
      if (p == 0) {
        EXPECT_EQ(m, 0.0) << c;
      } else {
        EXPECT_NEAR(m, p, 0.05 * p) << c;
        line += fmt::format(" {} {:.4f}", c, m / p);
      }
    }
    if (!name.empty()) std::cout << line << std::endl;
  }

  static fs::path dir_;
};
fs::path MemoryLedgerTest::dir_;

TEST_F(MemoryLedgerTest, EveryStageMatchesThePlanAndTheSeedsRatios) {
  // Every stage on 2 ranks, and ZeRO-3 on 4 (oversubscribed, so one run there): the unsharded
  // state per rank does not depend on the rank count, so stage 0 on 2 ranks is the base of the
  // ratios on 4 too.
  std::vector<json> two;
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE("2 ranks, ZeRO stage " + std::to_string(stage));
    two.push_back(measured(2, stage, "none"));
    expect_matches_plan(two.back(), planned(2, stage, "none"));
  }
  const json four = measured(4, 3, "none");
  {
    SCOPED_TRACE("4 ranks, ZeRO stage 3");
    expect_matches_plan(four, planned(4, 3, "none"));
  }
  auto ratio = [&](const json& run, const char* c) {
    return run[std::string("mem_") + c].get<double>() /
           two[0][std::string("mem_") + c].get<double>();
  };
  for (const auto& [run, N] : {std::pair<const json&, double>{two[3], 2.0}, {four, 4.0}}) {
    SCOPED_TRACE(std::to_string(int(N)) + " ranks");
    EXPECT_NEAR(ratio(run, "params"), 1 / N, 0.01 / N);
    EXPECT_NEAR(ratio(run, "grads"), 1 / N, 0.01 / N);
    EXPECT_NEAR(ratio(run, "optimizer"), 1 / N, 0.01 / N);
  }
  EXPECT_NEAR(ratio(two[1], "optimizer"), 0.5, 0.005);
  EXPECT_NEAR(ratio(two[1], "grads"), 1.0, 1e-9);
  EXPECT_NEAR(ratio(two[2], "optimizer"), 0.5, 0.005);
  EXPECT_NEAR(ratio(two[2], "grads"), 0.5, 0.005);
  EXPECT_NEAR(ratio(two[2], "params"), 1.0, 1e-9);
}

TEST_F(MemoryLedgerTest, FullRecomputationCutsActivationsAsPlanned) {
  const json full = measured(2, 0, "full");
  const json want = planned(2, 0, "full"), none = planned(2, 0, "none");
  for (const char* c : {"activations", "temporaries"}) {
    EXPECT_NEAR(full[std::string("mem_") + c].get<double>(), want[c].get<double>(),
                0.05 * want[c].get<double>())
        << c;
  }
  // The block inputs instead of everything each block saves: under half here (the logits, which
  // recomputation keeps, weigh more in this small model than in gpt2-124m, where it is a third).
  EXPECT_LT(full["mem_activations"].get<double>(), none["activations"].get<double>() / 2);
}

// Mixed precision adds the bf16 copies of the largest product's operands (here the head's backward:
// the (T,V) logit gradient with wte) to the temporaries; the rest of the ledger is fp32's.
TEST_F(MemoryLedgerTest, MixedPrecisionCountsTheBf16OperandCopies) {
  const json want = planned(1, 0, "none", "bf16"), fp32 = planned(1, 0, "none");
  const double copies = 2.0 * (kT * kV + double(kV) * kC);
  EXPECT_DOUBLE_EQ(want["temporaries"].get<double>() - fp32["temporaries"].get<double>(), copies);
  const cpu::Bf16MatmulPath& mp = cpu::bf16_matmul_path();
  std::cout << "[ bf16     ] the run side " << (mp.hardware ? "runs" : "is refused (cli_test)")
            << " on " << mp.describe() << std::endl;
  if (!mp.hardware) return;
  expect_matches_plan(measured(1, 0, "none", "bf16"), want);
}

// A Llama model of the same width and depth (model.arch = llama: 2 key/value heads of 4, the
// default SwiGLU width 8C/3 rounded up to 64 = 704, an untied lm_head; then tied): every ZeRO
// stage on 2 ranks, full recomputation and mixed precision within 5% of what `tetra plan`
// predicts for the planner's Llama-style model of that shape, and the stages divide the state as
// they do GPT-2's.
TEST_F(MemoryLedgerTest, LlamaEveryStageMatchesThePlan) {
  const std::string train = "--model.arch=llama --model.n_kv_head=2";
  const std::string& plan = train;  // one vocabulary: the run's keys plan it
  std::vector<json> two;
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE("Llama, 2 ranks, ZeRO stage " + std::to_string(stage));
    two.push_back(measured(2, stage, "none", "fp32", train));
    expect_matches_plan(two.back(), planned(2, stage, "none", "fp32", plan),
                        "llama zero" + std::to_string(stage));
  }
  auto ratio = [&](const json& run, const char* c) {
    return run[std::string("mem_") + c].get<double>() /
           two[0][std::string("mem_") + c].get<double>();
  };
  EXPECT_NEAR(ratio(two[3], "params"), 0.5, 0.005);
  EXPECT_NEAR(ratio(two[2], "grads"), 0.5, 0.005);
  EXPECT_NEAR(ratio(two[1], "optimizer"), 0.5, 0.005);
  {
    SCOPED_TRACE("Llama, full recomputation");
    expect_matches_plan(measured(2, 0, "full", "fp32", train), planned(2, 0, "full", "fp32", plan),
                        "llama full");
  }
  {
    SCOPED_TRACE("tied Llama, ZeRO stage 1");
    const json tied = measured(2, 1, "none", "fp32", train + " --model.tie_embeddings=true");
    expect_matches_plan(tied, planned(2, 1, "none", "fp32", plan + " --model.tie_embeddings=true"),
                        "llama tied zero1");
    // The lm_head (V,C) is gone: 8192 x 256 floats of parameters, as many of gradients.
    EXPECT_NEAR(two[1]["mem_params"].get<double>() - tied["mem_params"].get<double>(),
                4.0 * kV * kC, 0.01 * 4.0 * kV * kC);
  }
  // Mixed precision: the bf16 copies of the largest product's operands, the head's backward (the
  // (T,V) logit gradient with the lm_head) as for GPT-2.
  const json want = planned(1, 0, "none", "bf16", plan), fp32 = planned(1, 0, "none", "fp32", plan);
  EXPECT_DOUBLE_EQ(want["temporaries"].get<double>() - fp32["temporaries"].get<double>(),
                   2.0 * (kT * kV + double(kV) * kC));
  if (cpu::bf16_matmul_path().hardware) {
    expect_matches_plan(measured(1, 0, "none", "bf16", train), want, "llama bf16");
  }
}

}  // namespace
}  // namespace tetra
