// Pipeline bubble against 000 パイプライン並列: p = 8 with m = 8 / 64 / 256.
#include "plan/bubble.h"

#include <gtest/gtest.h>

namespace tetra::plan {
namespace {

TEST(Bubble, SeedFigures) {
  EXPECT_NEAR(bubble_fraction(Schedule::GPipe, 8, 8), 0.47, 0.005);       // 47%
  EXPECT_NEAR(bubble_fraction(Schedule::OneFOneB, 8, 64), 0.10, 0.005);   // ~10%
  EXPECT_NEAR(bubble_fraction(Schedule::OneFOneB, 8, 256), 0.03, 0.005);  // ~3%
  EXPECT_DOUBLE_EQ(bubble_fraction(Schedule::OneFOneB, 8, 8), 7.0 / 15.0);
}

TEST(Bubble, InterleavedDividesByV) {
  EXPECT_DOUBLE_EQ(bubble_ratio(Schedule::OneFOneB, 8, 64), 7.0 / 64.0);
  EXPECT_DOUBLE_EQ(bubble_ratio(Schedule::Interleaved, 8, 64, 4), 7.0 / 256.0);
  EXPECT_DOUBLE_EQ(bubble_fraction(Schedule::Interleaved, 8, 64, 4), 7.0 / (256.0 + 7.0));
  EXPECT_DOUBLE_EQ(bubble_fraction(Schedule::OneFOneB, 1, 64), 0.0);
}

TEST(Bubble, InflightMicrobatches) {
  EXPECT_DOUBLE_EQ(inflight_microbatches(Schedule::GPipe, 4, 32), 32);
  EXPECT_DOUBLE_EQ(inflight_microbatches(Schedule::OneFOneB, 4, 32), 4);
  EXPECT_DOUBLE_EQ(inflight_microbatches(Schedule::OneFOneB, 4, 2), 2);
  EXPECT_DOUBLE_EQ(inflight_microbatches(Schedule::Interleaved, 4, 32, 2), 4 * (1 + 3.0 / 8));
}

}  // namespace
}  // namespace tetra::plan
