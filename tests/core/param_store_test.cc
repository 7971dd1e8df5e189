// The parameter store: layout by units, ZeRO shards and tensor slices that initialise and load
// exactly the serial values, and owned segments that cover every element once across ranks.
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
