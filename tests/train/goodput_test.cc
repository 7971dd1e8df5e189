// Goodput across restarts (tetra launch --max-restarts with injected kills) and the measured MFU
// audit of DP, TP and PP runs (docs/health.md, "Goodput" and "The MFU audit").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

using testing::contains;
using testing::Ran;
using testing::run_command;
using testing::tetra_command;

class GoodputRun : public testing::RunDirTest {
 protected:
  nlohmann::json read_json(const std::string& name) const {
    std::ifstream in(dir_ / name);
    return nlohmann::json::parse(in);
  }
};

TEST_F(GoodputRun, AccountsEveryRestartOfAJobKilledTwice) {
  // 12 steps, a checkpoint every 3: killed after step 5 (resumes from 3: steps 4 and 5 redone),
  // then after step 10 (resumes from 9: step 10 redone).
  const Ran r = run_command(
      std::string(TETRA_BINARY) +
      " launch -n 2 --max-restarts 2 --inject-fault kill:0@5,kill:0@10 -- " +
      tiny_train_args("run", 12, "--ckpt.every=3 --ckpt.async=false --ckpt.dir=" + path("ckpt")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "newest checkpoint after step 3: 2 step(s) lost")) << r.output;
  EXPECT_TRUE(contains(r.output, "newest checkpoint after step 9: 1 step(s) lost")) << r.output;
  const nlohmann::json g = read_json("run/goodput.json");
  EXPECT_EQ(g["attempts"], 3) << g.dump(1);
  EXPECT_EQ(g["kept_steps"], 12) << g.dump(1);
  EXPECT_EQ(g["redone_steps"], 3) << g.dump(1);
  // Every second of the wall time is in one category, and none is negative.
  const double wall = g["wall_s"];
  double sum = 0;
  for (auto it = g["seconds"].begin(); it != g["seconds"].end(); ++it) {
    EXPECT_GE(it.value().get<double>(), 0.0) << it.key() << ": " << g.dump(1);
    sum += it.value().get<double>();
  }
  EXPECT_NEAR(sum, wall, 1e-6 * wall) << g.dump(1);
  // The account starts with the launcher's first attempt and ends before the launcher does.
  EXPECT_LE(wall, r.seconds) << g.dump(1);
  // Both restarts lost time (the kill, its detection, a new job's start), and each attempt
  // started up.
  EXPECT_GT(g["seconds"]["restart"].get<double>(), 0.0) << g.dump(1);
  EXPECT_GT(g["seconds"]["startup"].get<double>(), 0.0) << g.dump(1);
  EXPECT_GT(g["seconds"]["redone"].get<double>(), 0.0) << g.dump(1);
  // Productive time recomputed from the kept steps of metrics.jsonl (the final history: each
  // step once, as the attempt that kept it measured it).
  const auto records = metrics("run");
  ASSERT_EQ(records.size(), 12u);
  double productive_ms = 0;
  for (const auto& rec : records) {
    productive_ms += rec["step_ms"].get<double>() - rec["data_wait_ms"].get<double>();
  }
  EXPECT_NEAR(productive_ms / 1e3 / wall, g["goodput"].get<double>(),
              0.01 * g["goodput"].get<double>())
      << g.dump(1);
  // Every record carries the account so far.
  for (const auto& rec : records) {
    EXPECT_GT(rec["goodput"].get<double>(), 0.0) << rec.dump();
    EXPECT_LE(rec["goodput"].get<double>(), 1.0) << rec.dump();
  }
  EXPECT_TRUE(contains(r.output, "[goodput] goodput ")) << r.output;
  EXPECT_TRUE(contains(r.output, "over 3 attempt(s), 3 step(s) redone")) << r.output;
  // One incident per restart: the launcher's cause and the heartbeats' silence, the steps redone
  // and the seconds lost as the account measured them; together the restart and redone time.
  const nlohmann::json& incidents = g["incidents"];
  ASSERT_EQ(incidents.size(), 2u) << g.dump(1);
  double lost = 0;
  for (size_t i = 0; i < 2; ++i) {
    const nlohmann::json& inc = incidents[i];
    SCOPED_TRACE(inc.dump());
    EXPECT_EQ(inc["attempt"], int(i) + 1);
    EXPECT_TRUE(contains(inc["cause"].get<std::string>(), "the job exited with status"));
    EXPECT_GE(inc["silence_s"].get<double>(), 0.0);
    EXPECT_LT(inc["silence_s"].get<double>(), 60.0);
    EXPECT_EQ(inc["resumed_from"], i == 0 ? 3 : 9);
    EXPECT_EQ(inc["steps_redone"], i == 0 ? 2 : 1);
    EXPECT_GT(inc["seconds_lost"].get<double>(), 0.0);
    EXPECT_EQ(inc["change"], "");
    lost += inc["seconds_lost"].get<double>();
  }
  EXPECT_NEAR(lost, g["seconds"]["restart"].get<double>() + g["seconds"]["redone"].get<double>(),
              1e-6 * wall)
      << g.dump(1);
  EXPECT_TRUE(contains(r.output, "[goodput] incident 1: the job exited with status")) << r.output;
  EXPECT_TRUE(contains(r.output, "; 2 step(s) redone, ")) << r.output;
  EXPECT_TRUE(contains(r.output, "[goodput] incident 2: ")) << r.output;
}

TEST_F(GoodputRun, ARunResumedByHandContinuesItsAccount) {
  Ran r = run_command(
      tetra_command(1, tiny_train_args("run", 4, "--ckpt.every=2 --ckpt.dir=" + path("c"))));
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json first = read_json("run/goodput.json");
  EXPECT_EQ(first["attempts"], 1);
  EXPECT_EQ(first["kept_steps"], 4);
  r = run_command(tetra_command(
      1, tiny_train_args("run", 6, "--ckpt.every=2 --ckpt.resume=auto --ckpt.dir=" + path("c"))));
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json g = read_json("run/goodput.json");
  EXPECT_EQ(g["attempts"], 2) << g.dump(1);
  EXPECT_EQ(g["kept_steps"], 6) << g.dump(1);
  EXPECT_EQ(g["redone_steps"], 0) << g.dump(1);
  // Not under the launcher: the time between the two processes is not the run's.
  EXPECT_EQ(g["seconds"]["restart"].get<double>(), 0.0) << g.dump(1);
  EXPECT_GT(g["wall_s"].get<double>(), first["wall_s"].get<double>()) << g.dump(1);
}

// The audit's parts add up to the measured step, whatever the layout.
TEST_F(GoodputRun, TheMfuAuditAddsUpToTheMeasuredStep) {
  struct Case {
    std::string name, flags;
    std::vector<std::string> parts;
  };
  const Case cases[] = {
      {"dp", "--train.grad_accum=2", {"ideal", "data", "comm_dp", "kernels", "stragglers"}},
      {"tp", "--parallel.tp=2", {"ideal", "data", "comm_tp", "kernels", "stragglers"}},
      {"pp",
       "--parallel.pp=2 --train.grad_accum=4",
       {"ideal", "data", "comm_pp", "bubble", "kernels", "stragglers"}},
  };
  for (const Case& c : cases) {
    const Ran r = run_command(
        tetra_command(2, tiny_train_args(c.name, 12, c.flags + " --health.telemetry_every=4")));
    ASSERT_EQ(r.code, 0) << c.name << "\n" << r.output;
    const nlohmann::json a = read_json(c.name + "/audit.json");
    std::vector<std::string> names;
    double sum = 0;
    for (const auto& p : a["parts"]) {
      names.push_back(p["name"]);
      EXPECT_GE(p["ms"].get<double>(), 0.0) << c.name << ": " << a.dump(1);
      sum += p["ms"].get<double>();
    }
    // The layout's parts, in the audit's order; a group the layout lacks appears where the step
    // records counted a wait in it (a pp run's data-parallel engine can time microseconds).
    const std::vector<std::string> order = {"ideal",   "data",   "comm_dp", "comm_tp",   "comm_pp",
                                            "comm_ep", "bubble", "kernels", "stragglers"};
    std::vector<std::string> laid_out;
    for (const std::string& n : order) {
      const bool expected = std::find(c.parts.begin(), c.parts.end(), n) != c.parts.end();
      const bool present = std::find(names.begin(), names.end(), n) != names.end();
      if (expected || (present && n.starts_with("comm_"))) laid_out.push_back(n);
    }
    EXPECT_EQ(names, laid_out) << c.name << ": " << a.dump(1);
    const double measured = a["measured_step_ms"];
    EXPECT_GT(measured, 0.0);
    EXPECT_NEAR(a["sum_ms"].get<double>(), sum, 1e-9 * sum + 1e-12) << a.dump(1);
    EXPECT_NEAR(sum, measured, 0.05 * measured) << c.name << ": " << a.dump(1);
    EXPECT_GT(a["mfu"].get<double>(), 0.0) << a.dump(1);
    EXPECT_LT(a["mfu"].get<double>(), 1.0) << a.dump(1);
    EXPECT_TRUE(contains(r.output, "[audit] measured MFU audit")) << r.output;
  }
}

}  // namespace
}  // namespace tetra
