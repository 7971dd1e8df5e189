// The vocabulary-parallel cross-entropy against the whole-row kernel: tp "ranks" are threads of
// this process, each holding a column block of the padded logits, and the group reductions are a
// barrier-synchronised sum or max over them. Losses and gradients must equal the serial kernel's,
// including ranks that hold padding columns only.
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cpu/cross_entropy.h"

namespace tetra::cpu {
namespace {

// Emulates a group of `n` ranks in one process: every rank contributes n values, all receive the
// elementwise sum or max.
class ThreadGroup {
 public:
  explicit ThreadGroup(int n) : n_(n), sync_(n), slots_(size_t(n)) {}
  void reduce(int rank, double* v, int64_t count, bool max) {
    slots_[size_t(rank)].assign(v, v + count);
    sync_.arrive_and_wait();
    for (int64_t i = 0; i < count; ++i) {
      double r = slots_[0][size_t(i)];
      for (int q = 1; q < n_; ++q) {
        const double x = slots_[size_t(q)][size_t(i)];
        r = max ? std::max(r, x) : r + x;
      }
      v[i] = r;
    }
    sync_.arrive_and_wait();  // nobody overwrites its slot before every rank has read it
  }

 private:
  int n_;
  std::barrier<> sync_;
  std::vector<std::vector<double>> slots_;
};

void check(int N, int V, int Vp, int tp) {
  SCOPED_TRACE(::testing::Message() << "N=" << N << " V=" << V << " Vp=" << Vp << " tp=" << tp);
  std::mt19937 gen(uint32_t(N * 131 + V * 7 + tp));
  std::normal_distribution<double> normal(0.0, 2.0);
  std::vector<double> logits(size_t(N) * Vp);
  for (double& x : logits) x = normal(gen);
  std::vector<int32_t> y(static_cast<size_t>(N));
  for (int i = 0; i < N; ++i) y[size_t(i)] = int32_t(gen() % uint32_t(V));
  const double dloss = 0.25;
  std::vector<double> want_losses(static_cast<size_t>(N)), want = logits;
  const double want_sum =
      softmax_xent_forward_backward(want_losses.data(), want.data(), y.data(), N, V, Vp, dloss);

  const int Vl = Vp / tp;
  ThreadGroup group(tp);
  std::vector<std::vector<double>> parts(static_cast<size_t>(tp)), losses(static_cast<size_t>(tp));
  std::vector<double> sums(static_cast<size_t>(tp)), eval_sums(static_cast<size_t>(tp));
  std::vector<std::thread> ranks;
  for (int r = 0; r < tp; ++r) {
    ranks.emplace_back([&, r] {
      auto& part = parts[size_t(r)];
      part.resize(size_t(N) * Vl);
      for (int i = 0; i < N; ++i)
        std::copy_n(logits.begin() + i * Vp + r * Vl, Vl, part.begin() + i * Vl);
      losses[size_t(r)].resize(static_cast<size_t>(N));
      const GroupReduce<double> all_max = [&](double* v, int64_t n) {
        group.reduce(r, v, n, true);
      };
      const GroupReduce<double> all_sum = [&](double* v, int64_t n) {
        group.reduce(r, v, n, false);
      };
      eval_sums[size_t(r)] =
          softmax_xent_vocab_parallel(losses[size_t(r)].data(), part.data(), y.data(), N, Vl,
                                      r * Vl, V, false, 0.0, all_max, all_sum);
      sums[size_t(r)] =
          softmax_xent_vocab_parallel(losses[size_t(r)].data(), part.data(), y.data(), N, Vl,
                                      r * Vl, V, true, dloss, all_max, all_sum);
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < tp; ++r) {
    EXPECT_NEAR(eval_sums[size_t(r)], want_sum, 1e-12 * want_sum) << "rank " << r;
    EXPECT_NEAR(sums[size_t(r)], want_sum, 1e-12 * want_sum) << "rank " << r;
    for (int i = 0; i < N; ++i) {
      EXPECT_NEAR(losses[size_t(r)][size_t(i)], want_losses[size_t(i)], 1e-12) << "row " << i;
      for (int v = 0; v < Vl; ++v) {
        ASSERT_NEAR(parts[size_t(r)][size_t(i) * Vl + v], want[size_t(i) * Vp + r * Vl + v], 1e-14)
            << "rank " << r << " row " << i << " column " << r * Vl + v;
      }
    }
  }
}

TEST(VocabParallelCrossEntropy, EqualsTheWholeRowKernel) {
  check(6, 50, 50, 1);
  check(6, 50, 50, 2);
  check(5, 333, 336, 4);  // the last rank holds 3 padding columns
  check(4, 37, 128, 2);   // the second rank holds padding only
}

}  // namespace
}  // namespace tetra::cpu
