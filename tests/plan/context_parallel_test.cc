// Context parallelism in the planner (docs/plan.md, "Context parallelism"): the sequence split
// divides every per-token byte by cp, ZeRO shards over dp * cp, and ring attention's traffic is
// cp_ring_traffic's formula.
#include <gtest/gtest.h>

#include "plan/comm_cost.h"
#include "plan/ledger.h"
#include "plan/presets.h"
#include "plan/run_memory.h"
#include "plan/tetra_run.h"

namespace tetra::plan {
namespace {

ModelSpec small_model() {
  ModelSpec m = model_preset("gpt2-124m");
  m.seq = 2048;
  m.max_seq = 2048;
  return m;
}

Layout cp_layout(int64_t cp, int64_t dp = 1) {
  Layout l;
  l.dp = dp;
  l.zero = 1;
  l.micro_batch = 2;
  l.microbatches = 4;
  l.recompute = Recompute::none;
  l.cp = cp;
  return l;
}

// The seeds' ledger: activations (every layer's per-token bytes, the logits) are exactly 1/cp with
// a flash kernel; with a materialized one cp also drops the T x T scores, since the split's
// attention is blockwise. ZeRO-1's optimizer shard is over dp * cp ranks, so dp 2 x cp 2 holds
// what dp 4 does.
TEST(ContextParallel, LedgerActivationsScaleByOneOverCp) {
  const ModelSpec m = small_model();
  TrainingSpec flash, materialized;
  flash.attention = Attention::flash;
  materialized.attention = Attention::materialized;
  const MemoryBreakdown one = memory_per_device(m, flash, cp_layout(1));
  for (int64_t cp : {2, 4}) {
    SCOPED_TRACE(cp);
    const MemoryBreakdown split = memory_per_device(m, flash, cp_layout(cp));
    EXPECT_DOUBLE_EQ(split.activations * double(cp), one.activations);
    EXPECT_DOUBLE_EQ(split.params, one.params);
    EXPECT_DOUBLE_EQ(memory_per_device(m, materialized, cp_layout(cp)).activations,
                     split.activations);
  }
  EXPECT_GT(memory_per_device(m, materialized, cp_layout(1)).activations, one.activations);
  const TrainingSpec t;
  const MemoryBreakdown dp2cp2 = memory_per_device(m, t, cp_layout(2, 2));
  const MemoryBreakdown dp4 = memory_per_device(m, t, cp_layout(1, 4));
  EXPECT_DOUBLE_EQ(dp2cp2.optimizer, dp4.optimizer);
  EXPECT_DOUBLE_EQ(dp2cp2.grads, dp4.grads);
  EXPECT_LT(dp2cp2.optimizer, memory_per_device(m, t, cp_layout(1, 2)).optimizer);
}

// tetra's own ledger (run_memory): every per-token buffer is exactly 1/cp. Attention's saved state
// becomes each local row's log-sum-exp (B·NH·T/cp per layer) where the CPU kernel kept the T x T
// probabilities and a flash one the log-sum-exp of all T rows; the flat layout pads and shards
// over dp * cp.
TEST(ContextParallel, RunMemoryPerTokenCategoriesScaleByOneOverCp) {
  const ModelSpec m = small_model();
  TrainingSpec t;
  t.precision = Precision::Fp32;
  const double L = double(m.n_layer), B = 2, NH = double(m.n_head), T = double(m.seq), f32 = 4;
  const double KV = double(m.d_model);  // GPT-2: as many key/value columns as query ones
  for (bool flash : {false, true}) {
    SCOPED_TRACE(flash);
    RunOptions o;
    o.flash_attention = flash;
    const RunMemory one = run_memory(run_shape(m, t, cp_layout(1), o));
    // Attention's state per layer and micro-batch in flight (one, on one stage), and in backward
    // its saved state and scratch once: the probabilities (or a flash kernel's log-sum-exp) at
    // cp = 1.
    const double state_one = B * NH * T * (flash ? 1.0 : T) * f32;
    for (int64_t cp : {2, 4}) {
      SCOPED_TRACE(cp);
      const RunMemory split = run_memory(run_shape(m, t, cp_layout(cp), o));
      const double Tl = T / double(cp), c = Tl / 2, lse = B * NH * Tl * f32;
      EXPECT_DOUBLE_EQ(split.activations, (one.activations - L * state_one) / double(cp) + L * lse);
      // The ring's scratch: the local rows' packed K|V six times, the delta rows, and on the CPU
      // one c x c block's scores and probabilities.
      const double ring =
          (6 * B * Tl * 2 * KV + B * Tl * NH + (flash ? 0.0 : 2 * B * NH * c * c)) * f32;
      EXPECT_DOUBLE_EQ(split.temporaries,
                       (one.temporaries - 2 * state_one) / double(cp) + lse + ring);
      EXPECT_DOUBLE_EQ(split.params, one.params);
    }
  }
  const RunShape dp2cp2 = run_shape(m, t, cp_layout(2, 2));
  EXPECT_EQ(dp2cp2.dp_cp(), 4);
  EXPECT_DOUBLE_EQ(flat_layout(dp2cp2).shard, flat_layout(run_shape(m, t, cp_layout(1, 4))).shard);
  EXPECT_DOUBLE_EQ(run_memory(dp2cp2).optimizer,
                   run_memory(run_shape(m, t, cp_layout(1, 4))).optimizer);
}

// By hand: B = 2 sequences of T = 8192 tokens over cp = 4 ranks, 8 KV heads of 128 (kv_width
// 1024), bf16. A hop is one rank's K and V: 2 x 2048 x 2 x 1024 x 2 B = 16 MiB; forward 3 hops,
// 48 MiB; backward twice that (K, V again and dK, dV back), 96 MiB.
TEST(ContextParallel, RingBytesByHand) {
  const RingTraffic r = cp_ring_traffic(2, 8192, 4, 1024, 2.0);
  EXPECT_EQ(r.hops, 3);
  EXPECT_DOUBLE_EQ(r.hop, 16.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(r.forward, 48.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(r.backward, 96.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(r.total(), 144.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(cp_ring_traffic(2, 8192, 1, 1024, 2.0).total(), 0.0);
  // Exposed = max(0, comm - compute) under full overlap; none without overlap.
  EXPECT_DOUBLE_EQ(ring_exposed_seconds(3.0, 1.0, 1.0), 2.0);
  EXPECT_DOUBLE_EQ(ring_exposed_seconds(1.0, 3.0, 1.0), 0.0);
  EXPECT_DOUBLE_EQ(ring_exposed_seconds(3.0, 1.0, 0.0), 3.0);
  EXPECT_DOUBLE_EQ(ring_exposed_seconds(3.0, 1.0, 0.5), 2.5);
}

// The planner's communication: a cp row of (cp-1) sends forward and as many backward per layer
// and micro-batch on the intra-node link, and the gradients reduced over dp * cp ranks.
TEST(ContextParallel, CommunicationHasTheRingAndReducesOverDpTimesCp) {
  ModelSpec m = model_preset("llama3-8b");
  m.seq = 8192;
  ClusterSpec c = cluster_preset("h100");
  c.gpus = 16;
  TrainingSpec t;
  Layout l = cp_layout(4, 2);
  l.tp = 2;
  l.micro_batch = 1;
  const std::vector<DimComm> comm = comm_per_step(m, c, t, l, 1.0);
  const DimComm* cp = nullptr;
  const DimComm* dp = nullptr;
  for (const DimComm& d : comm) {
    if (d.dim == "cp") cp = &d;
    if (d.dim == "dp") dp = &d;
  }
  ASSERT_NE(cp, nullptr);
  ASSERT_NE(dp, nullptr);
  EXPECT_EQ(dp->group, 8);
  EXPECT_EQ(cp->group, 4);
  EXPECT_TRUE(cp->intra_node);  // tp 2 x cp 4 = 8 ranks: one node
  EXPECT_EQ(cp->calls, 2 * 3 * 32 * 4);
  // 8 KV heads of 128 over tp 2: kv_width 512; a hop of 1 x 2048 x 2 x 512 x 2 B = 4 MiB.
  const double hop = 4.0 * 1024 * 1024;
  EXPECT_DOUBLE_EQ(cp->bytes, 32 * 4 * 3 * (3 * hop));
  EXPECT_GT(cp->seconds, 0.0);
  EXPECT_DOUBLE_EQ(cp->overlap, 0.0);  // evaluate_layout sets it against attention
}

}  // namespace
}  // namespace tetra::plan
