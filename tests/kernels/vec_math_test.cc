#include "kernels/cpu/vec_math.h"

#include <gtest/gtest.h>

#include <cmath>

namespace tetra::cpu {
namespace {

TEST(VecMath, ExpIsAccurateAcrossItsRange) {
  double worst = 0;
  for (float x = -87.0f; x < 88.0f; x += 0.0137f) {
    double ref = std::exp(double(x));
    worst = std::max(worst, std::abs(exp_approx(x) - ref) / ref);
  }
  EXPECT_LT(worst, 3e-7);
  EXPECT_EQ(exp_approx(-1000.0f) < 1e-37f, true);
  EXPECT_TRUE(std::isfinite(exp_approx(1000.0f)));
}

}  // namespace
}  // namespace tetra::cpu
