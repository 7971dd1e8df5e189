// `tetra plan --config <a training config>` plans the run `tetra train --config` launches: the
// trainer's header line "[plan] <params>, <FLOPs/token>, <memory per rank> (tetra plan --config
// <its config> plans this run)" (train/run_plan.h) carries the same parameters, model FLOPs per
// token and memory per rank as the plan report of the same config, and the plan command that line
// names reports them too.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "plan/tetra_run.h"
#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

using nlohmann::json;
using testing::Ran;
using testing::run_command;
using testing::tetra_command;

class PlanAgreement : public testing::RunDirTest {
 protected:
  // The brown config on the bundled synthetic shards, two steps, nothing written outside dir_.
  std::string overrides(const std::string& run) const {
    const std::string src = TETRA_SOURCE_DIR;
    return " --data.train=" + src + "/data/synthetic/train.bin --data.val=" + src +
           "/data/synthetic/val.bin --train.steps=2 --eval.batches=1 --save.final= "
           "--run.threads=1 --run.peak_gflops=50 --run.dir=" +
           path(run);
  }
  static std::string brown() { return std::string(TETRA_SOURCE_DIR) + "/configs/brown.toml"; }

  // `tetra plan ARGS --json`: the report's run section.
  static json planned(const std::string& args) {
    const Ran r = run_command(tetra_command(1, "plan " + args + " --json"), false);
    EXPECT_EQ(r.code, 0) << r.output;
    const json j = json::parse(r.output, nullptr, false);
    return j.is_discarded() || !j.contains("run") ? json::object() : j["run"];
  }

  // The trainer's "[plan] ..." line: its summary and the arguments of the plan command it names.
  struct PlanLine {
    std::string summary, plan_args;
  };
  static PlanLine plan_line(const std::string& output) {
    const std::string head = "[plan] ", cmd = " (tetra plan ", tail = " plans this run)";
    const std::string text = "\n" + output;
    const size_t at = text.find("\n" + head);
    if (at == std::string::npos) return {};
    const std::string line = text.substr(at + 1, text.find('\n', at + 1) - at - 1);
    const size_t c = line.find(cmd), t = line.rfind(tail);
    if (c == std::string::npos || t == std::string::npos || t < c)
      return {line.substr(head.size()), ""};
    return {line.substr(head.size(), c - head.size()),
            line.substr(c + cmd.size(), t - c - cmd.size())};
  }

  void expect_agreement(int ranks, const std::string& extra) {
    const std::string run = "run_" + std::to_string(ranks);
    const Ran train =
        run_command(tetra_command(ranks, "train --config " + brown() + overrides(run) + extra));
    ASSERT_EQ(train.code, 0) << train.output;
    const PlanLine line = plan_line(train.output);
    ASSERT_FALSE(line.summary.empty()) << "the trainer's header has no \"[plan] ...\" line:\n"
                                       << train.output;

    // The same config and overrides, planned; with dp inferred from the world, on its ranks.
    const json want = planned("--config " + brown() + overrides(run) + extra +
                              (ranks > 1 ? " --cluster.gpus=" + std::to_string(ranks) : ""));
    ASSERT_TRUE(want.contains("summary")) << want.dump();
    EXPECT_EQ(want["ranks"], ranks);
    EXPECT_EQ(line.summary, want["summary"].get<std::string>()) << train.output;
    EXPECT_EQ(line.summary, plan::run_summary(want["params"].get<int64_t>(),
                                              want["flops_per_token"].get<double>(),
                                              want["memory_per_rank"].get<double>()));

    // The plan command the line names (the run directory's config.toml) plans the same run.
    ASSERT_NE(line.plan_args.find("--config "), std::string::npos) << line.plan_args;
    const json named = planned(line.plan_args);
    EXPECT_EQ(named["params"], want["params"]) << line.plan_args;
    EXPECT_EQ(named["flops_per_token"], want["flops_per_token"]) << line.plan_args;
    EXPECT_EQ(named["memory_per_rank"], want["memory_per_rank"]) << line.plan_args;
  }
};

TEST_F(PlanAgreement, OneProcess) { expect_agreement(1, ""); }

// parallel.dp = 0 on two ranks: dp = 2, ZeRO-1 sharding the optimizer state over them.
TEST_F(PlanAgreement, TwoDataParallelRanksWithZero) { expect_agreement(2, " --zero.stage=1"); }

// A mixture-of-experts run, 4 experts top-2 in every other block: every expert's parameters, the
// active FLOPs (the router and 2 experts per MoE block), the MoE blocks' buffers.
TEST_F(PlanAgreement, MixtureOfExperts) {
  expect_agreement(1, " --model.moe_experts=4 --model.moe_every=2");
}

// Expert parallelism, ep 2 over dp 2: each rank holds half of every MoE block's experts.
TEST_F(PlanAgreement, ExpertParallelOverTwoDataParallelRanks) {
  expect_agreement(2, " --model.moe_experts=4 --parallel.ep=2");
}

// A Llama run (model.arch = llama, 2 key/value heads for brown's 4 query heads, the default
// SwiGLU width, an untied lm_head): its parameters, FLOPs and memory as `tetra plan` has them.
TEST_F(PlanAgreement, Llama) { expect_agreement(1, " --model.arch=llama --model.n_kv_head=2"); }

// Tied, with one key/value head, on two data-parallel ranks with ZeRO-2.
TEST_F(PlanAgreement, TiedLlamaOnTwoDataParallelRanks) {
  expect_agreement(2,
                   " --model.arch=llama --model.n_kv_head=1 --model.tie_embeddings=true "
                   "--zero.stage=2");
}

}  // namespace
}  // namespace tetra
