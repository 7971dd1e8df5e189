// A GPT with its own parameter store, unsharded, for the model tests.
#pragma once

#include <random>

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

}  // namespace tetra::testing
