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

// Context parallelism sits right after tp (Megatron's tp-cp-ep-dp-pp): every shape with cp of
// several world sizes keeps the rank formula, and its groups are the ranks it names.
TEST(MeshLayout, ContextParallelShapes) {
  const MeshDim dims[] = {MeshDim::tp,  MeshDim::dp, MeshDim::pp,  MeshDim::ep,
                          MeshDim::edp, MeshDim::cp, MeshDim::dpcp};
  int shapes = 0;
  for (int world : {2, 4, 8, 12, 16}) {
    for (int cp = 2; cp <= world; ++cp) {
      if (world % cp) continue;
      for (const MeshShape& base : all_shapes(world / cp)) {
        MeshShape s = base;
        s.cp = cp;
        SCOPED_TRACE(fmt::format("world {} dp {} tp {} pp {} ep {} cp {}", world, s.dp, s.tp, s.pp,
                                 s.ep, s.cp));
        const MeshLayout l = MeshLayout::make(MeshShape{0, s.tp, s.pp, s.ep, s.cp}, world);
        ASSERT_EQ(l.shape().dp, s.dp);
        std::set<std::tuple<int, int, int, int>> seen;
        for (int r = 0; r < world; ++r) {
          const MeshCoord c = l.coord(r);
          EXPECT_EQ(r, c.tp + s.tp * (c.cp + s.cp * (c.dp + s.dp * c.pp)));
          EXPECT_EQ(l.rank_of(c.dp, c.pp, c.tp, c.cp), r);
          seen.insert({c.dp, c.pp, c.tp, c.cp});
          for (MeshDim d : dims) {
            const std::vector<int> g = l.group_ranks(d, r);
            ASSERT_EQ(int(g.size()), l.size(d)) << mesh_dim_name(d);
            EXPECT_EQ(g[size_t(l.coordinate(d, r))], r) << mesh_dim_name(d);
            EXPECT_TRUE(std::is_sorted(g.begin(), g.end())) << mesh_dim_name(d);
            for (int q : g) {
              EXPECT_EQ(l.group_ranks(d, q), g) << mesh_dim_name(d);
              EXPECT_EQ(l.group_index(d, q), l.group_index(d, r)) << mesh_dim_name(d);
            }
          }
          // A cp group's ranks are tp apart; a dpcp group is dp*cp ranks tp apart, its coordinate
          // cp + CP*dp; an ep group is consecutive dp ranks of one cp coordinate.
          const std::vector<int> cpg = l.group_ranks(MeshDim::cp, r);
          for (size_t i = 1; i < cpg.size(); ++i) EXPECT_EQ(cpg[i] - cpg[i - 1], s.tp);
          const std::vector<int> dpcp = l.group_ranks(MeshDim::dpcp, r);
          for (size_t i = 1; i < dpcp.size(); ++i) EXPECT_EQ(dpcp[i] - dpcp[i - 1], s.tp);
          EXPECT_EQ(l.coordinate(MeshDim::dpcp, r), c.cp + s.cp * c.dp);
          const std::vector<int> ep = l.group_ranks(MeshDim::ep, r);
          for (size_t i = 1; i < ep.size(); ++i) EXPECT_EQ(ep[i] - ep[i - 1], s.tp * s.cp);
        }
        EXPECT_EQ(int(seen.size()), world);
        ++shapes;
      }
    }
  }
  EXPECT_GT(shapes, 40);
}

// The brief's example: 16 ranks, tp 2, cp 2, dp 2, pp 2. Rank 13 = tp 1 + 2 * (cp 0 + 2 * (dp 1 +
// 2 * pp 1)).
TEST(MeshLayout, ContextParallelKnownExample) {
  const MeshLayout l = MeshLayout::make(MeshShape{2, 2, 2, 1, 2}, 16);
  const MeshCoord c = l.coord(13);
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.cp, 0);
  EXPECT_EQ(c.dp, 1);
  EXPECT_EQ(c.pp, 1);
  EXPECT_EQ(l.coord(6).cp, 1);  // 6 = tp 0 + 2 * (cp 1 + 2 * dp 1)
  EXPECT_EQ(l.group_ranks(MeshDim::tp, 13), (std::vector<int>{12, 13}));
  EXPECT_EQ(l.group_ranks(MeshDim::cp, 13), (std::vector<int>{13, 15}));
  EXPECT_EQ(l.group_ranks(MeshDim::dp, 13), (std::vector<int>{9, 13}));
  EXPECT_EQ(l.group_ranks(MeshDim::pp, 13), (std::vector<int>{5, 13}));
  EXPECT_EQ(l.group_ranks(MeshDim::dpcp, 13), (std::vector<int>{9, 11, 13, 15}));
  EXPECT_EQ(l.coordinate(MeshDim::dpcp, 13), 2);  // cp 0 + 2 * dp 1
  EXPECT_EQ(l.group_ranks(MeshDim::dpcp, 0), (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(l.size(MeshDim::dpcp), 4);
  // dp = 0 infers world / (tp * cp * pp).
  EXPECT_EQ(MeshLayout::make(MeshShape{0, 2, 2, 1, 2}, 16).shape().dp, 2);
}

// With cp = 1 the dpcp group is the dp group, rank for rank and coordinate for coordinate.
TEST(MeshLayout, DpcpIsDpWithoutContextParallelism) {
  for (int world : {1, 4, 8, 12}) {
    for (const MeshShape& s : all_shapes(world)) {
      const MeshLayout l = MeshLayout::make(s, world);
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(l.group_ranks(MeshDim::dpcp, r), l.group_ranks(MeshDim::dp, r));
        EXPECT_EQ(l.coordinate(MeshDim::dpcp, r), l.coordinate(MeshDim::dp, r));
        EXPECT_EQ(l.group_index(MeshDim::dpcp, r), l.group_index(MeshDim::dp, r));
        EXPECT_EQ(l.group_ranks(MeshDim::cp, r), std::vector<int>{r});
      }
    }
  }
}

TEST(MeshLayout, ContextParallelSizesSayWhatWouldFit) {
  std::string e = error_of(MeshShape{0, 1, 1, 1, 0}, 8);
  EXPECT_NE(e.find("[mesh] parallel.cp=0 must be >= 1; use parallel.cp=1"), std::string::npos) << e;
  e = error_of(MeshShape{0, 2, 1, 1, 3}, 8);
  EXPECT_NE(e.find("tp*cp*pp = 2*3*1 = 6 does not divide the world size 8"), std::string::npos)
      << e;
  EXPECT_NE(e.find("parallel.cp must be one of {1, 2, 4}"), std::string::npos) << e;
  e = error_of(MeshShape{4, 2, 1, 1, 2}, 8);
  EXPECT_NE(e.find("dp*tp*cp*pp = 4*2*2*1 = 16 but the world has 8 ranks"), std::string::npos) << e;
  EXPECT_NE(e.find("set parallel.dp=2"), std::string::npos) << e;
}

// TP and CP are both intra-node: a TP x CP block of tp*cp consecutive ranks must sit on one host.
TEST(MeshLayout, ContextParallelAcrossNodesIsWarnedAbout) {
  const std::vector<std::string> hosts = {"a", "a", "a", "a", "b", "b", "b", "b"};
  EXPECT_EQ(tp_placement_warning(MeshLayout::make(MeshShape{0, 2, 1, 1, 2}, 8), hosts), "");
  EXPECT_EQ(tp_placement_warning(MeshLayout::make(MeshShape{0, 1, 1, 1, 4}, 8), hosts), "");
  // tp 2 alone fits a node, but tp 2 x cp 4 spans both.
  const std::string w = tp_placement_warning(MeshLayout::make(MeshShape{0, 2, 1, 1, 4}, 8), hosts);
  EXPECT_NE(w.find("parallel.tp=2 parallel.cp=4: the tp x cp block of ranks 0..7 spans hosts a, b "
                   "(at least one node runs only 4 rank(s))"),
            std::string::npos)
      << w;
  EXPECT_NE(w.find("use parallel.tp * parallel.cp <= 4"), std::string::npos) << w;
  EXPECT_NE(tp_placement_warning(MeshLayout::make(MeshShape{0, 1, 1, 1, 8}, 8), hosts), "");
}

TEST(MeshShape, FromConfig) {
  ConfigSchema schema = mesh_config_schema();
  Config c = Config::from_overrides(schema, {"parallel.tp=2", "parallel.ep=2"});
  MeshShape s = MeshShape::from_config(c);
  EXPECT_EQ(s.dp, 0);
  EXPECT_EQ(s.tp, 2);
  EXPECT_EQ(s.pp, 1);
  EXPECT_EQ(s.ep, 2);
  EXPECT_EQ(s.cp, 1);
  EXPECT_EQ(MeshShape::from_config(Config::from_overrides(schema, {"parallel.cp=4"})).cp, 4);
}

}  // namespace
}  // namespace tetra::parallel
