// Per-rank telemetry and straggler detection (docs/health.md): every health.telemetry_every steps
// metrics.jsonl holds every rank's step, compute, communication and data times and gradient norm
// with their p50/p99/max and the slowest rank; a rank slowed by an injected delay is named with
// its host, a clean run names none, and health.on_straggler=stop stops the job naming it. Ranks
// are real processes under mpirun (4 on 2 cores: the factor is 2, above oversubscription noise).
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

using testing::Ran;
using testing::run_command;
using testing::tetra_command;

class Health : public testing::RunDirTest {
 protected:
  Ran train(int ranks, const std::string& run, const std::string& extra) {
    return run_command(tetra_command(
        ranks,
        "train --model.vocab_size=61 --model.n_layer=2 --model.n_head=2 "
        "--model.d_model=32 --model.max_seq=16 --train.seq_len=16 --train.micro_batch=2 "
        "--train.steps=10 --run.threads=1 --run.peak_gflops=50 --eval.every=0 "
        "--run.progress=never --dist.timeout_s=60 --health.telemetry_every=5 "
        "--health.straggler_factor=2 --data.train=" +
            path("train.bin") + " --run.dir=" + path(run) + " " + extra));
  }
  // The records that carry a window's per-rank telemetry.
  std::vector<nlohmann::json> windows(const std::string& run) const {
    std::vector<nlohmann::json> out;
    for (const auto& m : metrics(run)) {
      if (m.contains("ranks")) out.push_back(m["ranks"]);
    }
    return out;
  }
};

TEST_F(Health, ASlowedRankIsNamedWithItsHost) {
  // Four ranks share two cores here, so an unslowed rank's ~1 ms of compute can read 3x its
  // peers'; factor 20 still names the rank slowed by 120 ms (over 100x) and nothing else.
  const Ran r =
      train(4, "slow", "--debug.slow_ms=120 --debug.fault_rank=2 --health.straggler_factor=20");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto w = windows("slow");
  ASSERT_EQ(w.size(), 2u);  // steps 1..5 and 6..10
  for (const auto& ranks : w) {
    ASSERT_EQ(ranks["compute_ms"].size(), 4u);
    ASSERT_EQ(ranks["step_ms"].size(), 4u);
    EXPECT_EQ(ranks["compute_ms_summary"]["slowest_rank"], 2);
    EXPECT_GE(double(ranks["compute_ms"][2]), 120.0);
    ASSERT_EQ(ranks["stragglers"].size(), 1u) << ranks.dump();
    EXPECT_EQ(ranks["stragglers"][0]["rank"], 2);
    EXPECT_FALSE(ranks["stragglers"][0]["host"].get<std::string>().empty());
    // Its peers wait for it in the collectives: their communication, not their compute.
    EXPECT_GT(double(ranks["comm_ms"][0]), double(ranks["comm_ms"][2]));
  }
  EXPECT_NE(r.output.find("[health] steps 1..5: straggler(s)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 2 on "), std::string::npos) << r.output;
}

TEST_F(Health, ACleanRunNamesNone) {
  const Ran r = train(2, "clean", "");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto w = windows("clean");
  ASSERT_EQ(w.size(), 2u);
  for (const auto& ranks : w) {
    EXPECT_TRUE(ranks["stragglers"].empty()) << ranks.dump();
    EXPECT_EQ(ranks["grad_norm"].size(), 2u);
  }
  EXPECT_EQ(r.output.find("straggler(s)"), std::string::npos) << r.output;
}

TEST_F(Health, StopOnAStragglerEndsTheJobNamingIt) {
  const Ran r = train(4, "stop",
                      "--debug.slow_ms=120 --debug.fault_rank=1 --health.on_straggler=stop "
                      "--health.straggler_factor=20");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("rank 1 on "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("stopping (health.on_straggler=stop)"), std::string::npos) << r.output;
}

TEST_F(Health, TelemetryOffWritesNone) {
  const Ran r = train(2, "off", "--health.telemetry_every=0");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(windows("off").empty());
}

}  // namespace
}  // namespace tetra
