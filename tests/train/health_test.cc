// Per-rank telemetry and straggler detection (docs/health.md): every health.telemetry_every steps
// metrics.jsonl holds every rank's step, compute, communication and data times and gradient norm
// with their p50/p99/max and the slowest rank; a rank slowed by an injected delay is named with
// its host, a clean run names none, and health.on_straggler=stop stops the job naming it. Ranks
// are real processes under mpirun on 2 cores, next to other tests: the factor is 8 and the injected
// delay 600 ms, so oversubscription noise names nobody (an unslowed rank's few ms read 3x its
// peers' alone, and once over 4x next to another test's ranks in a CI-like ctest -j2) while the
// slowed rank reads over 50x (600 ms against its peers' ~10 ms). Three ranks: while the slowed one
// sleeps, the other two have a core each.
#include "train/health.h"

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
        "--health.straggler_factor=8 --data.train=" +
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

// The detection rule on window means (no processes): over the factor, and by a share of the step.
TEST(FindStragglers, NamesARankOverTheMedianByTheFactorAndByAShareOfTheStep) {
  HealthOptions o;  // factor 1.2, min share 0.05
  // Compute-bound ranks: 130 ms against a median of 100 ms on 140 ms steps.
  EXPECT_EQ(find_stragglers({100, 101, 130, 99}, {140, 140, 140, 140}, o), std::vector<int>{2});
  // Just under the factor: nobody.
  EXPECT_TRUE(find_stragglers({100, 101, 119, 99}, {140, 140, 140, 140}, o).empty());
  // 3x the median, but 2 ms of a 150 ms step: scheduler noise on a small step, not named...
  EXPECT_TRUE(find_stragglers({1, 1, 3, 1}, {150, 150, 150, 150}, o).empty());
  // ...unless the share is lowered to what the excess costs.
  o.straggler_min_share = 0.01;
  EXPECT_EQ(find_stragglers({1, 1, 3, 1}, {150, 150, 150, 150}, o), std::vector<int>{2});
}

TEST(FindStragglers, TheMedianOfTwoRanksIsTheirMean) {
  HealthOptions o;
  // 10 vs 14: the mean 12 is the median, 14 / 12 < 1.2 (the faster rank's 10 would make it 1.4).
  EXPECT_TRUE(find_stragglers({10, 14}, {20, 20}, o).empty());
  EXPECT_EQ(find_stragglers({10, 16}, {20, 20}, o), std::vector<int>{1});  // 16 / 13 > 1.2
  EXPECT_TRUE(find_stragglers({10}, {20}, o).empty());                     // one rank: no peers
}

TEST_F(Health, ASlowedRankIsNamedWithItsHost) {
  const Ran r = train(3, "slow", "--debug.slow_ms=600 --debug.fault_rank=2");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto w = windows("slow");
  ASSERT_EQ(w.size(), 2u);  // steps 1..5 and 6..10
  for (const auto& ranks : w) {
    ASSERT_EQ(ranks["compute_ms"].size(), 3u);
    ASSERT_EQ(ranks["step_ms"].size(), 3u);
    EXPECT_EQ(ranks["compute_ms_summary"]["slowest_rank"], 2);
    EXPECT_GE(double(ranks["compute_ms"][2]), 600.0);
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
  const Ran r = train(3, "clean", "");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto w = windows("clean");
  ASSERT_EQ(w.size(), 2u);
  for (const auto& ranks : w) {
    EXPECT_TRUE(ranks["stragglers"].empty()) << ranks.dump();
    EXPECT_EQ(ranks["grad_norm"].size(), 3u);
  }
  EXPECT_EQ(r.output.find("straggler(s)"), std::string::npos) << r.output;
}

TEST_F(Health, StopOnAStragglerEndsTheJobNamingIt) {
  const Ran r =
      train(3, "stop", "--debug.slow_ms=600 --debug.fault_rank=1 --health.on_straggler=stop");
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
