// Serial ≡ parallel for data parallelism and ZeRO: with a fixed global batch, dp = 1, 2, 4 (with
// gradient accumulation) and every ZeRO stage give the loss of the single-rank run at every step
// and its final weights; the same layout run twice is bit-identical; the bytes each rank sends
// per step are exactly the seeds' volumes. Ranks are real processes under mpirun.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "data/token_shard.h"
#include "kernels/cpu/matmul.h"
#include "tests/train/layout_run.h"
#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using testing::run_command;
using testing::tetra_command;

using Result = testing::LayoutRun;

// A vocabulary of 333 with no padding (vocab_multiple 1): wte's rows divide by no rank count.
constexpr int kDpVocab = 333;
constexpr int kDpSteps = 5;

class DataParallel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // One directory per process: CTest runs these cases as parallel processes.
    dir_ = fs::temp_directory_path() / ("tetra_dp_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::vector<uint32_t> tokens(20000);
    uint32_t x = 1;
    for (auto& t : tokens) t = ((x = x * 1103515245u + 12345u) >> 16) % kDpVocab;
    write_token_shard((dir_ / "train.bin").string(), tokens);
  }

  // Global batch 8 sequences per step, whatever the layout; shuffled data, warm-up + cosine.
  static Result train(int ranks, int micro_batch, int accum, const std::string& name,
                      const std::string& extra = "") {
    fs::path run = dir_ / name;
    const std::string args =
        "train --model.vocab_size=" + std::to_string(kDpVocab) +
        " --model.vocab_multiple=1 --model.n_layer=2 --model.n_head=2 --model.d_model=32 "
        "--model.max_seq=16 --train.seq_len=16 --train.steps=" +
        std::to_string(kDpSteps) +
        " --optim.lr=1e-2 --optim.warmup_steps=2 --data.shuffle=true --run.threads=1 "
        "--run.peak_gflops=50 "
        "--dp.bucket_mb=0.01 --dist.timeout_s=60 --train.micro_batch=" +
        std::to_string(micro_batch) + " --train.grad_accum=" + std::to_string(accum) +
        " --data.train=" + (dir_ / "train.bin").string() + " --run.dir=" + run.string() +
        " --save.final=" + (run / "w.safetensors").string() + " " + extra;
    return testing::read_layout_run(run_command(tetra_command(ranks, args)), run,
                                    run / "w.safetensors");
  }

  // Losses within 1e-5; final weights within 3e-5 over the model and 2e-4 per tensor
  // (docs/testing.md): over seeds 1337 and 7, 1 and 2 threads per rank, native and AVX2, dp2's
  // reordered reduction ends at most 8.6e-6 and 4.4e-5 (wpe.weight, seed 7: four AdamW steps at
  // lr 1e-2 carry the float noise of rows whose gradients nearly cancel).
  static void expect_same_trajectory(const Result& a, const Result& b, double tol) {
    testing::expect_same_trajectory(a, b, tol, kDpSteps, 3e-5, 2e-4);
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

// Every ZeRO stage (and stage 3 keeping parameters between forward and backward) on 1, 2 and 4
// ranks, with gradient accumulation.
TEST_F(DataParallel, EveryZeroStageReproducesTheSingleRankTrajectory) {
  Result serial = train(1, 8, 1, "z_serial");
  ASSERT_EQ(serial.code, 0) << serial.output;
  for (int ranks : {1, 2, 4}) {
    int variant = 0;
    for (std::string stage : {"1", "2", "3", "3 --zero.reshard_after_forward=false"}) {
      const std::string name = fmt::format("z{}_{}", ranks, variant++);
      SCOPED_TRACE(std::to_string(ranks) + " ranks, --zero.stage=" + stage);
      Result r = train(ranks, 8 / ranks / 2, 2, name, "--zero.stage=" + stage);
      ASSERT_EQ(r.code, 0) << r.output;
      expect_same_trajectory(serial, r, 1e-5);
      if (ranks == 1) {
        EXPECT_NE(r.output.find("shards nothing"), std::string::npos) << r.output;
      }
    }
  }
}

// Elements of the flat parameter layout on `ranks` ranks: every tensor 16-aligned, every unit (a
// block; the embeddings with ln_f) padded to a multiple of 16 * ranks.
double flat_elements(int ranks) {
  const int64_t C = 32, V = kDpVocab, T = 16;
  auto align = [](int64_t n, int64_t m) { return (n + m - 1) / m * m; };
  const int64_t block_tensors[] = {C * 4 * C, C, 4 * C * C, 4 * C, C, C,
                                   C * C,     C, 3 * C * C, 3 * C, C, C};
  int64_t block = 0;
  for (int64_t n : block_tensors) block += align(n, 16);
  const int64_t root = align(T * C, 16) + align(V * C, 16) + 2 * align(C, 16);
  return double(2 * align(block, 16 * ranks) + align(root, 16 * ranks));
}

// 000/004: data parallelism all-reduces the gradient, 2(N-1)/N of its bytes per rank; ZeRO-1 and
// 2 reduce-scatter it and all-gather the parameters, (N-1)/N each, the same total; ZeRO-3
// all-gathers the parameters twice (forward, backward), 1.5x; without resharding once, 1x.
// Stages 2 and 3 reduce every micro-batch.
TEST_F(DataParallel, BytesSentPerStepAreTheSeedsVolumes) {
  for (int ranks : {2, 4}) {
    const double D = 4.0 * flat_elements(ranks), share = double(ranks - 1) / ranks;
    struct Case {
      std::string flags;
      int accum;
      double volume;
    };
    const Case cases[] = {
        {"--zero.stage=0", 1, 2 * share * D},
        {"--zero.stage=1", 1, 2 * share * D},
        {"--zero.stage=2", 1, 2 * share * D},
        {"--zero.stage=3", 1, 3 * share * D},
        {"--zero.stage=3 --zero.reshard_after_forward=false", 1, 2 * share * D},
        {"--zero.stage=0", 2, 2 * share * D},
        {"--zero.stage=2", 2, 3 * share * D},
        {"--zero.stage=3", 2, 6 * share * D},
    };
    for (const Case& c : cases) {
      SCOPED_TRACE(std::to_string(ranks) + " ranks, accumulation " + std::to_string(c.accum) + " " +
                   c.flags);
      Result r = train(ranks, 8 / ranks / c.accum, c.accum, "bytes", c.flags);
      ASSERT_EQ(r.code, 0) << r.output;
      for (double sent : r.comm_bytes) EXPECT_NEAR(sent, c.volume, 1e-9 * c.volume);
    }
  }
}

// dp.reduce_dtype=bf16 (002): the gradient collectives move bf16, half the bytes of the f32
// reduction (ZeRO's parameter gathers stay f32), and the losses and gradient norms stay within 1%
// of the single-rank f32 run.
TEST_F(DataParallel, Bf16ReductionHalvesTheGradientBytesAndTracksTheF32Trajectory) {
  Result serial = train(1, 8, 1, "bf16_serial");
  ASSERT_EQ(serial.code, 0) << serial.output;
  const double D = 4.0 * flat_elements(2), share = 0.5;
  for (const auto& [stage, volume] :
       {std::pair{0, 2 * share * D / 2}, {2, share * D / 2 + share * D}}) {
    SCOPED_TRACE("--zero.stage=" + std::to_string(stage));
    Result r = train(2, 4, 1, "bf16_" + std::to_string(stage),
                     "--dp.reduce_dtype=bf16 --zero.stage=" + std::to_string(stage));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("gradients reduced in bf16"), std::string::npos) << r.output;
    for (double sent : r.comm_bytes) EXPECT_NEAR(sent, volume, 1e-9 * volume);
    ASSERT_EQ(r.loss.size(), serial.loss.size());
    for (size_t i = 0; i < r.loss.size(); ++i) {
      EXPECT_NEAR(r.loss[i], serial.loss[i], 1e-2 * std::abs(serial.loss[i])) << "step " << i + 1;
      EXPECT_NEAR(r.grad_norm[i], serial.grad_norm[i], 1e-2 * serial.grad_norm[i])
          << "step " << i + 1;
    }
    // AdamW normalises each update, so the elements whose gradients nearly cancel across ranks
    // (where bf16 rounding is relatively largest) move differently: a few percent after 5 steps.
    for (const auto& [name, t] : serial.weights.tensors) {
      EXPECT_LT(testing::norm_rel_error(t.to_f32(), r.weights.tensors.at(name).to_f32()), 5e-2)
          << name;
    }
  }
}

TEST_F(DataParallel, SameLayoutTwiceIsBitIdentical) {
  for (std::string flags : {"--dp.overlap=true", "--dp.overlap=false", "--zero.stage=3"}) {
    Result a = train(2, 4, 1, "twice_a", flags), b = train(2, 4, 1, "twice_b", flags);
    ASSERT_EQ(a.code, 0) << a.output;
    ASSERT_EQ(b.code, 0) << b.output;
    EXPECT_EQ(a.loss, b.loss) << flags;
    for (const auto& [name, t] : a.weights.tensors) {
      EXPECT_EQ(t.bytes, b.weights.tensors.at(name).bytes) << flags << " " << name;
    }
  }
}

// Under bf16 the update writes the products' copy of the weights it updated; under ZeRO-1/2 that
// is this rank's shard only, and the gathered rest must be rounded afresh by the products. Either
// way the run is bit for bit the one that rounds every product's operands.
TEST_F(DataParallel, Bf16UpdateCopiesGiveTheSameRunAsRoundingEveryProduct) {
  if (!cpu::bf16_matmul_path().hardware) {
    std::cout << "[ bf16     ] no bf16 instructions on " << cpu::bf16_matmul_path().describe()
              << ": train.precision=bf16 is refused here, nothing to compare" << std::endl;
    return;
  }
  for (const std::string stage : {"1", "2"}) {
    SCOPED_TRACE("--zero.stage=" + stage);
    const std::string flags = "--train.precision=bf16 --zero.stage=" + stage;
    Result kept = train(2, 2, 2, "bf16_kept_" + stage, flags);
    Result each = train(2, 2, 2, "bf16_each_" + stage, flags + " --debug.bf16_weight_cache=false");
    ASSERT_EQ(kept.code, 0) << kept.output;
    ASSERT_EQ(each.code, 0) << each.output;
    EXPECT_EQ(kept.loss, each.loss);
    for (const auto& [name, t] : kept.weights.tensors) {
      EXPECT_EQ(t.bytes, each.weights.tensors.at(name).bytes) << name;
    }
  }
}

TEST_F(DataParallel, RecomputationIsBitIdenticalAtTheSameLayout) {
  Result none = train(2, 2, 2, "rc_none", "--zero.stage=3");
  ASSERT_EQ(none.code, 0) << none.output;
  for (std::string mode : {"selective", "full"}) {
    Result r = train(2, 2, 2, "rc_" + mode, "--zero.stage=3 --train.recompute=" + mode);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(r.loss, none.loss) << mode;
    EXPECT_EQ(r.grad_norm, none.grad_norm) << mode;
    for (const auto& [name, t] : none.weights.tensors) {
      EXPECT_EQ(t.bytes, r.weights.tensors.at(name).bytes) << mode << " " << name;
    }
  }
}

TEST_F(DataParallel, InconsistentLayoutIsRefused) {
  Result r = train(2, 4, 1, "bad", "--parallel.dp=4");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("parallel.dp"), std::string::npos) << r.output;
  Result stage = train(1, 8, 1, "bad_stage", "--zero.stage=4");
  EXPECT_NE(stage.code, 0);
  EXPECT_NE(stage.output.find("zero.stage"), std::string::npos) << stage.output;
}

}  // namespace
}  // namespace tetra
