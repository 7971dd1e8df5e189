// Context parallelism in the planner (docs/plan.md, "Context parallelism"): the sequence split
// divides every per-token byte by cp, ZeRO shards over dp * cp, ring attention's traffic is
// cp_ring_traffic's formula and Ulysses' cp_ulysses_traffic's, and a given cp takes whichever of
// the two makes the faster step on the cluster's links.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "plan/comm_cost.h"
#include "plan/layout_search.h"
#include "plan/ledger.h"
#include "plan/presets.h"
#include "plan/report.h"
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

// By hand, Llama 3 8B (32 heads, 8 KV heads of 128) at T = 8192, B = 1, cp 4, tp 2, bf16: a tp
// rank has 16 query and 4 key/value heads, a cp rank 4 and 1. The buffers are the 2048 local
// rows of qkv blocks (4 x (4 + 2) heads x 128 = 3072 columns: 12 MiB), out (16 x 128: 8 MiB)
// and delta (16: 64 KiB); 3/4 of each leaves the rank. Forward qkv + out = 15 MiB, backward
// 2 qkv + out + delta = 24.046875 MiB: more than the ring's 12 + 24 under this GQA. With as many
// key/value heads as query heads (GPT-2) Ulysses sends 2/cp of the ring's bytes.
TEST(ContextParallel, UlyssesBytesByHand) {
  const double MiB = 1024.0 * 1024;
  const UlyssesTraffic u = cp_ulysses_traffic(1, 8192, 4, 16, 4, 128, 2.0);
  EXPECT_DOUBLE_EQ(u.qkv, 12 * MiB);
  EXPECT_DOUBLE_EQ(u.out, 8 * MiB);
  EXPECT_DOUBLE_EQ(u.delta, MiB / 16);
  EXPECT_DOUBLE_EQ(u.forward(), 15 * MiB);
  EXPECT_DOUBLE_EQ(u.backward(), 24.046875 * MiB);
  EXPECT_GT(u.total(), cp_ring_traffic(1, 8192, 4, 4 * 128, 2.0).total());
  // Fewer key/value heads than cp: one each, replicated (2 of 16 over cp 4).
  EXPECT_DOUBLE_EQ(cp_ulysses_traffic(1, 8192, 4, 16, 2, 128, 2.0).qkv, 12 * MiB);
  // Multi-head, 12 heads of 64 (C 768), cp 4: qkv 3C and out C against the ring's 2C per hop.
  for (int64_t cp : {2, 4, 8}) {
    const UlyssesTraffic mha = cp_ulysses_traffic(2, 4096, cp, 12 - 12 % cp, 12 - 12 % cp, 64, 4);
    const RingTraffic ring = cp_ring_traffic(2, 4096, cp, (12 - 12 % cp) * 64, 4);
    EXPECT_DOUBLE_EQ(mha.forward(), ring.forward * 2 / double(cp)) << cp;
  }
  EXPECT_DOUBLE_EQ(cp_ulysses_traffic(1, 8192, 1, 16, 4, 128, 2.0).total(), 0.0);
}

// The planner's row for Ulysses: six all-to-alls per layer and micro-batch (eight under full
// recomputation), exposed, with the formula's bytes.
TEST(ContextParallel, CommunicationHasUlyssesAllToAlls) {
  ModelSpec m = model_preset("llama3-8b");
  m.seq = 8192;
  ClusterSpec c = cluster_preset("h100");
  c.gpus = 16;
  TrainingSpec t;
  Layout l = cp_layout(4, 2);
  l.tp = 2;
  l.micro_batch = 1;
  l.cp_attention = CpAttention::ulysses;
  for (Recompute r : {Recompute::none, Recompute::full}) {
    l.recompute = r;
    const std::vector<DimComm> comm = comm_per_step(m, c, t, l, 1.0);
    const DimComm* cp = nullptr;
    for (const DimComm& d : comm) {
      if (d.dim == "cp") cp = &d;
    }
    ASSERT_NE(cp, nullptr);
    const int64_t forwards = r == Recompute::full ? 2 : 1;
    EXPECT_EQ(cp->calls, (2 * forwards + 4) * 32 * 4);
    EXPECT_EQ(cp->algorithm, "all-to-all");
    const UlyssesTraffic u = cp_ulysses_traffic(1, 8192, 4, 16, 4, 128, 2.0);
    EXPECT_DOUBLE_EQ(cp->bytes, 32 * 4 * (double(forwards) * u.forward() + u.backward()));
    const LayoutEstimate e = evaluate_layout(m, c, t, l);
    for (const DimComm& d : e.comm) {
      if (d.dim == "cp") {
        EXPECT_DOUBLE_EQ(d.exposed(), d.seconds) << "Ulysses is not overlapped";
      }
    }
  }
  // Heads that do not split over cp are a layout problem for Ulysses, not for the ring: a tp rank's
  // 16 query heads over 32 cp ranks.
  l.recompute = Recompute::none;
  l.cp = 32;
  l.dp = 1;
  c.gpus = 64;
  EXPECT_NE(layout_problem(m, c, t, l).find("ulysses"), std::string::npos);
  l.cp_attention = CpAttention::ring;
  EXPECT_EQ(layout_problem(m, c, t, l).find("ulysses"), std::string::npos);
}

// A given cp without cp.attention: the plan keeps the fastest of the ring, Ulysses over the whole
// cp group and Ulysses over smaller groups with a ring across them. Multi-head attention over a
// slow link (the ring cannot hide its 1/(2/cp) more bytes) takes Ulysses; GQA with few key/value
// heads on NVLink (the ring's small K/V hide behind the blocks) the ring; Llama 3 8B at cp 16
// over two nodes of 8 on a slow inter-node link Ulysses inside each node and a ring of 2 across
// (the one hop between the nodes hides behind the blocks, where Ulysses over 16 sends half its
// all-to-alls over that link), and the ring on a fast one. The chosen step is the least of the
// candidates the report lists: every divisor of cp that splits the heads.
TEST(ContextParallel, PlanChoosesRingUlyssesOrHybridByTheLink) {
  struct Case {
    const char* model;
    int64_t cp, seq;
    double intra_gbs, inter_gbs;
    const char* want;
    size_t candidates;
  };
  for (const Case& k : {Case{"gpt2-124m", 4, 8192, 1.0, 0, "ulysses", 3},
                        Case{"llama3-8b", 4, 8192, 900.0, 0, "ring", 3},
                        Case{"llama3-8b", 16, 32768, 0, 25.0, "ulysses 8 x ring 2", 5},
                        Case{"llama3-8b", 16, 32768, 0, 400.0, "ring", 5}}) {
    SCOPED_TRACE(fmt::format("{} cp {} inter {}", k.model, k.cp, k.inter_gbs));
    PlanInputs in;
    in.model = model_preset(k.model);
    in.model.seq = k.seq;
    in.model.max_seq = k.seq;
    in.cluster = cluster_preset("h100");
    in.cluster.gpus = 2 * k.cp;
    if (k.intra_gbs > 0) in.cluster.intra_bw = k.intra_gbs * 1e9;
    if (k.inter_gbs > 0) in.cluster.inter_bw = k.inter_gbs * 1e9;
    in.training.global_batch_tokens = 8 * k.seq;
    in.layout.tp = 1;
    in.layout.pp = 1;
    in.layout.dp = 2;
    in.layout.cp = k.cp;
    in.layout.zero = 1;
    const ChosenLayout chosen = choose_layout(in);
    const Layout& l = chosen.chosen.layout;
    EXPECT_EQ(cp_attention_label(l.cp_attention, int(l.cp), int(l.cp_ulysses)), k.want);
    const nlohmann::json r = plan_report(in, 1);
    ASSERT_EQ(r["cp_attention"]["candidates"].size(), k.candidates) << r["cp_attention"].dump();
    double best = 1e30;
    for (const auto& cand : r["cp_attention"]["candidates"]) {
      best = std::min(best, cand["step_seconds"].get<double>());
    }
    EXPECT_EQ(r["cp_attention"]["chosen"], k.want);
    EXPECT_DOUBLE_EQ(chosen.chosen.step_seconds, best);
    // Fixed, it stays.
    in.layout.cp_attention = CpAttention::ring;
    EXPECT_EQ(choose_layout(in).chosen.layout.cp_attention, CpAttention::ring);
    in.layout.cp_attention = CpAttention::ulysses;
    in.layout.cp_ulysses = 2;
    EXPECT_EQ(choose_layout(in).chosen.layout.cp_ulysses, 2);
  }
}

// The hybrid's bytes (plan/comm_cost.h): all-to-alls over u ranks as Ulysses over u, on the T/cp
// rows of cp ranks, and the ring's hops across cp/u groups, each the group's u·T/cp rows of this
// rank's key/value heads. By hand, Llama 3 8B per tp rank (16 query, 4 key/value heads of 128),
// T = 8192, B = 1, cp 8, u 2, bf16: 1024 local rows; qkv blocks 2 x (8 + 2·2) heads x 128 = 3072
// columns = 6 MiB, out 16 x 128 = 4 MiB, delta 16 columns = 32 KiB, half of each sent; the ring's
// hop 2 x 1024 rows x 2 x 2 heads x 128 x 2 bytes = 2 MiB, 3 hops forward, 6 of twice that back.
// Its row in the ledger: the all-to-alls exposed, the ring's hops overlapped with the blocks.
TEST(ContextParallel, HybridBytesByHand) {
  const double MiB = 1024.0 * 1024;
  const UlyssesTraffic u = cp_ulysses_traffic(1, 8192, 8, 16, 4, 128, 2.0, 2);
  EXPECT_EQ(u.group, 2);
  EXPECT_DOUBLE_EQ(u.qkv, 6 * MiB);
  EXPECT_DOUBLE_EQ(u.out, 4 * MiB);
  EXPECT_DOUBLE_EQ(u.delta, MiB / 32);
  EXPECT_EQ(u.ring.hops, 3);
  EXPECT_DOUBLE_EQ(u.ring.hop, 2 * MiB);
  EXPECT_DOUBLE_EQ(u.forward(), 0.5 * (6 + 4) * MiB + 3 * 2 * MiB);
  EXPECT_DOUBLE_EQ(u.backward(), 0.5 * (2 * 6 + 4 + 1.0 / 32) * MiB + 6 * 2 * MiB);
  // The whole group is plain Ulysses: no ring.
  EXPECT_EQ(cp_ulysses_traffic(1, 8192, 8, 16, 4, 128, 2.0, 8).ring.hops, 0);
  EXPECT_DOUBLE_EQ(cp_ulysses_traffic(1, 8192, 8, 16, 4, 128, 2.0, 8).total(),
                   cp_ulysses_traffic(1, 8192, 8, 16, 4, 128, 2.0).total());

  ModelSpec m = model_preset("llama3-8b");
  m.seq = 8192;
  ClusterSpec c = cluster_preset("h100");
  c.gpus = 16;
  TrainingSpec t;
  Layout l = cp_layout(8, 1);
  l.tp = 2;
  l.micro_batch = 1;
  l.cp_attention = CpAttention::ulysses;
  l.cp_ulysses = 2;
  const LayoutEstimate e = evaluate_layout(m, c, t, l);
  std::vector<const DimComm*> cp;
  for (const DimComm& d : e.comm) {
    if (d.dim == "cp") cp.push_back(&d);
  }
  ASSERT_EQ(cp.size(), 2u);
  EXPECT_EQ(cp[0]->algorithm, "all-to-all");
  EXPECT_EQ(cp[0]->group, 2);
  EXPECT_DOUBLE_EQ(cp[0]->exposed(), cp[0]->seconds);
  EXPECT_EQ(cp[1]->algorithm, "p2p");
  EXPECT_EQ(cp[1]->group, 4);
  EXPECT_DOUBLE_EQ(cp[1]->bytes, 32 * l.microbatches * u.ring.total());
  EXPECT_LT(cp[1]->exposed(), cp[1]->seconds) << "the ring's hops overlap the blocks";
  // A group that does not divide cp, or heads that do not split over it, is refused.
  l.cp_ulysses = 3;
  EXPECT_NE(layout_problem(m, c, t, l).find("does not divide cp=8"), std::string::npos);
  l.cp_ulysses = 32;
  l.cp = 32;
  c.gpus = 64;
  EXPECT_NE(layout_problem(m, c, t, l).find("do not split 32 ways"), std::string::npos);
}

}  // namespace
}  // namespace tetra::plan
