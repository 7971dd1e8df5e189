// Flight records and triage of real training runs (comm/flight.h, comm/triage.h,
// docs/comm.md, "Watchdog"): a rank that stops making progress is named by the waiting rank's
// watchdog and by `tetra triage RUN_DIR`, with the step and phase it stopped in; a rank's error
// exit is the triage's cause; SIGUSR1 writes a record of a running rank, which goes on to finish;
// and `tetra triage` refuses what holds no record, saying what writes one.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using testing::contains;
using testing::Ran;
using testing::run_command;
using testing::tetra_command;

class TriageRun : public testing::RunDirTest {
 protected:
  Ran triage(const std::string& args) {
    return run_command(std::string(TETRA_BINARY) + " triage " + args);
  }
  nlohmann::json record(const std::string& run, int rank) const {
    std::ifstream in(dir_ / run / "flight" / ("rank-" + std::to_string(rank) + ".json"));
    return nlohmann::json::parse(in, nullptr, false);
  }
};

TEST_F(TriageRun, AStoppedRankIsNamedByTheWatchdogAndByTriage) {
  // Rank 1 stops after step 3; rank 0 waits in step 4's first collective past the step deadline.
  const Ran r = run_command(tetra_command(
      2, tiny_train_args("run", 40,
                         "--debug.hang_step=3 --debug.fault_rank=1 --dist.step_timeout_min_s=2 "
                         "--dist.step_timeout_factor=5")));
  ASSERT_EQ(r.code, 75) << r.output;
  EXPECT_TRUE(contains(r.output, "[triage] cause: stopped or slow rank: world rank(s) 1 "))
      << r.output;
  EXPECT_TRUE(contains(r.output, "[flight] this rank's record: " + path("run") + "/flight/rank-0"))
      << r.output;
  const nlohmann::json own = record("run", 0);
  ASSERT_FALSE(own.is_discarded());
  EXPECT_TRUE(contains(own["reason"], "watchdog: ")) << own["reason"];
  EXPECT_EQ(own["step"], 4);
  // Each operation names the code that issued it: the gradient buckets and the step's scalars.
  std::set<std::string> sites;
  for (const nlohmann::json& op : own["ops"]) sites.insert(op.value("site", ""));
  EXPECT_TRUE(sites.count("dp.bucket") && sites.count("step.scalars")) << own["ops"].dump();

  const Ran t = triage(path("run"));
  ASSERT_EQ(t.code, 0) << t.output;
  EXPECT_TRUE(contains(t.output, "[triage] cause: stopped or slow rank: world rank(s) 1 "))
      << t.output;
  EXPECT_TRUE(contains(t.output, "world rank 1: outside any operation")) << t.output;
  EXPECT_TRUE(contains(t.output, "phase between_steps (step 3)")) << t.output;
  const Ran j = triage(path("run") + " --json");
  ASSERT_EQ(j.code, 0) << j.output;
  EXPECT_EQ(nlohmann::json::parse(j.output)["cause"], "stopped or slow rank") << j.output;
}

TEST_F(TriageRun, ARanksErrorExitIsTheCause) {
  const Ran r = run_command(
      tetra_command(2, tiny_train_args("run", 6, "--debug.fail_step=2 --debug.fail_rank=1")));
  ASSERT_EQ(r.code, 2) << r.output;
  const nlohmann::json own = record("run", 1);
  ASSERT_FALSE(own.is_discarded()) << r.output;
  EXPECT_TRUE(contains(own["reason"], "error: [train] debug.fail_step")) << own["reason"];
  const Ran t = triage(path("run"));
  ASSERT_EQ(t.code, 0) << t.output;
  EXPECT_TRUE(contains(t.output, "[triage] cause: error exit: world rank 1 stopped: error: "))
      << t.output;
}

TEST_F(TriageRun, Sigusr1WritesARecordAndTheRunGoesOn) {
  // Slowed to 20 ms a step, so that the signal arrives mid-run.
  const std::string metrics_file = path("run") + "/metrics.jsonl";
  const Ran r = run_command(
      tetra_command(1, tiny_train_args("run", 150, "--debug.slow_ms=20 --debug.fault_rank=0")) +
      " >" + path("train.log") +
      " 2>&1 & pid=$!; "
      "for i in $(seq 1 600); do [ \"$(wc -l < " +
      metrics_file +
      " 2>/dev/null)\" -ge 3 ] && break; "
      "sleep 0.02; done; kill -USR1 $pid; wait $pid; echo exit=$?");
  EXPECT_TRUE(contains(r.output, "exit=0")) << r.output;
  EXPECT_EQ(metrics("run").size(), 150u);
  const nlohmann::json rec = record("run", 0);
  ASSERT_FALSE(rec.is_discarded()) << "no record after SIGUSR1";
  EXPECT_TRUE(contains(rec["reason"], "SIGUSR1")) << rec["reason"];
  EXPECT_GE(rec["step"].get<int>(), 3);
  EXPECT_FALSE(rec["phases"].empty());
}

TEST_F(TriageRun, WhatHoldsNoRecordIsRefusedSayingWhatWritesOne) {
  EXPECT_REFUSED(triage(path("missing")), "is not a directory; give a run's run.dir");
  fs::create_directories(dir_ / "empty");
  EXPECT_REFUSED(triage(path("empty")), "no flight record under " + path("empty"));
  EXPECT_REFUSED(triage(path("empty")), "`kill -USR1 PID` of a running rank writes one now");
  fs::create_directories(dir_ / "damaged" / "flight");
  std::ofstream(dir_ / "damaged" / "flight" / "rank-0.json") << "{\"rank\": 0, \"reas";
  const Ran d = triage(path("damaged"));
  EXPECT_REFUSED(d, "(1 file(s) that are not records)");
  EXPECT_TRUE(contains(d.output, "[triage] skipped " + path("damaged") + "/flight/rank-0.json"))
      << d.output;
  EXPECT_REFUSED(triage(""), "give the run directory of the job");
}

}  // namespace
}  // namespace tetra
