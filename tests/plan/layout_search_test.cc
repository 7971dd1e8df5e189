// Layout validation, search and the seeds' common mistakes (000 3D並列, 001 よくある間違い).
#include "plan/layout_search.h"

#include <gtest/gtest.h>

#include "core/error.h"
#include "plan/comm_cost.h"

namespace tetra::plan {
namespace {

struct Case {
  ModelSpec m = model_preset("llama3-70b");
  ClusterSpec c = [] {
    ClusterSpec c = cluster_preset("h100");
    c.gpus = 512;
    return c;
  }();
  TrainingSpec t = [] {
    TrainingSpec t;
    t.tokens = 15e12;
    t.global_batch_tokens = 2048 * 8192;
    t.micro_batch = 1;
    return t;
  }();
};

Layout layout(int64_t tp, int64_t pp, int64_t dp, int64_t m) {
  return Layout{tp, pp, dp, 1, 1, Schedule::one_f_one_b, 1, 1, m, {}};
}

std::string problem(const Case& s, const Layout& l) { return layout_problem(s.m, s.c, s.t, l); }

TEST(LayoutSearch, SeedsLayoutIsValidAndFits) {
  Case s;
  const Layout l = layout(8, 4, 16, 128);
  EXPECT_EQ(problem(s, l), "");
  const LayoutEstimate e = evaluate_layout(s.m, s.c, s.t, l);
  EXPECT_TRUE(e.fits);
  EXPECT_GT(e.mfu, 0.3);
  EXPECT_LT(e.mfu, 0.6);
  // The audit order adds up: communication, bubble, kernels (the micro-batches and the update)
  // and the stragglers' tax on all three.
  EXPECT_NEAR(e.step_seconds, e.time.total(), 1e-9);
  EXPECT_NEAR(e.time.kernels, e.compute_seconds + e.optimizer_seconds, 1e-9);
  EXPECT_NEAR(e.time.bubble, e.bubble_seconds, 1e-9);
  EXPECT_NEAR(e.time.comm, e.exposed_comm_seconds, 1e-9);
  EXPECT_NEAR(e.time.stragglers,
              straggler_fraction(512, s.c.jitter) * (e.time.comm + e.time.bubble + e.time.kernels),
              1e-9);
  EXPECT_EQ(e.time.data, 0.0);
}

// step_terms splits the step into what a user can act on; the terms add up to it.
TEST(LayoutSearch, StepTermsAddUpToTheStep) {
  Case s;
  s.c.gpus = 512;
  const LayoutEstimate e = evaluate_layout(s.m, s.c, s.t, layout(8, 4, 16, 128));
  const std::vector<StepTerm> terms = step_terms(e);
  double sum = 0;
  for (size_t i = 0; i < terms.size(); ++i) {
    sum += terms[i].seconds;
    if (i > 0) {
      EXPECT_GE(terms[i - 1].seconds, terms[i].seconds);
    }
  }
  EXPECT_NEAR(sum, e.step_seconds, 1e-9 * e.step_seconds);
  EXPECT_EQ(terms[0].name, "products");
  bool tp = false, bubble = false;
  for (const StepTerm& x : terms) {
    tp = tp || x.name == "tp comm";
    bubble = bubble || x.name == "bubble";
  }
  EXPECT_TRUE(tp && bubble);
}

// An unfused attention's scores cost memory traffic kernel by kernel (13 bytes forward, 19
// backward per score element for GPT, a recomputed forward again), on top of the other tensors'
// three passes; a flash kernel has none, tetra's materialized kernel three passes over the 5
// bytes per element it keeps.
TEST(LayoutSearch, UnfusedScoresCostTheirKernelsTraffic) {
  Case s;
  s.m = model_preset("gpt3-175b");
  s.c = cluster_preset("a100-80g");
  s.c.gpus = 64;
  s.t.global_batch_tokens = 64 * 2048;
  Layout l = layout(8, 8, 1, 64);
  l.recompute = Recompute::selective;
  s.t.attention = Attention::flash;
  const double flash = evaluate_layout(s.m, s.c, s.t, l).microbatch.memory_bound;
  s.t.attention = Attention::unfused;
  const double unfused = evaluate_layout(s.m, s.c, s.t, l).microbatch.memory_bound;
  s.t.attention = Attention::materialized;
  const double materialized = evaluate_layout(s.m, s.c, s.t, l).microbatch.memory_bound;
  const double elements = 96.0 * 2048 / 8;  // NH * T / tp per token and layer
  const double tokens = 2048, layers = 96, stages = 8;
  const double per_byte = layers * tokens / stages / s.c.mem_bw;
  EXPECT_NEAR(unfused - flash, elements * (13 + 19 + 13) * per_byte, 1e-12);
  // tetra's kernel: the 5 bytes per element the ledger keeps (the row statistics aside).
  EXPECT_NEAR(materialized - flash, 3 * (elements * 5 - 4 * 96.0 / 8) * per_byte, 1e-12);
}

TEST(LayoutSearch, SeedsLayoutIsAmongTheTopChoices) {
  Case s;
  // The seeds' example recomputes selectively (configs/plan/70b-512-h100.toml); with the mode
  // searched too, FSDP-only layouts with full recomputation (torchtitan's 70B recipe) join them.
  LayoutConstraints k;
  k.recompute = Recompute::selective;
  k.zero_bubble = false;  // the schedules the seeds had
  const SearchResult r = search_layouts(s.m, s.c, s.t, k);
  ASSERT_GE(r.ranked.size(), 5u);
  bool found = false;
  for (size_t i = 0; i < 5; ++i) {
    const Layout& l = r.ranked[i].layout;
    found |= l.tp == 8 && l.pp == 4 && l.dp == 16;
    EXPECT_LE(l.tp, 8);
    EXPECT_TRUE(r.ranked[i].fits);
    if (i > 0) {
      EXPECT_LE(r.ranked[i - 1].step_seconds, r.ranked[i].step_seconds);
    }
  }
  EXPECT_TRUE(found) << "TP 8 x PP 4 x DP 16 not in the top 5";
  EXPECT_GT(r.too_big, 0);  // TP 1 / PP 1 with no ZeRO cannot hold 70B
}

TEST(LayoutSearch, ConstraintsAreRespected) {
  Case s;
  LayoutConstraints k;
  k.tp = 8;
  k.pp = 4;
  const SearchResult r = search_layouts(s.m, s.c, s.t, k);
  ASSERT_FALSE(r.ranked.empty());
  EXPECT_EQ(r.ranked[0].layout.tp, 8);
  EXPECT_EQ(r.ranked[0].layout.pp, 4);
  EXPECT_EQ(r.ranked[0].layout.dp, 16);
}

TEST(LayoutSearch, RefusesTpLargerThanANode) {
  Case s;
  const std::string p = problem(s, layout(16, 2, 16, 64));
  EXPECT_NE(p.find("tp=16 exceeds gpus_per_node=8"), std::string::npos) << p;
  EXPECT_NE(p.find("use tp<=8"), std::string::npos) << p;
  EXPECT_THROW(validate_layout(s.m, s.c, s.t, layout(16, 2, 16, 64)), Error);
}

TEST(LayoutSearch, RefusesLayoutsThatDoNotDivideTheModel) {
  Case s;
  s.c.gpus = 8 * 3 * 16;
  EXPECT_NE(problem(s, layout(8, 3, 16, 128)).find("layers=80 is not divisible by pp=3"),
            std::string::npos);
  ModelSpec odd = s.m;
  odd.n_head = 60;
  odd.n_kv_head = 60;
  odd.d_model = 7680;
  s.c.gpus = 512;
  EXPECT_NE(layout_problem(odd, s.c, s.t, layout(8, 4, 16, 128)).find("heads=60"),
            std::string::npos);
}

TEST(LayoutSearch, RefusesLayoutsThatDoNotDivideTheGpus) {
  Case s;
  const std::string p = problem(s, layout(8, 4, 8, 256));
  EXPECT_NE(p.find("= 256 but cluster.gpus = 512; set dp = gpus/(tp*pp) = 16"), std::string::npos)
      << p;
  EXPECT_NE(problem(s, layout(8, 4, 16, 100)).find("does not split"), std::string::npos);
}

TEST(LayoutSearch, RefusesBadExpertParallelism) {
  Case s;
  Layout l = layout(8, 4, 16, 128);
  l.ep = 2;
  EXPECT_NE(problem(s, l).find("is dense"), std::string::npos);
}

TEST(LayoutSearch, WarnsAboutDeepPipelinesWithFewMicrobatches) {
  Case s;
  s.t.global_batch_tokens = 128 * 8192;  // 128 sequences over dp=16: m = 8 for p = 8
  const LayoutEstimate e = evaluate_layout(s.m, s.c, s.t, layout(4, 8, 16, 8));
  // 000's 47% for equal stages; Llama 3 70B's last stage also runs the output head (1.2 layers of
  // compute), which the others wait for.
  EXPECT_NEAR(e.bubble_formula, 7.0 / 15.0, 1e-12);
  EXPECT_GT(e.bubble, 7.0 / 15.0);
  EXPECT_LT(e.bubble, 7.0 / 15.0 + 0.05);
  const auto w = layout_warnings(s.m, s.c, s.t, e);
  ASSERT_FALSE(w.empty());
  EXPECT_NE(w[0].find("deep PP with few micro-batches"), std::string::npos);
}

TEST(LayoutSearch, WarnsAbout3DOnAModelThatFitsOneNode) {
  Case s;
  s.m = model_preset("llama3-8b");  // 128 GB of state: fits a node of 8 x 80 GB
  s.c.gpus = 64;
  s.t.global_batch_tokens = 512 * 8192;
  const LayoutEstimate e = evaluate_layout(s.m, s.c, s.t, layout(2, 2, 16, 32));
  bool found = false;
  for (const auto& w : layout_warnings(s.m, s.c, s.t, e))
    found |= w.find("3D") != std::string::npos;
  EXPECT_TRUE(found);
}

TEST(LayoutSearch, NoZeroOn70BDoesNotFit) {
  Case s;
  Layout l = layout(1, 1, 512, 4);
  l.zero = 0;
  const LayoutEstimate e = evaluate_layout(s.m, s.c, s.t, l);
  EXPECT_FALSE(e.fits);
  EXPECT_NE(layout_warnings(s.m, s.c, s.t, e)[0].find("does not fit"), std::string::npos);
}

}  // namespace
}  // namespace tetra::plan

namespace tetra::plan {
namespace {

// Recomputation and the micro-batch size are searched with the rest; full recomputation trades a
// third more compute for activations.
TEST(LayoutSearch, RecomputationAndMicroBatchAreSearched) {
  ModelSpec m = model_preset("llama3-8b");
  ClusterSpec c = cluster_preset("h100");
  c.gpus = 64;
  TrainingSpec t;
  t.tokens = 1e12;
  t.global_batch_tokens = 256 * 8192;
  const SearchResult r = search_layouts(m, c, t, LayoutConstraints{});
  ASSERT_FALSE(r.ranked.empty());
  // Three modes for every candidate; constraining the mode keeps only it.
  LayoutConstraints k;
  k.recompute = Recompute::full;
  const SearchResult full_only = search_layouts(m, c, t, k);
  EXPECT_EQ(r.considered, 3 * full_only.considered);
  for (const auto& e : full_only.ranked) EXPECT_EQ(e.layout.recompute, Recompute::full);
  // Micro-batches of 1, 2, 4, ... sequences: fixing the size leaves fewer candidates.
  TrainingSpec one = t;
  one.micro_batch = 1;
  EXPECT_GT(r.considered, search_layouts(m, c, one, LayoutConstraints{}).considered);
  // Full recomputation costs a third more compute than none on the same grid.
  Layout l{8, 1, 8, 1, 1, Schedule::one_f_one_b, 1, 1, 32, {}, Recompute::none};
  const LayoutEstimate none = evaluate_layout(m, c, t, l);
  l.recompute = Recompute::full;
  const LayoutEstimate full = evaluate_layout(m, c, t, l);
  EXPECT_GT(full.compute_seconds, 1.25 * none.compute_seconds);
  EXPECT_LT(full.memory.activations, none.memory.activations);
  EXPECT_GT(full.hfu, full.mfu);
}

// Why each listed layout beats the next, and the chosen one's step in the audit order.
TEST(LayoutSearch, RankingIsExplained) {
  Case s;
  LayoutConstraints k;
  k.recompute = Recompute::selective;
  const SearchResult r = search_layouts(s.m, s.c, s.t, k);
  const std::vector<std::string> why = rank_reasons(r.ranked);
  ASSERT_EQ(why.size(), r.ranked.size() - 1);
  EXPECT_NE(why[0].find("beats #2 by"), std::string::npos) << why[0];
  const std::vector<std::string> steps = explain_step(s.m, s.c, s.t, r.ranked[0]);
  const char* const order[] = {"1. data", "2. comm", "3. bubble", "4. kernels", "5. stragglers"};
  size_t at = 0;
  for (const char* item : order) {
    bool found = false;
    for (size_t i = at; i < steps.size() && !found; ++i) {
      if (steps[i].rfind(item, 0) == 0) found = true, at = i;
    }
    EXPECT_TRUE(found) << item;
  }
}

}  // namespace
}  // namespace tetra::plan
