// A stand-in for a mixture-of-experts GPT as the data-parallel engine sees it: units registered in
// backward order as GptT does, with an expert unit "h.l.experts" of its own (in the expert shard
// group) before each MoE block's unit, and the hook calls the model makes around them
// (docs/moe.md, parallel/data_parallel.cc). Tensors hold small integers keyed by name and index,
// and backward adds gradients that are small integers too, so every mean the engine produces is
// exact in f32 and in bf16 and the tests compare bit for bit.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/param_store.h"

namespace tetra::parallel::testing {

class FakeMoe {
 public:
  /** `layers` blocks, block l a MoE block when l % moe_every == moe_every - 1; this rank is at
   *  expert-parallel coordinate `ep_rank`, which names its experts' tensors. */
  FakeMoe(ParamStore& store, int layers, int moe_every, int ep_rank) : store_(store), L_(layers) {
    block_.assign(size_t(L_), -1);
    experts_.assign(size_t(L_), -1);
    for (int l = L_ - 1; l >= 0; --l) {
      const std::string h = "h." + std::to_string(l);
      const bool moe = l % moe_every == moe_every - 1;
      if (moe) {
        // Two tensors, 47 elements: their unit's shard boundary falls inside the first.
        experts_[size_t(l)] = store.begin_unit(h + ".experts", ShardGroup::expert);
        const std::string e = h + ".experts." + std::to_string(ep_rank);
        add(e + ".w", {6, 7});
        add(e + ".b", {5});
        store.end_unit();
      }
      // A MoE block has a router in place of the MLP: a smaller unit than a dense block's.
      block_[size_t(l)] = store.begin_unit(h);
      add(h + ".attn", moe ? Shape{3, 11} : Shape{5, 13});
      add(h + ".ln", {9});
      store.end_unit();
    }
    root_ = store.begin_unit("root");
    add("root.wte", {21, 4});
    store.end_unit();
  }

  /** The initial value of element i of tensor `name`: an integer in [-3, 3]. */
  static float value(const std::string& name, int64_t i) {
    size_t h = 0;
    for (char c : name) h = h * 31 + size_t(c);
    return float(int64_t((h + size_t(i) * 5) % 7) - 3);
  }

  /** Writes value() into what this rank holds of every tensor. */
  void load() {
    for (TensorId id = 0; id < TensorId(store_.tensors().size()); ++id) {
      const ParamEntry& e = store_.tensor(id);
      std::vector<float> global(size_t(e.numel()));
      for (int64_t i = 0; i < e.numel(); ++i) global[size_t(i)] = value(e.spec.name, i);
      store_.load_global(id, global.data());
    }
  }

  /** What a parameter must hold when a pass reads it. */
  using Expect = std::function<double(const ParamEntry&, int64_t)>;

  /** The forward pass's hook calls; every tensor is read (compared with `expect`) while its unit
   *  is resident. Returns the number of elements that differed. */
  int64_t forward(UnitHooks& h, const Expect& expect) {
    int64_t bad = 0;
    h.before_forward(root_, block_[0]);
    bad += check(root_, expect);
    h.after_forward(root_);
    for (int l = 0; l < L_; ++l) {
      const int next = l + 1 < L_ ? block_[size_t(l) + 1] : root_;
      const int b = block_[size_t(l)], e = experts_[size_t(l)];
      if (e < 0) {
        h.before_forward(b, next);
        bad += check(b, expect);
        h.after_forward(b);
        continue;
      }
      h.before_forward(b, e);
      bad += check(b, expect);  // attention, ln_2, the router
      h.before_forward(e, next);
      bad += check(e, expect);  // the experts
      h.after_forward(e);
      h.after_forward(b);  // the residual add
    }
    return bad;
  }

  /** The head's and the blocks' backward with the model's hook calls; on data-parallel rank
   *  `rank`, micro-batch `mb`, element i of every tensor gets the gradient grad(rank, mb, value).
   *  Returns the number of parameter elements that differed from `expect`. */
  int64_t backward(UnitHooks& h, int rank, int mb, const Expect& expect) {
    int64_t bad = 0;
    h.before_backward(root_, block_[size_t(L_) - 1]);  // the head: ln_f and the tied wte
    bad += check(root_, expect);
    produce(root_, 0, rank, mb);
    for (int l = L_ - 1; l >= 0; --l) {
      const int prev = l > 0 ? block_[size_t(l) - 1] : -1;
      const int b = block_[size_t(l)], e = experts_[size_t(l)];
      if (e < 0) {
        h.before_backward(b, prev);
        bad += check(b, expect);
        produce(b, 0, rank, mb);
        produce(b, 1, rank, mb);
        h.after_backward(b);
        continue;
      }
      h.before_backward(b, e);
      bad += check(b, expect);
      produce(b, 1, rank, mb);  // the residual's gradient passes ln's (stand-in) first
      h.before_backward(e, prev);
      bad += check(e, expect);
      produce(e, 0, rank, mb);
      produce(e, 1, rank, mb);
      h.after_backward(e);
      produce(b, 0, rank, mb);  // router, ln_2, attention
      h.after_backward(b);
    }
    h.after_backward(root_);  // the embedding's backward adds nothing more here
    return bad;
  }

  /** The gradient rank `rank` produces for an element of initial value v in micro-batch mb. */
  static double grad(int rank, int mb, double v) { return double(rank + 1) * v + mb; }

  int root() const { return root_; }
  const std::vector<int>& experts() const { return experts_; }

 private:
  void add(const std::string& name, Shape shape) {
    ParamSpec s;
    s.name = name;
    s.shape = std::move(shape);
    s.decay = true;
    store_.add(s);
  }

  int64_t check(int unit, const Expect& expect) {
    int64_t bad = 0;
    const ParamUnit& u = store_.units()[size_t(unit)];
    for (TensorId id = u.first; id < u.end; ++id) {
      const ParamEntry& e = store_.tensor(id);
      const float* p = store_.param(id);
      for (int64_t i = 0; i < e.numel(); ++i) bad += double(p[i]) != expect(e, i);
    }
    return bad;
  }

  // Adds the gradient of the k-th tensor of `unit`.
  void produce(int unit, int k, int rank, int mb) {
    const TensorId id = store_.units()[size_t(unit)].first + k;
    const ParamEntry& e = store_.tensor(id);
    float* g = store_.grad(id);
    for (int64_t i = 0; i < e.numel(); ++i) {
      g[i] += float(grad(rank, mb, value(e.spec.name, i)));
    }
  }

  ParamStore& store_;
  int L_;
  std::vector<int> block_, experts_;
  int root_ = -1;
};

}  // namespace tetra::parallel::testing
