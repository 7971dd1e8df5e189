// Pipeline stages of the GPT in one process: the model cut into parts (even, uneven, interleaved
// chunks) and driven chunk by chunk, with the boundary activations and gradients handed over by
// hand, gives the whole model's loss and gradients (the tied wte's as the sum of the embedding's
// gradient and the head copy's); every part's tensors start equal to the whole model's; slots
// hold several micro-batches in flight and are charged to the ledger. A zero-bubble schedule's
// split backward (B now, the weight products later) gives the unsplit backward's gradients bit for
// bit.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/memory.h"
#include "model/gpt.h"
#include "tests/model/test_model.h"

namespace tetra {
namespace {

GptConfig config() { return GptConfig::make(37, 4, 2, 16, 8, 64); }

std::vector<int32_t> tokens(int n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(gen() % 37u);
  return t;
}

struct Part {
  ParamStoreT<double> store;
  std::unique_ptr<GptT<double>> model;
  MemoryLedger ledger;
};

// Layer ranges of each virtual stage; part r holds stages r, r + p, ... (chunks).
std::vector<std::unique_ptr<Part>> make_parts(const std::vector<int>& split, int p, int slots,
                                              int B, int T) {
  std::vector<int> begin = {0};
  for (int n : split) begin.push_back(begin.back() + n);
  const int stages = int(split.size());
  std::vector<std::unique_ptr<Part>> parts;
  for (int r = 0; r < p; ++r) {
    GptPart gp;
    for (int s = r; s < stages; s += p)
      gp.chunks.push_back({begin[size_t(s)], begin[size_t(s) + 1], slots});
    gp.embedding = r == 0;
    gp.head = r == (stages - 1) % p;
    auto part = std::make_unique<Part>();
    part->model = std::make_unique<GptT<double>>(cpu_backend(), config(), part->store, B, T,
                                                 Recompute::none, &part->ledger, nullptr, gp);
    part->store.finalize({});
    part->store.init(11);
    part->store.grads().zero();
    parts.push_back(std::move(part));
  }
  return parts;
}

// Micro-batches mb = 0..m-1 through every stage forward (all in flight), then backward in reverse
// stage order: GPipe by hand. Returns the mean loss.
double run_parts(std::vector<std::unique_ptr<Part>>& parts, int stages, int m, int B, int T,
                 const std::vector<int32_t>& in, const std::vector<int32_t>& tg) {
  const int p = int(parts.size());
  const size_t n = parts[0]->model->boundary_size();
  std::vector<double> act(n), grad(n), next(n);
  for (int mb = 0; mb < m; ++mb) {
    const int32_t* x = in.data() + size_t(mb) * B * T;
    for (int s = 0; s < stages; ++s) {
      GptT<double>& g = *parts[size_t(s % p)]->model;
      g.forward_chunk(s / p, mb, x, s == 0 ? nullptr : act.data(),
                      s == stages - 1 ? nullptr : next.data());
      std::swap(act, next);
    }
  }
  double loss = 0;
  for (int mb = 0; mb < m; ++mb) {
    const int32_t* y = tg.data() + size_t(mb) * B * T;
    for (int s = stages - 1; s >= 0; --s) {
      GptT<double>& g = *parts[size_t(s % p)]->model;
      loss += g.backward_chunk(s / p, mb, y, s == stages - 1 ? nullptr : grad.data(),
                               s == 0 ? nullptr : next.data(), 1.0f / float(m));
      std::swap(grad, next);
    }
  }
  return loss / m;
}

void expect_parts_match_whole(const std::vector<int>& split, int p) {
  const int B = 2, T = 5, m = 3;
  const auto in = tokens(B * T * m, 5), tg = tokens(B * T * m, 6);
  testing::TestModel<double> whole(config(), B, T);
  whole.store.init(11);
  whole.store.grads().zero();
  double want = 0;
  for (int mb = 0; mb < m; ++mb) {
    want += whole.model.forward_backward(in.data() + mb * B * T, tg.data() + mb * B * T,
                                         1.0f / float(m));
  }
  want /= m;

  auto parts = make_parts(split, p, m, B, T);
  const double got = run_parts(parts, int(split.size()), m, B, T, in, tg);
  EXPECT_NEAR(got, want, 1e-12 * want);

  // Every tensor is held by exactly one part, except wte: on the first part and, as the head's
  // copy, on the last; its gradient is the sum of the two.
  std::map<std::string, int> seen;
  for (const auto& part : parts) {
    for (TensorId id = 0; id < TensorId(part->store.tensors().size()); ++id) {
      const std::string& name = part->store.tensor(id).spec.name;
      ++seen[name];
      const TensorId w = whole.store.find(name);
      ASSERT_GE(w, 0) << name;
      const int64_t count = part->store.tensor(id).numel();
      std::vector<double> g(part->store.grad(id), part->store.grad(id) + count);
      if (name == "transformer.wte.weight" && p > 1) {
        Part& other = *parts[size_t(&part == &parts[0] ? (int(split.size()) - 1) % p : 0)];
        const double* o = other.store.grad(other.store.find(name));
        for (int64_t i = 0; i < count; ++i) g[size_t(i)] += o[i];
      }
      double diff = 0, ref = 1e-30;
      for (int64_t i = 0; i < count; ++i) {
        EXPECT_EQ(part->store.param(id)[i], whole.store.param(w)[i]) << name << " init " << i;
        diff += std::pow(g[size_t(i)] - whole.store.grad(w)[i], 2);
        ref += std::pow(whole.store.grad(w)[i], 2);
      }
      EXPECT_LT(std::sqrt(diff / ref), 1e-12) << name;
    }
  }
  EXPECT_EQ(seen.size(), whole.store.tensors().size());
  for (const auto& [name, count] : seen)
    EXPECT_EQ(count, name == "transformer.wte.weight" && p > 1 ? 2 : 1) << name;
  EXPECT_EQ(parts.back()->model->tied_wte_copy() >= 0, p > 1);
}

TEST(GptStage, EvenSplitOverTwoPartsEqualsTheWholeModel) { expect_parts_match_whole({2, 2}, 2); }

TEST(GptStage, UnevenSplitOverFourPartsEqualsTheWholeModel) {
  expect_parts_match_whole({1, 1, 1, 1}, 4);
  expect_parts_match_whole({1, 3}, 2);
}

TEST(GptStage, InterleavedChunksEqualTheWholeModel) { expect_parts_match_whole({1, 1, 1, 1}, 2); }

TEST(GptStage, OnePartHoldingEveryChunkEqualsTheWholeModel) { expect_parts_match_whole({2, 2}, 1); }

TEST(GptStage, SlotsAreChargedToTheLedgerAndRefuseOneTooMany) {
  const int B = 2, T = 5;
  auto one = make_parts({2, 2}, 2, 1, B, T);
  auto three = make_parts({2, 2}, 2, 3, B, T);
  // Activations of the first part: 3 layers' boundaries (B,T,C) and 2 blocks' saved tensors per
  // slot; no head.
  const size_t per_slot = three[0]->ledger.peak(MemCategory::activations) -
                          one[0]->ledger.peak(MemCategory::activations);
  const size_t BTC = size_t(B) * T * 16;
  const size_t saved = AttentionSizes::of(cpu_backend().f64(), config(), B, T).saved;
  const size_t block = BlockActs<double>::elements(block_spec(config(), 0), config(), B, T, saved,
                                                   MoeShape::of(config(), B, T));
  EXPECT_EQ(per_slot, 2 * sizeof(double) * (3 * BTC + 2 * block));
  const auto in = tokens(B * T, 1);
  std::vector<double> out(BTC);
  GptT<double>& g = *one[0]->model;
  g.forward_chunk(0, 0, in.data(), nullptr, out.data());
  EXPECT_THROW(g.forward_chunk(0, 1, in.data(), nullptr, out.data()), Error);
  EXPECT_THROW(g.forward_backward(in.data(), in.data(), 1.0f), Error);  // a part, not the whole
}

// Zero-bubble pipelines (docs/pipeline.md): each chunk's backward split into B,
// backward_input_chunk, which keeps the weight products with copies of their operands, and W,
// backward_weight_chunk, which runs them. Two parts of two layers each run m micro-batches
// forward, every B, then the W's in micro-batch order per chunk; the loss and every gradient
// equal, bit for bit, the same parts run with the unsplit backward: GPT-2, Llama (GQA, SwiGLU, an
// untied head) and a MoE model, under each recomputation, in float and double.
template <typename F>
void expect_split_backward_matches(const GptConfig& c, Recompute r) {
  const int B = 2, T = 5, m = 3, p = 2;
  const std::vector<int> begin = {0, 2, 4};
  const auto in = tokens(B * T * m, 5), tg = tokens(B * T * m, 6);
  struct Half {
    ParamStoreT<F> store;
    std::unique_ptr<GptT<F>> model;
  };
  auto make = [&] {
    std::vector<std::unique_ptr<Half>> parts;
    for (int k = 0; k < p; ++k) {
      GptPart gp;
      gp.chunks.push_back({begin[size_t(k)], begin[size_t(k) + 1], m});
      gp.embedding = k == 0;
      gp.head = k == p - 1;
      auto h = std::make_unique<Half>();
      h->model =
          std::make_unique<GptT<F>>(cpu_backend(), c, h->store, B, T, r, nullptr, nullptr, gp);
      h->store.finalize({});
      h->store.init(11);
      h->store.grads().zero();
      parts.push_back(std::move(h));
    }
    return parts;
  };
  auto run = [&](std::vector<std::unique_ptr<Half>>& parts, bool split) {
    const size_t n = parts[0]->model->boundary_size();
    const std::vector<std::vector<F>> zeros(static_cast<size_t>(m), std::vector<F>(n));
    std::vector<std::vector<F>> acts = zeros, grads = zeros;
    for (int mb = 0; mb < m; ++mb) {
      parts[0]->model->forward_chunk(0, mb, in.data() + mb * B * T, nullptr,
                                     acts[size_t(mb)].data());
      parts[1]->model->forward_chunk(0, mb, in.data() + mb * B * T, acts[size_t(mb)].data(),
                                     nullptr);
    }
    double loss = 0;
    for (int mb = 0; mb < m; ++mb) {
      const int32_t* y = tg.data() + mb * B * T;
      F* g = grads[size_t(mb)].data();
      if (split) {
        loss += parts[1]->model->backward_input_chunk(0, mb, y, nullptr, g, 1.0f / m);
        loss += parts[0]->model->backward_input_chunk(0, mb, y, g, nullptr, 1.0f / m);
      } else {
        loss += parts[1]->model->backward_chunk(0, mb, y, nullptr, g, 1.0f / m);
        loss += parts[0]->model->backward_chunk(0, mb, y, g, nullptr, 1.0f / m);
      }
    }
    if (split) {
      // B left every matrix's gradient to W (the embeddings' lookups excepted).
      for (const auto& h : parts) {
        for (TensorId id = 0; id < TensorId(h->store.tensors().size()); ++id) {
          const ParamSpec& spec = h->store.tensor(id).spec;
          if (spec.shape.size() != 2 || spec.name.find("wte") != std::string::npos ||
              spec.name.find("wpe") != std::string::npos ||
              spec.name.find("embed") != std::string::npos) {
            continue;
          }
          bool zero = true;
          for (int64_t i = 0; i < h->store.tensor(id).numel(); ++i) {
            zero = zero && h->store.grad(id)[i] == F(0);
          }
          EXPECT_TRUE(zero) << spec.name << " has a gradient before its W";
        }
      }
    }
    for (int mb = 0; split && mb < m; ++mb) {
      parts[1]->model->backward_weight_chunk(0, mb);
      parts[0]->model->backward_weight_chunk(0, mb);
    }
    return loss;
  };
  auto whole = make(), split = make();
  EXPECT_EQ(run(split, true), run(whole, false));
  for (int k = 0; k < p; ++k) {
    ParamStoreT<F>& a = whole[size_t(k)]->store;
    ParamStoreT<F>& b = split[size_t(k)]->store;
    for (TensorId id = 0; id < TensorId(a.tensors().size()); ++id) {
      const int64_t count = a.tensor(id).numel();
      bool same = true;
      bool nonzero = false;
      for (int64_t i = 0; i < count; ++i) {
        same = same && a.grad(id)[i] == b.grad(id)[i];
        nonzero = nonzero || a.grad(id)[i] != F(0);
      }
      EXPECT_TRUE(same) << a.tensor(id).spec.name << " on part " << k;
      EXPECT_TRUE(nonzero) << a.tensor(id).spec.name << " on part " << k;
    }
  }
}

// What reduces a unit's gradients (the data-parallel hooks) hears that they are final when they
// are: under the unsplit backward as each unit's backward ends, under the split one only at W,
// each unit's after its own weight products and before the next unit's, in backward order (so a
// reduction overlaps the rest of W). The gradient a hook sees is the unit's final one.
TEST(GptStage, SplitBackwardTellsTheHooksAUnitIsFinalAfterItsW) {
  struct Recorder final : UnitHooks {
    ParamStoreT<double>* store = nullptr;
    std::vector<std::pair<int, double>> final;  // (unit, sum of |gradient| then)
    void before_forward(int, int) override {}
    void after_forward(int) override {}
    void before_backward(int, int) override {}
    void after_backward(int unit) override {
      const ParamUnit& u = store->units()[size_t(unit)];
      double sum = 0;
      for (size_t i = 0; i < u.padded; ++i) sum += std::abs(store->grads().data()[u.offset + i]);
      final.emplace_back(unit, sum);
    }
    void end_forward_only() override {}
  };
  const int B = 2, T = 5;
  const auto in = tokens(B * T, 5), tg = tokens(B * T, 6);
  for (bool split : {false, true}) {
    SCOPED_TRACE(split ? "split" : "unsplit");
    const GptConfig c = config();
    GptPart gp;
    gp.chunks.push_back({0, int(c.n_layer), 1});
    gp.embedding = gp.head = true;
    ParamStoreT<double> store;
    GptT<double> model(cpu_backend(), c, store, B, T, Recompute::none, nullptr, nullptr, gp);
    store.finalize({});
    store.init(11);
    store.grads().zero();
    Recorder hooks;
    hooks.store = &store;
    model.set_hooks(&hooks);
    model.forward_chunk(0, 0, in.data(), nullptr, nullptr);
    if (split) {
      model.backward_input_chunk(0, 0, tg.data(), nullptr, nullptr, 1.0f);
      EXPECT_TRUE(hooks.final.empty()) << "a unit called final before its W";
      model.backward_weight_chunk(0, 0);
    } else {
      model.backward_chunk(0, 0, tg.data(), nullptr, nullptr, 1.0f);
    }
    const size_t units = store.units().size();
    ASSERT_EQ(hooks.final.size(), units);
    for (size_t k = 0; k < units; ++k) {
      const auto [unit, sum] = hooks.final[k];
      EXPECT_EQ(unit, int(k)) << "units are final in backward order";
      const ParamUnit& u = store.units()[size_t(unit)];
      double now = 0;
      for (size_t i = 0; i < u.padded; ++i) now += std::abs(store.grads().data()[u.offset + i]);
      EXPECT_EQ(sum, now) << "unit " << unit << " changed after it was called final";
      EXPECT_GT(sum, 0.0) << "unit " << unit;
    }
  }
}

GptConfig llama_config() {
  GptConfig c = GptConfig::make(37, 4, 4, 16, 8, 64);
  LlamaShape l;
  l.n_kv_head = 2;
  l.ffn = 20;
  c.set_llama(l);
  return c;
}

GptConfig moe_config() {
  GptConfig c = GptConfig::make(37, 4, 2, 16, 8, 64);
  MoeConfig e;
  e.experts = 4;
  e.top_k = 2;
  e.capacity_factor = 0;
  c.set_moe(e);
  return c;
}

TEST(GptStage, SplitBackwardGivesTheUnsplitGradientsBitForBit) {
  for (Recompute r : {Recompute::none, Recompute::selective, Recompute::full}) {
    SCOPED_TRACE(recompute_name(r));
    for (const GptConfig& c : {config(), llama_config(), moe_config()}) {
      SCOPED_TRACE(c.llama() ? "llama" : c.moe.experts ? "moe" : "gpt2");
      expect_split_backward_matches<double>(c, r);
      expect_split_backward_matches<float>(c, r);
    }
  }
}

}  // namespace
}  // namespace tetra
