// Plan vs measured (docs/training.md): at its end a run prints the planner's prediction for its own
// layout beside what it measured and writes both to run.dir/plan_vs_measured.json. The bytes each
// group sends per step are the trainer's own count (comm::Work::sent_bytes), so the plan must
// match them exactly; memory per rank within 5% (it is the same ledger); the pipeline's bubble
// within 5 points. Step times depend on how busy the machine is: the test only checks that they
// are there (bench/plan_vs_run.py tabulates them with the load average).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "plan/tetra_run.h"
#include "tests/train/run_tetra.h"
#include "train/run_plan.h"

namespace tetra {
namespace {

using nlohmann::json;
using testing::Ran;
using testing::run_command;
using testing::tetra_command;

class PlanVsRun : public testing::RunDirTest {
 protected:
  json run(int ranks, const std::string& name, const std::string& flags) {
    const std::string args =
        "train --model.vocab_size=64 --model.n_layer=4 --model.n_head=4 --model.d_model=64 "
        "--model.max_seq=32 --train.seq_len=32 --train.micro_batch=2 --train.steps=3 "
        "--run.threads=1 --run.peak_gflops=50 --run.progress=never --eval.every=0 --data.val= "
        "--data.train=" +
        path("train.bin") + " --run.dir=" + path(name) + " " + flags;
    const Ran r = run_command(tetra_command(ranks, args));
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("[plan] plan vs measured for this run"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("[plan]   step time     predicted"), std::string::npos) << r.output;
    std::ifstream in(path(name) + "/plan_vs_measured.json");
    const json j = json::parse(in, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << r.output;
    return j;
  }

  // The last step's record of the run in `name` (metrics.jsonl, rank 0's): its memory peaks per
  // category and, for a MoE run, the all-to-all bytes.
  json last_step(const std::string& name) const {
    std::ifstream in(path(name) + "/metrics.jsonl");
    json last;
    for (std::string line; std::getline(in, line);) {
      const json j = json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.contains("mem_params")) last = j;
    }
    EXPECT_FALSE(last.is_null()) << name;
    return last;
  }

  // What `tetra plan --config <the run's config.toml>` predicts for the run on `ranks` ranks.
  RunPlan planned(const std::string& name, int ranks) const {
    return plan_training_config(path(name) + "/config.toml",
                                {"cluster.gpus=" + std::to_string(ranks)})
        .run;
  }

  // Every memory category of rank 0 exactly as planned, but those in `except`.
  static void expect_exact_memory(const json& step, const plan::RunMemory& want,
                                  const std::set<std::string>& except = {}) {
    const std::pair<const char*, double> categories[] = {
        {"params", want.params},       {"grads", want.grads},
        {"optimizer", want.optimizer}, {"activations", want.activations},
        {"comm", want.comm},           {"temporaries", want.temporaries}};
    for (const auto& [name, bytes] : categories) {
      if (except.count(name)) continue;
      EXPECT_EQ(step["mem_" + std::string(name)].get<double>(), bytes) << name;
    }
  }

  static double planned_bytes(const RunPlan& p, const std::string& dim, bool buffers = false) {
    for (const plan::GroupTraffic& g : p.traffic) {
      if (g.dim == dim) return buffers ? g.buffer_bytes() : g.bytes();
    }
    return 0;
  }

  static void expect_agreement(const json& j, const std::vector<std::string>& groups) {
    ASSERT_TRUE(j.contains("step_seconds")) << j.dump();
    EXPECT_GT(j["step_seconds"]["predicted"].get<double>(), 0);
    EXPECT_GT(j["step_seconds"]["measured"].get<double>(), 0);
    const double mem = j["memory_bytes"]["measured"].get<double>();
    EXPECT_NEAR(j["memory_bytes"]["predicted"].get<double>(), mem, 0.05 * mem) << j.dump();
    for (const std::string& g : groups) {
      ASSERT_TRUE(j["bytes_per_step"].contains(g)) << g << " " << j.dump();
      EXPECT_GT(j["bytes_per_step"][g]["measured"].get<double>(), 0) << g;
      EXPECT_EQ(j["bytes_per_step"][g]["predicted"], j["bytes_per_step"][g]["measured"]) << g;
    }
  }
};

TEST_F(PlanVsRun, OneRank) {
  const json j = run(1, "one", "");
  expect_agreement(j, {});
  EXPECT_FALSE(j.contains("bytes_per_step"));
}

TEST_F(PlanVsRun, DataParallelEveryZeroStage) {
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE(stage);
    expect_agreement(run(2, "dp" + std::to_string(stage),
                         "--zero.stage=" + std::to_string(stage) + " --train.grad_accum=2"),
                     {"dp"});
  }
  // bf16 reductions send half the bytes of a reduce-scatter, the f32 gathers as many.
  expect_agreement(run(2, "dp_bf16", "--zero.stage=2 --dp.reduce_dtype=bf16"), {"dp"});
}

TEST_F(PlanVsRun, TensorParallel) {
  expect_agreement(run(2, "tp", "--parallel.tp=2 --parallel.dp=1"), {"tp"});
  expect_agreement(run(2, "tp_sp",
                       "--parallel.tp=2 --parallel.dp=1 --tp.sequence_parallel=true "
                       "--train.recompute=full"),
                   {"tp"});
}

TEST_F(PlanVsRun, PipelineParallel) {
  for (const char* schedule : {"1f1b", "gpipe"}) {
    SCOPED_TRACE(schedule);
    const json j = run(2, std::string("pp_") + schedule,
                       std::string("--parallel.pp=2 --parallel.dp=1 --train.grad_accum=4 "
                                   "--pp.schedule=") +
                           schedule);
    expect_agreement(j, {"pp"});
    ASSERT_TRUE(j.contains("bubble")) << j.dump();
    EXPECT_GT(j["bubble"]["predicted"].get<double>(), 0);
  }
  expect_agreement(run(2, "pp_inter",
                       "--parallel.pp=2 --parallel.dp=1 --train.grad_accum=4 "
                       "--pp.schedule=interleaved --pp.chunks=2"),
                   {"pp"});
}

// A mixture-of-experts run, 4 experts top-2 in every other block, every memory category exactly
// as planned: serially with the capacity's drops (the buffers are its bounds whatever is
// dropped), and under expert parallelism, ep 2 over dp 2 without ZeRO, where with no capacity
// nothing is dropped and the rows each rank puts into its all-to-alls (metrics.jsonl's a2a_bytes,
// the mean over the ranks) are the plan's ep group's: 4 exchanges per MoE block and micro-batch.
TEST_F(PlanVsRun, MixtureOfExperts) {
  const std::string moe = "--model.moe_experts=4 --model.moe_every=2 --train.grad_accum=2 ";
  expect_agreement(run(1, "moe", moe), {});
  const RunPlan serial = planned("moe", 1);
  expect_exact_memory(last_step("moe"), serial.prediction.memory);
  EXPECT_EQ(planned_bytes(serial, "ep"), 0);

  expect_agreement(run(2, "moe_ep", moe + "--parallel.ep=2 --moe.capacity_factor=0"), {});
  const RunPlan ep = planned("moe_ep", 2);
  const json step = last_step("moe_ep");
  expect_exact_memory(step, ep.prediction.memory);
  // 2 micro-batches x 2 MoE blocks x 4 exchanges of 2 x 32 tokens x 2 routes x 64 floats.
  EXPECT_EQ(planned_bytes(ep, "ep", true), 2 * 2 * 4 * (2 * 32 * 2) * 64 * 4.0);
  EXPECT_EQ(step["a2a_bytes"].get<double>(), planned_bytes(ep, "ep", true));
  EXPECT_EQ(planned_bytes(ep, "ep"), planned_bytes(ep, "ep", true) / 2);
}

// ZeRO under expert parallelism (ep 2 over dp 2): expert units are sharded and reduced over their
// edp group of dp/ep ranks (docs/zero.md, "Expert units"), here one rank, so their optimizer
// state is whole from stage 1 and their gradients cross no rank; every stage's memory and dp bytes
// are the plan's exactly. A trainer sharding them over dp like the dense units would hold half of
// their stage-1 optimizer state and fail here.
TEST_F(PlanVsRun, ExpertParallelZeroShardsExpertsOverTheirGroup) {
  const std::string moe =
      "--model.moe_experts=4 --model.moe_every=2 --train.grad_accum=2 --parallel.ep=2 "
      "--moe.capacity_factor=0 ";
  const json one = run(2, "ep_zero1", moe + "--zero.stage=1");
  const RunPlan p = planned("ep_zero1", 2);
  const json step = last_step("ep_zero1");
  ASSERT_GT(p.prediction.experts.optimizer, 0.0);
  expect_agreement(one, {"dp"});
  expect_exact_memory(step, p.prediction.memory);
  for (int stage : {0, 2, 3}) {
    SCOPED_TRACE(stage);
    const std::string name = "ep_zero" + std::to_string(stage);
    expect_agreement(run(2, name, moe + "--zero.stage=" + std::to_string(stage)), {"dp"});
    expect_exact_memory(last_step(name), planned(name, 2).prediction.memory);
  }
}

}  // namespace
}  // namespace tetra
