// Pipeline bubble against 000 パイプライン並列: p = 8 with m = 8 / 64 / 256.
#include "plan/bubble.h"

#include <gtest/gtest.h>

namespace tetra::plan {
namespace {

TEST(Bubble, SeedFigures) {
  EXPECT_NEAR(bubble_fraction(Schedule::gpipe, 8, 8), 0.47, 0.005);          // 47%
  EXPECT_NEAR(bubble_fraction(Schedule::one_f_one_b, 8, 64), 0.10, 0.005);   // ~10%
  EXPECT_NEAR(bubble_fraction(Schedule::one_f_one_b, 8, 256), 0.03, 0.005);  // ~3%
  EXPECT_DOUBLE_EQ(bubble_fraction(Schedule::one_f_one_b, 8, 8), 7.0 / 15.0);
}

TEST(Bubble, InterleavedDividesByV) {
  EXPECT_DOUBLE_EQ(bubble_ratio(Schedule::one_f_one_b, 8, 64), 7.0 / 64.0);
  EXPECT_DOUBLE_EQ(bubble_ratio(Schedule::interleaved, 8, 64, 4), 7.0 / 256.0);
  EXPECT_DOUBLE_EQ(bubble_fraction(Schedule::interleaved, 8, 64, 4), 7.0 / (256.0 + 7.0));
  EXPECT_DOUBLE_EQ(bubble_fraction(Schedule::one_f_one_b, 1, 64), 0.0);
}

TEST(Bubble, InflightMicrobatches) {
  EXPECT_DOUBLE_EQ(inflight_microbatches(Schedule::gpipe, 4, 32), 32);
  EXPECT_DOUBLE_EQ(inflight_microbatches(Schedule::one_f_one_b, 4, 32), 4);
  EXPECT_DOUBLE_EQ(inflight_microbatches(Schedule::one_f_one_b, 4, 2), 2);
  EXPECT_DOUBLE_EQ(inflight_microbatches(Schedule::interleaved, 4, 32, 2), 4 * (1 + 3.0 / 8));
}

}  // namespace
}  // namespace tetra::plan
