// Running the tetra binary (alone or under mpirun) from the train tests.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/token_shard.h"
#include "tests/test_util.h"

namespace tetra::testing {

/** Expects the command run as `ran` refused with the CLI's error exit code (2) and `text` in its
 *  output. */
#define EXPECT_REFUSED(ran, text)                                                            \
  do {                                                                                       \
    const auto& r_ = (ran);                                                                  \
    EXPECT_EQ(r_.code, 2) << r_.output;                                                      \
    EXPECT_NE(r_.output.find(text), std::string::npos) << "missing '" << (text) << "' in:\n" \
                                                       << r_.output;                         \
  } while (0)

/** `args` of a `tetra train` run as the floor measurement asks (docs/testing.md,
 *  scripts/measure-floors.sh): TETRA_TEST_SEED adds --train.seed, TETRA_TEST_THREADS replaces
 *  --run.threads=1. Unset, as in every ctest run, `args` is returned as given. */
inline std::string with_measurement_knobs(std::string args) {
  if (args.rfind("train ", 0) != 0) return args;
  if (const char* seed = std::getenv("TETRA_TEST_SEED"); seed && *seed)
    args += std::string(" --train.seed=") + seed;
  if (const char* threads = std::getenv("TETRA_TEST_THREADS"); threads && *threads) {
    const std::string one = "--run.threads=1 ";
    if (const size_t at = (args + " ").find(one); at != std::string::npos)
      args.replace(at, one.size() - 1, std::string("--run.threads=") + threads);
  }
  return args;
}

/** `tetra <args>` on one process, or under mpirun on `ranks` ranks. */
inline std::string tetra_command(int ranks, const std::string& args_given) {
  const std::string args = with_measurement_knobs(args_given);
  if (ranks <= 1) return std::string(TETRA_BINARY) + " " + args;
  return std::string(TETRA_MPIEXEC) +
         " --oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader -np " +
         std::to_string(ranks) + " " + TETRA_BINARY + " " + args;
}

/** True when `s` holds `what`. */
inline bool contains(const std::string& s, const std::string& what) {
  return s.find(what) != std::string::npos;
}

/** A test's own directory (removed afterwards) holding a small token shard, train.bin, and the
 * run directories of the tiny models the test trains. */
class RunDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("tetra_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    std::vector<uint32_t> tokens(8192);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint32_t((i * 7 + i / 5) % 61);
    write_token_shard(path("train.bin"), tokens);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  /** `tetra train` arguments for a tiny model trained `steps` steps on train.bin in run
   *  directory `run`, then `extra`. */
  std::string tiny_train_args(const std::string& run, int steps,
                              const std::string& extra = "") const {
    return "train --model.vocab_size=64 --model.n_layer=2 --model.n_head=2 --model.d_model=32 "
           "--model.max_seq=16 --train.seq_len=16 --train.micro_batch=2 --optim.lr=1e-2 "
           "--run.threads=1 --run.peak_gflops=50 --dist.timeout_s=60 --train.steps=" +
           std::to_string(steps) + " --data.train=" + path("train.bin") +
           " --run.dir=" + path(run) + " " + extra;
  }
  /** Every record of run directory `run`'s metrics.jsonl. */
  std::vector<nlohmann::json> metrics(const std::string& run) const {
    std::vector<nlohmann::json> out;
    std::ifstream in(dir_ / run / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  }
  static std::vector<double> losses(const std::vector<nlohmann::json>& m) {
    std::vector<double> out;
    for (const auto& j : m) out.push_back(j["loss"]);
    return out;
  }

  std::filesystem::path dir_;
};

}  // namespace tetra::testing
