#include "core/philox.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/dtype.h"

namespace tetra {
namespace {

// Known-answer vectors of Philox4x32-10 from the Random123 distribution (kat_vectors).
TEST(Philox, KnownAnswers) {
  auto zero = philox4x32({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(zero[0], 0x6627e8d5u);
  EXPECT_EQ(zero[1], 0xe169c58du);
  EXPECT_EQ(zero[2], 0xbc57ac4cu);
  EXPECT_EQ(zero[3], 0x9b00dbd8u);
  auto ones =
      philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu});
  EXPECT_EQ(ones[0], 0x408f276du);
  EXPECT_EQ(ones[1], 0x41c83b0eu);
  EXPECT_EQ(ones[2], 0xa20bc7c6u);
  EXPECT_EQ(ones[3], 0x6d5451fdu);
}

TEST(Philox, DrawsArePureFunctionsOfSeedNameIndex) {
  Philox a(42, "transformer.wte.weight"), b(42, "transformer.wte.weight");
  Philox other_name(42, "transformer.wpe.weight"), other_seed(43, "transformer.wte.weight");
  for (uint64_t i : {0ull, 1ull, 12345ull, 1ull << 40}) {
    EXPECT_EQ(a.normal(i), b.normal(i));
    EXPECT_NE(a.normal(i), other_name.normal(i));
    EXPECT_NE(a.normal(i), other_seed.normal(i));
  }
}

TEST(Philox, NormalHasUnitMoments) {
  Philox r(7, "moments");
  const int n = 200000;
  double sum = 0, sq = 0;
  for (int i = 0; i < n; ++i) {
    double x = r.normal(uint64_t(i));
    sum += x;
    sq += x * x;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sq / n, 1.0, 0.01);
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(bf16::from_float(1.0f).to_float(), 1.0f);
  EXPECT_EQ(bf16::from_float(1.00390625f).to_float(), 1.0f);       // tie -> even
  EXPECT_EQ(bf16::from_float(1.01171875f).to_float(), 1.015625f);  // tie -> even (up)
  EXPECT_TRUE(std::isnan(bf16::from_float(NAN).to_float()));
  EXPECT_EQ(bf16::from_float(-2.5f).to_float(), -2.5f);
}

}  // namespace
}  // namespace tetra
