// The memory and compute ledgers against the seeds' worked figures (000 なぜ分散するか, ZeRO).
#include "plan/ledger.h"

#include <gtest/gtest.h>

#include "plan/presets.h"
#include "plan/run_memory.h"

namespace tetra::plan {
namespace {

TEST(Ledger, SixteenBytesPerParam) {
  const StateBytes b = state_bytes_per_param(Precision::Bf16Mixed);
  EXPECT_EQ(b.weights, 2);
  EXPECT_EQ(b.grads, 2);
  EXPECT_EQ(b.master, 4);
  EXPECT_EQ(b.adam_m, 4);
  EXPECT_EQ(b.adam_v, 4);
  EXPECT_EQ(b.total(), 16);
  EXPECT_EQ(state_bytes_per_param(Precision::Fp32).total(), 16);
}

TEST(Ledger, StateOfSevenSeventyAndFourHundredFiveB) {
  EXPECT_DOUBLE_EQ(zero_state_memory(7e9, 1, 0, Precision::Bf16Mixed).total(), 112e9);
  EXPECT_DOUBLE_EQ(zero_state_memory(70e9, 1, 0, Precision::Bf16Mixed).total(), 1.12e12);
  EXPECT_DOUBLE_EQ(zero_state_memory(405e9, 1, 0, Precision::Bf16Mixed).total(), 6.48e12);
  // 112 GB does not fit an 80 GB H100; 1.12 TB does not fit a node of 8 (640 GB).
  EXPECT_GT(112e9, 80e9);
  EXPECT_GT(1.12e12, 8 * 80e9);
}

TEST(Ledger, FourOFiveBNeedsEightyTwoH100sBeforeOneToken) {
  // The computed Llama 3 405B (405.8e9 parameters) needs ceil(6.49 TB / 80 GB) = 82.
  const double P = double(count_params(model_preset("llama3-405b")).total());
  EXPECT_EQ(min_devices_for_state(P, 80e9, Precision::Bf16Mixed), 82);
}

TEST(Ledger, ZeroStageFormulas) {
  const double P = 1e9;
  const int64_t N = 8;
  auto total = [&](int stage) {
    return zero_state_memory(P, N, stage, Precision::Bf16Mixed).total();
  };
  EXPECT_DOUBLE_EQ(total(0), 16 * P);
  EXPECT_DOUBLE_EQ(total(1), 4 * P + 12 * P / N);
  EXPECT_DOUBLE_EQ(total(2), 2 * P + 14 * P / N);
  EXPECT_DOUBLE_EQ(total(3), 16 * P / N);
  const StateMemory z2 = zero_state_memory(P, N, 2, Precision::Bf16Mixed);
  EXPECT_DOUBLE_EQ(z2.params, 2 * P);
  EXPECT_DOUBLE_EQ(z2.grads, 2 * P / N);
  EXPECT_DOUBLE_EQ(z2.optimizer, 12 * P / N);
}

TEST(Ledger, SeventyBWithZero3On64GpusIs17Point5GB) {
  EXPECT_DOUBLE_EQ(zero_state_memory(70e9, 64, 3, Precision::Bf16Mixed).total(), 17.5e9);
}

TEST(Ledger, SeventyBOnFifteenTTokens) {
  // 6.3e24 FLOPs; ~500 GPU-years at 40% of 990 TFLOP/s; ~22 days on 8,192 GPUs.
  const double flops = 6.0 * 70e9 * 15e12;
  EXPECT_DOUBLE_EQ(flops, 6.3e24);
  const double s = gpu_seconds(flops, 990e12, 0.4);
  EXPECT_NEAR(s, 1.6e10, 0.05e10);
  EXPECT_NEAR(s / kSecondsPerYear, 500, 10);
  EXPECT_NEAR(s / 8192 / 86400, 22, 1);
  EXPECT_NEAR(s / 8 / kSecondsPerYear, 63, 1);
}

TEST(Ledger, ComputeLedgerUsesSixPTPlusAttention) {
  const ModelSpec m = model_preset("llama3-70b");
  const ComputeLedger c = compute_ledger(m, 15e12, 8192, 990e12, 0.4);
  // P of 6PT is the weights a token is multiplied by: the model's 70.55e9 parameters less the
  // embedding lookup (128256 x 8192) and the norms, 69.50e9; still the seeds' 6.3e24 on 15T tokens.
  const ParamCounts pc = count_params(m);
  const double P = double(pc.matmul_active());
  EXPECT_EQ(pc.total() - pc.matmul_active(), 128256LL * 8192 + 80 * 2 * 8192 + 8192);
  EXPECT_DOUBLE_EQ(c.flops_6pt, 6 * P * 15e12);
  EXPECT_NEAR(c.flops_6pt, 6.3e24, 0.05e24);
  EXPECT_DOUBLE_EQ(c.flops_total - c.flops_6pt, 12.0 * 80 * 8192 * 8192 * 15e12);
  EXPECT_NEAR(c.gpu_years, c.flops_total / (990e12 * 0.4) / kSecondsPerYear, 1e-9);
  const FlopsPerToken full = flops_per_token(m, Recompute::full);
  EXPECT_NEAR(full.recompute / full.model(), 1.0 / 3.0, 1e-12);  // one more forward: 1/3 more
}

// The MFU numerator of `tetra train` and `tetra plan` alike (docs/training.md): for GPT-2,
// 6 x (12 L C^2 + V C) + 12 L C T: the blocks' matrices and the tied head, not wte's lookup, wpe,
// biases or LayerNorms; positions beyond the trained T (max_seq) change the parameters only.
TEST(Ledger, ModelFlopsOfGpt2AreTheMatmulWeightsPlusAttention) {
  ModelSpec m = model_preset("gpt2-124m");
  const double L = 12, C = 768, V = 50257;
  for (const int64_t T : {1024, 64}) {
    m.seq = T;
    m.max_seq = 1024;
    const FlopsPerToken f = flops_per_token(m, Recompute::none);
    EXPECT_DOUBLE_EQ(f.model(), 6 * (12 * L * C * C + V * C) + 12 * L * C * double(T)) << T;
    EXPECT_EQ(count_params(m).total(), 124439808) << T;
  }
  // Recomputation is hardware work, not model work.
  EXPECT_DOUBLE_EQ(flops_per_token(m, Recompute::full).model(),
                   flops_per_token(m, Recompute::none).model());
}

// MFU counts a MoE model's ACTIVE FLOPs: 6 per weight a token is multiplied by, the router and
// top_k experts of each MoE block. More experts add only their router's columns; another expert
// per token adds its MLP's matrices.
TEST(Ledger, MoeModelFlopsScaleWithTopKNotExperts) {
  ModelSpec m = model_preset("gpt2-124m");
  m.moe.every = 2;  // 6 MoE blocks of 12
  m.moe.experts = 8;
  m.moe.top_k = 2;
  const double C = 768, moe = 6;
  auto flops = [](const ModelSpec& x) { return flops_per_token(x, Recompute::none).model(); };
  const double dense = flops(model_preset("gpt2-124m"));
  EXPECT_DOUBLE_EQ(flops(m) - dense, 6 * moe * (8 * C * C + 8 * C));
  ModelSpec wide = m;
  wide.moe.experts = 64;
  EXPECT_DOUBLE_EQ(flops(wide) - flops(m), 6 * moe * (64 - 8) * C);
  ModelSpec switch_k1 = m;
  switch_k1.moe.top_k = 1;
  EXPECT_DOUBLE_EQ(flops(m) - flops(switch_k1), 6 * moe * 8 * C * C);
  // One expert and one route per token: the dense FLOPs and one router column per MoE block.
  ModelSpec one = m;
  one.moe.experts = one.moe.top_k = 1;
  EXPECT_DOUBLE_EQ(flops(one) - dense, 6 * moe * C);
}

TEST(Ledger, ActivationsMatchKorthikantiForGpt) {
  // GPT (ffn = 4C, multi-head): 34*C + 5*NH*T bytes per token per layer, /t with SP.
  ModelSpec m = model_preset("gpt3-175b");
  const double C = 12288, NH = 96, T = 2048;
  EXPECT_DOUBLE_EQ(activation_bytes_per_token_layer(m, Recompute::none, Precision::Bf16Mixed, 1),
                   34 * C + 5 * NH * T);
  EXPECT_DOUBLE_EQ(
      activation_bytes_per_token_layer(m, Recompute::selective, Precision::Bf16Mixed, 8),
      34 * C / 8);
  EXPECT_DOUBLE_EQ(activation_bytes_per_token_layer(m, Recompute::full, Precision::Bf16Mixed, 8),
                   2 * C / 8);
}

TEST(Ledger, WithoutSequenceParallelismNormsAndMasksStayWhole) {
  // Korthikanti et al. Table 2, tensor parallelism alone: 10*C + 24*C/t + 5*NH*T/t.
  ModelSpec m = model_preset("gpt3-175b");
  const double C = 12288, NH = 96, T = 2048;
  EXPECT_DOUBLE_EQ(activation_bytes_per_token_layer(m, Recompute::none, Precision::Bf16Mixed, 8,
                                                    Attention::materialized, false),
                   10 * C + 24 * C / 8 + 5 * NH * T / 8);
  // At tp 1 there is nothing to split either way; full recomputation keeps the whole input.
  EXPECT_DOUBLE_EQ(activation_bytes_per_token_layer(m, Recompute::none, Precision::Bf16Mixed, 1,
                                                    Attention::materialized, false),
                   34 * C + 5 * NH * T);
  EXPECT_DOUBLE_EQ(activation_bytes_per_token_layer(m, Recompute::full, Precision::Bf16Mixed, 8,
                                                    Attention::materialized, false),
                   2 * C);
}

TEST(Ledger, LayoutMemorySplitsStateOverModelParallelRanks) {
  const ModelSpec m = model_preset("llama3-70b");
  TrainingSpec t;
  Layout l{8, 4, 16, 1, 1, Schedule::one_f_one_b, 1, 1, 128, {}};
  const MemoryBreakdown mem = memory_per_device(m, t, l);
  // The tightest pipeline rank's state: the first holds the embedding and four micro-batches.
  EXPECT_EQ(mem.rank, 0);
  const LocalParams lp = rank_params(m, l, mem.rank);
  const double local = lp.dense + lp.expert;
  EXPECT_NEAR(local, double(count_params(m).total()) / 32, 0.05 * local);  // ~1/32 of the model
  EXPECT_DOUBLE_EQ(mem.params, 2 * local);
  EXPECT_DOUBLE_EQ(mem.optimizer, 12 * local / 16);
  EXPECT_GT(mem.activations, 0);
  EXPECT_LT(mem.total(), 80e9);
}

}  // namespace
}  // namespace tetra::plan

namespace tetra::plan {
namespace {

// A GPT-2 run's shape (n_head key/value heads, a 4C MLP, tied), V padded to Vp.
RunShape gpt2_run(int64_t V, int64_t Vp, int64_t L, int64_t C, int64_t NH, int64_t T, int64_t B) {
  RunShape s;
  s.model.vocab_size = V, s.padded_vocab = Vp, s.model.n_layer = L, s.model.d_model = C;
  s.model.n_head = s.model.n_kv_head = NH, s.model.ffn = 4 * C, s.model.max_seq = T;
  s.micro_batch = B, s.seq = T;
  return s;
}

// A flash attention (run.device = cuda) keeps the row log-sum-exp instead of the probabilities:
// per layer B·NH·T elements saved and as many of scratch instead of B·NH·T² each, and no bf16
// copies for attention. Everything else of the run's memory is the CPU backend's.
TEST(RunMemory, FlashAttentionKeepsNoTByTMatrix) {
  RunShape s = gpt2_run(50257, 50304, 12, 768, 12, 1024, 4);
  RunShape flash = s;
  flash.flash_attention = true;
  const RunMemory cpu = run_memory(s), gpu = run_memory(flash);
  const double f32 = 4, B = 4, NH = 12, T = 1024, L = 12;
  EXPECT_DOUBLE_EQ(cpu.activations - gpu.activations, f32 * L * B * NH * (T * T - T));
  EXPECT_DOUBLE_EQ(cpu.temporaries - gpu.temporaries, 2 * f32 * B * NH * (T * T - T));
  EXPECT_EQ(cpu.params, gpu.params);
  EXPECT_EQ(cpu.comm, gpu.comm);
  // Selective recomputation drops the saved state on both.
  s.recompute = flash.recompute = Recompute::selective;
  EXPECT_DOUBLE_EQ(run_memory(s).activations, run_memory(flash).activations);
}

// A MoE block's buffers are the trainer's bounds (model/moe.cc, MoeShape::of): its local experts
// take at most ceil(cf·T·k/E) routes of each sequence that meets them, and no more than every
// route; each expert's rows are padded to 32. Under expert parallelism a rank sends its N·k routes
// and its E/ep experts receive from every rank of the group.
TEST(RunMemory, MoeRowsAreTheTrainersBounds) {
  RunShape s;
  s.micro_batch = 2, s.seq = 32, s.model.moe.experts = 4, s.model.moe.top_k = 2,
  s.model.moe.capacity_factor = 1.25;
  // cap = ceil(1.25·32·2/4) = 20 routes per sequence, 40 of the micro-batch's per expert: 160 >
  // the 128 routes there are.
  MoeRows r = moe_rows(s);
  EXPECT_EQ(r.tokens, 64);
  EXPECT_EQ(r.expert_rows, 128 + 4 * 31);
  EXPECT_EQ(r.send_rows + r.recv_rows, 0);
  s.model.moe.capacity_factor = 0.5;  // cap = 8: 16 rows per expert
  EXPECT_EQ(moe_rows(s).expert_rows, 64 + 4 * 31);
  s.model.moe.capacity_factor = 0;  // no capacity: every route
  EXPECT_EQ(moe_rows(s).expert_rows, 128 + 4 * 31);
  s.model.moe.capacity_factor = 0.5;
  s.ep = s.dp = 2;  // two experts here, 16 rows each from either rank's micro-batch
  r = moe_rows(s);
  EXPECT_EQ(r.expert_rows, 64 + 2 * 31);
  EXPECT_EQ(r.send_rows, 128);
  EXPECT_EQ(r.recv_rows, 64);
}

// What a MoE block keeps instead of the dense MLP's input and GELU output (model/moe.cc,
// MoeActs): logits (N,E), gates (N,k), the experts' rows in and out (R,C) and hidden activations
// (R,4C), with its routing's int32 index vectors (N·k + R); backward's shared MoeScratch; the
// flat layout's router in the block's unit and the experts in a unit of their own.
TEST(RunMemory, MoeBlocksKeepTheirRowsAndRouting) {
  RunShape dense = gpt2_run(64, 64, 4, 64, 4, 32, 2);
  RunShape s = dense;
  s.model.moe.experts = 4, s.model.moe.top_k = 2, s.model.moe.every = 2;  // blocks 1 and 3
  EXPECT_EQ(s.local_moe_layers(), 2);
  const double N = 64, C = 64, E = 4, k = 2, R = N * k + E * 31, f32 = 4;
  const RunMemory d = run_memory(dense), m = run_memory(s);
  const double acts = N * E + N * k + R * (2 * C + 8 * C) + (N * k + R);
  EXPECT_DOUBLE_EQ(m.activations - d.activations, f32 * 2 * (acts - 8 * N * C));
  EXPECT_DOUBLE_EQ(m.temporaries - d.temporaries, f32 * (N * E + N * k + R * C + R * 4 * C));
  const FlatLayout f = flat_layout(s);
  const double expert = 2 * 4 * C * C + 5 * C;
  EXPECT_EQ(f.experts, E * expert);
  EXPECT_EQ(f.moe_block, f.block - (2 * 4 * C * C + 5 * C) + E * C);
  EXPECT_EQ(f.total, flat_layout(dense).total + 2 * (E * expert + E * C - expert));
  EXPECT_DOUBLE_EQ(m.params, f32 * f.total);
  EXPECT_DOUBLE_EQ(m.optimizer, 2 * m.params);
  // Full recomputation keeps no block, and reruns the larger of a dense and a MoE block (one
  // buffer, either view) with a MoE block's routing.
  s.recompute = dense.recompute = Recompute::full;
  EXPECT_DOUBLE_EQ(run_memory(s).temporaries - run_memory(dense).temporaries,
                   f32 * ((N * E + N * k + R * C + R * 4 * C) + acts - 8 * N * C));
}

// Expert units are sharded over the expert-data-parallel group (dp/ep ranks), each padded to 16
// times its size; dense units over dp. ZeRO's workspaces hold each class apart: the blocks' at
// the largest block's size, the expert units' at theirs, each by the stage's bound.
TEST(RunMemory, ExpertUnitsAreShardedOverTheExpertDataParallelGroup) {
  RunShape s = gpt2_run(64, 64, 4, 64, 4, 32, 2);
  s.model.moe.experts = 4, s.model.moe.top_k = 2, s.model.moe.every = 2, s.ep = 2, s.dp = 4,
  s.zero = 3;
  EXPECT_EQ(s.edp(), 2);
  const FlatLayout f = flat_layout(s);
  const double expert = 2 * 4 * 64 * 64 + 5 * 64, f32 = 4;
  EXPECT_EQ(f.experts, 2 * expert);  // this rank's two experts, a multiple of 16 x 2 already
  EXPECT_EQ(f.expert_total, 2 * f.experts);
  EXPECT_DOUBLE_EQ(f.shard, (f.total - f.expert_total) / 4 + f.expert_total / 2);
  const RunMemory m = run_memory(s);
  EXPECT_DOUBLE_EQ(m.params, f32 * f.shard);
  // Stage 3 with one prefetch: the root twice, 1 + 1 + 2 blocks (dense, the larger) and 2 + 2
  // expert units (there are two).
  EXPECT_DOUBLE_EQ(m.comm, f32 * (2 * f.root + 4 * f.block + 4 * f.experts));
  EXPECT_DOUBLE_EQ(expert_memory(s).comm, f32 * 4 * f.experts);
  EXPECT_DOUBLE_EQ(expert_memory(s).params, f32 * f.expert_total / 2);
  s.zero = 2;
  EXPECT_DOUBLE_EQ(run_memory(s).comm, f32 * (f.root + 2 * f.block + 2 * f.experts));
  // With bf16 reductions each workspace whose group communicates has a bf16 staging buffer: all
  // of them over edp = 2, the dense ones only when ep = dp leaves the experts' group one rank.
  s.reduce_bf16 = true;
  EXPECT_DOUBLE_EQ(run_memory(s).comm, 1.5 * f32 * (f.root + 2 * f.block + 2 * f.experts));
  s.ep = 4;
  const FlatLayout g = flat_layout(s);
  EXPECT_DOUBLE_EQ(run_memory(s).comm, f32 * (1.5 * (g.root + 2 * g.block) + 2 * g.experts));
}

// A tetra Llama run (model.arch = llama, model/block.cc): per block down_proj (C,ffn), up_proj
// and gate_proj (ffn,C), o_proj and q_proj (C,C), k_proj and v_proj (KVH·hs,C) and two RMSNorm
// weights, no biases; the root embed_tokens, an untied lm_head (the embedding's shape) and
// model.norm, no wpe. Unpadded, the flat layout is count_params' model.
TEST(RunMemory, LlamaUnitsAreItsTensors) {
  ModelSpec m;
  m.name = "llama";
  m.arch = Arch::llama;
  m.n_layer = 4, m.d_model = 64, m.n_head = 4, m.n_kv_head = 2, m.ffn = 160, m.vocab_size = 64;
  m.max_seq = m.seq = 32;
  m.tie_embeddings = false;
  RunShape s;
  s.model.vocab_size = s.padded_vocab = 64, s.model.n_layer = 4, s.model.d_model = 64,
  s.model.n_head = 4, s.model.max_seq = 32;
  s.micro_batch = 2, s.seq = 32;
  s.model.arch = Arch::llama, s.model.n_kv_head = 2, s.model.ffn = 160,
  s.model.tie_embeddings = false;
  const double C = 64, KV = 2 * 16, F = 160, V = 64;
  const double block = 3 * C * F + 2 * C * C + 2 * KV * C + 2 * C;
  FlatLayout f = flat_layout(s);
  EXPECT_EQ(f.block, block);
  EXPECT_EQ(f.ends, (std::vector<double>{2 * V * C + C}));
  EXPECT_EQ(f.total, double(count_params(m).total()));
  m.tie_embeddings = s.model.tie_embeddings = true;
  f = flat_layout(s);
  EXPECT_EQ(f.ends, (std::vector<double>{V * C + C}));
  EXPECT_EQ(f.total, double(count_params(m).total()));
  EXPECT_EQ(count_params(m).head, 0);
  EXPECT_EQ(count_params(m).head_matmul, V * C);  // the tied head still multiplies

  // Pipeline stages: the first holds one end unit, the root (embed_tokens); the last the head
  // (lm_head and model.norm), or, tied, a "wte" unit with the copy and the head (model.norm).
  s.chunks = {{2, 1, 0}};
  s.embedding = true, s.head = false;
  EXPECT_EQ(flat_layout(s).ends, (std::vector<double>{V * C}));
  s.chunks = {{2, 1, 2}};
  s.embedding = false, s.head = true;
  EXPECT_EQ(flat_layout(s).ends, (std::vector<double>{V * C, C}));
  s.model.tie_embeddings = false;
  EXPECT_EQ(flat_layout(s).ends, (std::vector<double>{V * C + C}));
  // A unit is padded to 16 x dp, a tensor aligned to 16: model.norm (64) and lm_head share one.
  s.dp = 3;
  EXPECT_EQ(flat_layout(s).ends, (std::vector<double>{4176}));  // 4160 to a multiple of 48
  EXPECT_EQ(flat_layout(s).units.front().elements, 4176);       // the head runs first
}

// What a Llama block keeps (model/block.cc, BlockActs): both RMSNorm outputs (BT,C) with one rstd
// per row each, the residual after attention, the attention output (BT,C/tp), q, k and v
// (BT,W) with W = (C + 2·KVH·hs)/tp, the probabilities (B·NH/tp·T² per layer: one per query head,
// grouped-query attention or not) and the SwiGLU's gate, up and product (BT,ffn/tp) each; its
// backward scratch dln, dqkv, datty, dgate and dup, the attention's; the head an rstd per row.
TEST(RunMemory, LlamaBlocksKeepTheirActivations) {
  RunShape s;
  s.model.vocab_size = s.padded_vocab = 64, s.model.n_layer = 4, s.model.d_model = 64,
  s.model.n_head = 4, s.model.max_seq = 32;
  s.micro_batch = 2, s.seq = 32;
  s.model.arch = Arch::llama, s.model.n_kv_head = 2, s.model.ffn = 160;
  const double BT = 64, B = 2, T = 32, C = 64, W = 64 + 2 * 32, H = 160, V = 64, NH = 4, f32 = 4;
  const double att = B * NH * T * T;
  const double saves = 2 * BT * C + 2 * BT + BT * C + BT * C + BT * W + att + 3 * BT * H;
  const double head = BT * C + BT + BT * V + BT;
  const RunMemory m = run_memory(s);
  EXPECT_DOUBLE_EQ(m.activations, f32 * (4 * saves + 5 * BT * C + head));
  const double scratch = BT * C + BT * W + 2 * att + BT * C + 2 * BT * H;
  EXPECT_DOUBLE_EQ(m.temporaries, f32 * (BT * C + scratch));
  s.recompute = Recompute::full;
  EXPECT_DOUBLE_EQ(run_memory(s).temporaries, f32 * (BT * C + scratch + saves - att + BT * C));
  EXPECT_DOUBLE_EQ(run_memory(s).activations, f32 * (5 * BT * C + head));
  // Mixed precision: the largest product's bf16 operands, here an MLP product's (BT,ffn) with a
  // (ffn,C) weight, more than attention's q, k, v and probabilities (the CPU backend's copies)
  // until T is longer.
  s.recompute = Recompute::none;
  s.bf16 = true;
  EXPECT_DOUBLE_EQ(run_memory(s).temporaries - m.temporaries, 2 * (BT * H + H * C));
  EXPECT_GT(BT * H + H * C, BT * W + att);
  s.seq = s.model.max_seq = 64;
  const double BT2 = 128, att2 = B * NH * 64 * 64;
  EXPECT_DOUBLE_EQ(
      run_memory(s).temporaries -
          [&] {
            RunShape fp32 = s;
            fp32.bf16 = false;
            return run_memory(fp32).temporaries;
          }(),
      2 * (BT2 * W + att2));
  s.seq = s.model.max_seq = 32;
  // Tensor parallelism with sequence parallelism: 2 key/value heads and 80 MLP channels a rank,
  // the residual's rows and the norms' statistics halved, and two norm weights' gradients.
  s.bf16 = false;
  s.tp = 2, s.sequence_parallel = true, s.padded_vocab = 128;
  const double rows = BT / 2, Wl = W / 2, Hl = H / 2, Vl = 64, attl = att / 2;
  const double saves2 =
      2 * BT * C + 2 * rows + rows * C + BT * C / 2 + BT * Wl + attl + 3 * BT * Hl;
  const double head2 = BT * C + rows + BT * Vl + BT;
  EXPECT_DOUBLE_EQ(run_memory(s).activations, f32 * (4 * saves2 + 5 * rows * C + head2));
  const double scratch2 = BT * C + BT * Wl + 2 * attl + BT * C / 2 + 2 * BT * Hl + BT * C + 2 * C;
  EXPECT_DOUBLE_EQ(run_memory(s).temporaries, f32 * (rows * C + scratch2));
}

}  // namespace
}  // namespace tetra::plan

namespace tetra::plan {
namespace {

// Activations tensor by tensor: Llama-style (RMSNorm, SwiGLU, GQA, no dropout) keeps the two norm
// inputs (4C), qkv's input, q, k and v and the attention output (6C + 4 kv_dim), the MLP's input,
// gate, up and their product (2C + 6 ffn); materialized attention adds the softmax output
// (2 NH T), a flash kernel keeps its row statistics (fp32 per head) instead.
TEST(Ledger, ActivationsTensorByTensorForLlama) {
  const ModelSpec m = model_preset("llama3-405b");
  const double C = 16384, kvd = 1024, ffn = 53248, NH = 128, T = 8192;
  const double dense = 12 * C + 4 * kvd + 6 * ffn;
  EXPECT_DOUBLE_EQ(activation_bytes_per_token_layer(m, Recompute::none, Precision::Bf16Mixed, 8,
                                                    Attention::materialized),
                   (dense + 2 * NH * T) / 8);
  EXPECT_DOUBLE_EQ(activation_bytes_per_token_layer(m, Recompute::none, Precision::Bf16Mixed, 8,
                                                    Attention::flash),
                   (dense + 4 * NH) / 8);
  // Selective recomputation is what a flash kernel does anyway.
  EXPECT_DOUBLE_EQ(activation_bytes_per_token_layer(m, Recompute::selective, Precision::Bf16Mixed,
                                                    8, Attention::flash),
                   activation_bytes_per_token_layer(m, Recompute::none, Precision::Bf16Mixed, 8,
                                                    Attention::flash));
  // Grouped-query attention keeps 8 KV heads' k and v, not 128.
  ModelSpec mha = m;
  mha.n_kv_head = mha.n_head;
  EXPECT_DOUBLE_EQ(activation_bytes_per_token_layer(mha, Recompute::none, Precision::Bf16Mixed, 8,
                                                    Attention::flash) -
                       activation_bytes_per_token_layer(m, Recompute::none, Precision::Bf16Mixed, 8,
                                                        Attention::flash),
                   4 * (C - kvd) / 8);
}

// The micro-batches each pipeline rank holds, walked through its program: 1F1B rank r holds
// p - r of them, interleaved more on the first rank (004 GPipe と 1F1B), GPipe all m; uneven
// stages weigh each by its layers.
TEST(Ledger, HeldActivationsFollowTheSchedule) {
  Layout l{1, 4, 1, 1, 0, Schedule::one_f_one_b, 1, 1, 8, {}};
  EXPECT_EQ(held_layer_microbatches(l, 16), (std::vector<double>{16, 12, 8, 4}));
  l.schedule = Schedule::gpipe;
  EXPECT_EQ(held_layer_microbatches(l, 16), (std::vector<double>{32, 32, 32, 32}));
  l.schedule = Schedule::interleaved;
  l.v = 2;
  const std::vector<double> inter = held_layer_microbatches(l, 16);
  EXPECT_GT(inter[0], 16);
  EXPECT_NEAR(inter[0], 16 * (1 + 3.0 / 8), 2.0);  // min(m,p)(1 + (p-1)/(p v)) stages of 4 layers
  l.schedule = Schedule::one_f_one_b;
  l.v = 1;
  l.split = {3, 4, 4, 5};
  EXPECT_EQ(held_layer_microbatches(l, 16), (std::vector<double>{12, 12, 8, 5}));
}

// The memory of a layout is its tightest pipeline rank's: with 1F1B the first holds the most
// micro-batches, unless a later one holds many more layers.
TEST(Ledger, MemoryIsTheTightestPipelineRanks) {
  const ModelSpec m = model_preset("llama3-70b");
  TrainingSpec t;
  Layout l{8, 4, 16, 1, 1, Schedule::one_f_one_b, 1, 1, 128, {}};
  EXPECT_EQ(memory_per_device(m, t, l).rank, 0);
  l.split = {2, 2, 2, 74};
  EXPECT_EQ(memory_per_device(m, t, l).rank, 3);
}

}  // namespace
}  // namespace tetra::plan
