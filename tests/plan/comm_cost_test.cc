// Communication formulas against 000 データ並列 and 004 通信総量.
#include "plan/comm_cost.h"

#include <gtest/gtest.h>

#include "plan/presets.h"

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
