// Communication formulas against 000 データ並列 and 004 通信総量.
#include "plan/comm_cost.h"

#include <gtest/gtest.h>

#include "plan/presets.h"
#include "plan/tetra_run.h"

namespace tetra::plan {
namespace {

TEST(CommCost, RingAllReduceMovesTwoD) {
  EXPECT_DOUBLE_EQ(ring_allreduce_bytes(100, 4), 150);
  EXPECT_DOUBLE_EQ(ring_gather_bytes(100, 4), 75);
  // 70B bf16 gradients: D = 140 GB -> ~280 GB per GPU -> ~5.6 s on a 50 GB/s link.
  const double bytes = ring_allreduce_bytes(140e9, 1024);
  EXPECT_NEAR(bytes, 280e9, 0.5e9);
  EXPECT_NEAR(link_seconds(bytes, 0, 50e9, 0), 5.6, 0.02);
}

TEST(CommCost, GroupPlacement) {
  EXPECT_TRUE(group_in_node(1, 8, 8));     // TP 8
  EXPECT_FALSE(group_in_node(8, 16, 8));   // DP over nodes
  EXPECT_TRUE(group_in_node(2, 4, 8));     // EP 4 next to TP 2
  EXPECT_FALSE(group_in_node(128, 4, 8));  // PP across nodes
}

Layout seeds_layout(int zero) {
  return Layout{8, 4, 16, 1, zero, Schedule::one_f_one_b, 1, 1, 128, {}};
}

const DimComm& find(const std::vector<DimComm>& v, const std::string& dim) {
  for (const auto& d : v) {
    if (d.dim == dim) return d;
  }
  throw std::runtime_error("no " + dim);
}

TEST(CommCost, SeventyBOn512H100) {
  const ModelSpec m = model_preset("llama3-70b");
  const ClusterSpec c = [] {
    ClusterSpec c = cluster_preset("h100");
    c.gpus = 512;
    return c;
  }();
  const TrainingSpec t;
  const auto comm = comm_per_step(m, c, t, seeds_layout(1), 0.2);
  const DimComm& tp = find(comm, "tp");
  EXPECT_TRUE(tp.intra_node);
  EXPECT_EQ(tp.calls, 4 * 20 * 128);  // 2 fwd + 2 bwd per layer per micro-batch
  EXPECT_DOUBLE_EQ(tp.overlap, 0.0);  // critical path
  EXPECT_DOUBLE_EQ(tp.bytes, tp.calls * 2.0 * 7 / 8 * (8192.0 * 8192 * 2));
  const DimComm& dp = find(comm, "dp");
  EXPECT_FALSE(dp.intra_node);
  EXPECT_GT(dp.overlap, 0.0);
  const DimComm& pp = find(comm, "pp");
  EXPECT_FALSE(pp.intra_node);
  EXPECT_EQ(pp.calls, 2 * 128);
  EXPECT_DOUBLE_EQ(pp.bytes, pp.calls * 8192.0 * 8192 * 2 / 8);
  // ZeRO-3 moves ~1.5x the bytes of plain DP per micro-batch (000: 2D -> ~3D).
  Layout one = seeds_layout(0);
  one.microbatches = 1;
  one.dp = 16;
  Layout three = one;
  three.zero = 3;
  const double d0 = find(comm_per_step(m, c, t, one, 0.2), "dp").bytes;
  const double d3 = find(comm_per_step(m, c, t, three, 0.2), "dp").bytes;
  EXPECT_NEAR(d3 / d0, 1.5, 1e-9);
}

TEST(CommCost, MoeAllToAll) {
  const ModelSpec m = model_preset("mixtral-8x7b");
  ClusterSpec c = cluster_preset("h100");
  c.gpus = 64;
  const TrainingSpec t;
  const Layout l{1, 1, 64, 8, 1, Schedule::one_f_one_b, 1, 1, 1, {}};
  const auto dims = comm_per_step(m, c, t, l, 0.2);  // find() returns a reference into it
  const DimComm& ep = find(dims, "ep");
  EXPECT_TRUE(ep.intra_node);
  // tokens x top_k x hidden x 2 bytes, twice per layer forward and twice backward.
  EXPECT_EQ(ep.calls, 4 * 32);
  EXPECT_DOUBLE_EQ(ep.bytes, ep.calls * 7.0 / 8 * 4096 * 2 * 4096 * 2);
}

}  // namespace
}  // namespace tetra::plan

namespace tetra::plan {
namespace {

ClusterSpec h100(int64_t gpus) {
  ClusterSpec c = cluster_preset("h100");
  c.gpus = gpus;
  return c;
}

TEST(Collectives, PlacementFollowsTheRankOrder) {
  const GroupPlacement tp = place_group(1, 8, 8);
  EXPECT_EQ(tp.per_node, 8);
  EXPECT_EQ(tp.nodes, 1);
  const GroupPlacement dp = place_group(2, 64, 8);  // TP 2: four DP ranks per node
  EXPECT_EQ(dp.per_node, 4);
  EXPECT_EQ(dp.nodes, 16);
  const GroupPlacement pp = place_group(512, 16, 8);  // TP 8 x DP 64: one stage per 64 nodes
  EXPECT_EQ(pp.per_node, 1);
  EXPECT_EQ(pp.nodes, 16);
  EXPECT_EQ(pp.span, 961);
}

// A ring pays its latency once per step, 2(N-1) steps for an all-reduce: small collectives over
// large groups are latency, and NCCL takes the double binary tree for them (log N steps), the ring
// for large buffers, whose bandwidth term is lower.
TEST(Collectives, LatencyGrowsWithTheGroupAndNcclPicksTreeOrRing) {
  const ClusterSpec c = h100(8192);
  const double small = 64e3;
  const double at16 = collective_seconds(Collective::all_reduce, small, place_group(8, 16, 8), c);
  const double at1024 =
      collective_seconds(Collective::all_reduce, small, place_group(8, 1024, 8), c);
  EXPECT_GT(at1024, at16);
  EXPECT_EQ(allreduce_algorithm(small, place_group(8, 1024, 8), c), "tree");
  EXPECT_EQ(allreduce_algorithm(4e9, place_group(8, 16, 8), c), "ring");
  // Reduce-scatter and all-gather have no tree: their latency is the ring's, (N-1) steps.
  const double rs =
      collective_seconds(Collective::reduce_scatter, small, place_group(8, 1024, 8), c);
  EXPECT_GT(rs, 1023 * c.inter_latency);
}

// Inside the node first: with 8 ranks of the group per node each NIC carries an eighth of the
// buffer across, so the inter-node part is 8x smaller than a flat ring over the NICs.
TEST(Collectives, HierarchicalAllReduceUsesEveryNic) {
  const ClusterSpec c = h100(128);
  const double D = 1e9;
  const double flat = collective_seconds(Collective::all_reduce, D, place_group(8, 16, 8), c);
  const double hier = collective_seconds(Collective::all_reduce, D, place_group(1, 128, 8), c);
  EXPECT_LT(hier, flat / 4);
  const double inter = 2.0 * 15 / 16 * (D / 8) / (c.inter_bw * c.link_efficiency);
  EXPECT_GT(hier, inter);
}

// Small buckets do not reach the link's bandwidth (NCCL's protocols): half of it at half_bw_bytes.
TEST(Collectives, SmallMessagesAreLessEfficient) {
  ClusterSpec c = h100(8);
  c.intra_latency = 0;
  const GroupPlacement g = place_group(1, 8, 8);
  const double big = collective_seconds(Collective::all_reduce, 1e9, g, c) / 1e9;
  const double tiny =
      collective_seconds(Collective::all_reduce, c.half_bw_bytes, g, c) / c.half_bw_bytes;
  EXPECT_NEAR(tiny / big, 2.0, 0.01);  // per byte, twice as long at half the bandwidth
}

// Above the pod's non-blocking tier an oversubscribed fabric divides the bandwidth: a group that
// spans more nodes than a pod holds is slower than one inside a pod.
TEST(Collectives, OversubscribedFabricSlowsGroupsThatLeaveThePod) {
  ClusterSpec c = h100(8192);
  c.nodes_per_pod = 384;
  c.oversubscription = 7;
  const double D = 4e9;
  const double inside =
      collective_seconds(Collective::reduce_scatter, D, place_group(8, 256, 8), c);
  const double across =
      collective_seconds(Collective::reduce_scatter, D, place_group(8, 1024, 8), c);
  EXPECT_GT(across, 2.5 * inside);
  c.oversubscription = 1;
  EXPECT_LT(collective_seconds(Collective::reduce_scatter, D, place_group(8, 1024, 8), c),
            1.1 * inside);
}

// 000 ストラグラー: the synchronous step waits for the slowest of N; with a 1% spread per device
// the expected maximum of 8,192 is ~3.8 standard deviations away.
TEST(Collectives, StragglerTaxIsTheExpectedMaximum) {
  EXPECT_EQ(straggler_fraction(1, 0.01), 0.0);
  EXPECT_EQ(straggler_fraction(8192, 0.0), 0.0);
  EXPECT_NEAR(straggler_fraction(2, 1.0), 0.56, 0.03);  // E[max of 2] = 1/sqrt(pi)
  EXPECT_NEAR(straggler_fraction(8192, 0.01), 0.038, 0.002);
  EXPECT_LT(straggler_fraction(512, 0.01), straggler_fraction(8192, 0.01));
}

}  // namespace
}  // namespace tetra::plan

namespace tetra::plan {
namespace {

const GroupTraffic* group(const std::vector<GroupTraffic>& traffic, const std::string& dim) {
  for (const GroupTraffic& g : traffic) {
    if (g.dim == dim) return &g;
  }
  return nullptr;
}

// A tetra MoE run's traffic as its trainer counts it: per MoE block and micro-batch 4 all-to-alls
// (dispatch and combine, forward and backward; 6 with full recomputation) of the N·k rows of C
// floats a rank puts in (parallel/expert_parallel.cc's row_bytes), of which (ep-1)/ep leave it;
// ZeRO's collectives on expert units over their edp group of dp/ep ranks, none when that is one
// rank; and a MoE block's MLP, whole on every tp rank, without the MLP's tp reductions.
TEST(RunTraffic, MoeRunsExchangeRowsAndReduceExpertsOverTheirGroup) {
  ModelSpec m;
  m.name = "moe";
  m.n_layer = 4, m.d_model = 64, m.n_head = m.n_kv_head = 4, m.ffn = 256, m.vocab_size = 64;
  m.max_seq = m.seq = 32;
  m.moe.experts = 4, m.moe.top_k = 2, m.moe.every = 2;  // blocks 1 and 3
  TrainingSpec t;
  t.precision = Precision::Fp32;
  Layout l{1, 1, 2, 2, 1, Schedule::one_f_one_b, 1, 2, 3, {}, Recompute::none};
  const RunShape s = run_shape(m, t, l);
  EXPECT_EQ(s.local_moe_layers(), 2);
  const double rows = 2 * 32 * 2, row_bytes = rows * 64 * 4;
  std::vector<GroupTraffic> traffic = run_traffic(s, l, 1e9);
  const GroupTraffic* ep = group(traffic, "ep");
  ASSERT_NE(ep, nullptr);
  EXPECT_EQ(ep->group, 2);
  EXPECT_DOUBLE_EQ(ep->calls(), 3 * 2 * 4);
  EXPECT_DOUBLE_EQ(ep->buffer_bytes(), 3 * 2 * 4 * row_bytes);
  EXPECT_DOUBLE_EQ(ep->bytes(), ep->buffer_bytes() / 2);
  // ep = dp: every expert unit's edp group is its rank alone; the dense units reduce over dp.
  const FlatLayout f = flat_layout(s);
  const GroupTraffic* dp = group(traffic, "dp");
  ASSERT_NE(dp, nullptr);
  EXPECT_DOUBLE_EQ(dp->bytes(), 0.5 * (4 + 4) * (f.total - f.expert_total));
  // dp = 4: the expert units' reduce-scatters and gathers run over edp groups of 2.
  Layout wide = l;
  wide.dp = 4;
  const RunShape w = run_shape(m, t, wide);
  const FlatLayout fw = flat_layout(w);
  traffic = run_traffic(w, wide, 1e9);
  EXPECT_DOUBLE_EQ(group(traffic, "dp")->bytes(),
                   0.75 * 8 * (fw.total - fw.expert_total) + 0.5 * 8 * fw.expert_total);
  // Full recomputation exchanges the forward's rows again.
  Layout full = l;
  full.recompute = Recompute::full;
  traffic = run_traffic(run_shape(m, t, full), full, 1e9);
  EXPECT_DOUBLE_EQ(group(traffic, "ep")->buffer_bytes(), 3 * 2 * 6 * row_bytes);
  // Tensor parallelism: a dense block all-reduces twice forward and twice backward, a MoE block
  // once forward (attention's projection) and twice backward.
  Layout tp{2, 1, 1, 1, 0, Schedule::one_f_one_b, 1, 2, 3, {}, Recompute::none};
  traffic = run_traffic(run_shape(m, t, tp), tp, 1e9);
  const double btc = 2 * 32 * 64 * 4;
  // Blocks, the embedding's lookup, ln_f, the cross-entropy's maxima and sums.
  EXPECT_DOUBLE_EQ(group(traffic, "tp")->bytes(),
                   3 * (2 * 4 + 2 * 3 + 1 + 1) * btc + 3 * (2 * 32 * 4 + 2 * 2 * 32 * 4));
  // Priced: the all-to-alls exposed, on the link of the ep group.
  ClusterSpec c = cluster_preset("h100");
  c.gpus = 2;
  const std::vector<DimComm> comm = run_comm(run_traffic(s, l, 1e9), l, c, 0.1);
  for (const DimComm& d : comm) {
    if (d.dim != "ep") continue;
    EXPECT_GT(d.seconds, 0);
    EXPECT_EQ(d.overlap, 0);
    EXPECT_EQ(d.algorithm, "all-to-all");
  }
}

// A Llama run's tensor-parallel traffic is GPT-2's but for the norms: under sequence parallelism
// a block's two RMSNorm weights' gradients (2C, not a LayerNorm's 4C with the biases) and the
// head's model.norm (C, not 2C) are summed over the group; the gathers and reductions of the
// residual stream are the same (q, k and v read one gathered norm output, gate and up another).
TEST(RunTraffic, LlamaSumsOnlyItsNormsWeights) {
  ModelSpec g;
  g.name = "gpt2";
  g.n_layer = 4, g.d_model = 64, g.n_head = g.n_kv_head = 4, g.ffn = 256, g.vocab_size = 64;
  g.max_seq = g.seq = 32;
  ModelSpec m = g;
  m.name = "llama";
  m.arch = Arch::llama;
  m.tie_embeddings = false;
  m.n_kv_head = 2, m.ffn = 160;
  TrainingSpec t;
  t.precision = Precision::Fp32;
  Layout l{2, 1, 1, 1, 0, Schedule::one_f_one_b, 1, 2, 3, {}, Recompute::none};
  RunOptions o;
  o.sequence_parallel = true;
  const double C = 64 * 4.0;  // bytes of a row of C floats
  // An all-reduce over 2 ranks sends its buffer once: 3 micro-batches x (4 blocks x 2C + C).
  EXPECT_DOUBLE_EQ(group(run_traffic(run_shape(g, t, l, o), l, 1e9), "tp")->bytes() -
                       group(run_traffic(run_shape(m, t, l, o), l, 1e9), "tp")->bytes(),
                   3 * (4 * 2 * C + C));
  o.sequence_parallel = false;
  EXPECT_DOUBLE_EQ(group(run_traffic(run_shape(g, t, l, o), l, 1e9), "tp")->bytes(),
                   group(run_traffic(run_shape(m, t, l, o), l, 1e9), "tp")->bytes());
}

}  // namespace
}  // namespace tetra::plan
