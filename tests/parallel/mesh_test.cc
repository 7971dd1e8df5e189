// Mesh rank arithmetic for many (dp, tp, pp, ep) shapes, without MPI.
#include "parallel/mesh.h"

#include <gtest/gtest.h>

#include <set>

#include "core/error.h"

namespace tetra::parallel {
namespace {

const MeshDim kDims[] = {MeshDim::tp, MeshDim::dp, MeshDim::pp, MeshDim::ep, MeshDim::edp};

std::vector<MeshShape> all_shapes(int world) {
  std::vector<MeshShape> out;
  for (int tp = 1; tp <= world; ++tp) {
    for (int pp = 1; pp <= world; ++pp) {
      if (world % (tp * pp)) continue;
      int dp = world / (tp * pp);
      for (int ep = 1; ep <= dp; ++ep) {
        if (dp % ep == 0) out.push_back(MeshShape{dp, tp, pp, ep});
      }
    }
  }
  return out;
}

void check_layout(const MeshLayout& l) {
  const MeshShape& s = l.shape();
  const int world = l.world_size();
  ASSERT_EQ(s.dp * s.tp * s.pp, world);
  std::set<std::tuple<int, int, int>> seen;
  for (int r = 0; r < world; ++r) {
    MeshCoord c = l.coord(r);
    EXPECT_EQ(l.rank_of(c.dp, c.pp, c.tp), r);
    seen.insert({c.dp, c.pp, c.tp});
    // Megatron order: tp fastest, then dp, then pp.
    EXPECT_EQ(r, c.tp + s.tp * (c.dp + s.dp * c.pp));
    EXPECT_EQ(c.dp, c.ep + s.ep * c.edp);
    for (MeshDim d : kDims) {
      std::vector<int> g = l.group_ranks(d, r);
      ASSERT_EQ(int(g.size()), l.size(d)) << mesh_dim_name(d);
      EXPECT_EQ(g[size_t(l.coordinate(d, r))], r) << mesh_dim_name(d);
      EXPECT_TRUE(std::is_sorted(g.begin(), g.end()));
      for (int q : g) {
        // Every member computes the same group and the same group index.
        EXPECT_EQ(l.group_ranks(d, q), g) << mesh_dim_name(d) << " rank " << r << " member " << q;
        EXPECT_EQ(l.group_index(d, q), l.group_index(d, r));
      }
    }
    // TP groups are contiguous ranks; EP groups are consecutive DP ranks.
    std::vector<int> tp = l.group_ranks(MeshDim::tp, r);
    EXPECT_EQ(tp.back() - tp.front(), s.tp - 1);
    std::vector<int> ep = l.group_ranks(MeshDim::ep, r);
    for (size_t i = 1; i < ep.size(); ++i) EXPECT_EQ(ep[i] - ep[i - 1], s.tp);
  }
  EXPECT_EQ(int(seen.size()), world);
  for (MeshDim d : kDims) {
    std::set<int> indices;
    for (int r = 0; r < world; ++r) indices.insert(l.group_index(d, r));
    EXPECT_EQ(int(indices.size()), world / l.size(d)) << mesh_dim_name(d);
    EXPECT_EQ(*indices.rbegin(), world / l.size(d) - 1);
  }
}

TEST(MeshLayout, EveryShapeOfManyWorldSizes) {
  int shapes = 0;
  for (int world : {1, 2, 3, 4, 6, 8, 12, 16, 24}) {
    for (const MeshShape& s : all_shapes(world)) {
      SCOPED_TRACE(fmt::format("world {} dp {} tp {} pp {} ep {}", world, s.dp, s.tp, s.pp, s.ep));
      check_layout(MeshLayout::make(s, world));
      ++shapes;
    }
  }
  EXPECT_GT(shapes, 100);
}

TEST(MeshLayout, KnownExample) {
  // 16 ranks, tp 2, pp 2, dp 4, ep 2: rank 13 = tp 1 + 2 * (dp 2 + 4 * pp 1).
  MeshLayout l = MeshLayout::make(MeshShape{4, 2, 2, 2}, 16);
  MeshCoord c = l.coord(13);
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.dp, 2);
  EXPECT_EQ(c.pp, 1);
  EXPECT_EQ(c.ep, 0);
  EXPECT_EQ(c.edp, 1);
  EXPECT_EQ(l.group_ranks(MeshDim::tp, 13), (std::vector<int>{12, 13}));
  EXPECT_EQ(l.group_ranks(MeshDim::dp, 13), (std::vector<int>{9, 11, 13, 15}));
  EXPECT_EQ(l.group_ranks(MeshDim::pp, 13), (std::vector<int>{5, 13}));
  EXPECT_EQ(l.group_ranks(MeshDim::ep, 13), (std::vector<int>{13, 15}));
  EXPECT_EQ(l.group_ranks(MeshDim::edp, 13), (std::vector<int>{9, 13}));
}

TEST(MeshLayout, DpZeroIsInferred) {
  MeshLayout l = MeshLayout::make(MeshShape{0, 2, 2, 1}, 8);
  EXPECT_EQ(l.shape().dp, 2);
}

std::string error_of(MeshShape s, int world) {
  try {
    MeshLayout::make(s, world);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(MeshLayout, InconsistentSizesSayWhatWouldFit) {
  std::string e = error_of(MeshShape{2, 2, 4, 1}, 8);
  EXPECT_NE(e.find("dp*tp*pp = 2*2*4 = 16 but the world has 8 ranks"), std::string::npos) << e;
  EXPECT_NE(e.find("parallel.dp=1"), std::string::npos) << e;
  e = error_of(MeshShape{0, 3, 1, 1}, 8);
  EXPECT_NE(e.find("does not divide the world size 8"), std::string::npos) << e;
  EXPECT_NE(e.find("{1, 2, 4, 8}"), std::string::npos) << e;
  e = error_of(MeshShape{4, 2, 1, 3}, 8);
  EXPECT_NE(e.find("parallel.ep=3 must divide dp=4"), std::string::npos) << e;
  EXPECT_NE(e.find("{1, 2, 4}"), std::string::npos) << e;
  e = error_of(MeshShape{0, 0, 1, 1}, 8);
  EXPECT_NE(e.find("[mesh] parallel sizes must be >= 1"), std::string::npos) << e;
}

// Seeds 000 and 004: TP stays inside a node. Two hosts of 2 ranks each: tp=2 fits, tp=4 spans both.
TEST(MeshLayout, TensorParallelAcrossNodesIsWarnedAbout) {
  const std::vector<std::string> hosts = {"a", "a", "b", "b"};
  EXPECT_EQ(tp_placement_warning(MeshLayout::make(MeshShape{0, 2, 1, 1}, 4), hosts), "");
  EXPECT_EQ(tp_placement_warning(MeshLayout::make(MeshShape{0, 1, 1, 1}, 4), hosts), "");
  const std::string w = tp_placement_warning(MeshLayout::make(MeshShape{0, 4, 1, 1}, 4), hosts);
  EXPECT_NE(w.find("parallel.tp=4: the tp group of rank 0 spans hosts a, b (at least one node "
                   "runs only 2 rank(s))"),
            std::string::npos)
      << w;
  EXPECT_NE(w.find("Seeds 000 and 004 keep tensor parallelism inside a node"), std::string::npos)
      << w;
  EXPECT_NE(w.find("use parallel.tp <= 2"), std::string::npos) << w;
  // Ranks placed round-robin: even tp=2 pairs straddle the hosts.
  EXPECT_NE(tp_placement_warning(MeshLayout::make(MeshShape{0, 2, 1, 1}, 4), {"a", "b", "a", "b"}),
            "");
}

TEST(MeshShape, FromConfig) {
  ConfigSchema schema = mesh_config_schema();
  Config c = Config::from_overrides(schema, {"parallel.tp=2", "parallel.ep=2"});
  MeshShape s = MeshShape::from_config(c);
  EXPECT_EQ(s.dp, 0);
  EXPECT_EQ(s.tp, 2);
  EXPECT_EQ(s.pp, 1);
  EXPECT_EQ(s.ep, 2);
}

}  // namespace
}  // namespace tetra::parallel
