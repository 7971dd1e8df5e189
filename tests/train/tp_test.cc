// Serial ≡ tensor parallel: tp = 2 and 4, and tp 2 × dp 2 (ZeRO 0 and 3 with accumulation) give
// the single-rank run's step-1 logits and gradients, every step's loss and the final weights
// (assembled from the slices into whole Hugging Face tensors). The vocabulary (333) divides by
// neither 2 nor 4, so wte carries padding rows on the last rank. Ranks are real processes under
// mpirun; each tensor-parallel rank runs 1 thread.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/safetensors.h"
#include "data/token_shard.h"
#include "plan/comm_cost.h"
#include "plan/presets.h"
#include "plan/run_memory.h"
#include "tests/train/layout_run.h"
#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using testing::LayoutRun;

constexpr int kTpVocab = 333;
constexpr int kTpSteps = 4;
constexpr double kTpTol = 1e-5;

struct TpRun {
  LayoutRun run;
  SafeTensorsFile logits, grads;  // step 1: the first micro-batch's logits, the mean gradient
};

class TensorParallel : public testing::RunDirTest {
 protected:
  // Tokens over the whole vocabulary, so that lookups and targets fall in every rank's rows.
  void SetUp() override {
    RunDirTest::SetUp();
    std::vector<uint32_t> tokens(20000);
    uint32_t x = 7;
    for (auto& t : tokens) t = ((x = x * 1103515245u + 12345u) >> 16) % kTpVocab;
    write_token_shard(path("vocab.bin"), tokens);
  }

  // Global batch 8 sequences of 16 tokens per step; 4 heads, so tp up to 4.
  TpRun train(int ranks, int micro_batch, int accum, const std::string& name,
              const std::string& extra) const {
    const fs::path run = dir_ / name;
    const std::string args = fmt::format(
        "train --model.vocab_size={} --model.vocab_multiple=1 --model.n_layer=2 "
        "--model.n_head=4 --model.d_model=32 --model.max_seq=16 --train.seq_len=16 "
        "--train.steps={} --optim.lr=1e-3 --optim.warmup_steps=2 --data.shuffle=true "
        "--run.threads=1 --run.peak_gflops=50 --dist.timeout_s=60 --train.micro_batch={} "
        "--train.grad_accum={} "
        "--data.train={} --run.dir={} --save.final={} --debug.dump_logits={} "
        "--debug.dump_grads={} {}",
        kTpVocab, kTpSteps, micro_batch, accum, path("vocab.bin"), run.string(),
        (run / "w.safetensors").string(), (run / "logits.safetensors").string(),
        (run / "grads.safetensors").string(), extra);
    TpRun r;
    r.run = testing::read_layout_run(testing::run_command(testing::tetra_command(ranks, args)), run,
                                     run / "w.safetensors");
    if (r.run.code != 0) return r;
    if (fs::exists(run / "logits.safetensors")) {  // not on a resumed run: no step 1
      r.logits = read_safetensors((run / "logits.safetensors").string());
    }
    if (fs::exists(run / "grads.safetensors")) {
      r.grads = read_safetensors((run / "grads.safetensors").string());
    }
    return r;
  }
};

// The logits of a layout's first micro-batch (its rows are the serial batch's first rows).
void expect_same_logits(const TpRun& serial, const TpRun& r) {
  const auto want = serial.logits.tensors.at("logits").to_f32();
  const auto got = r.logits.tensors.at("logits").to_f32();
  ASSERT_LE(got.size(), want.size());
  ASSERT_EQ(got.size() % (16 * kTpVocab), 0u);
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, double(std::abs(got[i] - want[i])));
  EXPECT_LT(worst, kTpTol);
}

void expect_same_grads(const TpRun& serial, const TpRun& r) {
  ASSERT_EQ(r.grads.tensors.size(), serial.grads.tensors.size());
  for (const auto& [name, t] : serial.grads.tensors) {
    EXPECT_LT(testing::norm_rel_error(t.to_f32(), r.grads.tensors.at(name).to_f32()), kTpTol)
        << name;
  }
}

TEST_F(TensorParallel, EveryLayoutReproducesTheSerialRun) {
  const TpRun serial = train(1, 8, 1, "serial", "");
  ASSERT_EQ(serial.run.code, 0) << serial.run.output;
  struct Layout {
    int ranks, micro_batch, accum;
    std::string flags;
    bool zero0;  // gradients whole on every rank: dumped and compared
  };
  const std::string sp = "--tp.sequence_parallel=true";
  const Layout layouts[] = {
      {2, 8, 1, "--parallel.tp=2", true},
      {4, 8, 1, "--parallel.tp=4", true},
      {4, 4, 1, "--parallel.tp=2", true},
      {4, 2, 2, "--parallel.tp=2 --zero.stage=3", false},
      {2, 8, 1, "--parallel.tp=2 " + sp, true},
      {4, 8, 1, "--parallel.tp=4 " + sp, true},
      {4, 4, 1, "--parallel.tp=2 " + sp, true},
      {4, 2, 2, "--parallel.tp=2 --zero.stage=3 --train.recompute=full " + sp, false},
  };
  int n = 0;
  for (const Layout& l : layouts) {
    SCOPED_TRACE(
        fmt::format("{} ranks, micro-batch {} x {}: {}", l.ranks, l.micro_batch, l.accum, l.flags));
    const std::string flags = l.zero0 ? l.flags : l.flags + " --debug.dump_grads=";
    const TpRun r = train(l.ranks, l.micro_batch, l.accum, fmt::format("l{}", n++), flags);
    ASSERT_EQ(r.run.code, 0) << r.run.output;
    // Weights per tensor: 3.9e-6 measured (h.0.mlp.c_proj.weight), held to 2e-5 (docs/testing.md).
    testing::expect_same_trajectory(serial.run, r.run, kTpTol, kTpSteps, kTpTol, 2e-5);
    expect_same_logits(serial, r);
    if (l.zero0) expect_same_grads(serial, r);
  }
}

// The tp group's own counters, every step, per micro-batch: without sequence parallelism 2
// all-reduces per block forward and 2 backward (seed 004), plus the embedding's output and the
// head's input gradient, and the loss's row maxima and sums of exponentials
// (kernels/cpu/cross_entropy.h). With it, each block all-reduce becomes an all-gather and a
// reduce-scatter each way (the same bytes), as do the embedding's and the head's, and the
// LayerNorm gradients (each rank saw its rows only) are all-reduced once per block and for ln_f.
// The blocks' bytes are `tetra plan`'s TP volume for the same shape, exactly.
TEST_F(TensorParallel, CollectivesAndActivationBytesPerRankMatchTheModel) {
  constexpr int L = 2, A = 2, B = 4, T = 16, C = 32;
  for (bool sp : {false, true}) {
    for (int tp : {2, 4}) {
      SCOPED_TRACE(fmt::format("tp={} sequence_parallel={}", tp, sp));
      const std::string name = fmt::format("count{}{}", tp, sp);
      const TpRun r = train(tp, B, A, name,
                            fmt::format("--parallel.tp={} --tp.sequence_parallel={} "
                                        "--debug.dump_grads=",
                                        tp, sp));
      ASSERT_EQ(r.run.code, 0) << r.run.output;
      plan::ModelSpec m;
      m.n_layer = L;
      m.d_model = C;
      m.n_head = m.n_kv_head = 4;
      m.ffn = 4 * C;
      m.vocab_size = kTpVocab;
      m.max_seq = m.seq = T;
      m.vocab_multiple = 1;
      plan::ClusterSpec cluster = plan::cluster_preset("h100");
      cluster.gpus = tp;
      plan::TrainingSpec spec;
      spec.precision = plan::Precision::Fp32;
      plan::Layout layout;
      layout.tp = tp;
      layout.micro_batch = B;
      layout.microbatches = A;
      double blocks = -1;
      for (const plan::DimComm& d : plan::comm_per_step(m, cluster, spec, layout, 1.0)) {
        if (d.dim == "tp") blocks = d.bytes;
      }
      const double BT = B * T, f32 = 4.0;
      const double activations = 2 * plan::ring_allreduce_bytes(BT * C * f32, tp);
      const double loss =
          plan::ring_allreduce_bytes(BT * f32, tp) + plan::ring_allreduce_bytes(2 * BT * f32, tp);
      const double norms = sp ? plan::ring_allreduce_bytes((4 * L + 2) * C * f32, tp) : 0.0;
      const auto steps = metrics(name);
      ASSERT_EQ(steps.size(), size_t(kTpSteps));
      for (const auto& s : steps) {
        if (sp) {
          EXPECT_EQ(s["tp_all_gather"], A * (2 * L + 2 * L + 2));
          EXPECT_EQ(s["tp_reduce_scatter"], A * (2 * L + 2 * L + 2));
          EXPECT_EQ(s["tp_all_reduce"], A * (2 + L + 1));
        } else {
          EXPECT_EQ(s["tp_all_reduce"], A * (2 * L + 2 * L + 2 + 2));
          EXPECT_EQ(s["tp_all_gather"], 0);
          EXPECT_EQ(s["tp_reduce_scatter"], 0);
        }
        const double want = blocks + A * (activations + loss) + (sp ? A * norms : 0.0);
        EXPECT_NEAR(double(s["tp_comm_bytes"]), want, 1e-9 * want);
      }
      // Activation bytes per rank in the ledger: column-parallel buffers split by tp, the
      // residual stream, residual2 and the LayerNorm statistics by tp under sequence parallelism
      // (the LayerNorm outputs stay whole: gathered once, kept for the weight gradients).
      const int64_t N = B * T / (sp ? tp : 1), Vp = (kTpVocab + tp - 1) / tp * tp;
      const int64_t per_layer = 2 * B * T * C + N * C + 4 * N + 4 * B * T * C / tp +
                                B * (4 / tp) * T * T + 2 * B * T * 4 * C / tp;
      const int64_t head = B * T * C + 2 * N + B * T * Vp / tp + B * T;
      const double bytes = 4.0 * double((L + 1) * N * C + L * per_layer + head);
      EXPECT_EQ(double(steps.back()["mem_activations"]), bytes);
      plan::RunShape shape;
      shape.model.vocab_size = kTpVocab;
      shape.padded_vocab = Vp;
      shape.model.n_layer = L;
      shape.model.d_model = C;
      shape.model.n_head = shape.model.n_kv_head = 4;
      shape.model.ffn = 4 * C;
      shape.model.max_seq = T;
      shape.micro_batch = B;
      shape.seq = T;
      shape.tp = tp;
      shape.sequence_parallel = sp;
      EXPECT_EQ(plan::run_memory(shape).activations, bytes);  // what the run header prints
      ::testing::Test::RecordProperty(fmt::format("activation_bytes_tp{}_sp{}", tp, sp),
                                      std::to_string(bytes));
    }
  }
}

// Checkpoints under tensor parallelism hold every rank's slices (c_attn's q, k and v parts among
// them) and load into any tensor-parallel size: tp 2 -> tp 1 -> tp 4 continues the uninterrupted
// tp-2 run's losses, and tp 2 -> tp 2 continues it bit for bit.
TEST_F(TensorParallel, CheckpointsResumeUnderAnotherTensorParallelSize) {
  const std::string common = "--optim.schedule=constant --ckpt.every=2 --debug.dump_grads= ";
  auto ckpt = [&](const std::string& run, int step) {
    return (dir_ / run / "ckpt" / ckpt::checkpoint_name(step)).string();
  };
  auto resume = [&](int ranks, int tp, const std::string& name, const std::string& from) {
    return train(ranks, 8, 1, name,
                 fmt::format("{} --parallel.tp={} --train.steps={} --ckpt.dir={} --ckpt.resume={}",
                             common, tp, from == ckpt("a", 2) ? 4 : kTpSteps,
                             (dir_ / name / "ckpt").string(), from));
  };
  const TpRun a =
      train(2, 8, 1, "a", common + "--parallel.tp=2 --ckpt.dir=" + (dir_ / "a" / "ckpt").string());
  ASSERT_EQ(a.run.code, 0) << a.run.output;
  const TpRun b = resume(1, 1, "b", ckpt("a", 2));
  ASSERT_EQ(b.run.code, 0) << b.run.output;
  const TpRun c = resume(4, 4, "c", ckpt("b", 4));
  ASSERT_EQ(c.run.code, 0) << c.run.output;
  const TpRun d = resume(2, 2, "d", ckpt("a", 2));
  ASSERT_EQ(d.run.code, 0) << d.run.output;
  ASSERT_EQ(a.run.loss.size(), size_t(kTpSteps));
  ASSERT_EQ(b.run.loss.size(), 2u);  // steps 3 and 4
  ASSERT_EQ(c.run.loss.size(), 0u + kTpSteps - 4);
  ASSERT_EQ(d.run.loss.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(b.run.loss[i], a.run.loss[2 + i], kTpTol * a.run.loss[2 + i]) << "step " << 3 + i;
    EXPECT_EQ(d.run.loss[i], a.run.loss[2 + i]) << "step " << 3 + i;
  }
  for (size_t i = 0; i < c.run.loss.size(); ++i) {
    EXPECT_NEAR(c.run.loss[i], a.run.loss[4 + i], kTpTol * a.run.loss[4 + i]) << "step " << 5 + i;
  }
}

// tetra generate under tetra launch runs the model tensor-parallel over every rank (each holding
// its heads, MLP channels and vocabulary rows of the saved Hugging Face file) and prints what the
// single process prints. A model trained on a repeated sentence makes greedy decoding confident,
// so float noise between layouts cannot flip a choice.
TEST_F(TensorParallel, GenerateUnderLaunchPrintsTheSerialText) {
  const std::string text = "the quick brown fox jumps over the lazy dog. ";
  std::vector<uint32_t> tokens;
  for (int i = 0; i < 200; ++i) {
    for (char ch : text) tokens.push_back(uint8_t(ch));
  }
  write_token_shard(path("text.bin"), tokens);
  const fs::path run = dir_ / "gen", weights = run / "w.safetensors";
  const testing::Ran trained = testing::run_command(testing::tetra_command(
      1, fmt::format("train --model.vocab_size=257 --model.n_layer=2 --model.n_head=4 "
                     "--model.d_model=32 --model.max_seq=64 --train.seq_len=32 "
                     "--train.micro_batch=8 --train.steps=60 --optim.lr=1e-2 --run.threads=1 "
                     "--run.peak_gflops=50 "
                     "--data.train={} --run.dir={} --save.final={}",
                     path("text.bin"), run.string(), weights.string())));
  ASSERT_EQ(trained.code, 0) << trained.output;
  const std::string gen = fmt::format(
      "generate --model {} --config {} --tokenizer byte --prompt 'the quick' --max-tokens 24 "
      "--temperature 0 --threads 1",
      weights.string(), (run / "config.toml").string());
  const testing::Ran serial = testing::run_command(testing::tetra_command(1, gen), false);
  ASSERT_EQ(serial.code, 0) << serial.output;
  EXPECT_EQ(serial.output.rfind("the quick", 0), 0u) << serial.output;
  for (int ranks : {2, 4}) {
    const testing::Ran tp =
        testing::run_command(fmt::format("{} launch -n {} -- {}", TETRA_BINARY, ranks, gen), false);
    ASSERT_EQ(tp.code, 0) << tp.output;
    EXPECT_EQ(tp.output, serial.output) << ranks << " ranks";
  }
}

TEST_F(TensorParallel, LayoutsThatCannotSplitAreRefusedWithWhatToChange) {
  const TpRun heads = train(3, 8, 1, "bad_heads", "--parallel.tp=3");
  EXPECT_EQ(heads.run.code, 2);
  EXPECT_NE(heads.run.output.find("[model] parallel.tp=3 does not divide model.n_head=4: tensor "
                                  "parallelism gives each rank whole attention heads (and "
                                  "4*d_model/tp MLP channels); use parallel.tp in {1, 2, 4}"),
            std::string::npos)
      << heads.run.output;
  const TpRun rows =
      train(2, 1, 1, "bad_rows", "--parallel.tp=2 --tp.sequence_parallel=true --train.seq_len=15");
  EXPECT_EQ(rows.run.code, 2);
  EXPECT_NE(rows.run.output.find("[model] tp.sequence_parallel splits the B*T = 1*15 = 15 token "
                                 "rows of a micro-batch over parallel.tp=2 ranks, which does not "
                                 "divide them; change train.micro_batch or train.seq_len"),
            std::string::npos)
      << rows.run.output;
}

}  // namespace
}  // namespace tetra
