// The sampler's promises: the single-rank order is the sequential one the trainer has always
// used, every epoch is covered exactly once however the ranks split it, a resume from any cursor
// continues exactly as the uninterrupted run, and a resume under another data-parallel size loses
// or repeats no sample. The prefetcher delivers the sampler's batches and reports the consumed
// cursor, not its read-ahead.
#include "data/sampler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/prefetch.h"
#include "data/token_dataset.h"
#include "data/token_shard.h"
#include "tests/test_util.h"

namespace tetra {
namespace {

using ::testing::HasSubstr;

/** The dataset indices of one global batch: every rank's share, in rank order. */
std::vector<int64_t> global_batch(std::vector<Sampler>& ranks) {
  std::vector<int64_t> all;
  for (Sampler& s : ranks) {
    std::vector<int64_t> part = s.next_batch();
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

std::vector<Sampler> make_ranks(int64_t n, bool shuffle, uint64_t seed, int64_t gb, int R) {
  std::vector<Sampler> ranks;
  for (int r = 0; r < R; ++r) ranks.emplace_back(n, shuffle, seed, gb, r, R);
  return ranks;
}

using testing::error_of;

TEST(Sampler, SingleRankUnshuffledIsSequential) {
  // Row b of micro-batch m of step s is sample (s*grad_accum + m)*B + b (mod N): the order the
  // PyTorch parity test reproduces.
  const int64_t N = 50, B = 4, accum = 3;
  Sampler s(N, false, 1337, B * accum, 0, 1);
  for (int64_t step = 0; step < 10; ++step) {
    std::vector<int64_t> got = s.next_batch();
    ASSERT_EQ(got.size(), size_t(B * accum));
    for (int64_t m = 0; m < accum; ++m) {
      for (int64_t b = 0; b < B; ++b) {
        EXPECT_EQ(got[size_t(m * B + b)], ((step * accum + m) * B + b) % N);
      }
    }
  }
  EXPECT_EQ(s.cursor(), 10 * B * accum);
}

TEST(Sampler, ShuffledOrderIsAPureFunctionOfSeedAndEpoch) {
  SampleOrder a(100, true, 7), b(100, true, 7), c(100, true, 8);
  // Asking in another order (and across epochs) gives the same answers.
  std::vector<int64_t> fwd, bwd(300);
  for (int64_t g = 0; g < 300; ++g) fwd.push_back(a.at(g));
  for (int64_t g = 299; g >= 0; --g) bwd[size_t(g)] = b.at(g);
  EXPECT_EQ(fwd, bwd);
  std::vector<int64_t> e0(fwd.begin(), fwd.begin() + 100), e1(fwd.begin() + 100, fwd.begin() + 200);
  EXPECT_NE(e0, e1) << "each epoch has its own permutation";
  std::vector<int64_t> other;
  for (int64_t g = 0; g < 100; ++g) other.push_back(c.at(g));
  EXPECT_NE(e0, other) << "the seed changes the order";
}

class Coverage : public ::testing::TestWithParam<int> {};

TEST_P(Coverage, RanksAreDisjointAndCoverEachEpochExactly) {
  const int R = GetParam();
  for (bool shuffle : {false, true}) {
    for (int64_t N : {int64_t(480), int64_t(1000)}) {  // a multiple of the batch, and not
      const int64_t gb = 48;                           // divisible by 1, 2, 3, 4 and 8
      auto ranks = make_ranks(N, shuffle, 42, gb, R);
      std::vector<int64_t> draws;  // the global order, rank shares concatenated
      std::vector<std::vector<int64_t>> per_rank(static_cast<size_t>(R));
      for (int64_t k = 0; k * gb < 2 * N; ++k) {
        for (int r = 0; r < R; ++r) {
          std::vector<int64_t> part = ranks[size_t(r)].next_batch();
          ASSERT_EQ(part.size(), size_t(gb / R));
          draws.insert(draws.end(), part.begin(), part.end());
          if (draws.size() - part.size() < size_t(N)) {
            for (int64_t j : part) per_rank[size_t(r)].push_back(j);
          }
        }
      }
      for (int e = 0; e < 2; ++e) {
        std::vector<int64_t> epoch(draws.begin() + e * N, draws.begin() + (e + 1) * N);
        std::sort(epoch.begin(), epoch.end());
        for (int64_t i = 0; i < N; ++i) {
          ASSERT_EQ(epoch[size_t(i)], i) << "R=" << R << " N=" << N << " epoch " << e;
        }
      }
      // The rank split changes nothing about the global order.
      auto one = make_ranks(N, shuffle, 42, gb, 1);
      for (size_t k = 0; k * gb < draws.size(); ++k) {
        std::vector<int64_t> ref = one[0].next_batch();
        ASSERT_TRUE(std::equal(ref.begin(), ref.end(), draws.begin() + k * gb));
      }
      if (N % gb == 0) {  // whole batches in the epoch: ranks hold disjoint sets
        std::set<int64_t> seen;
        for (const auto& p : per_rank) {
          for (int64_t j : p) EXPECT_TRUE(seen.insert(j).second) << "sample " << j << " twice";
        }
        EXPECT_EQ(seen.size(), size_t(N));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DataParallelSizes, Coverage, ::testing::Values(1, 2, 3, 4, 8));

TEST(Sampler, ResumeAtRandomCursorsContinuesIdentically) {
  std::mt19937_64 rng(2024);
  const int sizes[] = {1, 2, 3, 4, 8};
  for (int trial = 0; trial < 300; ++trial) {
    const int R = sizes[rng() % 5];
    const int64_t N = 20 + int64_t(rng() % 300);
    const int64_t gb = R * (1 + int64_t(rng() % 12));
    const bool shuffle = rng() % 2;
    const uint64_t seed = rng();
    const int64_t before = int64_t(rng() % 40), after = 1 + int64_t(rng() % 20);
    const int r = int(rng() % uint64_t(R));
    Sampler run(N, shuffle, seed, gb, r, R);
    run.set_cursor(int64_t(rng() % uint64_t(3 * N)));  // any start, e.g. after a layout change
    for (int64_t k = 0; k < before; ++k) run.next_batch();
    // Round-trip the state through its JSON text, as a checkpoint does.
    const std::string saved = run.state().to_json().dump();
    Sampler resumed(N, shuffle, seed, gb, r, R);
    resumed.restore(SamplerState::from_json(nlohmann::json::parse(saved)));
    ASSERT_EQ(resumed.cursor(), run.cursor());
    for (int64_t k = 0; k < after; ++k) {
      ASSERT_EQ(resumed.next_batch(), run.next_batch()) << "trial " << trial << " batch " << k;
    }
  }
}

TEST(Sampler, StateSerialisesToAFewIntegers) {
  Sampler s(1000, true, 99, 32, 1, 4);
  for (int k = 0; k < 40; ++k) s.next_batch();
  nlohmann::json j = s.state().to_json();
  EXPECT_EQ(j["seed"], 99);
  EXPECT_EQ(j["num_samples"], 1000);
  EXPECT_EQ(j["shuffle"], true);
  EXPECT_EQ(j["cursor"], 40 * 32);
  EXPECT_EQ(j["epoch"], 1);
  EXPECT_EQ(j["global_batch"], 32);
  EXPECT_EQ(j["dp_size"], 4);
  nlohmann::json broken = j;
  broken.erase("cursor");
  EXPECT_THAT(error_of([&] { SamplerState::from_json(broken); }), HasSubstr("lacks 'cursor'"));
}

TEST(Sampler, ChangingTheDataParallelSizeLosesAndRepeatsNothing) {
  // Saved under R=4 (global batch 32 = 8 per rank), resumed under R=3 (24 = 8 per rank) and
  // R=8 (64): the cursor counts global draws, so the new ranks continue at the same draw.
  const int64_t N = 600;
  for (int new_R : {3, 8, 1, 2}) {
    const int64_t old_gb = 32, new_gb = 8 * new_R;
    auto old_ranks = make_ranks(N, true, 5, old_gb, 4);
    std::vector<int64_t> consumed;
    for (int k = 0; k < 7; ++k) {
      auto b = global_batch(old_ranks);
      consumed.insert(consumed.end(), b.begin(), b.end());
    }
    const SamplerState saved = old_ranks[2].state();  // every rank saves the same cursor
    for (const Sampler& s : old_ranks) ASSERT_EQ(s.cursor(), saved.cursor);

    auto new_ranks = make_ranks(N, true, 5, new_gb, new_R);
    for (Sampler& s : new_ranks) s.restore(saved);
    std::vector<int64_t> after;
    while (int64_t(consumed.size() + after.size()) < N) {
      auto b = global_batch(new_ranks);
      after.insert(after.end(), b.begin(), b.end());
    }
    // The rest of the epoch: exactly the samples the old layout had not consumed, each once.
    std::vector<int64_t> epoch = consumed;
    epoch.insert(epoch.end(), after.begin(), after.begin() + (N - int64_t(consumed.size())));
    std::sort(epoch.begin(), epoch.end());
    for (int64_t i = 0; i < N; ++i) ASSERT_EQ(epoch[size_t(i)], i) << "new R=" << new_R;

    // And what the new ranks take together equals what the old layout would have taken.
    const int64_t span = std::lcm(old_gb, new_gb);
    auto old_cont = make_ranks(N, true, 5, old_gb, 4);
    auto new_cont = make_ranks(N, true, 5, new_gb, new_R);
    for (Sampler& s : old_cont) s.restore(saved);
    for (Sampler& s : new_cont) s.restore(saved);
    std::multiset<int64_t> old_set, new_set;
    for (int64_t k = 0; k < span / old_gb; ++k) {
      for (int64_t j : global_batch(old_cont)) old_set.insert(j);
    }
    for (int64_t k = 0; k < span / new_gb; ++k) {
      for (int64_t j : global_batch(new_cont)) new_set.insert(j);
    }
    EXPECT_EQ(old_set, new_set) << "new R=" << new_R;
  }
}

TEST(Sampler, RefusesWhatItCannotHonour) {
  EXPECT_THAT(error_of([] { Sampler(100, false, 1, 30, 0, 4); }),
              HasSubstr("does not split over 4 data-parallel ranks"));
  EXPECT_THAT(error_of([] { Sampler(100, false, 1, 32, 4, 4); }), HasSubstr("rank 4"));
  Sampler s(100, true, 1, 8, 0, 1);
  SamplerState other = s.state();
  other.num_samples = 99;
  EXPECT_THAT(error_of([&] { s.restore(other); }), HasSubstr("dataset has 100"));
  other = s.state();
  other.seed = 2;
  EXPECT_THAT(error_of([&] { s.restore(other); }), HasSubstr("train.seed"));
}

class PrefetchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("tetra_prefetch_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    std::vector<uint32_t> tokens(5000);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint32_t(i % 1000);
    shard_ = (dir_ / "train.bin").string();
    write_token_shard(shard_, tokens);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
  std::string shard_;
};

TEST_F(PrefetchTest, DeliversTheSamplersBatchesAndTheConsumedCursor) {
  const int T = 16;
  TokenDataset data(shard_, T);
  const int64_t gb = 12;
  Sampler ref(data.num_samples(), true, 3, gb, 1, 2);
  Prefetcher pf(data, Sampler(data.num_samples(), true, 3, gb, 1, 2), 3);
  std::vector<int32_t> window(T + 1);
  for (int k = 0; k < 50; ++k) {  // several epochs of 312 samples
    const Batch& b = pf.next();
    std::vector<int64_t> idx = ref.next_batch();
    ASSERT_EQ(b.inputs.size(), idx.size() * T);
    for (size_t i = 0; i < idx.size(); ++i) {
      data.sample(idx[i], window.data());
      for (int t = 0; t < T; ++t) {
        ASSERT_EQ(b.inputs[i * T + t], window[size_t(t)]);
        ASSERT_EQ(b.targets[i * T + t], window[size_t(t) + 1]);
      }
    }
    // The thread reads ahead, but the state is what the consumer has taken.
    EXPECT_EQ(pf.state().cursor, (k + 1) * gb);
  }
}

TEST_F(PrefetchTest, ResumeFromItsStateContinuesTheSameTokens) {
  const int T = 8;
  TokenDataset data(shard_, T);
  auto sampler = [&] { return Sampler(data.num_samples(), true, 11, 20, 0, 1); };
  Prefetcher full(data, sampler(), 2);
  std::vector<std::vector<int32_t>> seen;
  SamplerState at17;
  for (int k = 0; k < 30; ++k) {
    seen.push_back(full.next().inputs);
    if (k == 16) at17 = full.state();
  }
  Sampler s = sampler();
  s.restore(at17);
  Prefetcher resumed(data, std::move(s), 2);
  for (int k = 17; k < 30; ++k) ASSERT_EQ(resumed.next().inputs, seen[size_t(k)]) << k;
}

}  // namespace
}  // namespace tetra
