// Checkpoints, resume and the trainer's own refusals under hostile use, end to end through the
// tetra binary (issue 21): stray names in ckpt.dir are noted and never fatal; a second job on a
// ckpt.dir or run.dir in use is refused naming the first; a fresh run does not mix with another
// run's checkpoints; `tetra ckpt` never overwrites its input or an existing file; resume refuses
// another model shape, other data or a step past the run, and passes over a checkpoint whose
// counters do not add up; a failed last save fails the run; ckpt.every=auto stays bounded; a
// single process refuses a layout it cannot run.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/checkpoint.h"
#include "core/dir_lock.h"
#include "data/token_shard.h"
#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using testing::contains;
using testing::Ran;
using testing::run_command;
using testing::tetra_command;

class CkptRobust : public testing::RunDirTest {
 protected:
  Ran tetra(const std::string& a) const { return run_command(tetra_command(1, a)); }
  std::string read(const fs::path& p) const {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  // Edits checkpoint `step`'s manifest under ckpt directory `ckpt`.
  void edit_manifest(const std::string& ckpt, int64_t step,
                     const std::function<void(nlohmann::json&)>& edit) const {
    const fs::path p = dir_ / ckpt / ckpt::checkpoint_name(step) / "manifest.json";
    nlohmann::json j = nlohmann::json::parse(read(p));
    edit(j);
    std::ofstream(p) << j.dump(1);
  }
};

TEST_F(CkptRobust, StrayNamesInCkptDirAreNotedAndNeverFatal) {
  const std::string ckpt =
      "--ckpt.every=2 --ckpt.async=false --ckpt.keep=2 --ckpt.dir=" + path("ckpt") + " ";
  for (const char* d : {"step-99999999999999999999", "step-abc", "step-1.tmp-x",
                        "step-000000001.tmp-", "step-0000000004"}) {
    fs::create_directories(dir_ / "ckpt" / d);
  }
  std::ofstream(dir_ / "ckpt" / "step-000000003") << "a file named like a step";
  // A fresh run beside them: saves, prunes and publishes, leaving every stray name alone.
  Ran r = tetra(tiny_train_args("run", 4, ckpt));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[ckpt] ignored " + path("ckpt/step-99999999999999999999") +
                                     ": not a checkpoint name"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "[ckpt] ignored " + path("ckpt/step-000000003") +
                                     ": named like a checkpoint but not a directory"))
      << r.output;
  for (const char* d : {"step-99999999999999999999", "step-abc", "step-1.tmp-x",
                        "step-000000001.tmp-", "step-0000000004", "step-000000003"}) {
    EXPECT_TRUE(fs::exists(dir_ / "ckpt" / d)) << d;
  }
  // Resume, and every tetra ckpt verb, find the newest real checkpoint.
  r = tetra(tiny_train_args("run", 6, ckpt + "--ckpt.resume=auto"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from " + path("ckpt/" + ckpt::checkpoint_name(4))))
      << r.output;
  for (const char* verb : {"inspect", "verify"}) {
    r = run_command(std::string(TETRA_BINARY) + " ckpt " + verb + " " + path("ckpt"));
    EXPECT_EQ(r.code, 0) << verb << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, ckpt::checkpoint_name(6))) << verb << "\n" << r.output;
    EXPECT_FALSE(contains(r.output, "unexpected")) << verb << "\n" << r.output;
  }
  r = run_command(std::string(TETRA_BINARY) + " ckpt export " + path("ckpt") + " --to " +
                  path("w.safetensors"));
  EXPECT_EQ(r.code, 0) << r.output;
}

TEST_F(CkptRobust, ASecondJobOnADirectoryInUseIsRefusedNamingTheFirst) {
  // The first job stops making progress after step 1 and keeps its directories.
  const std::string first = tetra_command(
      1, tiny_train_args(
             "run", 4, "--ckpt.dir=" + path("ckpt") + " --debug.hang_step=1 --debug.fault_rank=0"));
  ASSERT_EQ(std::system(("(" + first + " > " + path("first.log") + " 2>&1 & echo $! > " +
                         path("first.pid") + ")")
                            .c_str()),
            0);
  const fs::path lock = DirLock::file_of(dir_ / "ckpt");
  for (int i = 0; i < 600 && !contains(read(path("first.log")), "stops making progress"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(contains(read(path("first.log")), "stops making progress"))
      << read(path("first.log"));
  const pid_t pid = pid_t(std::stol(read(path("first.pid"))));
  EXPECT_TRUE(contains(read(lock), "pid " + std::to_string(pid) + " (ckpt.dir=")) << read(lock);
  // The same ckpt.dir from another run directory, and the same run.dir with its own ckpt.dir.
  EXPECT_REFUSED(tetra(tiny_train_args("other", 4, "--ckpt.dir=" + path("ckpt"))),
                 "[train] ckpt.dir=" + path("ckpt") + ": " + path("ckpt") + " is in use by ");
  EXPECT_REFUSED(tetra(tiny_train_args("run", 4, "--ckpt.dir=" + path("ckpt2"))),
                 "[train] run.dir=" + path("run") + ": " + path("run") + " is in use by ");
  const Ran second = tetra(tiny_train_args("other", 4, "--ckpt.dir=" + path("ckpt")));
  EXPECT_TRUE(contains(second.output, "pid " + std::to_string(pid))) << second.output;
  // The refused jobs wrote nothing: no metrics of their own, no checkpoint.
  EXPECT_FALSE(fs::exists(dir_ / "other" / "metrics.jsonl"));
  EXPECT_TRUE(ckpt::list_checkpoints(dir_ / "ckpt").empty());
  ::kill(pid, SIGKILL);
  for (int i = 0; i < 100 && ::kill(pid, 0) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // Once it is gone the directory is free: a later job continues in it.
  const Ran after =
      tetra(tiny_train_args("run", 2, "--ckpt.dir=" + path("ckpt") + " --ckpt.resume=auto"));
  EXPECT_EQ(after.code, 0) << after.output;
}

TEST_F(CkptRobust, AFreshRunDoesNotMixWithAnotherRunsCheckpoints) {
  const std::string ckpt = "--ckpt.every=2 --ckpt.dir=" + path("ckpt") + " ";
  ASSERT_EQ(tetra(tiny_train_args("a", 4, ckpt)).code, 0);
  const std::string before = read(dir_ / "ckpt" / ckpt::checkpoint_name(4) / "manifest.json");
  EXPECT_REFUSED(tetra(tiny_train_args("b", 4, ckpt)),
                 "[ckpt] ckpt.dir=" + path("ckpt") +
                     " already holds checkpoints of another run "
                     "(newest " +
                     ckpt::checkpoint_name(4) + "), and this run starts from step 0");
  // Nor a resume from elsewhere into it.
  ASSERT_EQ(tetra(tiny_train_args("c", 2, "--ckpt.dir=" + path("ckpt-c"))).code, 0);
  EXPECT_REFUSED(tetra(tiny_train_args("d", 4, ckpt + "--ckpt.resume=" + path("ckpt-c"))),
                 "and this run resumes from " + path("ckpt-c/" + ckpt::checkpoint_name(2)));
  // Nor saves inside a checkpoint taken for a ckpt.dir.
  EXPECT_REFUSED(
      tetra(tiny_train_args(
          "e", 6, "--ckpt.resume=auto --ckpt.dir=" + path("ckpt/" + ckpt::checkpoint_name(4)))),
      "is itself a checkpoint (it holds manifest.json), so saves would land inside it; "
      "set ckpt.dir to the directory that holds the checkpoints (" +
          path("ckpt") + ")");
  // Nor going back to an earlier checkpoint of it by name: the later ones would be replaced by
  // another history.
  EXPECT_REFUSED(tetra(tiny_train_args(
                     "a", 6, ckpt + "--ckpt.resume=" + path("ckpt/" + ckpt::checkpoint_name(2)))),
                 "[ckpt] ckpt.resume=" + path("ckpt/" + ckpt::checkpoint_name(2)) + ": ckpt.dir=" +
                     path("ckpt") + " holds later checkpoints of that run (newest " +
                     ckpt::checkpoint_name(4) + ")");
  EXPECT_EQ(read(dir_ / "ckpt" / ckpt::checkpoint_name(4) / "manifest.json"), before);
  EXPECT_EQ(ckpt::list_checkpoints(dir_ / "ckpt").size(), 2u);
  // Continuing it is what the directory is for: with auto, or naming its newest checkpoint.
  Ran r = tetra(tiny_train_args("a", 6, ckpt + "--ckpt.resume=auto"));
  EXPECT_EQ(r.code, 0) << r.output;
  r = tetra(
      tiny_train_args("a", 8, ckpt + "--ckpt.resume=" + path("ckpt/" + ckpt::checkpoint_name(6))));
  EXPECT_EQ(r.code, 0) << r.output;
}

TEST_F(CkptRobust, ResumeRefusesAnotherModelShapeOtherDataOrAStepPastTheRun) {
  const std::string ckpt = "--ckpt.every=2 --ckpt.dir=" + path("ckpt") + " ";
  ASSERT_EQ(tetra(tiny_train_args("run", 4, ckpt)).code, 0);
  const std::string resume = ckpt + "--ckpt.resume=auto ";
  // n_head changes no tensor's shape: only the saved shape tells.
  EXPECT_REFUSED(tetra(tiny_train_args("run", 6, resume + "--model.n_head=1")),
                 "was saved from another model shape: model.n_head=2 (this run: 1); the model.* "
                 "keys must match the run that saved it (--model.n_head=2)");
  EXPECT_REFUSED(tetra(tiny_train_args("run", 6, resume + "--model.max_seq=32")),
                 "model.max_seq=16 (this run: 32)");
  // Other data: another sample count, another order.
  std::vector<uint32_t> tokens(4096, 7);
  write_token_shard(path("other.bin"), tokens);
  EXPECT_REFUSED(tetra(tiny_train_args("run", 6, resume + "--data.train=" + path("other.bin"))),
                 "was saved over 511 training samples but data.train has 255");
  EXPECT_REFUSED(tetra(tiny_train_args("run", 6, resume + "--data.shuffle=true")),
                 "was saved with data.shuffle=false and train.seed=1337, this run has "
                 "data.shuffle=true and train.seed=1337");
  // A checkpoint past the run's end.
  EXPECT_REFUSED(tetra(tiny_train_args("run", 3, resume)),
                 "is after step 4, past this run's train.steps=3; raise train.steps to at least 4");
  // A checkpoint at the run's end: nothing is left to train, and the summary says so rather than
  // a loss and a rate of steps that did not run.
  const Ran at_end = tetra(tiny_train_args("run", 4, resume));
  EXPECT_EQ(at_end.code, 0) << at_end.output;
  EXPECT_NE(at_end.output.find("[train] done: the checkpoint resumed from is after step 4 = "
                               "train.steps, so no step was left to train"),
            std::string::npos)
      << at_end.output;
  EXPECT_EQ(at_end.output.find("final loss"), std::string::npos) << at_end.output;
  // None of these wrote anything: the checkpoints are as they were.
  const auto all = ckpt::list_checkpoints(dir_ / "ckpt");
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].filename(), ckpt::checkpoint_name(4));
  // The old form of the record (no model_shape) is checked through the model's description.
  edit_manifest("ckpt", 4, [](nlohmann::json& j) { j.erase("model_shape"); });
  EXPECT_REFUSED(tetra(tiny_train_args("run", 6, resume + "--model.n_head=1")),
                 "model.n_head=2 (this run: 1)");
}

TEST_F(CkptRobust, ACheckpointWhoseCountersDoNotAddUpIsPassedOver) {
  const std::string ckpt = "--ckpt.every=2 --ckpt.keep=0 --ckpt.dir=" + path("ckpt") + " ";
  ASSERT_EQ(tetra(tiny_train_args("run", 6, ckpt)).code, 0);
  struct Edit {
    int64_t step;
    std::function<void(nlohmann::json&)> edit;
    std::string message;
  };
  const std::vector<Edit> edits = {
      {6, [](auto& j) { j["trainer"]["sampler"]["cursor"] = int64_t(1) << 50; },
       "epoch 0 does not match cursor"},
      {4,
       [](auto& j) {
         j["trainer"]["sampler"]["cursor"] = 4000;
         j["trainer"]["sampler"]["epoch"] = 7;
       },
       "the sampler cursor 4000 is not what 4 step(s) of 2 to 2 samples each drew"},
      {2, [](auto& j) { j["trainer"]["step"] = 5; }, "the trainer state is after step 5"},
  };
  for (const Edit& e : edits) edit_manifest("ckpt", e.step, e.edit);
  // Every one is refused with its reason, and then there is nothing left to resume.
  const Ran r = tetra(tiny_train_args("run", 8, ckpt + "--ckpt.resume=auto"));
  EXPECT_EQ(r.code, 2) << r.output;
  for (const Edit& e : edits) EXPECT_TRUE(contains(r.output, e.message)) << e.message << r.output;
  EXPECT_TRUE(contains(r.output, "none of the 3 checkpoint(s)")) << r.output;
  // A step far beyond anything, and counters that do not make it.
  edit_manifest("ckpt", 6, [](auto& j) {
    j["trainer"]["sampler"]["cursor"] = 12;
    j["step"] = j["trainer"]["step"] = 5'000'000'000'000'000'000ull;
  });
  const Ran big = tetra(tiny_train_args(
      "run", 8, ckpt + "--ckpt.resume=" + path("ckpt/" + ckpt::checkpoint_name(6))));
  EXPECT_EQ(big.code, 2) << big.output;
  EXPECT_TRUE(contains(big.output, "'step' is 5000000000000000000, not an integer in [0, "))
      << big.output;
  // A zero where at least one is needed (it used to reach a division: SIGFPE).
  edit_manifest("ckpt", 4, [](auto& j) { j["trainer"]["sampler"]["num_samples"] = 0; });
  const Ran zero = tetra(tiny_train_args(
      "run", 8, ckpt + "--ckpt.resume=" + path("ckpt/" + ckpt::checkpoint_name(4))));
  EXPECT_EQ(zero.code, 2) << zero.output;
  EXPECT_TRUE(contains(zero.output, "'num_samples' is 0, not an integer in [1, ")) << zero.output;
}

TEST_F(CkptRobust, AFailedLastSaveFailsTheRun) {
  // The last step's checkpoint cannot be written (an injected ENOSPC): the run fails, although
  // ckpt.on_error=continue, and says which checkpoint is the newest.
  const Ran r = tetra(
      tiny_train_args("run", 4,
                      "--ckpt.every=2 --ckpt.dir=" + path("ckpt") +
                          " --debug.save_error_step=4 --save.final=" + path("final.safetensors")));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "[ckpt] the run's last checkpoint (step 4) was not saved, so the "
                       "run did not finish"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "No space left on device")) << r.output;
  EXPECT_TRUE(contains(r.output, "The newest published checkpoint is after step 2")) << r.output;
  EXPECT_FALSE(contains(r.output, "[train] done")) << r.output;
  // What could be saved is: save.final, the step's metrics record.
  EXPECT_TRUE(fs::exists(path("final.safetensors")));
  const auto m = metrics("run");
  ASSERT_EQ(m.size(), 4u);
  EXPECT_EQ(m.back()["ckpt_failed_step"], 4);
  // A real limit on file size: the same.
  const Ran limit =
      run_command("ulimit -f 64 && " +
                  tetra_command(1, tiny_train_args("limit", 2, "--ckpt.dir=" + path("lim"))));
  EXPECT_EQ(limit.code, 2) << limit.output;
  EXPECT_TRUE(contains(limit.output, "File too large")) << limit.output;
}

TEST_F(CkptRobust, EveryAutoWithAHugeMtbfSavesOnlyTheLastStep) {
  for (const char* mtbf : {"1e12", "1e300"}) {
    SCOPED_TRACE(mtbf);
    const std::string dir = std::string("ckpt-") + mtbf;
    const Ran r =
        tetra(tiny_train_args(std::string("run-") + mtbf, 5,
                              std::string("--ckpt.every=auto --ckpt.keep=0 --ckpt.mtbf_hours=") +
                                  mtbf + " --ckpt.dir=" + path(dir)));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, "= every 5 step(s)")) << r.output;
    const auto saved = ckpt::list_checkpoints(dir_ / dir);
    ASSERT_EQ(saved.size(), 2u);
    EXPECT_EQ(saved[0].filename(), ckpt::checkpoint_name(5));
    EXPECT_EQ(saved[1].filename(), ckpt::checkpoint_name(1));
  }
}

TEST_F(CkptRobust, ASingleProcessRefusesLayoutsItCannotRun) {
  EXPECT_REFUSED(tetra(tiny_train_args("a", 2, "--parallel.dp=4")),
                 "[train] parallel.dp=4 needs 4 ranks but this is a single process; run it as "
                 "`tetra launch -n 4 -- train ...` (or under mpirun), or set parallel.dp=1");
  EXPECT_REFUSED(tetra(tiny_train_args("a", 2, "--parallel.dp=2 --parallel.tp=2")),
                 "[train] parallel.dp=2 parallel.tp=2 needs 4 ranks but this is a single "
                 "process; run it as `tetra launch -n 4 -- train ...` (or under mpirun), or set "
                 "parallel.dp=1 parallel.tp=1");
  EXPECT_REFUSED(tetra(tiny_train_args("a", 2, "--parallel.ep=2")),
                 "[model] parallel.ep=2 spreads experts, but model.moe_experts=0 makes a dense "
                 "model; set model.moe_experts (e.g. 4) or parallel.ep=1");
  EXPECT_REFUSED(tetra(tiny_train_args("a", 2, "--parallel.ep=2 --model.moe_experts=4")),
                 "[train] parallel.ep=2 needs 2 ranks but this is a single process; run it as "
                 "`tetra launch -n 2 -- train ...` (or under mpirun), or set parallel.ep=1");
  EXPECT_FALSE(fs::exists(dir_ / "a" / "metrics.jsonl"));
  // dp=1 and dp=0 (the world's: one rank) are what a single process runs.
  EXPECT_EQ(tetra(tiny_train_args("b", 1, "--parallel.dp=1")).code, 0);
}

TEST_F(CkptRobust, AnOutputNeverReplacesWhatTheRunReadsOrWrites) {
  ASSERT_EQ(tetra(tiny_train_args("run", 2, "--ckpt.dir=" + path("ckpt"))).code, 0);
  const std::string rank_file =
      (dir_ / "ckpt" / ckpt::checkpoint_name(2) / "rank-00000.safetensors").string();
  const std::string saved = read(rank_file), metrics_file = read(path("run/metrics.jsonl")),
                    data = read(path("train.bin"));
  const std::string resume = "--ckpt.dir=" + path("ckpt") + " --ckpt.resume=auto ";
  EXPECT_REFUSED(tetra(tiny_train_args("run", 4, resume + "--save.final=" + rank_file)),
                 "[train] save.final=" + rank_file + " is inside ckpt.dir=" + path("ckpt") +
                     ", whose checkpoints it would overwrite");
  EXPECT_REFUSED(
      tetra(tiny_train_args("run", 4, resume + "--save.final=" + path("run/metrics.jsonl"))),
      "would replace metrics.jsonl, which this run writes in run.dir=" + path("run"));
  EXPECT_REFUSED(tetra(tiny_train_args("other", 2, "--debug.dump_logits=" + path("train.bin"))),
                 "[train] debug.dump_logits=" + path("train.bin") + " is " + path("train.bin") +
                     ", which this run reads");
  EXPECT_REFUSED(tetra(tiny_train_args("other", 2,
                                       "--save.final=" + path("w.safetensors") +
                                           " --debug.dump_grads=" + path("./w.safetensors"))),
                 "name the same file, so one would replace the other");
  EXPECT_EQ(read(rank_file), saved);
  EXPECT_EQ(read(path("run/metrics.jsonl")), metrics_file);
  EXPECT_EQ(read(path("train.bin")), data);
  EXPECT_FALSE(fs::exists(path("w.safetensors")));
}

TEST_F(CkptRobust, CkptCommandsNeverOverwriteTheirInputOrAnExistingFile) {
  ASSERT_EQ(tetra(tiny_train_args("run", 2, "--ckpt.dir=" + path("ckpt"))).code, 0);
  const fs::path c = dir_ / "ckpt" / ckpt::checkpoint_name(2);
  const std::string rank_file = read(c / "rank-00000.safetensors");
  const std::string bin = std::string(TETRA_BINARY) + " ckpt ";
  // Inside the checkpoint read, or inside the ckpt.dir named.
  EXPECT_REFUSED(run_command(bin + "export " + c.string() + " --to " +
                             (c / "rank-00000.safetensors").string() + " --force"),
                 "which this export reads; write the weights outside it");
  EXPECT_REFUSED(run_command(bin + "export " + path("ckpt") + " --to " + path("ckpt/latest")),
                 "that is inside " + path("ckpt") + ", which this export reads");
  EXPECT_REFUSED(run_command(bin + "export " + path("ckpt") + " --to " +
                             path("ckpt/../ckpt/" + ckpt::checkpoint_name(2) + "/manifest.json")),
                 "which this export reads");
  EXPECT_EQ(read(c / "rank-00000.safetensors"), rank_file);
  // An existing file: only with --force, and only a safetensors file.
  std::ofstream(path("notes.txt")) << "keep me";
  EXPECT_REFUSED(run_command(bin + "export " + c.string() + " --to " + path("notes.txt")),
                 "the file exists; add --force to replace it");
  EXPECT_REFUSED(
      run_command(bin + "export " + c.string() + " --to " + path("notes.txt") + " --force"),
      "it exists and is not a safetensors file, so it is not replaced even with --force");
  EXPECT_EQ(read(path("notes.txt")), "keep me");
  ASSERT_EQ(run_command(bin + "export " + c.string() + " --to " + path("w.safetensors")).code, 0);
  EXPECT_REFUSED(run_command(bin + "export " + c.string() + " --to " + path("w.safetensors")),
                 "the file exists; add --force");
  EXPECT_EQ(
      run_command(bin + "export " + c.string() + " --to " + path("w.safetensors") + " --force")
          .code,
      0);
  EXPECT_REFUSED(run_command(bin + "export " + c.string() + " --to " + path("nodir/w.safetensors")),
                 "the directory " + path("nodir") + " does not exist");
  EXPECT_REFUSED(run_command(bin + "export " + c.string()), "export needs --to FILE.safetensors");
  EXPECT_REFUSED(run_command(bin + "export --to " + path("w2.safetensors") + " " + c.string()),
                 "needs the checkpoint right after the verb (tetra ckpt export CHECKPOINT --to "
                 "FILE.safetensors)");
  // A flag a verb does not take is refused, not ignored.
  EXPECT_REFUSED(run_command(bin + "inspect " + c.string() + " --to " + path("x")),
                 "[ckpt] tetra ckpt inspect takes no --to: only export writes a file");
  EXPECT_REFUSED(run_command(bin + "verify " + c.string() + " --force"),
                 "[ckpt] tetra ckpt verify takes no --force");
  EXPECT_FALSE(fs::exists(path("x")));
  // A checkpoint's manifest.json names the checkpoint; another file is called what it is.
  const Ran m = run_command(bin + "inspect " + (c / "manifest.json").string());
  EXPECT_EQ(m.code, 0) << m.output;
  EXPECT_TRUE(contains(m.output, "checkpoint " + c.string())) << m.output;
  EXPECT_REFUSED(run_command(bin + "verify " + (c / "rank-00000.safetensors").string()),
                 "is a file, not a checkpoint; give a checkpoint directory");
  EXPECT_REFUSED(run_command(bin + "inspect " + path("nowhere")), "does not exist");
  // And ckpt.resume takes the manifest's path too.
  const Ran r =
      tetra(tiny_train_args("run2", 4, "--ckpt.resume=" + (c / "manifest.json").string()));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from " + c.string())) << r.output;
}

TEST_F(CkptRobust, VerifyResumeEmptiesOnlyADirectoryOfItsOwn) {
  fs::create_directories(dir_ / "mine");
  std::ofstream(dir_ / "mine" / "thesis.tex") << "precious";
  const Ran r = run_command(std::string(TETRA_BINARY) + " verify-resume --steps 3 --dir " +
                            path("mine") + " --data.train=" + path("train.bin"));
  EXPECT_REFUSED(r, "holds files verify-resume did not write, and it is emptied first");
  EXPECT_EQ(read(dir_ / "mine" / "thesis.tex"), "precious");
}

}  // namespace
}  // namespace tetra
