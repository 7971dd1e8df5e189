// Single-process tests of the comm layer: splits, options, schema, backend selection.
#include <gtest/gtest.h>

#include "comm/communicator.h"
#include "core/error.h"
#ifdef TETRA_HAVE_CUDA
#include "kernels/backend.h"
#endif

namespace tetra::comm {
namespace {

TEST(EvenSplit, CoversTheRangeInOrder) {
  for (size_t total : {0, 1, 7, 8, 9, 1000, 1001}) {
    for (int parts : {1, 2, 3, 4, 8}) {
      size_t next = 0, lo = SIZE_MAX, hi = 0;
      for (int i = 0; i < parts; ++i) {
        Range r = even_split(total, parts, i);
        EXPECT_EQ(r.offset, next);
        next += r.count;
        lo = std::min(lo, r.count);
        hi = std::max(hi, r.count);
      }
      EXPECT_EQ(next, total);
      EXPECT_LE(hi - lo, 1u);
    }
  }
  EXPECT_EQ(even_split(10, 4, 0).count, 3u);
  EXPECT_EQ(even_split(10, 4, 3).count, 2u);
  EXPECT_THROW(even_split(10, 4, 4), Error);
}

TEST(CommOptions, DefaultsAndOverrides) {
  ConfigSchema schema = comm_config_schema();
  Config c = Config::from_overrides(schema, {"--dist.timeout_s=2.5", "dist.debug_hash=true"});
  CommOptions o = CommOptions::from_config(c);
  EXPECT_EQ(o.backend, "mpi");
  EXPECT_EQ(o.progress, "group");
  EXPECT_EQ(
      CommOptions::from_config(Config::from_overrides(schema, {"dist.progress=process"})).progress,
      "process");
  EXPECT_DOUBLE_EQ(o.timeout_s, 2.5);
  EXPECT_TRUE(o.debug_hash);
  EXPECT_EQ(o.debug_hash_every, 1);
  EXPECT_EQ(o.history, 2000);
  EXPECT_THROW(Config::from_overrides(schema, {"dist.timeout_s=0"}), Error);
  EXPECT_THROW(Config::from_overrides(schema, {"dist.history=0"}), Error);
  EXPECT_THROW(Config::from_overrides(schema, {"dist.backend=gloo"}), Error);
  try {
    Config::from_overrides(schema, {"dist.progress=fifo"});
    ADD_FAILURE() << "dist.progress=fifo was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("one of: group, process"), std::string::npos) << e.what();
  }
}

#ifndef TETRA_HAVE_CUDA
TEST(Backend, NcclStubSaysItIsNotBuilt) {
  CommOptions o;
  o.backend = "nccl";
  try {
    init_world(o);
    FAIL() << "nccl backend did not refuse";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[comm] NCCL backend not built"), std::string::npos);
  }
}
#else
// A CUDA build has the NCCL backend (src/comm/nccl/); without a GPU it refuses, saying why.
// tests/comm/nccl_mpi_main.cc covers it where there is one.
TEST(Backend, NcclWithoutGpuIsRefused) {
  const std::string why = cuda_unavailable();
  if (why.empty()) GTEST_SKIP() << "a GPU is present: comm_nccl_np1 runs the NCCL backend";
  CommOptions o;
  o.backend = "nccl";
  try {
    init_world(o);
    FAIL() << "nccl backend did not refuse";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[comm] dist.backend=nccl needs a GPU on every rank"),
              std::string::npos)
        << e.what();
  }
}
#endif

TEST(Backend, UnknownBackendIsRefused) {
  CommOptions o;
  o.backend = "gloo";
  EXPECT_THROW(init_world(o), Error);
}

TEST(Communicator, EmptyHandleIsRefused) {
  Communicator c;
  EXPECT_FALSE(c.valid());
  EXPECT_THROW(c.size(), Error);
  Work w;
  EXPECT_TRUE(w.done());
  w.wait();
}

}  // namespace
}  // namespace tetra::comm
