// Two hosts equal one: the same 4-rank run started on two namespaced hosts (scripts/twohost.sh:
// 2 ranks each, TCP between them, each host its own /tmp and /dev/shm) and on this host alone
// (shared memory) gives the same losses and final weights for every parallel dimension; a
// checkpoint written by both hosts into one shared directory resumes on one host, and one written
// on one host resumes on two, under another layout too. Skips, saying why, where this machine
// does not let a test create network namespaces (ip netns needs root).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

#include "data/token_shard.h"
#include "tests/train/layout_run.h"
#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using testing::contains;
using testing::LayoutRun;
using testing::Ran;
using testing::run_command;
using testing::tetra_command;

constexpr int kTwoHostVocab = 333;
constexpr int kTwoHostSteps = 4;
const std::string kTwoHost = std::string(TETRA_SOURCE_DIR) + "/scripts/twohost.sh";

/** `tetra <args>` on 4 ranks over two namespaced hosts (ranks 0-1 on hosta, 2-3 on hostb). */
std::string two_host_command(const std::string& args) {
  // Namespaces named after this process: the suite's cases run side by side under ctest -j.
  return "TWOHOST_ID=" + std::to_string(::getpid()) + " " + kTwoHost + " run -n 4 -- " +
         TETRA_BINARY + " " + testing::with_measurement_knobs(args);
}

/** What a restart's log says of its in-memory checkpoint: the step it found whole on the hosts
 *  (-1: none) and how many shards it brought from other hosts. */
struct MemoryRestore {
  int64_t step = -1;
  int shards_moved = -1;
};
MemoryRestore memory_restore(const std::string& log) {
  static const std::regex re(
      R"(\[ckpt\] in memory: step ([0-9]+) is whole \([0-9]+ rank\(s\)' shards\); ([0-9]+) shard)");
  std::smatch m;
  if (!std::regex_search(log, m, re)) return {};
  return {std::stoll(m[1].str()), std::stoi(m[2].str())};
}

class TwoHost : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("tetra_two_host_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::vector<uint32_t> tokens(20000);
    uint32_t x = 7;
    for (auto& t : tokens) t = ((x = x * 1103515245u + 12345u) >> 16) % kTwoHostVocab;
    write_token_shard((dir_ / "train.bin").string(), tokens);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  void SetUp() override {
    const Ran check = run_command(kTwoHost + " check");
    if (check.code != 0) GTEST_SKIP() << "no namespaced hosts here: " << check.output;
  }

  /** The arguments of a tiny 4-rank run named `name` with `layout`'s flags (global batch 8
   *  sequences per step). */
  static std::string train_args(const std::string& name, const std::string& layout, int steps,
                                const std::string& extra) {
    const fs::path run = dir_ / name;
    return "train --model.vocab_size=" + std::to_string(kTwoHostVocab) +
           " --model.vocab_multiple=1 --model.n_layer=2 --model.n_head=4 --model.d_model=32 "
           "--model.max_seq=16 --train.seq_len=16 --optim.lr=1e-2 --optim.warmup_steps=1 "
           "--data.shuffle=true --run.threads=1 --run.peak_gflops=50 --dp.bucket_mb=0.01 "
           "--dist.timeout_s=60 --eval.every=0 --run.progress=never --train.steps=" +
           std::to_string(steps) + " --data.train=" + (dir_ / "train.bin").string() +
           " --run.dir=" + run.string() + " --save.final=" + (run / "w.safetensors").string() +
           " " + layout + " " + extra;
  }

  /** That run, on two hosts or on this one. */
  static LayoutRun train(bool two_hosts, const std::string& name, const std::string& layout,
                         int steps = kTwoHostSteps, const std::string& extra = "") {
    const std::string args = train_args(name, layout, steps, extra);
    const Ran ran = run_command(two_hosts ? two_host_command(args) : tetra_command(4, args));
    return testing::read_layout_run(ran, dir_ / name, dir_ / name / "w.safetensors");
  }

  /** True when every step's loss and every final weight are the same bits. */
  static bool bitwise_equal(const LayoutRun& a, const LayoutRun& b) {
    if (a.loss != b.loss || a.grad_norm != b.grad_norm) return false;
    for (const auto& [name, t] : a.weights.tensors)
      if (t.bytes != b.weights.tensors.at(name).bytes) return false;
    return true;
  }

  static fs::path dir_;
};
fs::path TwoHost::dir_;

struct Layout {
  const char* name;
  const char* flags;
  bool bitwise;  // the same reduction order on both: OpenMPI picks its algorithms by size alone
};

// gtest names each case by its layout (and prints no bytes of the struct).
void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }

class TwoHostLayout : public TwoHost, public ::testing::WithParamInterface<Layout> {};

TEST_P(TwoHostLayout, GivesTheOneHostRun) {
  const Layout& l = GetParam();
  const LayoutRun one = train(false, std::string(l.name) + "_one", l.flags);
  ASSERT_EQ(one.code, 0) << one.output;
  const LayoutRun two = train(true, std::string(l.name) + "_two", l.flags);
  ASSERT_EQ(two.code, 0) << two.output;
  // The start-up table places every rank on its host.
  EXPECT_TRUE(contains(two.output, "hosta")) << two.output;
  EXPECT_TRUE(contains(two.output, "hostb")) << two.output;
  // The run's plan has the nodes the hosts make, and the link between them measured.
  EXPECT_TRUE(contains(two.output, "--cluster.gpus_per_node=2 plans this run")) << two.output;
  EXPECT_TRUE(contains(two.output, "the cpu cluster of 2 nodes x 2 ranks")) << two.output;
  EXPECT_TRUE(contains(two.output, "(measured by this run across its hosts)")) << two.output;
  EXPECT_FALSE(contains(one.output, "--cluster.gpus_per_node=")) << one.output;
  // The bytes each rank sends are the layout's, whatever carries them.
  EXPECT_EQ(one.comm_bytes, two.comm_bytes);
  const bool same = bitwise_equal(one, two);
  std::cout << "[ two-host ] " << l.name << (same ? ": bitwise equal" : ": not bitwise equal")
            << std::endl;
  if (l.bitwise) {
    EXPECT_TRUE(same) << "two hosts changed " << l.name << "'s bits";
  } else {
    // docs/testing.md's layout bounds for the one-host equivalence tests.
    testing::expect_same_trajectory(one, two, 1e-5, kTwoHostSteps, 2e-5, 1.5e-4);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, TwoHostLayout,
    ::testing::Values(Layout{"dp4", "--train.micro_batch=2", true},
                      Layout{"dp2_tp2", "--parallel.tp=2 --train.micro_batch=4", true},
                      Layout{"zero3", "--zero.stage=3 --train.micro_batch=2", true},
                      Layout{"pp2_dp2",
                             "--parallel.pp=2 --pp.schedule=1f1b --train.micro_batch=2 "
                             "--train.grad_accum=2",
                             true},
                      Layout{"ep2_moe",
                             "--model.moe_experts=4 --model.moe_top_k=2 --parallel.ep=2 "
                             "--moe.capacity_factor=0 --train.micro_batch=2",
                             true},
                      Layout{"cp2_llama",
                             "--model.arch=llama --model.n_kv_head=2 --model.ffn=88 "
                             "--parallel.cp=2 --train.micro_batch=4",
                             true}),
    [](const auto& info) { return std::string(info.param.name); });

// A tp group that has to span the hosts (tp4 on 2 x 2 ranks) trains, with the bandwidth reason
// to keep it inside a node; tp2 groups fit in a host and are not warned about.
TEST_F(TwoHost, ATpGroupAcrossHostsIsWarnedAbout) {
  const LayoutRun tp4 = train(true, "tp4", "--parallel.tp=4 --train.micro_batch=8", 2);
  ASSERT_EQ(tp4.code, 0) << tp4.output;
  EXPECT_TRUE(contains(tp4.output,
                       "[mesh] parallel.tp=4: the tp group of rank 0 spans hosts hosta, hostb (at "
                       "least one node runs only 2 rank(s))"))
      << tp4.output;
  EXPECT_TRUE(contains(tp4.output, "use parallel.tp <= 2")) << tp4.output;
  const LayoutRun tp2 = train(true, "tp2", "--parallel.tp=2 --train.micro_batch=4", 2);
  ASSERT_EQ(tp2.code, 0) << tp2.output;
  EXPECT_FALSE(contains(tp2.output, "spans hosts")) << tp2.output;
}

// Checkpoints every 2 steps into one shared directory and the last rank killed after step 5: a
// job checkpointed by both hosts (each writing its own ranks' shards) resumes on one host bitwise
// equal to an uninterrupted run, and one checkpointed on one host resumes on two as tp2 x dp2
// within the layout bounds of that uninterrupted run.
TEST_F(TwoHost, CheckpointsResumeAcrossHosts) {
  const std::string dp4 = "--train.micro_batch=2", tp2 = "--parallel.tp=2 --train.micro_batch=4";
  const std::string kill = " --ckpt.every=2 --debug.kill_step=5 --debug.fault_rank=3";
  const LayoutRun whole = train(false, "ck_whole", dp4, 6);
  ASSERT_EQ(whole.code, 0) << whole.output;

  for (const bool written_on_two : {true, false}) {
    const std::string name = written_on_two ? "ck_two" : "ck_one";
    SCOPED_TRACE(name);
    const std::string ckpt = " --ckpt.dir=" + (dir_ / (name + "_ckpt")).string();
    const LayoutRun killed = train(written_on_two, name, dp4, 6, ckpt + kill);
    ASSERT_NE(killed.code, 0) << killed.output;
    ASSERT_TRUE(contains(killed.output, "debug.kill_step=5")) << killed.output;
    const LayoutRun resumed =
        train(!written_on_two, name, written_on_two ? dp4 : tp2, 6, ckpt + " --ckpt.resume=auto");
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    EXPECT_TRUE(contains(resumed.output, "[ckpt] resumed from")) << resumed.output;
    EXPECT_TRUE(contains(resumed.output, "after step 4")) << resumed.output;
    if (written_on_two) {
      EXPECT_TRUE(bitwise_equal(whole, resumed)) << "a two-host checkpoint resumed on one host";
    } else {
      testing::expect_same_weights(whole, resumed, 2e-5, 1.5e-4);
    }
  }
}

// Every process of hostb killed, its MPI daemon included, after step 5 of 12: tetra launch names
// the lost host, its ranks and the newest checkpoint, restarts the job on both hosts from it, and
// the run ends bitwise equal to an uninterrupted one.
TEST_F(TwoHost, ALostHostIsNamedAndTheRestartEndsBitwise) {
  const std::string dp4 = "--train.micro_batch=2";
  const LayoutRun whole = train(false, "lost_whole", dp4, 12);
  ASSERT_EQ(whole.code, 0) << whole.output;

  const std::string id = "TWOHOST_ID=" + std::to_string(::getpid()) + " ";
  const fs::path run = dir_ / "lost";
  // Steps of at least 100 ms (rank 0 waits that long in each), so that the kill lands mid-run.
  // Checkpoints on disk every 4 steps, in memory every step: hostb's memory is lost with it, so
  // its ranks read the step from hosta's copies.
  const std::string args =
      train_args("lost", dp4, 12,
                 "--ckpt.dir=" + (dir_ / "lost_ckpt").string() +
                     " --ckpt.every=4 --ckpt.memory_every=1 --debug.slow_ms=100 "
                     "--debug.fault_rank=0");
  const std::string killer = "( for i in $(seq 1200); do [ $(cat " +
                             (run / "metrics.jsonl").string() +
                             " 2>/dev/null | wc -l) -ge 5 ] && break; sleep 0.05; done; " + id +
                             kTwoHost + " kill hostb ) & ";
  // In a subshell, so that run_command's 2>&1 takes all of it.
  const Ran r =
      run_command("(" + killer + id + "TETRA_HEARTBEAT_DIR=" + (dir_ / "lost_beats").string() +
                  " " + kTwoHost + " on-hosta -- " + TETRA_BINARY +
                  " launch -n 4 --hosts 10.77.0.1:2,10.77.0.2:2 --max-restarts 1 -- " + args +
                  "; status=$?; wait; exit $status)");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "[launch] host 10.77.0.2 lost while the job ran: the connection to its MPI "
                       "daemon ended (killed by signal 9 (Killed)), taking rank(s) 2-3 with it"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "the newest checkpoint is after step ")) << r.output;
  EXPECT_TRUE(contains(r.output, " in " + (dir_ / "lost_ckpt").string())) << r.output;
  EXPECT_TRUE(contains(r.output, "[launch] restart 1/1: host 10.77.0.2 lost;")) << r.output;
  // Resumed from memory, a step the disk does not hold (the kill came after step 5 or later, the
  // disk saves after steps 4 and 8), the shard hostb's ranks read brought from hosta's copy.
  const MemoryRestore m = memory_restore(r.output);
  EXPECT_GE(m.step, 5) << r.output;
  EXPECT_NE(m.step, 8) << r.output;
  EXPECT_GE(m.shards_moved, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "[ckpt] resumed from memory")) << r.output;
  const LayoutRun resumed = testing::read_layout_run(r, run, run / "w.safetensors");
  EXPECT_TRUE(bitwise_equal(whole, resumed)) << "the restart after a lost host";
}

// Elastic restart: hostb lost after step 5 of 24 with --min-ranks 2, and no host to replace it.
// The restart runs on hosta's two ranks as dp 2 with twice the accumulation (the global batch of
// 8 sequences kept), resumes from the step held in hosta's memory (its own shards and the copies
// of hostb's), and draws the batches the whole run drew. Once hostb answers again (--regrow 1),
// the job ends after its next step with a checkpoint and goes on on both hosts as dp 4. It ends
// within the layout bounds of the uninterrupted dp 4 run.
TEST_F(TwoHost, ALostHostWithMinRanksRestartsOnTheRanksLeftAndGrowsBack) {
  const std::string dp4 = "--train.micro_batch=2";
  const LayoutRun whole = train(false, "elastic_whole", dp4, 24);
  ASSERT_EQ(whole.code, 0) << whole.output;

  const std::string id = "TWOHOST_ID=" + std::to_string(::getpid()) + " ";
  const fs::path run = dir_ / "elastic";
  const std::string args =
      train_args("elastic", dp4, 24,
                 "--ckpt.dir=" + (dir_ / "elastic_ckpt").string() +
                     " --ckpt.every=4 --ckpt.memory_every=1 --debug.slow_ms=150 "
                     "--debug.fault_rank=0");
  // hostb down after step 5; back once the run on hosta has taken a step (leaving it 17 or more
  // steps of at least 150 ms to grow back in).
  const std::string metrics = (run / "metrics.jsonl").string();
  const std::string killer = "( for i in $(seq 1200); do [ $(cat " + metrics +
                             " 2>/dev/null | wc -l) -ge 5 ] && break; sleep 0.05; done; " + id +
                             kTwoHost + " kill hostb --down; for i in $(seq 1200); do [ -e " +
                             metrics + ".1 ] && [ $(cat " + metrics +
                             " 2>/dev/null | wc -l) -ge 7 ] && break; sleep 0.05; done; " + id +
                             kTwoHost + " revive hostb ) & ";
  const Ran r =
      run_command("(" + killer + id + "TETRA_HEARTBEAT_DIR=" + (dir_ / "elastic_beats").string() +
                  " " + kTwoHost + " on-hosta -- " + TETRA_BINARY +
                  " launch -n 4 --hosts 10.77.0.1:2,10.77.0.2:2 --max-restarts 1 "
                  "--min-ranks 2 --regrow 1 -- " +
                  args + "; status=$?; wait; exit $status)");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "[launch] 4 -> 2 ranks (host 10.77.0.2 lost, --min-ranks 2): dp 4 -> 2, "
                       "micro_batch 2 kept, grad_accum 1 -> 2; global batch 8 sequences kept"))
      << r.output;
  EXPECT_TRUE(contains(r.output,
                       "[launch] host 10.77.0.2 lost: the restart leaves it out (--hosts "
                       "10.77.0.1:2)"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "[launch] restart 1/1: host 10.77.0.2 lost;")) << r.output;
  // From memory: hosta holds its own ranks' shards and the copies of hostb's, whose memory went
  // with it.
  const MemoryRestore m = memory_restore(r.output);
  EXPECT_GE(m.step, 5) << r.output;
  EXPECT_NE(m.step, 8) << r.output;
  EXPECT_EQ(m.shards_moved, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[ckpt] resumed from memory")) << r.output;
  EXPECT_TRUE(contains(r.output, "[goodput] incident 1: host 10.77.0.2 lost (")) << r.output;
  EXPECT_TRUE(contains(r.output, "; 4 -> 2 ranks: dp 4 -> 2, micro_batch 2 kept")) << r.output;
  // Grown back, without using a restart of --max-restarts.
  EXPECT_TRUE(contains(r.output,
                       "[launch] host(s) 10.77.0.2 answer again: the job ends after its next step "
                       "with a checkpoint, to go on on 4 ranks"))
      << r.output;
  EXPECT_TRUE(contains(r.output,
                       "of 24, as the launcher asked (host(s) 10.77.0.2 answer again: "
                       "growing the job back to 4 ranks)"))
      << r.output;
  EXPECT_TRUE(contains(r.output,
                       "[launch] 2 -> 4 ranks (host(s) 10.77.0.2 back): dp 2 -> 4, micro_batch 2 "
                       "kept, grad_accum 2 -> 1; global batch 8 sequences kept"))
      << r.output;
  EXPECT_TRUE(contains(r.output,
                       "[goodput] incident 2: grown back: host(s) 10.77.0.2 answer "
                       "again"))
      << r.output;
  const LayoutRun resized = testing::read_layout_run(r, run, run / "w.safetensors");
  testing::expect_same_trajectory(whole, resized, 1e-5, 24, 2e-5, 1.5e-4);
}

// The pair set down after step 5 (a network partition): at the step deadline (at least 2 s here,
// not dist.timeout_s' 300) each host's watchdog finds the other out of reach and says so, tetra
// launch reports the partition both ways with the newest checkpoint, and no process of the job is
// left on either host, mpirun's daemons included, with nothing killed from outside.
TEST_F(TwoHost, APartitionIsReportedAtTheStepDeadlineAndNothingStays) {
  const std::string id = "TWOHOST_ID=" + std::to_string(::getpid()) + " ";
  const fs::path run = dir_ / "cut";
  const std::string args =
      train_args("cut", "--train.micro_batch=2", 40,
                 "--ckpt.dir=" + (dir_ / "cut_ckpt").string() +
                     " --ckpt.every=2 --dist.timeout_s=300 --dist.step_timeout_min_s=2 "
                     "--debug.slow_ms=50 --debug.fault_rank=0");
  const std::string cutter =
      "( for i in $(seq 1200); do [ $(cat " + (run / "metrics.jsonl").string() +
      " 2>/dev/null | wc -l) -ge 5 ] && break; sleep 0.05; done; " + id + kTwoHost + " cut ) & ";
  const Ran r = run_command(
      "(" + cutter + id + "TETRA_HEARTBEAT_DIR=" + (dir_ / "cut_beats").string() + " " + kTwoHost +
      " on-hosta -- " + TETRA_BINARY +
      // The launcher's own step bound above the watchdogs' (ten median steps, then a probe that
      // may wait 3 s for the address of a host cut off): both sides report first.
      " launch -n 4 --hosts 10.77.0.1:2,10.77.0.2:2 --heartbeat-min 20 -- " + args +
      "; status=$?; wait; exit $status)");
  EXPECT_NE(r.code, 0) << r.output;
  // 2 s, or ten median steps where a busy machine makes a step longer than 0.2 s.
  EXPECT_TRUE(contains(r.output, "past the step deadline of ")) << r.output;
  EXPECT_TRUE(contains(r.output, "(dist.step_timeout_factor=10 x the median step, ")) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "host hostb cannot be reached from host hosta (world rank(s) 2, 3): "
                       "network unreachable"))
      << r.output;
  EXPECT_TRUE(
      contains(r.output, "[launch] network partition: host hosta could not reach host hostb"))
      << r.output;
  EXPECT_TRUE(
      contains(r.output, "[launch] network partition: host hostb could not reach host hosta"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "the newest checkpoint is after step ")) << r.output;
  EXPECT_FALSE(contains(r.output, "lost while the job ran")) << r.output;
  // Nothing of the job on any host: no rank, no daemon, no link (their command lines name the
  // run directory).
  const Ran left = run_command("pgrep -af -- " + run.string() + " | grep -v pgrep");
  EXPECT_EQ(left.output, "") << left.output;
}

// Rank 3 (on hostb) stops making progress after step 4: the watchdogs on hosta ask it over the
// network and name it, with what it last did, instead of "state unknown"; the host is not taken
// for a partition.
TEST_F(TwoHost, AHungRankOnAnotherHostIsAskedOverTheNetwork) {
  const LayoutRun r = train(true, "hang", "--train.micro_batch=2", 8,
                            "--dist.step_timeout_min_s=2 --debug.hang_step=4 --debug.fault_rank=3");
  EXPECT_EQ(r.code, 75) << r.output;
  EXPECT_TRUE(contains(r.output, "ranks that have not arrived (world): 3\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "world rank 3 (host hostb, asked over the network): reached #"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "on 'dpcp.0'; now outside the communicator (computing?) for "))
      << r.output;
  EXPECT_FALSE(contains(r.output, "cannot be reached")) << r.output;
  EXPECT_FALSE(contains(r.output, "network partition")) << r.output;
}

// Slurm on the two hosts (scripts/twohost.sh slurm: slurmctld, a slurmd per host, PMIx).
class TwoHostSlurm : public TwoHost {
 protected:
  void SetUp() override {
    TwoHost::SetUp();
    if (IsSkipped()) return;
    if (run_command("command -v slurmctld slurmd srun sbatch munged").code != 0) {
      GTEST_SKIP() << "Slurm is not installed (scripts/install-deps.sh installs slurm-wlm, munge)";
    }
  }
  static std::string slurm(const std::string& command) {
    return "TWOHOST_ID=" + std::to_string(::getpid()) + " " + kTwoHost + " slurm -- " + command;
  }
};

// srun -N2 -n4 places ranks 0-1 on hosta and 2-3 on hostb, as mpirun does, and trains the
// one-host run's bits.
TEST_F(TwoHostSlurm, SrunGivesTheOneHostRun) {
  const LayoutRun one = train(false, "srun_one", "--train.micro_batch=2");
  ASSERT_EQ(one.code, 0) << one.output;
  const fs::path run = dir_ / "srun_two";
  const Ran ran =
      run_command(slurm("srun -N2 -n4 " + std::string(TETRA_BINARY) + " " +
                        train_args("srun_two", "--train.micro_batch=2", kTwoHostSteps, "")));
  const LayoutRun two = testing::read_layout_run(ran, run, run / "w.safetensors");
  ASSERT_EQ(two.code, 0) << two.output;
  EXPECT_TRUE(contains(two.output, "[mesh]     2    2    0    0    0    0    2  hostb"))
      << two.output;
  EXPECT_TRUE(bitwise_equal(one, two)) << "srun across hosts changed the bits";
}

// scripts/tetra.sbatch end to end: rank 3 (on hostb) killed after step 5 of 8 in the first
// attempt; the script's second attempt resumes from step 4 and the job ends bitwise equal to an
// uninterrupted run on one host.
TEST_F(TwoHostSlurm, TheSbatchScriptRestartsFromTheNewestCheckpoint) {
  const std::string dp4 = "--train.micro_batch=2";
  const LayoutRun whole = train(false, "sbatch_whole", dp4, 8);
  ASSERT_EQ(whole.code, 0) << whole.output;
  const fs::path job = dir_ / "sbatch_job", out = dir_ / "sbatch.out";
  // The model and data of train_args; the script sets run.dir, ckpt.dir and ckpt.resume.
  const std::string flags =
      "--model.vocab_size=" + std::to_string(kTwoHostVocab) +
      " --model.vocab_multiple=1 --model.n_layer=2 --model.n_head=4 --model.d_model=32 "
      "--model.max_seq=16 --train.seq_len=16 --optim.lr=1e-2 --optim.warmup_steps=1 "
      "--data.shuffle=true --run.peak_gflops=50 --dp.bucket_mb=0.01 --dist.timeout_s=60 "
      "--eval.every=0 --run.progress=never --train.steps=8 --ckpt.every=2 " +
      dp4 + " --data.train=" + (dir_ / "train.bin").string() +
      " --save.final=" + (job / "w.safetensors").string();
  // Every key from the command line: the config file only has to exist.
  std::ofstream(dir_ / "sbatch.toml") << "# every key is given on the command line\n";
  const Ran r =
      run_command("TETRA_JOB_DIR=" + job.string() + " TETRA_BINARY=" + TETRA_BINARY +
                  " TETRA_FIRST_ATTEMPT_ARGS='--debug.kill_step=5 --debug.fault_rank=3' " +
                  slurm("sbatch --wait --output=" + out.string() + " " + TETRA_SOURCE_DIR +
                        "/scripts/tetra.sbatch " + (dir_ / "sbatch.toml").string() + " " + flags));
  std::ifstream in(out);
  const std::string log((std::istreambuf_iterator<char>(in)), {});
  ASSERT_EQ(r.code, 0) << r.output << log;
  EXPECT_TRUE(contains(log, "[sbatch] job ")) << log;
  EXPECT_TRUE(contains(log, "4 ranks on hosta,hostb")) << log;
  EXPECT_TRUE(contains(log, "[train] debug.kill_step=5: rank 3 dies by SIGKILL")) << log;
  EXPECT_TRUE(contains(log, "[sbatch] attempt 1 of 4 failed")) << log;
  EXPECT_TRUE(contains(log, "[ckpt] resumed from " + (job / "ckpt").string())) << log;
  EXPECT_TRUE(contains(log, "after step 4")) << log;
  const LayoutRun resumed = testing::read_layout_run(r, job / "run", job / "w.safetensors");
  EXPECT_TRUE(bitwise_equal(whole, resumed)) << "the sbatch job's restart";
}

// A rank that dies on a host that stays up is not a lost host: mpirun names the rank and tetra
// launch adds no host verdict.
TEST_F(TwoHost, ARankLostIsNotAHostLost) {
  const std::string id = "TWOHOST_ID=" + std::to_string(::getpid()) + " ";
  const Ran r = run_command(id + "TETRA_HEARTBEAT_DIR=" + (dir_ / "rank_beats").string() + " " +
                            kTwoHost + " on-hosta -- " + TETRA_BINARY +
                            " launch -n 4 --hosts 10.77.0.1:2,10.77.0.2:2 -- " +
                            train_args("rank_lost", "--train.micro_batch=2", 6,
                                       "--debug.kill_step=3 --debug.fault_rank=3"));
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "process rank 3")) << r.output;
  EXPECT_FALSE(contains(r.output, "lost while the job ran")) << r.output;
}

}  // namespace
}  // namespace tetra
