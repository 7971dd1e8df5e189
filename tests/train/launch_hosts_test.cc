// tetra launch --exclude-host: the hosts it leaves out of the mpirun command, its errors, and the
// restart of a job stopped for a straggler (on one host: where it was).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

using testing::contains;
using testing::Ran;
using testing::run_command;

Ran launch(const std::string& args) {
  return run_command(std::string(TETRA_BINARY) + " launch " + args);
}

std::string this_host() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

TEST(LaunchExcludeHost, LeavesTheHostsOutOfTheCommand) {
  Ran r = launch("--dry-run -n 2 --hosts a,b,c --exclude-host b -- train");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--host a:1,c:1")) << r.output;
  r = launch("--dry-run -n 4 --hosts a:2,b:4,c:2 --exclude-host a,c -- train");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--host b:4")) << r.output;
  EXPECT_FALSE(contains(r.output, "a:2")) << r.output;
  // This machine under any of its names.
  r = launch("--dry-run -n 1 --hosts " + this_host() + ":1,b:1 --exclude-host localhost -- train");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--host b:1")) << r.output;
}

TEST(LaunchExcludeHost, RefusesToLeaveTooFewSlotsOrNoHost) {
  Ran r = launch("--dry-run -n 4 --hosts a:2,b:2 --exclude-host b -- train");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--hosts 'a:2' gives 2 slot(s) for -n 4")) << r.output;
  r = launch("--dry-run -n 2 --hosts a,b --exclude-host a,b -- train");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "leaves no host to run on")) << r.output;
  // Without --hosts the job runs on this machine alone.
  for (const std::string& self : {std::string("localhost"), this_host()}) {
    r = launch("--dry-run -n 2 --exclude-host " + self + " -- train");
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_TRUE(contains(r.output,
                         "leaves no host to run on (without --hosts the job runs on "
                         "this machine alone)"))
        << r.output;
  }
  r = launch("--dry-run -n 2 --hosts a,b --exclude-host z -- train");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "host 'z' is not one the job runs on (a,b)")) << r.output;
  r = launch("--dry-run -n 2 --hosts a,b --exclude-host a,, -- train");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "has an empty entry")) << r.output;
}

// The daemons mpirun starts on other hosts go through tetra's link, which notes a host lost
// (tests/train/two_host_test.cc runs it); a job on this machine alone has no daemon to watch.
TEST(LaunchHosts, OtherHostsDaemonsGoThroughTheLink) {
  Ran r = launch("--dry-run -n 2 --hosts a,b -- train");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, std::string("--mca plm_rsh_agent '") +
                                     std::filesystem::canonical(TETRA_BINARY).string() +
                                     " launch-link'"))
      << r.output;
  r = launch("--dry-run -n 2 --hosts localhost:2 -- train");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(contains(r.output, "launch-link")) << r.output;
  r = run_command(std::string(TETRA_BINARY) + " launch-link");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "is the rsh agent tetra launch gives mpirun")) << r.output;
}

class LaunchStraggler : public testing::RunDirTest {};

TEST_F(LaunchStraggler, AStopOnTheOnlyHostRestartsOnIt) {
  // Rank 1 of 3 is slowed by 600 ms a step: a straggler by far (factor 4: an unslowed rank's
  // few ms of compute on a busy machine read up to 60 ms), which stops the job. The launcher
  // cannot leave this machine out, so it restarts on it, where the straggler stops the job again.
  const Ran r = launch(
      "-n 3 --max-restarts 1 -- train --model.vocab_size=61 --model.n_layer=2 --model.n_head=2 "
      "--model.d_model=32 --model.max_seq=16 --train.seq_len=16 --train.micro_batch=2 "
      "--train.steps=6 --run.threads=1 --run.peak_gflops=50 --dist.timeout_s=60 "
      "--health.telemetry_every=2 --health.straggler_factor=4 --health.on_straggler=stop "
      "--debug.slow_ms=600 --debug.fault_rank=1 --ckpt.dir=" +
      path("ckpt") + " --data.train=" + path("train.bin") + " --run.dir=" + path("run"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "stopping (health.on_straggler=stop)")) << r.output;
  EXPECT_TRUE(contains(r.output, "[launch] straggler on ")) << r.output;
  EXPECT_TRUE(contains(r.output, ", the only host of the job: restarting on it")) << r.output;
  EXPECT_TRUE(contains(r.output, "[launch] restart 1/1: the job exited with status 2")) << r.output;
}

}  // namespace
}  // namespace tetra
