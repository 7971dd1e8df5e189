// tetra launch under hostile use, end to end through real mpirun jobs: every wait is bounded (ranks
// that never get ready, every rank failing at start-up), a stopped rank is found whenever a job
// runs (no --max-restarts needed), restarts that make no progress end, and a heartbeat timeout
// shorter than the first step does not stop a healthy job.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using testing::contains;
using testing::Ran;
using testing::run_command;

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

class LaunchRobust : public testing::RunDirTest {
 protected:
  // A tiny model trained `steps` steps in run directory `run` on `data` (train.bin when empty).
  std::string train(const std::string& run, int64_t steps, const std::string& extra = "",
                    const std::string& data = "") const {
    return fmt::format(
        "train --model.vocab_size=64 --model.n_layer=2 --model.n_head=2 --model.d_model=32 "
        "--model.max_seq=16 --train.seq_len=16 --train.micro_batch=2 --optim.lr=1e-2 "
        "--run.threads=1 --run.peak_gflops=50 --dist.timeout_s=60 --train.steps={} "
        "--data.train={} --run.dir={} {}",
        steps, data.empty() ? path("train.bin") : data, path(run), extra);
  }
  static std::string launch(const std::string& flags, const std::string& command) {
    return std::string(TETRA_BINARY) + " launch " + flags + " -- " + command;
  }
};

// The process of world rank `rank` of the job whose heartbeats go to `beats`, or 0.
pid_t rank_process(const fs::path& beats, int rank) {
  const std::string dir = "TETRA_HEARTBEAT_DIR=" + beats.string() + '\0';
  const std::string rank_var = fmt::format("OMPI_COMM_WORLD_RANK={}", rank) + '\0';
  std::error_code ec;
  for (fs::directory_iterator it("/proc", ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(it->path() / "environ", std::ios::binary);
    const std::string env = '\0' + std::string(std::istreambuf_iterator<char>(in), {});
    if (contains(env, '\0' + dir) && contains(env, '\0' + rank_var)) return pid_t(std::stoi(name));
  }
  return 0;
}

// The step in heartbeat file `file`, or -1 while there is none.
int64_t beat_step(const fs::path& file) {
  std::ifstream in(file);
  int64_t step = -1;
  in >> step;
  return in ? step : -1;
}

TEST_F(LaunchRobust, RanksThatNeverGetReadyAreStoppedAtTheStartUpDeadline) {
  // Every rank blocks opening its data (a FIFO nobody writes): alive, silent, never ready.
  const std::string fifo = path("never.bin");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const Ran r =
      run_command(launch("-n 2 --startup-timeout 2", train("run", 4, "", fifo)) + " < /dev/null");
  EXPECT_EQ(r.code, 75) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "[launch] start-up deadline missed: ranks 0-1 of 2 wrote no heartbeat "
                       "within --startup-timeout 2 s"))
      << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
}

TEST_F(LaunchRobust, EveryRankFailingAtStartUpEndsTheLaunch) {
  // Many ranks (oversubscribed), each failing before it is ready: mpirun may wait on with no rank
  // left; the launcher returns anyway, with the ranks' error.
  const Ran r =
      run_command(launch("-n 12", train("run", 4, "", path("missing.bin"))) + " < /dev/null");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "missing.bin")) << r.output;
  EXPECT_LT(r.seconds, 90) << r.output;
}

TEST_F(LaunchRobust, AStoppedRankIsFoundWithoutMaxRestarts) {
  const fs::path beats = dir_ / "beats";
  Ran r;
  std::thread job([&] {
    r = run_command("TETRA_HEARTBEAT_DIR=" + beats.string() + " " +
                    launch("-n 2 --heartbeat-timeout 2", train("run", 1000000)) + " < /dev/null");
  });
  // Once rank 1 trains, stop it as a debugger or a stray SIGSTOP would.
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = 0;
  while (since(start) < 120 && (pid == 0 || beat_step(beats / "rank-1") < 3)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (pid == 0) pid = rank_process(beats, 1);
  }
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  const auto stopped = std::chrono::steady_clock::now();
  job.join();
  EXPECT_EQ(r.code, 75) << r.output;
  EXPECT_TRUE(contains(r.output, "[launch] rank 1 made no progress for")) << r.output;
  EXPECT_TRUE(contains(r.output, fmt::format("rank 1 is process {}, stopped by a signal", pid)))
      << r.output;
  // The heartbeat timeout, then SIGTERM; the stopped rank is continued so that it ends at once.
  EXPECT_LT(since(stopped), 10) << r.output;
}

// The same with no flag: the launcher bounds a step by --heartbeat-factor (10) median steps, at
// least --heartbeat-min (5 s), so a stopped rank on a job of fast steps is named within seconds,
// not at the 300 s --heartbeat-timeout.
TEST_F(LaunchRobust, AStoppedRankIsNamedAtTheStepBoundWithNoFlag) {
  const fs::path beats = dir_ / "beats";
  Ran r;
  std::thread job([&] {
    r = run_command("TETRA_HEARTBEAT_DIR=" + beats.string() + " " +
                    launch("-n 2", train("run", 1000000)) + " < /dev/null");
  });
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = 0;
  while (since(start) < 120 && (pid == 0 || beat_step(beats / "rank-1") < 5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (pid == 0) pid = rank_process(beats, 1);
  }
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  const auto stopped = std::chrono::steady_clock::now();
  job.join();
  EXPECT_EQ(r.code, 75) << r.output;
  EXPECT_TRUE(contains(r.output, "[launch] rank 1 made no progress for")) << r.output;
  EXPECT_TRUE(contains(r.output, "(step bound 5 s: --heartbeat-factor 10 x its median step "))
      << r.output;
  EXPECT_TRUE(contains(r.output, fmt::format("rank 1 is process {}, stopped by a signal", pid)))
      << r.output;
  // The 5 s bound, a poll, then SIGTERM: well before the collective step deadline (30 s).
  EXPECT_LT(since(stopped), 20) << r.output;
  EXPECT_FALSE(contains(r.output, "[comm] watchdog")) << r.output;
}

// What follows a step is bounded by --heartbeat-timeout, not by the step bound: evaluations
// (after steps 3 and 6) three times longer than the step bound (1 s here) keep a healthy job.
TEST_F(LaunchRobust, AnEvaluationLongerThanTheStepBoundIsNoHang) {
  const Ran r = run_command(launch("-n 1 --heartbeat-factor 1 --heartbeat-min 1",
                                   train("run", 6,
                                         "--data.val=" + path("train.bin") +
                                             " --eval.every=3 --debug.slow_eval_ms=3000")) +
                            " < /dev/null");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(contains(r.output, "made no progress")) << r.output;
  // Each evaluation took its 3 s: three times the step bound.
  std::ifstream in(path("run") + "/goodput.json");
  const std::string account(std::istreambuf_iterator<char>(in), {});
  EXPECT_TRUE(contains(account, "\"eval\": 6.")) << account;
}

TEST_F(LaunchRobust, RestartsThatMakeNoProgressEnd) {
  // The job dies after step 3 every time, its newest checkpoint after step 2: a second identical
  // failure ends the restarts however many are left.
  const Ran r =
      run_command(launch("-n 1 --max-restarts 20",
                         train("run", 8,
                               "--ckpt.every=2 --ckpt.async=false --ckpt.dir=" + path("ckpt") +
                                   " --debug.kill_step=3 --debug.fault_rank=0")) +
                  " < /dev/null");
  EXPECT_EQ(r.code, 137) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "[launch] restart 1/20: the job exited with status 137; steps reached 3, "
                       "newest checkpoint after step 2: 1 step(s) lost"))
      << r.output;
  EXPECT_TRUE(contains(r.output,
                       "it failed at step 3 again with no checkpoint newer than step 2 (as "
                       "attempt 1 did): a restart would fail the same way, so not restarting (1 "
                       "of --max-restarts 20 used)"))
      << r.output;
  EXPECT_FALSE(contains(r.output, "restart 2/20")) << r.output;

  // The same with a rank that hangs after step 3 (steps so fast that the launcher may see no
  // heartbeat before step 3's): found at the heartbeat timeout each time, restarted once.
  const Ran hung =
      run_command(launch("-n 1 --max-restarts 20 --heartbeat-timeout 1",
                         train("hung", 8,
                               "--ckpt.every=2 --ckpt.async=false --ckpt.dir=" + path("hung-ckpt") +
                                   " --debug.hang_step=3 --debug.fault_rank=0")) +
                  " < /dev/null");
  EXPECT_EQ(hung.code, 75) << hung.output;
  EXPECT_TRUE(contains(hung.output, "[launch] restart 1/20: rank 0 made no progress for"))
      << hung.output;
  EXPECT_TRUE(contains(hung.output, "after step 3 (heartbeat timeout 1 s)")) << hung.output;
  EXPECT_TRUE(contains(hung.output,
                       "it failed at step 3 again with no checkpoint newer than step 2 (as "
                       "attempt 1 did)"))
      << hung.output;
  EXPECT_LT(hung.seconds, 60) << hung.output;
}

TEST_F(LaunchRobust, AHeartbeatTimeoutShorterThanTheFirstStepKeepsAHealthyJob) {
  // A model whose steps take under a second on one core, under the shortest timeout taken: the
  // first step and the end of the run are bounded by the start-up deadline, later steps by twice
  // the slowest step seen.
  const Ran r = run_command(
      launch("-n 1 --heartbeat-timeout 1",
             train("run", 3,
                   "--model.d_model=256 --model.n_layer=4 --model.n_head=4 --model.max_seq=128 "
                   "--train.seq_len=128 --train.micro_batch=8")) +
      " < /dev/null");
  // The end of the run (validation, the summary, the exit) takes longer than twice a step here;
  // past its last step a rank beats "finishing" and is allowed the start-up deadline.
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(contains(r.output, "made no progress")) << r.output;
}

}  // namespace
}  // namespace tetra
