// Bad numbers per rank and the loss-spike policy (docs/health.md): a rank whose copy of the
// reduced gradient is silently wrong (zero.stage=0), whose local gradient is an outlier (ZeRO) or
// whose known-answer test fails is named with its host before the update, and that update is not
// applied (the run equals one that skipped that step); health.on_bad_rank=stop ends the job
// naming it; clean runs name nobody. A loss spike skips its update, a clean run skips none, and
// the spike policy's window survives a checkpoint resume bit-exactly. Ranks are real processes
// under mpirun (4 on 2 cores).
#include "train/sdc.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

using testing::contains;
using testing::Ran;
using testing::run_command;
using testing::tetra_command;

class Sdc : public testing::RunDirTest {
 protected:
  Ran train(int ranks, const std::string& run, int steps, const std::string& extra) {
    return run_command(tetra_command(
        ranks,
        "train --model.vocab_size=61 --model.n_layer=2 --model.n_head=2 "
        "--model.d_model=32 --model.max_seq=16 --train.seq_len=16 --train.micro_batch=2 "
        "--run.threads=1 --run.peak_gflops=50 --eval.every=0 --run.progress=never "
        "--dist.timeout_s=60 --health.telemetry_every=0 --optim.schedule=constant "
        "--train.steps=" +
            std::to_string(steps) + " --data.train=" + path("train.bin") +
            " --run.dir=" + path(run) + " " + extra));
  }
  // Per record: the ranks it names as bad (empty when none).
  std::vector<nlohmann::json> bad_ranks(const std::string& run) const {
    std::vector<nlohmann::json> out;
    for (const auto& m : metrics(run)) {
      out.push_back(m.contains("bad_ranks") ? m["bad_ranks"] : nlohmann::json::array());
    }
    return out;
  }
  // Only step `step` (1-based) names a rank: `rank`, by check `check`, with a host.
  void expect_only_step_names(const std::string& run, int steps, int step, int rank,
                              const std::string& check) const {
    const auto bad = bad_ranks(run);
    ASSERT_EQ(bad.size(), size_t(steps));
    for (int s = 1; s <= steps; ++s) {
      const nlohmann::json& b = bad[size_t(s - 1)];
      if (s != step) {
        EXPECT_TRUE(b.empty()) << "step " << s << ": " << b.dump();
        continue;
      }
      ASSERT_EQ(b.size(), 1u) << b.dump();
      EXPECT_EQ(b[0]["rank"], rank);
      EXPECT_EQ(b[0]["check"], check);
      EXPECT_FALSE(b[0]["host"].get<std::string>().empty());
    }
  }
};

TEST(KnownAnswer, TheConstantIsTheExactIntegerProduct) {
  // The committed constant against the product recomputed here in integers.
  const int n = kKnownAnswerSize;
  int64_t sum = 0;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      int64_t s = 0;
      for (int k = 0; k < n; ++k) {
        s += int64_t(known_answer_input(int64_t(i) * n + k)) *
             known_answer_input(int64_t(n) * n + int64_t(j) * n + k);
      }
      sum += s * s;
    }
  }
  EXPECT_EQ(sum, kKnownAnswerSumSq);
}

TEST_F(Sdc, ACorruptReplicaIsNamedAndItsUpdateNotApplied) {
  // zero.stage=0 on 4 ranks: rank 2's copy of the reduced gradient is off by a factor 1 + 1e-6 at
  // step 3; the replicas' sums of squares disagree bitwise, so rank 2 is named and the update is
  // skipped on every rank: the run is the one that skipped step 3.
  const Ran r =
      train(4, "bad", 6, "--debug.corrupt_grad=1e-6 --debug.corrupt_step=3 --debug.fault_rank=2");
  ASSERT_EQ(r.code, 0) << r.output;
  expect_only_step_names("bad", 6, 3, 2, "replica");
  EXPECT_TRUE(contains(r.output, "[health] step 3: rank 2 on ")) << r.output;
  const Ran skip = train(4, "skip", 6, "--debug.skip_step=3");
  ASSERT_EQ(skip.code, 0) << skip.output;
  EXPECT_EQ(losses(metrics("bad")), losses(metrics("skip")));
  EXPECT_EQ(metrics("bad").back()["skipped"], 1);
}

TEST_F(Sdc, AZeroOutlierIsNamedBeforeItsGradientIsUsed) {
  // zero.stage=2 on 4 ranks: rank 1's local gradient is 101x its size before the reduce-scatter at
  // step 3; its norm is an outlier among the four, so it is named and the poisoned mean is not
  // applied.
  const std::string zero = "--zero.stage=2 ";
  const Ran r = train(
      4, "bad", 6, zero + "--debug.corrupt_grad=100 --debug.corrupt_step=3 --debug.fault_rank=1");
  ASSERT_EQ(r.code, 0) << r.output;
  expect_only_step_names("bad", 6, 3, 1, "zscore");
  EXPECT_TRUE(contains(r.output, "[health] step 3: rank 1 on ")) << r.output;
  const Ran skip = train(4, "skip", 6, zero + "--debug.skip_step=3");
  ASSERT_EQ(skip.code, 0) << skip.output;
  EXPECT_EQ(losses(metrics("bad")), losses(metrics("skip")));
}

TEST_F(Sdc, StopEndsTheJobNamingTheRankBeforeTheUpdate) {
  const Ran r = train(3, "stop", 6,
                      "--debug.corrupt_grad=1e-3 --debug.corrupt_step=2 --debug.fault_rank=1 "
                      "--health.on_bad_rank=stop");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 1 on ")) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "stopping before the update (health.on_bad_rank=stop), so the "
                       "weights stay those of step 1"))
      << r.output;
}

TEST_F(Sdc, CleanRunsNameNobody) {
  // Every check every step, at each ZeRO stage (stage 1 with accumulation: the local gradient is
  // measured once it is whole).
  for (const std::string zero :
       {"--zero.stage=0", "--zero.stage=1 --train.grad_accum=2", "--zero.stage=3"}) {
    SCOPED_TRACE(zero);
    const Ran r = train(4, "clean", 6, zero + " --health.known_answer_every=1");
    ASSERT_EQ(r.code, 0) << r.output;
    for (const auto& m : metrics("clean")) {
      EXPECT_FALSE(m.contains("bad_ranks")) << m.dump();
      EXPECT_TRUE(m.contains("bad_number_check_ms")) << m.dump();
      ASSERT_TRUE(m.contains("grad_zscore_max")) << m.dump();  // four ranks: the z-score ran
      EXPECT_LE(m["grad_zscore_max"].get<double>(), 8.0) << m.dump();
      EXPECT_EQ(m["skipped"], 0);
    }
    EXPECT_FALSE(contains(r.output, "[health]")) << r.output;
  }
}

TEST_F(Sdc, KnownAnswerNamesTheRankThatComputesWrong) {
  const Ran r = train(2, "kat", 6,
                      "--health.known_answer_every=2 --health.grad_check_every=0 "
                      "--debug.wrong_answer_step=4 --debug.fault_rank=1");
  ASSERT_EQ(r.code, 0) << r.output;
  expect_only_step_names("kat", 6, 4, 1, "known_answer");
  EXPECT_TRUE(contains(r.output, "known-answer test gave")) << r.output;
  // Checked on steps 2, 4 and 6 only.
  const auto m = metrics("kat");
  for (size_t i = 0; i < m.size(); ++i) {
    EXPECT_EQ(m[i].contains("bad_number_check_ms"), (i + 1) % 2 == 0) << m[i].dump();
  }
}

TEST_F(Sdc, ALossSpikeIsSkippedAndACleanRunSkipsNone) {
  const std::string spike = "--train.spike_zscore=6 --train.spike_window=4 ";
  const Ran clean = train(1, "clean", 12, spike);
  ASSERT_EQ(clean.code, 0) << clean.output;
  EXPECT_EQ(metrics("clean").back()["skipped"], 0);
  EXPECT_FALSE(contains(clean.output, "is a spike")) << clean.output;

  const Ran r = train(2, "spike", 8, spike + "--debug.spike_step=6");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto m = metrics("spike");
  ASSERT_EQ(m.size(), 8u);
  for (size_t i = 0; i < m.size(); ++i) EXPECT_EQ(m[i].contains("loss_spike_z"), i == 5);
  EXPECT_GT(double(m[5]["loss_spike_z"]), 6.0);
  EXPECT_EQ(m.back()["skipped"], 1);
  EXPECT_TRUE(contains(r.output, "[train] step 6: loss ")) << r.output;
  EXPECT_TRUE(contains(r.output, "is a spike (z=")) << r.output;
  const Ran skip = train(2, "skip", 8, spike + "--debug.skip_step=6");
  ASSERT_EQ(skip.code, 0) << skip.output;
  EXPECT_EQ(losses(m), losses(metrics("skip")));
}

TEST_F(Sdc, TheSpikeWindowSurvivesAResume) {
  // A run of 4 steps checkpoints after its last; resumed from there to step 8, it meets the spike
  // at step 6 with the window (steps 3..5, restored from the checkpoint and extended) of the
  // uninterrupted run: the same z, bit for bit. Without the window in the checkpoint it would hold
  // step 5 alone, too little history to judge step 6.
  const std::string spike =
      "--train.spike_zscore=6 --train.spike_window=3 --debug.spike_step=6 --ckpt.every=3 ";
  const Ran whole = train(2, "whole", 8, spike + "--ckpt.dir=" + path("whole-ckpt"));
  ASSERT_EQ(whole.code, 0) << whole.output;
  const Ran first = train(2, "part", 4, spike + "--ckpt.dir=" + path("part-ckpt"));
  ASSERT_EQ(first.code, 0) << first.output;
  const Ran resumed =
      train(2, "part", 8, spike + "--ckpt.dir=" + path("part-ckpt") + " --ckpt.resume=auto");
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "[ckpt] resumed from")) << resumed.output;
  const auto a = metrics("whole"), b = metrics("part");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  EXPECT_EQ(losses(a), losses(b));
  ASSERT_TRUE(a[5].contains("loss_spike_z")) << a[5].dump();
  ASSERT_TRUE(b[5].contains("loss_spike_z")) << b[5].dump();
  EXPECT_EQ(a[5]["loss_spike_z"].get<double>(), b[5]["loss_spike_z"].get<double>());
}

TEST_F(Sdc, BadSettingsAreRefusedSayingWhatToChange) {
  struct Bad {
    std::string flag, says;
  };
  for (const Bad& b : {Bad{"--health.grad_check_every=-1", "health.grad_check_every"},
                       Bad{"--health.known_answer_every=-5", "health.known_answer_every"},
                       Bad{"--health.grad_zscore=0", "health.grad_zscore"},
                       Bad{"--health.on_bad_rank=ignore", "one of: warn, stop"},
                       Bad{"--train.spike_zscore=-1", "train.spike_zscore"},
                       Bad{"--train.spike_window=1", "train.spike_window"}}) {
    SCOPED_TRACE(b.flag);
    const Ran r = train(1, "bad", 2, b.flag);
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, b.says)) << r.output;
  }
}

}  // namespace
}  // namespace tetra
