#include "plan/elastic.h"

#include <gtest/gtest.h>

namespace tetra::plan {
namespace {

Layout dp_layout(int64_t dp, int64_t mbs, int64_t m) {
  Layout l;
  l.dp = dp;
  l.micro_batch = mbs;
  l.microbatches = m;
  return l;
}

int64_t global_batch(const Layout& l) { return l.dp * l.micro_batch * l.microbatches; }

TEST(Elastic, FourToTwoRanksDoublesTheAccumulation) {
  const Resize r = resize(dp_layout(4, 2, 1), 2, 1);
  ASSERT_TRUE(r.fits) << r.why;
  EXPECT_EQ(r.ranks, 2);
  EXPECT_EQ(r.layout.dp, 2);
  EXPECT_EQ(r.layout.micro_batch, 2);
  EXPECT_EQ(r.layout.microbatches, 2);
  EXPECT_EQ(describe_resize(dp_layout(4, 2, 1), r.layout),
            "dp 4 -> 2, micro_batch 2 kept, grad_accum 1 -> 2; global batch 8 sequences kept");
}

// 8 sequences do not split over 3 replicas: two of the three ranks run, one waits.
TEST(Elastic, ADpThatDoesNotDivideTheBatchIsPassedOver) {
  const Resize r = resize(dp_layout(4, 1, 2), 3, 1);
  ASSERT_TRUE(r.fits) << r.why;
  EXPECT_EQ(r.ranks, 2);
  EXPECT_EQ(r.layout.dp, 2);
  EXPECT_EQ(global_batch(r.layout), 8);
}

// 12 sequences at micro_batch 4 over 3 replicas: 4 each, so one micro-batch of 4.
TEST(Elastic, TheMicroBatchIsNeverRaised) {
  const Resize r = resize(dp_layout(6, 2, 1), 3, 1);
  ASSERT_TRUE(r.fits) << r.why;
  EXPECT_EQ(r.layout.dp, 3);
  EXPECT_EQ(r.layout.micro_batch, 2);
  EXPECT_EQ(r.layout.microbatches, 2);
  // 12 sequences over 2 replicas: 6 each, three micro-batches of 2.
  const Resize odd = resize(dp_layout(3, 2, 2), 2, 1);
  ASSERT_TRUE(odd.fits) << odd.why;
  EXPECT_EQ(odd.layout.dp, 2);
  EXPECT_EQ(odd.layout.micro_batch, 2);
  EXPECT_EQ(odd.layout.microbatches, 3);
  // 6 sequences on one replica at a micro-batch of 3: two micro-batches.
  const Resize three = resize(dp_layout(2, 3, 1), 1, 1);
  ASSERT_TRUE(three.fits) << three.why;
  EXPECT_EQ(three.layout.micro_batch, 3);
  EXPECT_EQ(three.layout.microbatches, 2);
}

TEST(Elastic, TheModelParallelSplitIsKept) {
  Layout from = dp_layout(4, 1, 4);
  from.tp = 2;
  from.pp = 2;
  from.ep = 2;
  from.schedule = Schedule::interleaved;
  from.v = 2;
  // 12 ranks left: dp 3 is not a multiple of ep 2, so dp 2 on 8 ranks.
  const Resize r = resize(from, 12, 1);
  ASSERT_TRUE(r.fits) << r.why;
  EXPECT_EQ(r.ranks, 8);
  EXPECT_EQ(r.layout.tp, 2);
  EXPECT_EQ(r.layout.pp, 2);
  EXPECT_EQ(r.layout.ep, 2);
  EXPECT_EQ(r.layout.v, 2);
  EXPECT_EQ(r.layout.dp, 2);
  EXPECT_EQ(r.layout.microbatches % from.pp, 0);
  EXPECT_EQ(global_batch(r.layout), 16);
}

TEST(Elastic, GrowsBackWhenRanksReturn) {
  const Resize r = resize(dp_layout(2, 2, 2), 4, 4);
  ASSERT_TRUE(r.fits) << r.why;
  EXPECT_EQ(r.layout.dp, 4);
  EXPECT_EQ(r.layout.micro_batch, 2);
  EXPECT_EQ(r.layout.microbatches, 1);
}

TEST(Elastic, SaysWhyNoLayoutFits) {
  Layout from = dp_layout(2, 1, 1);
  from.tp = 4;
  // 7 ranks hold one tp 4 replica, fewer ranks than the minimum of 6.
  Resize r = resize(from, 7, 6);
  EXPECT_FALSE(r.fits);
  EXPECT_EQ(r.why,
            "7 rank(s) (4 in whole replicas of tp 4 x cp 1 x pp 1) are fewer than --min-ranks 6; "
            "lower it to go on with them");
  // A global batch of 5 over 2 or 3 replicas of 2 ranks.
  Layout odd = dp_layout(1, 1, 5);
  odd.tp = 2;
  r = resize(odd, 6, 4);
  EXPECT_FALSE(r.fits);
  EXPECT_EQ(r.why,
            "no dp from 2 to 3 divides the global batch of 5 sequences with tp 2 x cp 1 x pp "
            "1; lower --min-ranks, or change the global batch");
  r = resize(from, 4, 6);
  EXPECT_FALSE(r.fits);
  EXPECT_EQ(r.why, "4 rank(s) are fewer than --min-ranks 6; lower it to go on with them");
  // Fewer ranks than one model-parallel group.
  r = resize(from, 3, 1);
  EXPECT_FALSE(r.fits);
  EXPECT_EQ(r.why,
            "3 rank(s) cannot hold one replica of the model split tp 4 x cp 1 x pp 1 (4 ranks); "
            "add hosts, or restart from the checkpoint with a smaller split");
  // ep 4 with a global batch of 6: no dp is a multiple of 4 that divides 6.
  Layout moe = dp_layout(4, 1, 2);
  moe.ep = 4;
  moe.microbatches = 1;
  moe.dp = 6;
  r = resize(moe, 5, 1);
  EXPECT_FALSE(r.fits);
  EXPECT_EQ(r.why,
            "no dp from 1 to 5 divides the global batch of 6 sequences as a multiple of ep 4 "
            "with tp 1 x cp 1 x pp 1; lower --min-ranks, or change the global batch");
}

}  // namespace
}  // namespace tetra::plan
