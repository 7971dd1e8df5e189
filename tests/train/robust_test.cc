// `tetra train` when things go wrong: one failing rank ends the whole job quickly with its own
// message; a non-finite gradient is skipped (or stops the run) and never reaches the weights;
// bad weights, unwritable or misnamed outputs and a full disk are refused clearly, and a previous
// run in the same directory is kept.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "data/token_shard.h"
#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using testing::Ran;
using testing::run_command;
using testing::tetra_command;

class Robust : public testing::RunDirTest {
 protected:
  // A tiny model; `run` names the run directory.
  std::string args(const std::string& run, const std::string& extra = "") const {
    return "train --model.vocab_size=64 --model.n_layer=2 --model.n_head=2 --model.d_model=32 "
           "--model.max_seq=16 --train.seq_len=16 --train.micro_batch=2 --train.steps=6 "
           "--optim.lr=1e-2 --run.threads=1 --run.peak_gflops=50 --dist.timeout_s=60 "
           "--data.train=" +
           path("train.bin") + " --run.dir=" + path(run) + " " + extra;
  }
};

// The first line starting with "error:" in the output.
std::string first_error(const std::string& output) {
  size_t at = output.rfind("error:", 0) == 0 ? 0 : output.find("\nerror:");
  if (at == std::string::npos) return "";
  if (output[at] == '\n') ++at;
  return output.substr(at, output.find('\n', at) - at);
}

TEST_F(Robust, ARankFailingAtStartupEndsTheJobWithItsMessage) {
  for (int ranks : {2, 4}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    // Rank 1 alone is given a data file that does not exist (an MPMD launch).
    const std::string good = std::string(TETRA_BINARY) + " " + args("start");
    const std::string bad = good + " --data.train=" + path("missing.bin");
    std::string cmd = std::string(TETRA_MPIEXEC) +
                      " --oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader "
                      "-np 1 " +
                      good + " : -np 1 " + bad;
    if (ranks > 2) cmd += " : -np " + std::to_string(ranks - 2) + " " + good;
    const Ran r = run_command(cmd);
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_LT(r.seconds, 10.0) << r.output;
    const std::string first = first_error(r.output);
    EXPECT_NE(first.find("error: [rank 1] [data]"), std::string::npos) << r.output;
    EXPECT_NE(first.find("missing.bin"), std::string::npos) << r.output;
  }
}

TEST_F(Robust, ARankFailingMidStepEndsTheJobWithItsMessage) {
  for (int ranks : {2, 4}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    const Ran r = run_command(tetra_command(
        ranks, args("mid", "--train.micro_batch=1 --debug.fail_step=3 --debug.fail_rank=1")));
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_LT(r.seconds, 10.0) << r.output;
    EXPECT_NE(first_error(r.output).find("error: [rank 1] [train] debug.fail_step"),
              std::string::npos)
        << r.output;
    EXPECT_EQ(metrics("mid").size(), 2u);  // steps 1 and 2 completed and were recorded
  }
}

TEST_F(Robust, ANonFiniteGradientIsSkippedNamedAndNeverReachesTheWeights) {
  // Rank 1 poisons its gradient at step 3; the reduction spreads it, every rank skips.
  const Ran nan = run_command(tetra_command(
      2, args("nan", "--train.micro_batch=1 --debug.nan_grad_step=3 --debug.nan_grad_rank=1")));
  ASSERT_EQ(nan.code, 0) << nan.output;
  EXPECT_NE(nan.output.find("step 3: loss"), std::string::npos) << nan.output;
  EXPECT_NE(nan.output.find("first non-finite gradient: transformer.h.1.mlp.c_proj.weight"),
            std::string::npos)
      << nan.output;
  EXPECT_NE(nan.output.find("update skipped (1 in a row, train.max_skipped=5)"), std::string::npos)
      << nan.output;
  const auto m = metrics("nan");
  ASSERT_EQ(m.size(), 6u);
  for (size_t i = 0; i < m.size(); ++i) EXPECT_EQ(m[i]["skipped"], i < 2 ? 0 : 1) << i;
  // The remaining losses are those of a run that skips step 3's update without any NaN ...
  const Ran skip =
      run_command(tetra_command(2, args("skip", "--train.micro_batch=1 --debug.skip_step=3")));
  ASSERT_EQ(skip.code, 0) << skip.output;
  EXPECT_EQ(losses(m), losses(metrics("skip")));
  // ... and not those of a run that updates at step 3.
  const Ran plain = run_command(tetra_command(2, args("plain", "--train.micro_batch=1")));
  ASSERT_EQ(plain.code, 0) << plain.output;
  const auto p = losses(metrics("plain")), n = losses(m);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(p[i], n[i]) << i;
  EXPECT_NE(p[3], n[3]);
}

TEST_F(Robust, NonFiniteGradientsStopTheRunWhenAsked) {
  const Ran stop =
      run_command(tetra_command(1, args("stop",
                                        "--debug.nan_grad_step=2 --train.on_nonfinite=stop "
                                        "--save.final=" +
                                            path("stop.safetensors"))));
  EXPECT_EQ(stop.code, 2) << stop.output;
  EXPECT_NE(stop.output.find("step 2: loss"), std::string::npos) << stop.output;
  EXPECT_NE(stop.output.find("train.on_nonfinite=stop"), std::string::npos) << stop.output;
  EXPECT_FALSE(fs::exists(path("stop.safetensors")));
  const Ran max =
      run_command(tetra_command(1, args("max", "--debug.nan_grad_step=4 --train.max_skipped=1")));
  EXPECT_EQ(max.code, 2) << max.output;
  EXPECT_NE(max.output.find("1 skipped updates in a row (train.max_skipped=1): stopping. The "
                            "weights stay those of step 3"),
            std::string::npos)
      << max.output;
}

TEST_F(Robust, WeightsWithANaNAreRefusedByTensorAndElement) {
  const Ran good = run_command(
      tetra_command(1, args("good", "--train.steps=1 --save.final=" + path("w.safetensors"))));
  ASSERT_EQ(good.code, 0) << good.output;
  SafeTensorsFile f = read_safetensors(path("w.safetensors"));
  SafeTensor& t = f.tensors.at("transformer.h.0.mlp.c_fc.weight");
  std::vector<float> v = t.to_f32();
  v[17] = std::numeric_limits<float>::quiet_NaN();
  t = safetensor_f32(t.shape, v.data());
  write_safetensors(path("nan.safetensors"), f);
  const Ran r =
      run_command(tetra_command(1, args("load", "--init.from=" + path("nan.safetensors"))));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("tensor 'transformer.h.0.mlp.c_fc.weight' holds nan at element 17"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("[train] step"), std::string::npos) << r.output;
}

TEST_F(Robust, OutputPathsAreCheckedBeforeStepOne) {
  std::ofstream(path("a_file")) << "x";
  const Ran file = run_command(tetra_command(1, args("a_file")));
  EXPECT_EQ(file.code, 2) << file.output;
  EXPECT_NE(file.output.find("run.dir=" + path("a_file") + ": cannot create the directory"),
            std::string::npos)
      << file.output;
  fs::create_directories(path("weights_dir"));
  const Ran dir = run_command(tetra_command(1, args("d", "--save.final=" + path("weights_dir"))));
  EXPECT_EQ(dir.code, 2) << dir.output;
  EXPECT_NE(dir.output.find("is a directory; give a file path"), std::string::npos) << dir.output;
  for (const Ran& r : {file, dir}) EXPECT_EQ(r.output.find("[train] step"), std::string::npos);
  // A save.final in a directory that does not exist yet is created.
  const Ran nested = run_command(tetra_command(
      1, args("n", "--train.steps=1 --save.final=" + path("n/deeper/w.safetensors"))));
  EXPECT_EQ(nested.code, 0) << nested.output;
  EXPECT_TRUE(fs::exists(path("n/deeper/w.safetensors")));
}

TEST_F(Robust, AFullDiskStopsTheRunWithThePathAndTheReason) {
  // An 8 KiB file-size limit, with SIGXFSZ ignored so that write() reports EFBIG.
  const Ran r = run_command("bash -c \"ulimit -f 8; trap '' XFSZ; exec " +
                            tetra_command(1, args("full", "--train.steps=200")) + "\"");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(path("full") + "/metrics.jsonl: write failed (File too large)"),
            std::string::npos)
      << r.output;
  EXPECT_LT(metrics("full").size(), 200u);
}

TEST_F(Robust, ARerunKeepsThePreviousRunsConfigBesideItsMetrics) {
  ASSERT_EQ(run_command(tetra_command(1, args("again", "--optim.lr=1e-2"))).code, 0);
  ASSERT_EQ(run_command(tetra_command(1, args("again", "--optim.lr=2e-2"))).code, 0);
  auto read = [&](const std::string& name) {
    std::ifstream in(dir_ / "again" / name);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_NE(read("config.toml").find("lr = 0.02"), std::string::npos) << read("config.toml");
  EXPECT_NE(read("config.toml.1").find("lr = 0.01"), std::string::npos) << read("config.toml.1");
  EXPECT_TRUE(fs::exists(dir_ / "again" / "metrics.jsonl.1"));
  EXPECT_EQ(metrics("again").size(), 6u);
}

TEST_F(Robust, AStepLargerThanTheDataWarns) {
  std::vector<uint32_t> few(100, 3);
  write_token_shard(path("few.bin"), few);  // 6 samples of 16 tokens
  const Ran r =
      run_command(tetra_command(1, args("few", "--data.train=" + path("few.bin") +
                                                   " --train.micro_batch=8 --train.steps=1")));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("a step takes 8 sequences"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("every step repeats samples"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace tetra
