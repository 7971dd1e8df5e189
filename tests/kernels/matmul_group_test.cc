// Groups of products (Kernels::matmul_group; kernels/cpu/matmul.cc, "groups of products"): a
// mixture of experts' products of one kind — experts of uneven and empty row counts, each with its
// own weight, in the forward (with and without a bias), input-gradient and accumulating
// weight-gradient layouts — equal the f64 reference product by product at 1, 2 and 3 threads
// under both fixed libraries, and the group is one entry of the per-kernel profile.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/profile.h"
#include "kernels/backend.h"
#include "kernels/cpu/matmul.h"
#include "tests/kernels/random_floats.h"

namespace tetra {
namespace {

using testing::random_floats;
using testing::Threads;

// One kind of expert product over experts of `rows` rows each (0: an expert no token chose).
struct Group {
  char kind;  // 'f' forward x·Wᵀ (+ bias), 'i' input gradient dy·W, 'w' weight gradient dyᵀ·x
  bool bias;
};

// The group's largest error relative to the f64 reference's scale, run through matmul_group.
double group_error(const Group& g, const std::vector<int64_t>& rows, int64_t N, int64_t K) {
  Kernels<float>& k = cpu_backend().f32();
  Kernels<double>& k64 = cpu_backend().f64();
  int64_t total = 0;
  for (int64_t m : rows) total += m;
  const size_t E = rows.size();
  // Activations of all experts back to back, one weight (and bias) per expert.
  const bool wgrad = g.kind == 'w';
  const auto act = random_floats(size_t(total * (wgrad ? N + K : K)), 1);
  std::vector<std::vector<float>> w, bias;
  for (size_t e = 0; e < E; ++e) {
    w.push_back(random_floats(size_t(N * K), 10 + uint32_t(e)));
    bias.push_back(random_floats(size_t(N), 30 + uint32_t(e)));
  }
  const size_t out_size = wgrad ? E * size_t(N * K) : size_t(total * N);
  const auto start = random_floats(out_size, 50);  // a weight gradient accumulates onto it
  std::vector<float> out = start;
  std::vector<double> ref(start.begin(), start.end());
  const std::vector<double> act64(act.begin(), act.end());
  std::vector<std::vector<double>> w64, b64;
  for (size_t e = 0; e < E; ++e) {
    w64.emplace_back(w[e].begin(), w[e].end());
    b64.emplace_back(bias[e].begin(), bias[e].end());
  }
  std::vector<MatmulArgs> products;
  int64_t off = 0;
  for (size_t e = 0; e < E; ++e) {
    const int64_t m = rows[e];
    if (g.kind == 'f') {
      products.push_back(nt_args(out.data() + off * N, act.data() + off * K, w[e].data(),
                                 g.bias ? bias[e].data() : nullptr, m, N, K, false, "f"));
      matmul_nt(k64, ref.data() + off * N, act64.data() + off * K, w64[e].data(),
                g.bias ? b64[e].data() : nullptr, m, N, K);
    } else if (g.kind == 'i') {
      products.push_back(
          nn_args(out.data() + off * N, act.data() + off * K, w[e].data(), m, N, K, false, "i"));
      matmul_nn(k64, ref.data() + off * N, act64.data() + off * K, w64[e].data(), m, N, K);
    } else if (m > 0) {
      // dW_e (N,K) += a_eᵀ (N×m) · b_e (m,K), a_e = the first N columns' rows, b_e the next K.
      const float* a = act.data() + off * N;
      const float* b = act.data() + total * N + off * K;
      products.push_back(tn_args(out.data() + e * size_t(N * K), a, b, N, K, m, true, "w"));
      matmul_tn(k64, ref.data() + e * size_t(N * K), act64.data() + off * N,
                act64.data() + total * N + off * K, N, K, m, true);
    }
    off += m;
  }
  k.matmul_group(products);
  double err = 0, scale = 1e-30;
  for (size_t i = 0; i < out.size(); ++i) {
    err = std::max(err, std::abs(double(out[i]) - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  return err / scale;
}

TEST(MatmulGroup, EveryExpertProductMatchesTheReference) {
  // Uneven experts (one empty, one of a single padded block, one larger than the others
  // together), as a mixture's routing leaves them.
  const std::vector<int64_t> rows = {96, 0, 32, 416, 64};
  const Group groups[] = {{'f', false}, {'f', true}, {'i', false}, {'w', false}};
  const cpu::MatmulPolicy before = cpu::matmul_policy();
  for (cpu::MatmulPolicy policy : {cpu::MatmulPolicy::onednn, cpu::MatmulPolicy::openblas}) {
    cpu::set_matmul_policy(policy, "test");
    for (int threads : {1, 2, 3}) {
      const Threads scope(threads);
      for (const Group& g : groups) {
        SCOPED_TRACE(std::string(1, g.kind) + (g.bias ? " bias" : "") + " at " +
                     std::to_string(threads) + " threads, " + cpu::matmul_policy_describe());
        EXPECT_LT(group_error(g, rows, 48, 40), 1e-6);
        EXPECT_LT(group_error(g, rows, 200, 24), 1e-6);  // cut by columns where N > M
      }
    }
  }
  cpu::set_matmul_policy(before, "test");
}

TEST(MatmulGroup, TheGroupIsOneProfileEntryWithItsFlops) {
  const Threads scope(2);
  double t = 0.0;
  Profile profile([&] { return t += 1e-3; });
  {
    const ProfileActivation on(&profile);
    group_error({'f', false}, {64, 32}, 16, 8);
    profile.end_step(1, 10.0, 1);
  }
  const nlohmann::json j = profile.to_json();
  int groups = 0;
  for (const auto& e : j["entries"]) {
    if (e["label"] != "f [group of 2]") continue;
    ++groups;
    EXPECT_EQ(e["kind"], "matmul");
    EXPECT_EQ(e["calls_per_step"], 1.0);
    EXPECT_DOUBLE_EQ(e["flops_per_step"].get<double>(), 2.0 * (64 + 32) * 16 * 8);
  }
  EXPECT_EQ(groups, 1) << j.dump(1);
}

}  // namespace
}  // namespace tetra
