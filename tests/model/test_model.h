// A GPT with its own parameter store, unsharded, for the model tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/param_store.h"
#include "model/gpt.h"

namespace tetra::testing {

template <typename F>
struct TestModel {
  ParamStoreT<F> store;
  GptT<F> model;

  TestModel(const GptConfig& c, int B, int T, Recompute r = Recompute::none)
      : model(cpu_backend(), c, store, B, T, r) {
    store.finalize({});
  }

  /** GPT-2 init, then every real element perturbed, so biases and LayerNorm carry signal. */
  void randomise(uint64_t seed, double sd = 0.1) {
    store.init(seed);
    std::mt19937 gen(uint32_t(seed) + 1);
    std::normal_distribution<double> noise(0.0, sd);
    for (TensorId id = 0; id < TensorId(store.tensors().size()); ++id) {
      F* d = store.param(id);
      for (int64_t i = 0; i < real_elements(id); ++i) d[i] += F(noise(gen));
    }
  }
  /** Elements of tensor `id` outside any padding rows. */
  int64_t real_elements(TensorId id) const {
    const ParamEntry& e = store.tensor(id);
    if (e.spec.file.rows < 0) return e.numel();
    return e.spec.file.rows * e.spec.shape[1];
  }
};

/** n token ids in [0, V), seeded. */
inline std::vector<int32_t> tokens(int n, int V, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(gen() % uint32_t(V));
  return t;
}

/** The model's gradients (already in its store) against central differences of `objective`
 *  with step eps, at `samples` elements spread over each tensor's real elements: calls
 *  `each(name, relative error)` per tensor (max |numeric - analytic| / max |numeric|) and returns
 *  the worst. */
inline double finite_difference_error(TestModel<double>& m,
                                      const std::function<double()>& objective, double eps,
                                      int64_t samples,
                                      const std::function<void(const std::string&, double)>& each) {
  double worst = 0;
  for (TensorId id = 0; id < TensorId(m.store.tensors().size()); ++id) {
    double* d = m.store.param(id);
    const double* g = m.store.grad(id);
    const int64_t n = m.real_elements(id);
    double max_diff = 0, max_ref = 1e-12;
    for (int64_t k = 0; k < std::min(n, samples); ++k) {
      const int64_t i = (k * 7919) % n;  // spread over the tensor
      const double saved = d[i];
      d[i] = saved + eps;
      const double up = objective();
      d[i] = saved - eps;
      const double down = objective();
      d[i] = saved;
      const double numeric = (up - down) / (2 * eps);
      max_diff = std::max(max_diff, std::abs(numeric - g[i]));
      max_ref = std::max(max_ref, std::abs(numeric));
    }
    const double rel = max_diff / max_ref;
    worst = std::max(worst, rel);
    each(m.store.tensor(id).spec.name, rel);
  }
  return worst;
}

}  // namespace tetra::testing
