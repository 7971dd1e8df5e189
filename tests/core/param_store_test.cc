// The parameter store: layout by units, ZeRO shards and tensor slices that initialise and load
// exactly the serial values, and owned segments that cover every element once across ranks;
// expert units sharded over a group of their own.
#include "core/param_store.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/error.h"

namespace tetra {
namespace {

// Two units with sizes that divide nothing: a "vocabulary" of 333 rows padded to 345 and drawn
// only up to row 333, a matrix, and vectors of odd lengths.
void register_tensors(ParamStore& s, Slice matrix_slice = {}) {
  s.begin_unit("a");
  ParamSpec m;
  m.name = "m";
  m.shape = {6, 10};
  m.decay = true;
  m.init = {ParamInit::Kind::normal, 0.02f, -1};
  m.slice = matrix_slice;
  s.add(m);
  ParamSpec b;
  b.name = "b";
  b.shape = {7};
  s.add(b);
  s.end_unit();
  s.begin_unit("b");
  ParamSpec v;
  v.name = "vocab";
  v.shape = {345, 5};
  v.decay = true;
  v.init = {ParamInit::Kind::normal, 0.02f, 333};
  s.add(v);
  ParamSpec one;
  one.name = "ones";
  one.shape = {3};
  one.init.kind = ParamInit::Kind::ones;
  s.add(one);
  s.end_unit();
}

TEST(ParamStore, UnitsArePaddedSoShardsAreEqualAndAligned) {
  for (int shards : {1, 2, 3, 4, 8}) {
    ParamStore s;
    register_tensors(s);
    s.finalize({shards, 0, false, false, true});
    size_t offset = 0, shard_offset = 0;
    for (const ParamUnit& u : s.units()) {
      EXPECT_EQ(u.offset, offset);
      EXPECT_GE(u.padded, u.size);
      EXPECT_EQ(u.padded % (16 * size_t(shards)), 0u);
      EXPECT_EQ(u.shard * size_t(shards), u.padded);
      EXPECT_EQ(u.shard_offset, shard_offset);
      offset += u.padded;
      shard_offset += u.shard;
    }
    EXPECT_EQ(s.flat_size(), offset);
    EXPECT_EQ(s.shard_size() * size_t(shards), s.flat_size());
    for (const ParamEntry& e : s.tensors()) EXPECT_EQ(e.offset % 16, 0u) << e.spec.name;
  }
}

TEST(ParamStore, OwnedSegmentsCoverEveryElementOnceAcrossRanks) {
  for (int shards : {1, 2, 3, 4}) {
    std::vector<int> seen;
    for (int r = 0; r < shards; ++r) {
      ParamStore s;
      register_tensors(s);
      s.finalize({shards, r, true, true, true});
      if (seen.empty()) seen.assign(s.flat_size(), 0);
      for (const OwnedSegment& g : s.owned()) {
        const ParamEntry& e = s.tensor(g.tensor);
        EXPECT_EQ(g.decay, e.spec.decay);
        EXPECT_LE(g.element + g.count, size_t(e.numel()));
        EXPECT_EQ(g.param_pos, g.grad_pos);
        EXPECT_EQ(g.param_pos, g.state_pos);
        EXPECT_LT(g.param_pos + g.count - 1, s.shard_size());
        for (size_t i = 0; i < g.count; ++i) ++seen[e.offset + g.element + i];
      }
    }
    ParamStore layout;
    register_tensors(layout);
    layout.finalize({shards, 0, true, true, true});
    for (const ParamEntry& e : layout.tensors()) {
      for (int64_t i = 0; i < e.numel(); ++i) {
        ASSERT_EQ(seen[e.offset + size_t(i)], 1)
            << shards << " shards, " << e.spec.name << " " << i;
      }
    }
  }
}

TEST(ParamStore, EveryShardingInitialisesTheSerialValuesBitwise) {
  ParamStore serial;
  register_tensors(serial);
  serial.finalize({});
  serial.init(42);
  for (int shards : {1, 2, 3, 4, 8}) {
    std::vector<float> gathered;  // the sharded layout's flat buffer, assembled from every rank
    std::vector<ParamEntry> layout;
    for (int r = 0; r < shards; ++r) {
      ParamStore s;
      register_tensors(s);
      s.finalize({shards, r, true, true, true});
      s.init(42);
      gathered.resize(s.flat_size(), -1.0f);
      layout = s.tensors();
      for (int u = 0; u < int(s.units().size()); ++u) {
        const ParamUnit& unit = s.units()[size_t(u)];
        std::memcpy(gathered.data() + s.shard_begin(u), s.params().data() + unit.shard_offset,
                    unit.shard * sizeof(float));
      }
    }
    for (size_t t = 0; t < layout.size(); ++t) {
      const ParamEntry& e = serial.tensor(TensorId(t));
      ASSERT_EQ(std::memcmp(gathered.data() + layout[t].offset, serial.params().data() + e.offset,
                            size_t(e.numel()) * sizeof(float)),
                0)
          << shards << " shards: " << e.spec.name;
    }
  }
  // The vocabulary's padding rows stay zero; its real rows are drawn.
  const ParamEntry& v = serial.tensor(serial.find("vocab"));
  const float* p = serial.params().data() + v.offset;
  for (int64_t i = 333 * 5; i < 345 * 5; ++i) EXPECT_EQ(p[i], 0.0f);
  EXPECT_NE(p[332 * 5], 0.0f);
}

TEST(ParamStore, SlicesInitialiseAndLoadTheirPartOfTheGlobalTensor) {
  ParamStore serial;
  register_tensors(serial);
  serial.finalize({});
  serial.init(7);
  const float* whole = serial.param(serial.find("m"));  // (6, 10)
  for (Slice slice : {Slice{0, 2, 3}, Slice{1, 4, 5}}) {
    ParamStore s;
    register_tensors(s, slice);
    s.finalize({});
    s.init(7);
    const TensorId id = s.find("m");
    const ParamEntry& e = s.tensor(id);
    const float* part = s.param(id);
    for (int64_t i = 0; i < e.numel(); ++i) {
      const int64_t row = slice.dim == 0 ? slice.offset + i / 10 : i / 5;
      const int64_t col = slice.dim == 1 ? slice.offset + i % 5 : i % 10;
      ASSERT_EQ(part[i], whole[row * 10 + col]) << "dim " << slice.dim << " element " << i;
    }
    std::vector<float> global(60);
    for (int i = 0; i < 60; ++i) global[size_t(i)] = float(i);
    s.load_global(id, global.data());
    for (int64_t i = 0; i < e.numel(); ++i) EXPECT_EQ(part[i], float(e.global_index(i)));
  }
}

// c_attn's tensor-parallel slice: the (6, 10) matrix as 3 blocks of 2 rows ({0, 1}, {2, 3},
// {4, 5}, like q, k and v); offset 1, extent 1 takes rows 1, 3 and 5, the same row of each block.
TEST(ParamStore, SlicesOfEveryPartTakeTheSameRowsOfEachBlock) {
  ParamStore serial;
  register_tensors(serial);
  serial.finalize({});
  serial.init(7);
  const float* whole = serial.param(serial.find("m"));  // (6, 10)
  ParamStore s;
  register_tensors(s, Slice{0, 1, 1, 3});
  s.finalize({});
  s.init(7);
  const TensorId id = s.find("m");
  ASSERT_EQ(s.tensor(id).local_shape, (Shape{3, 10}));
  const float* part = s.param(id);
  const int64_t rows[] = {1, 3, 5};
  for (int64_t i = 0; i < 30; ++i) {
    ASSERT_EQ(part[i], whole[rows[i / 10] * 10 + i % 10]) << "element " << i;
    EXPECT_EQ(s.tensor(id).global_index(i), rows[i / 10] * 10 + i % 10);
  }
}

// A mixture-of-experts layout: an expert unit (sharded over the expert-data-parallel group), a
// block and a root (over the data-parallel group), in backward order, with sizes that divide
// nothing.
void register_moe(ParamStore& s, ShardGroup experts = ShardGroup::expert) {
  s.begin_unit("h.1.experts", experts);
  ParamSpec w;
  w.name = "x.0.w";
  w.shape = {5, 7};
  w.decay = true;
  w.init = {ParamInit::Kind::normal, 0.02f, -1};
  s.add(w);
  ParamSpec b;
  b.name = "x.0.b";
  b.shape = {9};
  b.init.kind = ParamInit::Kind::ones;
  s.add(b);
  s.end_unit();
  s.begin_unit("h.1");
  ParamSpec m;
  m.name = "m";
  m.shape = {6, 10};
  m.decay = true;
  m.init = {ParamInit::Kind::normal, 0.02f, -1};
  s.add(m);
  s.end_unit();
  s.begin_unit("root");
  ParamSpec v;
  v.name = "vocab";
  v.shape = {33, 5};
  v.init = {ParamInit::Kind::normal, 0.02f, 31};
  s.add(v);
  s.end_unit();
}

// (dp, edp) sizes: ep 2, ep 4, experts replicated on every rank (edp 1), and ep 1 (edp = dp).
constexpr int kMoeShards[][2] = {{4, 2}, {8, 2}, {4, 1}, {3, 3}, {1, 1}};

Sharding moe_sharding(int shards, int index, int expert_shards, int expert_index) {
  Sharding sh{shards, index, true, true, true};
  sh.expert_shards = expert_shards;
  sh.expert_index = expert_index;
  return sh;
}

TEST(ParamStore, ExpertUnitsArePaddedAndShardedOverTheirOwnGroup) {
  for (const auto& [shards, expert_shards] : kMoeShards) {
    SCOPED_TRACE(std::to_string(shards) + " shards, experts over " + std::to_string(expert_shards));
    ParamStore s;
    register_moe(s);
    s.finalize(moe_sharding(shards, shards - 1, expert_shards, expert_shards - 1));
    size_t offset = 0, shard_offset = 0;
    for (int u = 0; u < int(s.units().size()); ++u) {
      const ParamUnit& unit = s.units()[size_t(u)];
      const bool expert = u == 0;
      EXPECT_EQ(unit.group, expert ? ShardGroup::expert : ShardGroup::dense);
      const size_t n = size_t(expert ? expert_shards : shards);
      EXPECT_EQ(unit.offset, offset);
      EXPECT_GE(unit.padded, unit.size);
      EXPECT_EQ(unit.padded % (16 * n), 0u);
      EXPECT_LT(unit.padded - unit.size, 16 * n);  // no more padding than needed
      EXPECT_EQ(unit.shard * n, unit.padded);
      EXPECT_EQ(unit.shard_offset, shard_offset);
      EXPECT_EQ(s.shard_begin(u), unit.offset + (n - 1) * unit.shard);
      offset += unit.padded;
      shard_offset += unit.shard;
    }
    EXPECT_EQ(s.flat_size(), offset);
    EXPECT_EQ(s.shard_size(), shard_offset);
    EXPECT_EQ(s.params().size(), shard_offset);
    EXPECT_EQ(s.grads().size(), shard_offset);
    EXPECT_EQ(s.state_size(), shard_offset);
  }
  // With the experts over the dp group the layout is the one of a store without expert units.
  for (int shards : {1, 2, 3, 4, 8}) {
    ParamStore moe, dense;
    register_moe(moe);
    register_moe(dense, ShardGroup::dense);
    moe.finalize(moe_sharding(shards, shards - 1, shards, shards - 1));
    dense.finalize({shards, shards - 1, true, true, true});
    ASSERT_EQ(moe.units().size(), dense.units().size());
    for (size_t u = 0; u < moe.units().size(); ++u) {
      EXPECT_EQ(moe.units()[u].padded, dense.units()[u].padded);
      EXPECT_EQ(moe.units()[u].shard_offset, dense.units()[u].shard_offset);
      EXPECT_EQ(moe.shard_begin(int(u)), dense.shard_begin(int(u)));
    }
    EXPECT_EQ(moe.shard_size(), dense.shard_size());
    EXPECT_EQ(moe.shard_size() * size_t(shards), moe.flat_size());
  }
}

// Every (dp index, edp index) pair: a dense element is owned once per dp index, an expert element
// once per edp index, and held() is the owned run of the parameters.
TEST(ParamStore, ExpertOwnedSegmentsAndHeldRunsCoverTheirUnitOncePerGroup) {
  for (const auto& [shards, expert_shards] : kMoeShards) {
    SCOPED_TRACE(std::to_string(shards) + " shards, experts over " + std::to_string(expert_shards));
    std::vector<int> seen, held;
    ParamStore layout;
    register_moe(layout);
    layout.finalize(moe_sharding(shards, 0, expert_shards, 0));
    seen.assign(layout.flat_size(), 0);
    held.assign(layout.flat_size(), 0);
    for (int i = 0; i < shards; ++i) {
      for (int e = 0; e < expert_shards; ++e) {
        ParamStore s;
        register_moe(s);
        s.finalize(moe_sharding(shards, i, expert_shards, e));
        for (const OwnedSegment& g : s.owned()) {
          const ParamEntry& t = s.tensor(g.tensor);
          const ParamUnit& u = s.units()[size_t(t.unit)];
          EXPECT_EQ(g.param_pos, g.grad_pos);
          EXPECT_EQ(g.param_pos, g.state_pos);
          // Inside this rank's slice of its unit, at the same place in the shard buffer.
          const size_t flat = t.offset + g.element;
          EXPECT_GE(flat, s.shard_begin(t.unit));
          EXPECT_LE(flat + g.count, s.shard_begin(t.unit) + u.shard);
          EXPECT_EQ(g.param_pos, u.shard_offset + (flat - s.shard_begin(t.unit)));
          for (size_t k = 0; k < g.count; ++k) ++seen[flat + k];
        }
        for (TensorId id = 0; id < TensorId(s.tensors().size()); ++id) {
          const ParamEntry& t = s.tensor(id);
          const ParamUnit& u = s.units()[size_t(t.unit)];
          const ParamStore::HeldRun r = s.held(id);
          if (r.count == 0) continue;
          const size_t flat = t.offset + size_t(r.first);
          EXPECT_EQ(r.data, s.params().data() + u.shard_offset + (flat - s.shard_begin(t.unit)));
          for (int64_t k = 0; k < r.count; ++k) ++held[flat + size_t(k)];
        }
      }
    }
    for (const ParamEntry& t : layout.tensors()) {
      const int want = t.unit == 0 ? shards : expert_shards;
      for (int64_t k = 0; k < t.numel(); ++k) {
        ASSERT_EQ(seen[t.offset + size_t(k)], want) << t.spec.name << " " << k;
        ASSERT_EQ(held[t.offset + size_t(k)], want) << t.spec.name << " " << k;
      }
    }
  }
}

TEST(ParamStore, ExpertShardsInitialiseAndLoadTheSerialValuesBitwise) {
  ParamStore serial;
  register_moe(serial);
  serial.finalize({});
  serial.init(42);
  for (const auto& [shards, expert_shards] : kMoeShards) {
    SCOPED_TRACE(std::to_string(shards) + " shards, experts over " + std::to_string(expert_shards));
    // The flat layout assembled from the slices of the dense units on every dp index and of the
    // expert unit on every edp index.
    std::vector<float> gathered, loaded;
    std::vector<ParamEntry> layout;
    for (int i = 0; i < shards; ++i) {
      for (int e = 0; e < expert_shards; ++e) {
        ParamStore s;
        register_moe(s);
        s.finalize(moe_sharding(shards, i, expert_shards, e));
        s.init(42);
        gathered.resize(s.flat_size(), -1.0f);
        layout = s.tensors();
        for (int u = 0; u < int(s.units().size()); ++u) {
          const ParamUnit& unit = s.units()[size_t(u)];
          std::memcpy(gathered.data() + s.shard_begin(u), s.params().data() + unit.shard_offset,
                      unit.shard * sizeof(float));
        }
        // load_global writes the held run of a global tensor of index values.
        const TensorId w = s.find("x.0.w");
        std::vector<float> global(35);
        for (int k = 0; k < 35; ++k) global[size_t(k)] = float(k);
        s.load_global(w, global.data());
        const ParamStore::HeldRun r = s.held(w);
        for (int64_t k = 0; k < r.count; ++k) ASSERT_EQ(r.data[k], float(r.first + k));
      }
    }
    for (size_t t = 0; t < layout.size(); ++t) {
      const ParamEntry& e = serial.tensor(TensorId(t));
      ASSERT_EQ(std::memcmp(gathered.data() + layout[t].offset, serial.params().data() + e.offset,
                            size_t(e.numel()) * sizeof(float)),
                0)
          << e.spec.name;
    }
  }
}

TEST(ParamStore, UnboundShardedUnitsAreRefusedByName) {
  ParamStore s;
  register_tensors(s);
  s.finalize({2, 1, true, true, true});
  try {
    s.param(0);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'m' used while its unit 'a' is not resident"),
              std::string::npos)
        << e.what();
  }
  std::vector<float> ws(s.units()[0].padded);
  s.bind_params(0, ws.data());
  EXPECT_EQ(s.param(1), ws.data() + s.tensor(1).offset);
}

}  // namespace
}  // namespace tetra
