// In-memory checkpoints end to end (train/memory_checkpoint.h, docs/checkpoints.md "In memory"):
// a rank killed between disk saves resumes from the step held in memory, bitwise equal to an
// uninterrupted run, and the store is gone once the run ends; when both copies of a shard are gone
// the restart reads the disk's; a memory save that fails never stops the run; bad keys are
// refused. Across hosts (buddy copies, a lost host's shards from another's memory):
// tests/train/two_host_test.cc.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tests/train/run_tetra.h"
#include "train/memory_checkpoint.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using testing::contains;
using testing::Ran;
using testing::run_command;
using testing::tetra_command;

TEST(MemoryBuddies, EveryRanksCopyGoesToAnotherHostWhenOneCan) {
  // Hosts in blocks (the usual placement): half the ring along.
  EXPECT_EQ(MemoryCheckpoint::buddy_shift({"a", "a", "b", "b"}), 2);
  EXPECT_EQ(MemoryCheckpoint::buddy_shift({"a", "a", "a", "b", "b", "b"}), 3);
  // Dealt round robin: the next rank.
  EXPECT_EQ(MemoryCheckpoint::buddy_shift({"a", "b", "a", "b"}), 1);
  // Uneven: the smallest shift that moves every rank off its host.
  EXPECT_EQ(MemoryCheckpoint::buddy_shift({"a", "a", "b", "b", "c", "c"}), 2);
  EXPECT_EQ(MemoryCheckpoint::buddy_shift({"a", "a", "a", "b"}), 0);
  // One host (or one rank): no copy elsewhere.
  EXPECT_EQ(MemoryCheckpoint::buddy_shift({"a", "a"}), 0);
  EXPECT_EQ(MemoryCheckpoint::buddy_shift({"a"}), 0);
}

class MemoryCkpt : public testing::RunDirTest {
 protected:
  // A tiny 2-rank ZeRO-3 run of 8 steps in run directory `run`: shuffled data, disk checkpoints
  // after step 4 (and 8), in memory every step.
  std::string args(const std::string& run, const std::string& extra = "") const {
    return tiny_train_args(
        run, 8,
        "--data.shuffle=true --zero.stage=3 --ckpt.every=4 --ckpt.dir=" + path(run + "-ckpt") +
            " --ckpt.memory_every=1 --ckpt.memory_dir=" + path("shm") + " " + extra);
  }
  std::string bytes(const std::string& name) const {
    std::ifstream in(dir_ / name, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  void SetUp() override {
    RunDirTest::SetUp();
    fs::create_directories(dir_ / "shm");
  }
  // The uninterrupted run, and the run killed (SIGKILL, rank 1) after step 6.
  void control_and_killed(const std::string& run) {
    const Ran control = run_command(tetra_command(
        2, tiny_train_args(
               "control", 8,
               "--data.shuffle=true --zero.stage=3 --save.final=" + path("control.safetensors"))));
    ASSERT_EQ(control.code, 0) << control.output;
    const Ran killed =
        run_command(tetra_command(2, args(run, "--debug.kill_step=6 --debug.fault_rank=1")));
    ASSERT_NE(killed.code, 0) << killed.output;
  }
  // The store's directories of steps (under shm/tetra-*/).
  std::vector<fs::path> held_steps() const {
    std::vector<fs::path> out;
    for (const auto& store : fs::directory_iterator(dir_ / "shm")) {
      for (const auto& step : fs::directory_iterator(store.path())) {
        if (step.path().filename().string().starts_with("step-")) out.push_back(step.path());
      }
    }
    return out;
  }
};

TEST_F(MemoryCkpt, AKilledRankResumesFromMemoryBitwise) {
  control_and_killed("run");
  // What the killed run left in memory: a step after the disk's (4), whole on both ranks.
  ASSERT_FALSE(held_steps().empty());
  const Ran resumed = run_command(
      tetra_command(2, args("run", "--ckpt.resume=auto --save.final=" + path("run.safetensors"))));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "[ckpt] resumed from memory (" + path("shm") + "/tetra-"))
      << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "after step 5 (") ||
              contains(resumed.output, "after step 6 ("))
      << resumed.output;
  EXPECT_EQ(bytes("run.safetensors"), bytes("control.safetensors"));
  EXPECT_EQ(losses(metrics("run")), losses(metrics("control")));
  // The run ended whole on disk: its memory store is gone.
  EXPECT_TRUE(fs::is_empty(dir_ / "shm")) << "the store outlived the run";
  // Each memory save is in the metrics, with its stall.
  const std::vector<nlohmann::json> m = metrics("run");
  EXPECT_TRUE(m[6].contains("mem_ckpt_step") && m[6].contains("mem_ckpt_block_ms")) << m[6];
}

TEST_F(MemoryCkpt, BothCopiesOfAShardGoneFallBackToTheDisk) {
  control_and_killed("run");
  // Rank 0's shards gone from every step held (on one host there is no second copy).
  for (const fs::path& step : held_steps()) {
    fs::remove(step / "rank-00000.safetensors");
    fs::remove(step / "rank-00000.json");
  }
  const Ran resumed = run_command(
      tetra_command(2, args("run", "--ckpt.resume=auto --save.final=" + path("run.safetensors"))));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "(both copies of rank(s) 0's shards are gone)"))
      << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "; reading from disk")) << resumed.output;
  EXPECT_TRUE(contains(resumed.output,
                       "[ckpt] resumed from " + path("run-ckpt") + "/step-000000004 after step 4"))
      << resumed.output;
  EXPECT_EQ(bytes("run.safetensors"), bytes("control.safetensors"));
}

TEST_F(MemoryCkpt, AFailingMemorySaveNeverStopsTheRun) {
  // Rank 1's memory save of step 3 fails as in a full /dev/shm (disk saves after 4 and 8).
  const Ran r = run_command(
      tetra_command(2, args("run", "--debug.save_error_step=3 --debug.fault_rank=1 --save.final=" +
                                       path("run.safetensors"))));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[ckpt] step 3 in memory: [ckpt] ")) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "(No space left on device; debug.save_error_step=3); training "
                       "continues"))
      << r.output;
  // Step 3 never became whole in memory (rank 1's part is missing); step 4 did.
  int seen = 0;
  for (const nlohmann::json& j : metrics("run")) {
    if (j.value("mem_ckpt_step", 0) == 3) {
      EXPECT_EQ(j["mem_ckpt_complete"], 2) << j;
      ++seen;
    }
    if (j.value("mem_ckpt_step", 0) == 4) {
      EXPECT_EQ(j["mem_ckpt_complete"], 4) << j;
      ++seen;
    }
  }
  EXPECT_EQ(seen, 2) << "the records of the memory saves of steps 3 and 4";
  EXPECT_TRUE(fs::exists(dir_ / "run-ckpt" / "step-000000008")) << r.output;
}

TEST_F(MemoryCkpt, BadKeysAreRefusedSayingWhatToChange) {
  const Ran no_dir =
      run_command(tetra_command(1, tiny_train_args("run", 2, "--ckpt.memory_every=1")));
  EXPECT_NE(no_dir.code, 0);
  EXPECT_TRUE(contains(no_dir.output,
                       "[config] ckpt.memory_every=1 keeps checkpoints in memory "
                       "for a restart of the run whose checkpoints go to "
                       "ckpt.dir, which is not set; set ckpt.dir too"))
      << no_dir.output;
  const Ran missing = run_command(tetra_command(1, tiny_train_args("run", 2,
                                                                   "--ckpt.dir=" + path("ckpt") +
                                                                       " --ckpt.memory_every=1 "
                                                                       "--ckpt.memory_dir=" +
                                                                       path("nowhere"))));
  EXPECT_NE(missing.code, 0);
  EXPECT_TRUE(
      contains(missing.output, "[ckpt] ckpt.memory_dir=" + path("nowhere") + " is not a directory"))
      << missing.output;
  EXPECT_FALSE(fs::exists(dir_ / "ckpt" / "step-000000002")) << "a refused run saved";
}

}  // namespace
}  // namespace tetra
