// Checkpoints end to end through the tetra binary: a run killed by SIGKILL and resumed ends
// bitwise equal to an uninterrupted one on every data-parallel layout; a checkpoint resumes under
// another layout; damage, a kill during a write and a full disk never cost the previous
// checkpoint; tetra launch restarts a failed or hung job; ckpt.every=auto follows Young/Daly.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "data/token_shard.h"
#include "plan/checkpoint_math.h"
#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using testing::contains;
using testing::Ran;
using testing::run_command;
using testing::tetra_command;

class CkptCli : public testing::RunDirTest {
 protected:
  // A tiny model trained `steps` steps in run directory `run`, shuffled data.
  std::string args(const std::string& run, int steps, const std::string& extra = "") const {
    return "train --model.vocab_size=64 --model.n_layer=2 --model.n_head=2 --model.d_model=32 "
           "--model.max_seq=16 --train.seq_len=16 --train.micro_batch=2 --optim.lr=1e-2 "
           "--run.threads=1 --run.peak_gflops=50 --dist.timeout_s=60 --data.shuffle=true "
           "--train.steps=" +
           std::to_string(steps) + " --data.train=" + path("train.bin") +
           " --run.dir=" + path(run) + " " + extra;
  }
  std::string bytes(const std::string& name) const {
    std::ifstream in(dir_ / name, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
};

TEST_F(CkptCli, SigkillAndResumeIsBitIdenticalOnEveryDataParallelLayout) {
  struct L {
    int ranks, zero;
    bool async;
  };
  for (const L l : {L{1, 0, true}, L{2, 1, true}, L{2, 3, false}}) {
    const std::string name = fmt::format("r{}z{}", l.ranks, l.zero);
    SCOPED_TRACE(name);
    const std::string common = fmt::format("--zero.stage={} --ckpt.async={} ", l.zero, l.async);
    const Ran control = run_command(
        tetra_command(l.ranks, args(name + "-control", 8,
                                    common + "--ckpt.dir=" + path(name + "-control-ckpt") +
                                        " --save.final=" + path(name + "-control.safetensors"))));
    ASSERT_EQ(control.code, 0) << control.output;
    // Killed (SIGKILL, on the last rank) after step 5; checkpoints every 2 steps.
    const std::string ckpt = common + "--ckpt.every=2 --ckpt.dir=" + path(name + "-ckpt") + " ";
    const Ran killed = run_command(tetra_command(
        l.ranks,
        args(name, 8,
             ckpt + fmt::format("--debug.kill_step=5 --debug.fault_rank={}", l.ranks - 1))));
    ASSERT_NE(killed.code, 0) << killed.output;
    EXPECT_TRUE(contains(killed.output, "debug.kill_step=5")) << killed.output;
    const Ran resumed = run_command(tetra_command(
        l.ranks,
        args(name, 8, ckpt + "--ckpt.resume=auto --save.final=" + path(name + ".safetensors"))));
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    EXPECT_TRUE(contains(resumed.output, "[ckpt] resumed from")) << resumed.output;
    // Weights, every logged loss (the resumed history and what the killed run logged) and the
    // data position.
    EXPECT_EQ(bytes(name + ".safetensors"), bytes(name + "-control.safetensors"));
    const auto want = losses(metrics(name + "-control"));
    EXPECT_EQ(losses(metrics(name)), want);
    std::ifstream killed_log(dir_ / name / "metrics.jsonl.1");
    int lines = 0;
    for (std::string line; std::getline(killed_log, line); ++lines) {
      const auto rec = nlohmann::json::parse(line);
      EXPECT_EQ(double(rec["loss"]), want[size_t(rec["step"]) - 1]) << line;
    }
    EXPECT_EQ(lines, 5);
    const auto a = ckpt::Manifest::read(ckpt::list_checkpoints(path(name + "-control-ckpt"))[0]);
    const auto b = ckpt::Manifest::read(ckpt::list_checkpoints(path(name + "-ckpt"))[0]);
    EXPECT_EQ(a.trainer, b.trainer);
    EXPECT_EQ(a.trainer["sampler"]["cursor"], 8 * 2 * l.ranks);
    for (const auto& [tensor, rec] : a.tensors) {
      EXPECT_EQ(ckpt::read_global(a, tensor, "adam_v"), ckpt::read_global(b, tensor, "adam_v"))
          << tensor;
    }
    // Bytes per checkpoint: weights and both moments, 12 bytes per parameter (the planner's
    // fp32 figure), written once whatever the layout.
    int64_t params = 0;
    for (const auto& [tensor, rec] : a.tensors) params += shape_numel(rec.shape);
    EXPECT_EQ(double(a.bytes), plan::checkpoint_bytes_per_param(plan::Precision::Fp32) * params);
    const auto m = metrics(name);
    EXPECT_EQ(m.back()["ckpt_bytes"], a.bytes);
    EXPECT_TRUE(m.back().contains("ckpt_block_ms") && m.back().contains("ckpt_write_ms"));
  }
}

TEST_F(CkptCli, ResumesUnderAnotherDataParallelSizeAndZeroStage) {
  // A constant LR, so that runs of different lengths share the schedule.
  const std::string common = "--optim.schedule=constant --ckpt.every=2 ";
  const Ran a = run_command(
      tetra_command(2, args("a", 6, common + "--zero.stage=3 --ckpt.dir=" + path("a-ckpt"))));
  ASSERT_EQ(a.code, 0) << a.output;
  // One rank with two micro-batches takes the same global batch from the same data position.
  const Ran b = run_command(
      tetra_command(1, args("b", 4,
                            common + "--train.grad_accum=2 --ckpt.dir=" + path("b-ckpt") +
                                " --ckpt.resume=" + path("a-ckpt/" + ckpt::checkpoint_name(2)))));
  ASSERT_EQ(b.code, 0) << b.output;
  EXPECT_TRUE(contains(b.output, "\"zero\":3")) << b.output;
  // And back to two ranks under ZeRO-2 from the one-rank checkpoint.
  const Ran c = run_command(
      tetra_command(2, args("c", 6,
                            common + "--zero.stage=2 --ckpt.dir=" + path("c-ckpt") +
                                " --ckpt.resume=" + path("b-ckpt/" + ckpt::checkpoint_name(4)))));
  ASSERT_EQ(c.code, 0) << c.output;
  const auto want = losses(metrics("a"));
  const auto got_b = losses(metrics("b")), got_c = losses(metrics("c"));
  ASSERT_EQ(got_b.size(), 2u);  // steps 3 and 4
  ASSERT_EQ(got_c.size(), 2u);  // steps 5 and 6
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(got_b[i], want[2 + i], 1e-6 * want[2 + i]) << "step " << 3 + i;
    EXPECT_NEAR(got_c[i], want[4 + i], 1e-6 * want[4 + i]) << "step " << 5 + i;
  }
}

TEST_F(CkptCli, DamagedOrTruncatedCheckpointsAreRefusedByNameAndThePreviousUsed) {
  const std::string ckpt = "--ckpt.every=2 --ckpt.async=false --ckpt.dir=" + path("ckpt") + " ";
  ASSERT_EQ(run_command(tetra_command(1, args("run", 6, ckpt))).code, 0);
  const fs::path newest = dir_ / "ckpt" / ckpt::checkpoint_name(6);
  const fs::path file = newest / "rank-00000.safetensors";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(fs::file_size(file) / 2));
    f.put('\x7f');
  }
  const Ran verify = run_command(std::string(TETRA_BINARY) + " ckpt verify " + newest.string());
  EXPECT_EQ(verify.code, 1) << verify.output;
  EXPECT_TRUE(contains(verify.output, "fails its checksum")) << verify.output;
  Ran r = run_command(tetra_command(1, args("run", 8, ckpt + "--ckpt.resume=auto")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "rank-00000.safetensors: the chunk of")) << r.output;
  EXPECT_TRUE(contains(r.output, ckpt::checkpoint_name(6) + " was refused")) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from " + path("ckpt/" + ckpt::checkpoint_name(4))))
      << r.output;
  // The run saved step 6 again over the damaged one; now truncate the newest (step 8).
  const fs::path step8 = dir_ / "ckpt" / ckpt::checkpoint_name(8) / "rank-00000.safetensors";
  fs::resize_file(step8, fs::file_size(step8) - 100);
  r = run_command(tetra_command(1, args("run", 9, ckpt + "--ckpt.resume=auto")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "is truncated")) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from " + path("ckpt/" + ckpt::checkpoint_name(6))))
      << r.output;
  // Nothing loads: the run stops and says so rather than starting over.
  for (const auto& c : ckpt::list_checkpoints(dir_ / "ckpt")) {
    fs::resize_file(c / "rank-00000.safetensors", 16);
  }
  r = run_command(tetra_command(1, args("run", 9, ckpt + "--ckpt.resume=auto")));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "can be loaded")) << r.output;
}

TEST_F(CkptCli, AKillDuringAWriteLeavesThePreviousCheckpointLoadable) {
  const Ran control = run_command(
      tetra_command(2, args("control", 6, "--save.final=" + path("control.safetensors"))));
  ASSERT_EQ(control.code, 0) << control.output;
  const std::string ckpt = "--ckpt.every=2 --ckpt.async=false --ckpt.dir=" + path("ckpt") + " ";
  const Ran killed = run_command(
      tetra_command(2, args("run", 6, ckpt + "--debug.kill_in_save_step=4 --debug.fault_rank=1")));
  ASSERT_NE(killed.code, 0) << killed.output;
  EXPECT_EQ(ckpt::list_checkpoints(dir_ / "ckpt").size(), 1u);  // step 2 only
  const Ran r = run_command(tetra_command(
      2, args("run", 6, ckpt + "--ckpt.resume=auto --save.final=" + path("run.safetensors"))));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from " + path("ckpt/" + ckpt::checkpoint_name(2))))
      << r.output;
  EXPECT_TRUE(contains(r.output, "left by a save that did not finish")) << r.output;
  EXPECT_EQ(bytes("run.safetensors"), bytes("control.safetensors"));
}

TEST_F(CkptCli, AFullDiskIsReportedAndNoPublishedCheckpointIsDamaged) {
  const std::string ckpt = "--ckpt.every=2 --ckpt.dir=" + path("ckpt") + " ";
  // An injected ENOSPC on rank 1 at step 4: reported, training continues, step 4 never appears.
  Ran r = run_command(
      tetra_command(2, args("cont", 6, ckpt + "--debug.save_error_step=4 --debug.fault_rank=1")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "No space left on device")) << r.output;
  EXPECT_TRUE(contains(r.output, "training continues (ckpt.on_error=continue)")) << r.output;
  auto published = ckpt::list_checkpoints(dir_ / "ckpt");
  ASSERT_EQ(published.size(), 2u);
  EXPECT_EQ(published[0].filename(), ckpt::checkpoint_name(6));
  EXPECT_EQ(published[1].filename(), ckpt::checkpoint_name(2));
  for (const auto& c : published) EXPECT_TRUE(ckpt::verify(ckpt::Manifest::read(c)).empty());
  // ckpt.on_error=stop ends the run with the reason; the checkpoints already there stay.
  r = run_command(tetra_command(
      2, args("stop", 8,
              ckpt + "--ckpt.resume=auto --ckpt.on_error=stop --debug.save_error_step=8 "
                     "--debug.fault_rank=0")));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "stopping (ckpt.on_error=stop)")) << r.output;
  published = ckpt::list_checkpoints(dir_ / "ckpt");
  EXPECT_EQ(published[0].filename(), ckpt::checkpoint_name(6));
  for (const auto& c : published) EXPECT_TRUE(ckpt::verify(ckpt::Manifest::read(c)).empty());
  // A real limit: files may not grow past 64 KB (a checkpoint here is 0.3 MB). Every step is
  // trained and logged, but the run fails: its last checkpoint is not on disk.
  r = run_command("ulimit -f 64 && " +
                  tetra_command(1, args("limit", 4, "--ckpt.dir=" + path("limit-ckpt"))));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "File too large")) << r.output;
  EXPECT_TRUE(contains(r.output, "the run's last checkpoint (step 4) was not saved")) << r.output;
  EXPECT_TRUE(ckpt::list_checkpoints(dir_ / "limit-ckpt").empty());
  EXPECT_EQ(metrics("limit").size(), 4u);
}

TEST_F(CkptCli, LaunchRestartsAFailedJobFromItsNewestCheckpoint) {
  const Ran control = run_command(
      tetra_command(2, args("control", 8, "--save.final=" + path("control.safetensors"))));
  ASSERT_EQ(control.code, 0) << control.output;
  const Ran r = run_command(std::string(TETRA_BINARY) +
                            " launch -n 2 --max-restarts 3 --inject-fault kill:1@3,kill:0@6 -- " +
                            args("run", 8,
                                 "--ckpt.every=2 --ckpt.async=false --ckpt.dir=" + path("ckpt") +
                                     " --save.final=" + path("run.safetensors")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "[launch] restart 1/3: the job exited with status 137; steps reached 3, "
                       "newest checkpoint after step 2: 1 step(s) lost"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "[launch] restart 2/3")) << r.output;
  EXPECT_FALSE(contains(r.output, "[launch] restart 3/3")) << r.output;
  EXPECT_EQ(bytes("run.safetensors"), bytes("control.safetensors"));
  // A job that fails before training is not restarted.
  const Ran bad = run_command(std::string(TETRA_BINARY) + " launch -n 1 --max-restarts 3 -- " +
                              args("bad", 8, "--model.n_head=3"));
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_TRUE(contains(bad.output, "before any rank started training; not restarting"))
      << bad.output;
}

TEST_F(CkptCli, LaunchRestartsAHungJobWhenItsHeartbeatStops) {
  const Ran control = run_command(
      tetra_command(1, args("control", 6, "--save.final=" + path("control.safetensors"))));
  ASSERT_EQ(control.code, 0) << control.output;
  const Ran r = run_command(std::string(TETRA_BINARY) +
                            " launch -n 1 --max-restarts 1 --heartbeat-timeout 2 "
                            "--inject-fault hang:0@4 -- " +
                            args("run", 6,
                                 "--ckpt.every=2 --ckpt.async=false --ckpt.dir=" + path("ckpt") +
                                     " --save.final=" + path("run.safetensors")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 0 made no progress for")) << r.output;
  EXPECT_TRUE(contains(r.output, "after step 4 (heartbeat timeout 2 s)")) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from " + path("ckpt/" + ckpt::checkpoint_name(4))))
      << r.output;
  EXPECT_EQ(bytes("run.safetensors"), bytes("control.safetensors"));
}

TEST_F(CkptCli, EveryAutoTakesTheYoungDalyInterval) {
  // A tiny MTBF makes the optimal interval far shorter than any step: every step is saved.
  Ran r = run_command(tetra_command(
      1,
      args("short", 5,
           "--ckpt.every=auto --ckpt.keep=0 --ckpt.mtbf_hours=1e-15 --ckpt.dir=" + path("short"))));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "Young/Daly interval")) << r.output;
  EXPECT_TRUE(contains(r.output, "= every 1 step(s)")) << r.output;
  EXPECT_EQ(ckpt::list_checkpoints(dir_ / "short").size(), 5u) << r.output;
  // A huge MTBF: after the first (measuring) save only the last step is saved.
  r = run_command(tetra_command(
      1, args("long", 5,
              "--ckpt.every=auto --ckpt.keep=0 --ckpt.mtbf_hours=1e9 --ckpt.dir=" + path("long"))));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto saved = ckpt::list_checkpoints(dir_ / "long");
  ASSERT_EQ(saved.size(), 2u);
  EXPECT_EQ(saved[0].filename(), ckpt::checkpoint_name(5));
  EXPECT_EQ(saved[1].filename(), ckpt::checkpoint_name(1));
}

TEST_F(CkptCli, BadCheckpointSettingsAreRefusedWithWhatToChange) {
  struct Case {
    std::string extra, message;
  };
  const std::vector<Case> cases = {
      {"--ckpt.every=often", "ckpt.every='often' must be a number of steps"},
      {"--ckpt.resume=auto", "ckpt.resume=auto looks for checkpoints in ckpt.dir, which is not"},
      {"--ckpt.resume=" + path("nowhere"), "no checkpoint there"},
      {"--ckpt.on_error=ignore", "continue, stop"},
  };
  for (const Case& c : cases) {
    const Ran r = run_command(tetra_command(1, args("bad", 2, c.extra)));
    EXPECT_EQ(r.code, 2) << c.extra << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, c.message)) << c.extra << "\n" << r.output;
  }
  // A checkpoint of another model is refused by tensor.
  ASSERT_EQ(run_command(tetra_command(1, args("small", 2, "--ckpt.dir=" + path("ckpt")))).code, 0);
  const Ran other = run_command(tetra_command(
      1,
      args("other", 2, "--model.d_model=48 --ckpt.dir=" + path("ckpt") + " --ckpt.resume=auto")));
  EXPECT_EQ(other.code, 2) << other.output;
  EXPECT_TRUE(contains(other.output, "model.* keys must match the run that saved it"))
      << other.output;
}

TEST_F(CkptCli, VerifyResumeReportsBitwiseEquality) {
  const std::string cfg = path("run.toml");
  std::ofstream(cfg) << "[model]\nvocab_size = 64\nn_layer = 2\nn_head = 2\nd_model = 32\n"
                        "max_seq = 16\n[train]\nseq_len = 16\nmicro_batch = 2\n[run]\nthreads = 1\n"
                        "[data]\nshuffle = true\ntrain = \""
                     << path("train.bin") << "\"\n";
  const Ran r = run_command(std::string(TETRA_BINARY) + " verify-resume --config " + cfg +
                            " -n 2 --steps 9 --zero.stage=1 --dir " + path("vr"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "killed after step 6")) << r.output;
  EXPECT_TRUE(contains(r.output, "PASS, bitwise equal: 0 difference(s)")) << r.output;
  const Ran export_ =
      run_command(std::string(TETRA_BINARY) + " ckpt export " + path("vr/resumed-ckpt") + " --to " +
                  path("exported.safetensors"));
  ASSERT_EQ(export_.code, 0) << export_.output;
  EXPECT_EQ(bytes("exported.safetensors"), bytes("vr/resumed.safetensors"));
}

}  // namespace
}  // namespace tetra
