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
#include <string>

#include "tests/train/run_tetra.h"

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

}  // namespace
}  // namespace tetra
