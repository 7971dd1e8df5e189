// Plan vs measured (docs/training.md): at its end a run prints the planner's prediction for its own
// layout beside what it measured and writes both to run.dir/plan_vs_measured.json. The bytes each
// group sends per step are the trainer's own count (comm::Work::sent_bytes), so the plan must
// match them exactly; memory per rank within 5% (it is the same ledger); the pipeline's bubble
// within 5 points. Step times depend on how busy the machine is: the test only checks that they
// are there (bench/plan_vs_run.py tabulates them with the load average).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "plan/tetra_run.h"
#include "tests/train/run_tetra.h"
#include "train/run_plan.h"

namespace tetra {
namespace {

using nlohmann::json;
using testing::Ran;
using testing::run_command;
using testing::tetra_command;

class PlanVsRun : public testing::RunDirTest {
 protected:
  json run(int ranks, const std::string& name, const std::string& flags) {
    const std::string args =
        "train --model.vocab_size=64 --model.n_layer=4 --model.n_head=4 --model.d_model=64 "
        "--model.max_seq=32 --train.seq_len=32 --train.micro_batch=2 --train.steps=3 "
        "--run.threads=1 --run.peak_gflops=50 --run.progress=never --eval.every=0 --data.val= "
        "--data.train=" +
        path("train.bin") + " --run.dir=" + path(name) + " " + flags;
    const Ran r = run_command(tetra_command(ranks, args));
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("[plan] plan vs measured for this run"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("[plan]   step time     predicted"), std::string::npos) << r.output;
    std::ifstream in(path(name) + "/plan_vs_measured.json");
    const json j = json::parse(in, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << r.output;
    return j;
  }

  // The last step's record of the run in `name` (metrics.jsonl, rank 0's): its memory peaks per
  // category and, for a MoE run, the all-to-all bytes.
  json last_step(const std::string& name) const {
    std::ifstream in(path(name) + "/metrics.jsonl");
    json last;
    for (std::string line; std::getline(in, line);) {
      const json j = json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.contains("mem_params")) last = j;
    }
    EXPECT_FALSE(last.is_null()) << name;
    return last;
  }

  // What `tetra plan --config <the run's config.toml>` predicts for the run on `ranks` ranks.
  RunPlan planned(const std::string& name, int ranks) const {
    return plan_training_config(path(name) + "/config.toml",
                                {"cluster.gpus=" + std::to_string(ranks)})
        .run;
  }

  // Every memory category of rank 0 exactly as planned, but those in `except`.
  static void expect_exact_memory(const json& step, const plan::RunMemory& want,
                                  const std::set<std::string>& except = {}) {
    const std::pair<const char*, double> categories[] = {
        {"params", want.params},       {"grads", want.grads},
        {"optimizer", want.optimizer}, {"activations", want.activations},
        {"comm", want.comm},           {"temporaries", want.temporaries}};
    for (const auto& [name, bytes] : categories) {
      if (except.count(name)) continue;
      EXPECT_EQ(step["mem_" + std::string(name)].get<double>(), bytes) << name;
    }
  }

  // Every memory category of rank 0 exactly as planned (an fp32 run's buffers are the plan's to
  // the byte), each printed as measured / planned for the record.
  static void expect_memory_exact(const std::string& name, const json& step,
                                  const plan::RunMemory& want) {
    const std::pair<const char*, double> categories[] = {
        {"params", want.params},       {"grads", want.grads},
        {"optimizer", want.optimizer}, {"activations", want.activations},
        {"comm", want.comm},           {"temporaries", want.temporaries}};
    std::string line = "[ ledger   ] " + name + ":";
    for (const auto& [category, bytes] : categories) {
      const double got = step["mem_" + std::string(category)].get<double>();
      if (bytes == 0) {
        EXPECT_EQ(got, 0.0) << category;
        continue;
      }
      EXPECT_EQ(got, bytes) << category;
      line += fmt::format(" {} {:.6f}", category, got / bytes);
    }
    std::cout << line << std::endl;
  }

  static double planned_bytes(const RunPlan& p, const std::string& dim, bool buffers = false) {
    for (const plan::GroupTraffic& g : p.traffic) {
      if (g.dim == dim) return buffers ? g.buffer_bytes() : g.bytes();
    }
    return 0;
  }

  static void expect_agreement(const json& j, const std::vector<std::string>& groups) {
    ASSERT_TRUE(j.contains("step_seconds")) << j.dump();
    EXPECT_GT(j["step_seconds"]["predicted"].get<double>(), 0);
    EXPECT_GT(j["step_seconds"]["measured"].get<double>(), 0);
    const double mem = j["memory_bytes"]["measured"].get<double>();
    EXPECT_NEAR(j["memory_bytes"]["predicted"].get<double>(), mem, 0.05 * mem) << j.dump();
    for (const std::string& g : groups) {
      ASSERT_TRUE(j["bytes_per_step"].contains(g)) << g << " " << j.dump();
      EXPECT_GT(j["bytes_per_step"][g]["measured"].get<double>(), 0) << g;
      EXPECT_EQ(j["bytes_per_step"][g]["predicted"], j["bytes_per_step"][g]["measured"]) << g;
    }
  }
};

TEST_F(PlanVsRun, OneRank) {
  const json j = run(1, "one", "");
  expect_agreement(j, {});
  EXPECT_FALSE(j.contains("bytes_per_step"));
}

TEST_F(PlanVsRun, DataParallelEveryZeroStage) {
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE(stage);
    expect_agreement(run(2, "dp" + std::to_string(stage),
                         "--zero.stage=" + std::to_string(stage) + " --train.grad_accum=2"),
                     {"dp"});
  }
  // bf16 reductions send half the bytes of a reduce-scatter, the f32 gathers as many.
  expect_agreement(run(2, "dp_bf16", "--zero.stage=2 --dp.reduce_dtype=bf16"), {"dp"});
}

TEST_F(PlanVsRun, TensorParallel) {
  expect_agreement(run(2, "tp", "--parallel.tp=2 --parallel.dp=1"), {"tp"});
  expect_agreement(run(2, "tp_sp",
                       "--parallel.tp=2 --parallel.dp=1 --tp.sequence_parallel=true "
                       "--train.recompute=full"),
                   {"tp"});
}

TEST_F(PlanVsRun, PipelineParallel) {
  for (const char* schedule : {"1f1b", "gpipe"}) {
    SCOPED_TRACE(schedule);
    const json j = run(2, std::string("pp_") + schedule,
                       std::string("--parallel.pp=2 --parallel.dp=1 --train.grad_accum=4 "
                                   "--pp.schedule=") +
                           schedule);
    expect_agreement(j, {"pp"});
    ASSERT_TRUE(j.contains("bubble")) << j.dump();
    EXPECT_GT(j["bubble"]["predicted"].get<double>(), 0);
  }
  expect_agreement(run(2, "pp_inter",
                       "--parallel.pp=2 --parallel.dp=1 --train.grad_accum=4 "
                       "--pp.schedule=interleaved --pp.chunks=2"),
                   {"pp"});
  // ZB-V puts the head on rank 0: every memory category there to the byte, the copies of the
  // weight products' operands held from B to W (GPT-2's fused qkv and GELU MLP) among them.
  expect_agreement(run(2, "pp_zb_v",
                       "--parallel.pp=2 --parallel.dp=1 --train.grad_accum=4 "
                       "--pp.schedule=zb_v --pp.chunks=2"),
                   {"pp"});
  expect_exact_memory(last_step("pp_zb_v"), planned("pp_zb_v", 2).prediction.memory);
}

// A mixture-of-experts run, 4 experts top-2 in every other block, every memory category exactly
// as planned: serially with the capacity's drops (the buffers are its bounds whatever is
// dropped), and under expert parallelism, ep 2 over dp 2 without ZeRO, where with no capacity
// nothing is dropped and the rows each rank puts into its all-to-alls (metrics.jsonl's a2a_bytes,
// the mean over the ranks) are the plan's ep group's: 4 exchanges per MoE block and micro-batch.
TEST_F(PlanVsRun, MixtureOfExperts) {
  const std::string moe = "--model.moe_experts=4 --model.moe_every=2 --train.grad_accum=2 ";
  expect_agreement(run(1, "moe", moe), {});
  const RunPlan serial = planned("moe", 1);
  expect_exact_memory(last_step("moe"), serial.prediction.memory);
  EXPECT_EQ(planned_bytes(serial, "ep"), 0);

  expect_agreement(run(2, "moe_ep", moe + "--parallel.ep=2 --moe.capacity_factor=0"), {});
  const RunPlan ep = planned("moe_ep", 2);
  const json step = last_step("moe_ep");
  expect_exact_memory(step, ep.prediction.memory);
  // 2 micro-batches x 2 MoE blocks x 4 exchanges of 2 x 32 tokens x 2 routes x 64 floats.
  EXPECT_EQ(planned_bytes(ep, "ep", true), 2 * 2 * 4 * (2 * 32 * 2) * 64 * 4.0);
  EXPECT_EQ(step["a2a_bytes"].get<double>(), planned_bytes(ep, "ep", true));
  EXPECT_EQ(planned_bytes(ep, "ep"), planned_bytes(ep, "ep", true) / 2);

  // Mixtral (SwiGLU experts of ffn channels without biases, a router in place of Llama's MLP;
  // every block routed here, and every other with capacity drops), serially and under full
  // recomputation: every category exactly as planned.
  const std::string mixtral = "--model.arch=llama --model.n_kv_head=2 --model.ffn=96 " + moe;
  for (const std::string extra :
       {"--model.moe_every=1 --moe.capacity_factor=0", "--train.recompute=full"}) {
    SCOPED_TRACE(extra);
    const std::string name = "mixtral" + std::to_string(extra.size());
    expect_agreement(run(1, name, mixtral + extra), {});
    expect_exact_memory(last_step(name), planned(name, 1).prediction.memory);
  }
}

// ZeRO under expert parallelism (ep 2 over dp 2): expert units are sharded and reduced over their
// edp group of dp/ep ranks (docs/zero.md, "Expert units"), here one rank, so their optimizer
// state is whole from stage 1 and their gradients cross no rank; every stage's memory and dp bytes
// are the plan's exactly. A trainer sharding them over dp like the dense units would hold half of
// their stage-1 optimizer state and fail here.
TEST_F(PlanVsRun, ExpertParallelZeroShardsExpertsOverTheirGroup) {
  const std::string moe =
      "--model.moe_experts=4 --model.moe_every=2 --train.grad_accum=2 --parallel.ep=2 "
      "--moe.capacity_factor=0 ";
  const json one = run(2, "ep_zero1", moe + "--zero.stage=1");
  const RunPlan p = planned("ep_zero1", 2);
  const json step = last_step("ep_zero1");
  ASSERT_GT(p.prediction.experts.optimizer, 0.0);
  expect_agreement(one, {"dp"});
  expect_exact_memory(step, p.prediction.memory);
  for (int stage : {0, 2, 3}) {
    SCOPED_TRACE(stage);
    const std::string name = "ep_zero" + std::to_string(stage);
    expect_agreement(run(2, name, moe + "--zero.stage=" + std::to_string(stage)), {"dp"});
    expect_exact_memory(last_step(name), planned(name, 2).prediction.memory);
  }
}

}  // namespace
}  // namespace tetra

namespace tetra {
namespace {

// Llama runs (model.arch = llama: RMSNorms, q, k and v with 2 key/value heads for 4 query heads,
// RoPE, a SwiGLU MLP of width 160, no biases, no wpe, an untied lm_head or the embedding tied)
// as the GPT-2 runs above: every memory category of rank 0 exactly as planned (the MoE runs'
// check; the GPT-2 runs' total within 5% holds too), the bytes of every group exactly, under each
// recomputation, each ZeRO stage over 2 data-parallel ranks, 2 tensor-parallel ranks (with sequence
// parallelism) and 2 pipeline stages.
class PlanVsRunLlama : public PlanVsRun {
 protected:
  static constexpr const char* kLlama = "--model.arch=llama --model.n_kv_head=2 --model.ffn=160 ";

  // A Llama run of `flags` on `ranks` ranks, checked against its plan; its plan.
  RunPlan check(int ranks, const std::string& name, const std::string& flags,
                const std::vector<std::string>& groups) {
    const json j = run(ranks, name, kLlama + flags);
    expect_agreement(j, groups);
    const RunPlan p = planned(name, ranks);
    EXPECT_TRUE(p.model.llama());
    EXPECT_TRUE(p.shape.model.llama());
    expect_memory_exact(name, last_step(name), p.prediction.memory);
    return p;
  }
};

TEST_F(PlanVsRunLlama, OneRankUnderEachRecomputation) {
  for (const char* r : {"none", "selective", "full"}) {
    SCOPED_TRACE(r);
    check(1, std::string("llama_") + r, std::string("--train.recompute=") + r, {});
  }
  const RunPlan tied = check(1, "llama_tied", "--model.tie_embeddings=true", {});
  EXPECT_TRUE(tied.shape.model.tie_embeddings);
}

TEST_F(PlanVsRunLlama, DataParallelEveryZeroStage) {
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE(stage);
    check(2, "llama_dp" + std::to_string(stage),
          "--zero.stage=" + std::to_string(stage) + " --train.grad_accum=2", {"dp"});
  }
  check(2, "llama_dp3_tied", "--zero.stage=3 --model.tie_embeddings=true", {"dp"});
}

TEST_F(PlanVsRunLlama, TensorParallel) {
  check(2, "llama_tp", "--parallel.tp=2 --parallel.dp=1", {"tp"});
  check(2, "llama_tp_sp", "--parallel.tp=2 --parallel.dp=1 --tp.sequence_parallel=true", {"tp"});
  check(2, "llama_tp_sp_full",
        "--parallel.tp=2 --parallel.dp=1 --tp.sequence_parallel=true --train.recompute=full",
        {"tp"});
}

// Rank 0 holds the first stage (its one end unit: embed_tokens); the last stage's units are
// checked in process (run_plan_test.cc, EveryPartAllocatesWhatThePlanSays).
TEST_F(PlanVsRunLlama, PipelineParallel) {
  for (const char* schedule : {"1f1b", "gpipe"}) {
    SCOPED_TRACE(schedule);
    const std::string name = std::string("llama_pp_") + schedule;
    check(2, name,
          std::string("--parallel.pp=2 --parallel.dp=1 --train.grad_accum=4 --pp.schedule=") +
              schedule,
          {"pp"});
  }
  check(2, "llama_pp_tied",
        "--parallel.pp=2 --parallel.dp=1 --train.grad_accum=4 --model.tie_embeddings=true", {"pp"});
  // The zero-bubble schedules: the activations hold the copies of the weight-gradient products'
  // operands of every micro-batch between its B and its W (plan::weight_grad_copies), on ZB-V's
  // rank 0 the head's (its logits' gradient) too.
  for (const char* schedule : {"zb_h1", "zb_v --pp.chunks=2"}) {
    SCOPED_TRACE(schedule);
    const RunPlan p =
        check(2, std::string("llama_pp_") + std::string(schedule).substr(0, 4),
              std::string("--parallel.pp=2 --parallel.dp=1 --train.grad_accum=4 --pp.schedule=") +
                  schedule,
              {"pp"});
    EXPECT_GT(plan::weight_grad_copies(p.shape), 0);
  }
}

// Context parallelism (docs/context_parallel.md): the ring's, the all-gather's and Ulysses' bytes
// exactly as planned, and every memory category to the byte: T/cp tokens' activations, attention's
// saved log-sum-exp, the K/V chunks in flight, ZeRO over dp x cp; with tensor parallelism (one
// key/value head per rank) and with full recomputation (the ring runs again in backward).
TEST_F(PlanVsRunLlama, ContextParallel) {
  check(2, "llama_cp_ring", "--parallel.cp=2", {"cp"});
  check(2, "llama_cp_all_gather", "--parallel.cp=2 --cp.attention=all_gather", {"cp"});
  check(2, "llama_cp_ulysses", "--parallel.cp=2 --cp.attention=ulysses", {"cp"});
  // The hybrid: all-to-alls over pairs, the ring across the two pairs.
  check(4, "llama_cp4_ulysses2", "--parallel.cp=4 --cp.attention=ulysses --cp.ulysses=2", {"cp"});
  check(4, "llama_cp2_dp2_zero3_full",
        "--parallel.cp=2 --zero.stage=3 --train.recompute=full --train.grad_accum=2", {"cp", "dp"});
  check(4, "llama_cp2_tp2_sp", "--parallel.cp=2 --parallel.tp=2 --tp.sequence_parallel=true",
        {"cp", "tp", "dp"});
}

}  // namespace
}  // namespace tetra
