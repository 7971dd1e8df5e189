// Serial ≡ pipeline parallel: pp = 2 and 4 × {GPipe, 1F1B, interleaved v = 2, ZB-V} (even, uneven
// and auto splits) and pp 2 × dp 2 under ZeRO-3 give the single-rank run's loss at every step, its
// step-1 gradients (the stages' gathered, the tied wte's summed over both copies), its validation
// loss (forward through the stages) and its final weights (the stages' tensors gathered into one
// file, wte once). tp 2 × pp 2 × dp 2 on 8 ranks, with and without sequence parallelism, gives
// the serial losses and the numbers of the same layout without a pipeline. run.trace writes a
// Chrome trace per rank and the metrics carry the measured and simulated bubble; checkpoints and
// init.from cross pipeline layouts; impossible pipelines are refused naming the keys. Ranks are
// real processes under mpirun, one thread each.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt/checkpoint.h"
#include "ckpt/safetensors.h"
#include "tests/train/layout_run.h"
#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using testing::LayoutRun;

constexpr int kPpSteps = 3;
constexpr double kPpTol = 1e-5;

class PipelineParallel : public testing::RunDirTest {
 protected:
  // 8 layers of a 4-head C=32 model; a step is 8 sequences of 16 tokens: `accum` micro-batches of
  // 2 on each of 8 / (2 accum) data-parallel ranks. Every layout multiplies matrices of the same
  // shapes, so every run uses the same matmul libraries (measured once per test).
  std::string args(const std::string& name, const std::string& extra, int steps = kPpSteps,
                   int accum = 4) const {
    const fs::path run = dir_ / name;
    return fmt::format(
        "train --model.vocab_size=64 --model.vocab_multiple=1 --model.n_layer=8 "
        "--model.n_head=4 --model.d_model=32 --model.max_seq=16 --train.seq_len=16 "
        "--train.steps={} --optim.lr=1e-3 --optim.warmup_steps=2 --data.shuffle=true "
        "--run.threads=1 --run.peak_gflops=50 --dist.timeout_s=60 --train.micro_batch=2 "
        "--train.grad_accum={} --data.train={} --data.val={} --eval.batches=2 --run.dir={} "
        "--save.final={} {}",
        steps, accum, path("train.bin"), path("train.bin"), run.string(),
        (run / "w.safetensors").string(), extra);
  }
  LayoutRun train(int ranks, const std::string& name, const std::string& extra,
                  int steps = kPpSteps, int accum = 4) const {
    const testing::Ran ran =
        testing::run_command(testing::tetra_command(ranks, args(name, extra, steps, accum)));
    return testing::read_layout_run(ran, dir_ / name, dir_ / name / "w.safetensors");
  }
};

TEST_F(PipelineParallel, EveryScheduleAndSplitReproducesTheSerialRun) {
  auto dump = [&](const std::string& name) { return path(name + "-grads.safetensors"); };
  const LayoutRun serial = train(1, "serial", "--debug.dump_grads=" + dump("serial"));
  ASSERT_EQ(serial.code, 0) << serial.output;
  const SafeTensorsFile grads = read_safetensors(dump("serial"));
  struct Layout {
    int ranks;
    std::string flags;
    int accum = 4;
    bool zero0 = true;  // every gradient whole on dp rank 0: step 1's are dumped and compared
  };
  const Layout layouts[] = {
      {2, "--parallel.pp=2 --pp.schedule=gpipe"},
      {2, "--parallel.pp=2 --pp.schedule=1f1b --pp.layers=3,5"},
      {2, "--parallel.pp=2 --pp.schedule=interleaved --pp.chunks=2 --pp.layers=1,3,2,2"},
      {4, "--parallel.pp=4 --pp.schedule=gpipe"},
      {4, "--parallel.pp=4 --pp.schedule=1f1b --pp.layers=1,2,3,2 --run.trace=true"},
      {4, "--parallel.pp=4 --pp.schedule=interleaved --pp.chunks=2 --pp.layers=auto"},
      // pp 2 x dp 2 (ZeRO-3): each data-parallel rank takes 2 micro-batches of 2 sequences.
      {4, "--parallel.pp=2 --zero.stage=3", 2, false},
      // ZB-V: two chunks per rank in a V, the embedding and the head (one tied wte) on rank 0.
      {2, "--parallel.pp=2 --pp.schedule=zb_v --pp.chunks=2", 4, false},
      {4, "--parallel.pp=4 --pp.schedule=zb_v --pp.chunks=2", 4, false},
      // ZB-V beside dp 2 under ZeRO-1: each unit reduced as its last W finishes it, rank 0's
      // root (the embedding's and the head's tied wte) only after both chunks' last Ws.
      {4, "--parallel.pp=2 --pp.schedule=zb_v --pp.chunks=2 --zero.stage=1", 2, false},
  };
  int n = 0;
  for (const Layout& l : layouts) {
    SCOPED_TRACE(fmt::format("{} ranks: {}", l.ranks, l.flags));
    const std::string name = fmt::format("l{}", n++);
    const LayoutRun r =
        train(l.ranks, name, l.flags + (l.zero0 ? " --debug.dump_grads=" + dump(name) : ""),
              kPpSteps, l.accum);
    ASSERT_EQ(r.code, 0) << r.output;
    if (l.zero0) {  // the stages' gradients gathered, the tied wte's summed over both copies
      const SafeTensorsFile got = read_safetensors(dump(name));
      ASSERT_EQ(got.tensors.size(), grads.tensors.size());
      for (const auto& [tensor, g] : grads.tensors) {
        EXPECT_LT(testing::norm_rel_error(g.to_f32(), got.tensors.at(tensor).to_f32()), kPpTol)
            << tensor;
      }
    }
    testing::expect_same_trajectory(serial, r, kPpTol, kPpSteps);
    const double val = metrics("serial").back()["val_loss"];
    EXPECT_NEAR(double(metrics(name).back()["val_loss"]), val, kPpTol * val);
    for (const auto& m : metrics(name)) {
      EXPECT_TRUE(m.contains("pp_bubble") && m.contains("pp_bubble_sim")) << m.dump();
      EXPECT_GE(double(m["pp_bubble_sim"]), 0.0);
      EXPECT_LT(double(m["pp_bubble_sim"]), 1.0);
    }
  }
  // tp 2 x pp 2 x dp 2 on 8 ranks, with and without sequence parallelism. Tensor parallelism
  // multiplies other shapes than the serial run, whose matmul libraries (measured per machine)
  // may round differently: its weights can end up to 3.5e-5 from the serial run's in layer 5's
  // attention here with no pipeline at all (tp 2 x dp 2). So the losses are held to the serial
  // run and the whole trajectory to the same layout without a pipeline, which multiplies the same
  // shapes: the pipeline must add no error of its own.
  for (const std::string tp : {"--parallel.tp=2 --zero.stage=1",
                               "--parallel.tp=2 --zero.stage=1 --tp.sequence_parallel=true"}) {
    SCOPED_TRACE(tp);
    const std::string name = fmt::format("l{}", n++);
    const LayoutRun twin = train(4, name + "-twin", tp, kPpSteps, 2);
    const LayoutRun piped = train(8, name, tp + " --parallel.pp=2", kPpSteps, 2);
    ASSERT_EQ(twin.code, 0) << twin.output;
    ASSERT_EQ(piped.code, 0) << piped.output;
    testing::expect_same_trajectory(twin, piped, kPpTol, kPpSteps);
    for (size_t i = 0; i < kPpSteps; ++i) {
      EXPECT_NEAR(piped.loss[i], serial.loss[i], kPpTol * serial.loss[i]) << "step " << i + 1;
    }
  }
  // The traced run: one file per rank, every (micro-batch) forward and backward of its stage.
  for (int rank = 0; rank < 4; ++rank) {
    std::ifstream in(dir_ / "l4" / fmt::format("trace-rank-{}.json", rank));
    ASSERT_TRUE(in.good()) << "rank " << rank;
    const nlohmann::json trace = nlohmann::json::parse(in);
    int forward = 0, backward = 0;
    for (const auto& e : trace["traceEvents"]) {
      const std::string name = e["name"];
      forward += name.rfind("forward mb", 0) == 0;
      backward += name.rfind("backward mb", 0) == 0;
    }
    EXPECT_EQ(forward, 4 * kPpSteps) << "rank " << rank;
    EXPECT_EQ(backward, 4 * kPpSteps) << "rank " << rank;
  }
}

// ZB-H1 (docs/pipeline.md, "Zero bubble"): the backward split into B and W, the weight products
// run later on copies of their operands (same shapes and strides), changes the order of work but
// no operation (each chunk's W run in micro-batch order, into the same accumulation; bit for bit
// in process: GptStage.SplitBackwardGivesTheUnsplitGradientsBitForBit). Dense layouts reproduce
// the serial run within the pipeline bound under pp 2 and 4 (uneven), pp 2 x tp 2 with sequence
// parallelism and pp 2 x dp 2 under ZeRO-1; a MoE model at pp 2 x ep 2, whose routing may flip on
// near ties between layouts, reproduces its 1F1B run (measured on an AVX-512 EPYC: bit for bit;
// the test prints whether). The metrics carry its bubble; ZeRO-2 and 3, which reduce at the
// backward, are refused.
TEST_F(PipelineParallel, ZeroBubbleH1ReproducesTheSerialRun) {
  const LayoutRun serial = train(1, "zb-serial", "");
  ASSERT_EQ(serial.code, 0) << serial.output;
  struct Layout {
    int ranks;
    std::string flags;
    int accum = 4;
    double tensor_tol = 0;      // per tensor; 0: kPpTol
    bool against_1f1b = false;  // MoE: routing may flip on near ties against the serial run
  };
  const std::string moe = "--model.moe_experts=4 --model.moe_top_k=2 --parallel.ep=2 ";
  const Layout layouts[] = {
      {2, "--parallel.pp=2"},
      {4, "--parallel.pp=4 --pp.layers=1,2,3,2"},
      // Per tensor, a LayerNorm bias's worst over seeds, 1 and 2 threads and the AVX-512 and AVX2
      // paths was 1.03e-5 (AVX2, AMD EPYC); the bound is about 4x that (docs/testing.md).
      {4, "--parallel.pp=2 --parallel.tp=2 --tp.sequence_parallel=true", 4, 4e-5},
      {4, "--parallel.pp=2 --zero.stage=1", 2},
      {4, moe + "--parallel.pp=2 --zero.stage=1", 2, 0, true},
  };
  int n = 0;
  for (const Layout& l : layouts) {
    SCOPED_TRACE(fmt::format("{} ranks: {}", l.ranks, l.flags));
    const std::string name = fmt::format("zb{}", n++);
    const LayoutRun zb = train(l.ranks, name, l.flags + " --pp.schedule=zb_h1", kPpSteps, l.accum);
    ASSERT_EQ(zb.code, 0) << zb.output;
    ASSERT_EQ(zb.loss.size(), size_t(kPpSteps));
    if (!l.against_1f1b) {
      testing::expect_same_trajectory(serial, zb, kPpTol, kPpSteps, 0, l.tensor_tol);
    } else {
      const LayoutRun ref =
          train(l.ranks, name + "-1f1b", l.flags + " --pp.schedule=1f1b", kPpSteps, l.accum);
      ASSERT_EQ(ref.code, 0) << ref.output;
      testing::expect_same_trajectory(ref, zb, kPpTol, kPpSteps);
      bool bitwise = zb.loss == ref.loss;
      for (const auto& [tensor, t] : ref.weights.tensors) {
        bitwise = bitwise && t.to_f32() == zb.weights.tensors.at(tensor).to_f32();
      }
      std::cout << "[ zb_h1    ] " << l.flags << ": " << (bitwise ? "bit for bit" : "within bound")
                << " of 1f1b\n";
    }
    for (const auto& m : metrics(name)) {
      EXPECT_TRUE(m.contains("pp_bubble") && m.contains("pp_bubble_sim")) << m.dump();
    }
  }
  const testing::Ran r =
      testing::run_command(testing::tetra_command(2, args("zb-refused",
                                                          "--parallel.pp=2 --pp.schedule=zb_h1 "
                                                          "--zero.stage=2")));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("use zero.stage=0 or 1 with zb_h1"), std::string::npos) << r.output;
}

// A pipeline's checkpoint holds every tensor once (the head's copy of wte is not written) and
// resumes on one rank; that rank's checkpoint resumes on a pipeline of another schedule with two
// data-parallel replicas under ZeRO-2: both continue the uninterrupted pipeline run (losses and
// final weights within 1e-5). Its final weights loaded with init.from on 4 interleaved stages
// give the single rank's next step.
TEST_F(PipelineParallel, CheckpointsAndInitFromWorkUnderAnotherPipelineLayout) {
  const std::string common = "--optim.schedule=constant --ckpt.every=2 ";
  const LayoutRun a =
      train(2, "a", common + "--parallel.pp=2 --pp.layers=3,5 --ckpt.dir=" + path("a-ckpt"), 6);
  ASSERT_EQ(a.code, 0) << a.output;
  const ckpt::Manifest m = ckpt::Manifest::read(dir_ / "a-ckpt" / ckpt::checkpoint_name(2));
  EXPECT_EQ(m.layout["pp"], 2);
  for (const auto& [name, rec] : m.tensors) {
    int64_t written = 0;
    for (const ckpt::Chunk& c : rec.chunks.at("param")) written += c.count;
    EXPECT_EQ(written, shape_numel(rec.shape)) << name;
  }
  const LayoutRun b = train(1, "b",
                            common + "--ckpt.dir=" + path("b-ckpt") +
                                " --ckpt.resume=" + path("a-ckpt/" + ckpt::checkpoint_name(2)),
                            4);
  ASSERT_EQ(b.code, 0) << b.output;
  const LayoutRun c = train(
      4, "c",
      common + "--parallel.pp=2 --pp.schedule=gpipe --zero.stage=2 --ckpt.dir=" + path("c-ckpt") +
          " --ckpt.resume=" + path("b-ckpt/" + ckpt::checkpoint_name(4)),
      6, 2);
  ASSERT_EQ(c.code, 0) << c.output;
  ASSERT_EQ(a.loss.size(), 6u);
  ASSERT_EQ(b.loss.size(), 2u);  // steps 3 and 4
  ASSERT_EQ(c.loss.size(), 2u);  // steps 5 and 6
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(b.loss[i], a.loss[2 + i], kPpTol * a.loss[2 + i]) << "step " << 3 + i;
    EXPECT_NEAR(c.loss[i], a.loss[4 + i], kPpTol * a.loss[4 + i]) << "step " << 5 + i;
  }
  testing::expect_same_weights(a, c, kPpTol);
  // The final weights as init.from: one step on 4 stages equals one step on one rank.
  const std::string init =
      "--optim.schedule=constant --init.from=" + (dir_ / "a" / "w.safetensors").string();
  const LayoutRun d = train(1, "d", init, 1);
  const LayoutRun e =
      train(4, "e", init + " --parallel.pp=4 --pp.schedule=interleaved --pp.chunks=2", 1);
  ASSERT_EQ(d.code, 0) << d.output;
  ASSERT_EQ(e.code, 0) << e.output;
  testing::expect_same_trajectory(d, e, kPpTol, 1);
}

TEST_F(PipelineParallel, ImpossiblePipelinesAreRefusedWithWhatWouldWork) {
  auto refused = [&](const std::string& extra, const std::string& text, int ranks = 1) {
    const testing::Ran r =
        testing::run_command(testing::tetra_command(ranks, args("refused", extra)));
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(text), std::string::npos) << "missing '" << text << "' in\n"
                                                      << r.output;
  };
  refused("--parallel.pp=16",
          "[config] parallel.pp=16 pp.schedule=1f1b pp.chunks=1 train.grad_accum=4 "
          "(micro-batches) model.n_layer=8: [pipeline] 16 pipeline stages for 8 layers: each "
          "stage needs at least one layer; use at most 8 stages (pp x v)");
  refused("--parallel.pp=2 --pp.layers=3,4",
          "[pipeline] pp.layers=\"3,4\" gives 2 stage(s) holding 7 layers, but the model has 8 "
          "layers on 2 stages (pp x v): give 2 counts that sum to 8");
  refused("--parallel.pp=3 --pp.schedule=interleaved --pp.chunks=2 --pp.layers=auto",
          "the micro-batch count must be a multiple of pp=3 (got m=4); use m=3 or 6, or 1f1b");
  refused("--parallel.pp=2 --pp.schedule=interleaved",
          "[pipeline] the interleaved schedule needs pp>=2 and at least 2 chunks per rank (got "
          "pp=2, v=1); set v=2, or use 1f1b");
  refused("--parallel.pp=2",
          "[train] parallel.pp=2 needs 2 ranks but this is a single process; run it as `tetra "
          "launch -n 2 -- train ...`");
  refused("--parallel.pp=2 --debug.dump_logits=" + path("logits.safetensors"),
          "[train] debug.dump_logits=" + path("logits.safetensors") +
              " needs the whole model on one rank, but parallel.pp=2 splits it over the pipeline; "
              "leave debug.dump_logits unset (or run with parallel.pp=1)",
          2);
}

}  // namespace
}  // namespace tetra
