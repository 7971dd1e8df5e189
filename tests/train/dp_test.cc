// Serial ≡ parallel for data parallelism: with a fixed global batch, dp = 1, 2, 4 (and gradient
// accumulation 1 vs 4) give the same loss on every step and the same final weights; the same
// layout run twice is bit-identical. Ranks are real processes under mpirun.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "data/token_shard.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;

struct Result {
  int code = 0;
  std::string output;
  std::vector<double> loss, grad_norm;
  SafeTensorsFile weights;
};

class DataParallel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // One directory per process: CTest runs these cases as parallel processes.
    dir_ = fs::temp_directory_path() / ("tetra_dp_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::vector<uint32_t> tokens(20000);
    uint32_t x = 1;
    for (auto& t : tokens) t = (x = x * 1103515245u + 12345u) >> 16 & 63;
    write_token_shard((dir_ / "train.bin").string(), tokens);
  }

  // Global batch 8 sequences per step, whatever the layout.
  static Result train(int ranks, int micro_batch, int accum, const std::string& name,
                      const std::string& extra = "") {
    fs::path run = dir_ / name;
    std::string args =
        "train --model.vocab_size=64 --model.n_layer=2 --model.n_head=2 --model.d_model=32 "
        "--model.max_seq=16 --train.seq_len=16 --train.steps=5 --optim.lr=1e-2 "
        "--optim.warmup_steps=1 --run.threads=1 --dp.bucket_mb=0.01 --dist.timeout_s=60 "
        "--train.micro_batch=" +
        std::to_string(micro_batch) + " --train.grad_accum=" + std::to_string(accum) +
        " --data.train=" + (dir_ / "train.bin").string() + " --run.dir=" + run.string() +
        " --save.final=" + (run / "w.safetensors").string() + " " + extra;
    std::string cmd = ranks == 1 ? std::string(TETRA_BINARY) + " " + args
                                 : std::string(TETRA_MPIEXEC) +
                                       " --oversubscribe --allow-run-as-root --bind-to none "
                                       "--mca btl self,vader -np " +
                                       std::to_string(ranks) + " " + TETRA_BINARY + " " + args;
    Result r;
    FILE* p = popen((cmd + " 2>&1").c_str(), "r");
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof buf, p)) r.output.append(buf, n);
    int status = pclose(p);
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (r.code != 0) return r;
    std::ifstream in(run / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      r.loss.push_back(j["loss"]);
      r.grad_norm.push_back(j["grad_norm"]);
    }
    r.weights = read_safetensors((run / "w.safetensors").string());
    return r;
  }

  static void expect_same_trajectory(const Result& a, const Result& b, double tol) {
    ASSERT_EQ(a.loss.size(), 5u);
    ASSERT_EQ(a.loss.size(), b.loss.size());
    for (size_t i = 0; i < a.loss.size(); ++i) {
      EXPECT_NEAR(b.loss[i], a.loss[i], tol * a.loss[i]) << "step " << i + 1;
      EXPECT_NEAR(b.grad_norm[i], a.grad_norm[i], 1e-4 * a.grad_norm[i]) << "step " << i + 1;
    }
    // Per tensor, ||a - b|| / ||a||: Adam turns float noise in gradients that are zero in exact
    // arithmetic (the key bias: softmax ignores a shift shared by all keys) into lr-sized steps
    // of arbitrary sign, so an elementwise maximum would measure noise, not the layout.
    // The key third of c_attn.bias is therefore compared on its own: it must stay at noise level.
    double worst = 0;
    for (const auto& [name, t] : a.weights.tensors) {
      auto x = t.to_f32(), y = b.weights.tensors.at(name).to_f32();
      if (name.ends_with("attn.c_attn.bias")) {
        const size_t C = x.size() / 3;
        for (size_t i = C; i < 2 * C; ++i) {
          EXPECT_LT(std::abs(x[i]), 1e-3) << name << " key bias " << i - C;
          EXPECT_LT(std::abs(y[i]), 1e-3) << name << " key bias " << i - C;
          x[i] = y[i] = 0.0f;
        }
      }
      double diff = 0, ref = 1e-30;
      for (size_t i = 0; i < x.size(); ++i) {
        diff += double(x[i] - y[i]) * (x[i] - y[i]);
        ref += double(x[i]) * x[i];
      }
      double rel = std::sqrt(diff / ref);
      worst = std::max(worst, rel);
      EXPECT_LT(rel, tol) << name;
    }
    ::testing::Test::RecordProperty("max_weight_rel_error", std::to_string(worst));
  }

  static fs::path dir_;
};
fs::path DataParallel::dir_;

TEST_F(DataParallel, EveryLayoutReproducesTheSingleRankTrajectory) {
  Result serial = train(1, 8, 1, "dp1");
  ASSERT_EQ(serial.code, 0) << serial.output;
  Result accum = train(1, 2, 4, "dp1_accum4");
  ASSERT_EQ(accum.code, 0) << accum.output;
  expect_same_trajectory(serial, accum, 1e-5);
  Result dp2 = train(2, 4, 1, "dp2");
  ASSERT_EQ(dp2.code, 0) << dp2.output;
  expect_same_trajectory(serial, dp2, 1e-5);
  Result dp4 = train(4, 1, 2, "dp4_accum2");
  ASSERT_EQ(dp4.code, 0) << dp4.output;
  expect_same_trajectory(serial, dp4, 1e-5);
}

TEST_F(DataParallel, SameLayoutTwiceIsBitIdentical) {
  for (bool overlap : {true, false}) {
    std::string flag = overlap ? "--dp.overlap=true" : "--dp.overlap=false";
    Result a = train(2, 4, 1, "twice_a", flag), b = train(2, 4, 1, "twice_b", flag);
    ASSERT_EQ(a.code, 0) << a.output;
    ASSERT_EQ(b.code, 0) << b.output;
    EXPECT_EQ(a.loss, b.loss);
    for (const auto& [name, t] : a.weights.tensors) {
      EXPECT_EQ(t.bytes, b.weights.tensors.at(name).bytes) << name;
    }
  }
}

TEST_F(DataParallel, InconsistentLayoutIsRefused) {
  Result r = train(2, 4, 1, "bad", "--parallel.dp=4");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("parallel.dp"), std::string::npos) << r.output;
  Result tp = train(2, 4, 1, "bad_tp", "--parallel.tp=2 --parallel.dp=1");
  EXPECT_NE(tp.code, 0);
  EXPECT_NE(tp.output.find("data parallelism only"), std::string::npos) << tp.output;
}

}  // namespace
}  // namespace tetra
