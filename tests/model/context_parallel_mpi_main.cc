// A whole model under context parallelism on the world's ranks (cp = 2 and 4 via CTest): every
// rank builds the same model twice from the same weights, once whole on (B, T) and once holding
// its T/cp tokens of each sequence (parallel::CpSplit) with attention across the world, and runs
// one forward and backward of the same batch. The mean of the ranks' local losses must be the
// whole model's loss, and the mean of their gradients its gradients: in double to 1e-12 (the
// sums differ only in order), in float to 2e-5 relative to each tensor's largest. GPT-2 (learned
// positions: the embedding adds each chunk's rows of wpe and its gradient goes back to them) and
// Llama (grouped-query attention, an untied head, rotary positions turned at each chunk's
// positions; Ulysses with its 2 key/value heads split at cp 2 and replicated at cp 4), ring,
// all-gather and Ulysses, with and without full recomputation (the exchanges run again in
// backward); at cp 4 also Llama under Ulysses over pairs with a ring across them (the hybrid).
// Exit 1 if any rank saw a mismatch.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/param_store.h"
#include "kernels/backend.h"
#include "model/gpt.h"
#include "parallel/context_parallel.h"

using namespace tetra;
using namespace tetra::parallel;

namespace {

int g_failures = 0, g_rank = 0;

void check(bool ok, const std::string& what) {
  if (ok) return;
  ++g_failures;
  std::fprintf(stderr, "[rank %d] FAIL %s\n", g_rank, what.c_str());
}

// Every rank's n values of v, in rank order (byte copies, so any element type).
template <typename F>
std::vector<F> gather(const comm::Communicator& world, const F* v, size_t n) {
  std::vector<F> all(n * size_t(world.size()));
  world
      .all_gather(
          std::span<const std::byte>(reinterpret_cast<const std::byte*>(v), n * sizeof(F)),
          std::span<std::byte>(reinterpret_cast<std::byte*>(all.data()), all.size() * sizeof(F)))
      .wait();
  return all;
}

// The weights of `store` from its init, every element perturbed so that biases and norms carry
// signal, copied (converted) into each of `copies`.
template <typename F, typename... Copies>
void same_weights(std::mt19937& gen, ParamStoreT<F>& store, Copies&... copies) {
  store.init(7);
  std::normal_distribution<double> noise(0.0, 0.1);
  for (TensorId id = 0; id < TensorId(store.tensors().size()); ++id) {
    F* d = store.param(id);
    const int64_t n = store.tensor(id).numel();
    for (int64_t i = 0; i < n; ++i) d[i] += F(noise(gen));
    (std::copy(d, d + n, copies.param(id)), ...);
  }
}

// B random sequences of T tokens and targets, and this rank's chunks of them.
struct Batch {
  std::vector<int32_t> inputs, targets, local_inputs, local_targets;
};
Batch random_batch(std::mt19937& gen, int vocab, int B, const CpSplit& split) {
  Batch b;
  b.inputs.resize(size_t(B) * size_t(split.T()));
  b.targets.resize(b.inputs.size());
  for (size_t i = 0; i < b.inputs.size(); ++i) {
    b.inputs[i] = int32_t(gen() % uint32_t(vocab));
    b.targets[i] = int32_t(gen() % uint32_t(vocab));
  }
  b.local_inputs.resize(b.inputs.size() / size_t(split.cp()));
  b.local_targets.resize(b.local_inputs.size());
  split.take(b.local_inputs.data(), b.inputs.data(), B);
  split.take(b.local_targets.data(), b.targets.data(), B);
  return b;
}

template <typename F>
void run(const comm::Communicator& world, const GptConfig& c, CpAttention variant, Recompute r,
         const std::string& name, int ulysses = 0) {
  const int cp = world.size(), B = 2, T = 8 * cp;
  Backend& backend = cpu_backend();
  ParamStoreT<F> whole_store, cp_store;
  GptT<F> whole(backend, c, whole_store, B, T, r);
  ContextAttention<F> attention(backend, world, variant, ulysses);
  GptT<F> split_model(backend, c, cp_store, B, T / cp, r, nullptr, nullptr, {}, nullptr,
                      &attention);
  whole_store.finalize({});
  cp_store.finalize({});
  std::mt19937 gen(11);
  same_weights(gen, whole_store, cp_store);
  const Batch batch = random_batch(gen, c.vocab_size, B, attention.split(T / cp));
  const double loss = whole.forward_backward(batch.inputs.data(), batch.targets.data(), 1.0f);
  const double local =
      split_model.forward_backward(batch.local_inputs.data(), batch.local_targets.data(), 1.0f);
  const std::vector<double> losses = gather(world, &local, 1);
  double mean = 0;
  for (double l : losses) mean += l / cp;
  const double tol = sizeof(F) == 8 ? 1e-12 : 2e-5;
  const std::string what =
      fmt::format("{} {} cp {}{}", name, cp_attention_label(variant, cp, attention.ulysses()), cp,
                  r == Recompute::full ? " recompute full" : "");
  const double el = std::abs(mean - loss) / std::abs(loss);
  check(el <= tol, fmt::format("{}: loss {} vs whole {} ({:.2e})", what, mean, loss, el));
  double worst = 0;
  std::string worst_name;
  for (TensorId id = 0; id < TensorId(whole_store.tensors().size()); ++id) {
    const size_t n = size_t(whole_store.tensor(id).numel());
    const std::vector<F> all = gather(world, cp_store.grad(id), n);
    const F* want = whole_store.grad(id);
    double num = 0, den = 0;
    for (size_t i = 0; i < n; ++i) {
      double sum = 0;
      for (int j = 0; j < cp; ++j) sum += double(all[size_t(j) * n + i]);
      num = std::max(num, std::abs(sum / cp - double(want[i])));
      den = std::max(den, std::abs(double(want[i])));
    }
    const double e = den > 0 ? num / den : num;
    if (e > worst) worst = e, worst_name = whole_store.tensor(id).spec.name;
  }
  check(worst <= tol, fmt::format("{}: gradient of {} {:.2e}", what, worst_name, worst));
  if (world.rank() == 0) {
    std::printf("ok %s %s: loss %.2e, worst gradient %.2e (%s)\n", sizeof(F) == 8 ? "f64" : "f32",
                what.c_str(), el, worst, worst_name.c_str());
  }
}

// How far float32 lands from float64 with and without the split: the whole float model and the
// split one, each against the whole model in double from the same weights (rounded to float).
// Blockwise attention merges softmax pieces and recomputes probabilities from the merged
// log-sum-exp, a different float32 computation than the materialised kernel's; the split
// model's gradients must stay within a few times the whole float model's own error.
void float_error_against_double(const comm::Communicator& world, const GptConfig& c,
                                const std::string& name) {
  const int cp = world.size(), B = 2, T = 8 * cp;
  Backend& backend = cpu_backend();
  ParamStoreT<double> exact_store;
  ParamStoreT<float> whole_store, cp_store;
  GptT<double> exact(backend, c, exact_store, B, T);
  GptT<float> whole(backend, c, whole_store, B, T);
  ContextAttention<float> attention(backend, world, CpAttention::ring);
  GptT<float> split_model(backend, c, cp_store, B, T / cp, Recompute::none, nullptr, nullptr, {},
                          nullptr, &attention);
  exact_store.finalize({});
  whole_store.finalize({});
  cp_store.finalize({});
  std::mt19937 gen(13);
  same_weights(gen, whole_store, exact_store, cp_store);
  const Batch batch = random_batch(gen, c.vocab_size, B, attention.split(T / cp));
  exact.forward_backward(batch.inputs.data(), batch.targets.data(), 1.0f);
  whole.forward_backward(batch.inputs.data(), batch.targets.data(), 1.0f);
  split_model.forward_backward(batch.local_inputs.data(), batch.local_targets.data(), 1.0f);
  double worst_whole = 0, worst_split = 0;
  for (TensorId id = 0; id < TensorId(exact_store.tensors().size()); ++id) {
    const size_t n = size_t(exact_store.tensor(id).numel());
    const std::vector<float> all = gather(world, cp_store.grad(id), n);
    const double* want = exact_store.grad(id);
    double den = 0, e_whole = 0, e_split = 0;
    for (size_t i = 0; i < n; ++i) {
      double sum = 0;
      for (int j = 0; j < cp; ++j) sum += double(all[size_t(j) * n + i]);
      den = std::max(den, std::abs(want[i]));
      e_whole = std::max(e_whole, std::abs(double(whole_store.grad(id)[i]) - want[i]));
      e_split = std::max(e_split, std::abs(sum / cp - want[i]));
    }
    if (den > 0) {
      worst_whole = std::max(worst_whole, e_whole / den);
      worst_split = std::max(worst_split, e_split / den);
    }
  }
  check(worst_split <= 4 * worst_whole,
        fmt::format("{} cp {}: float gradients {:.2e} from double, the whole float model's {:.2e}",
                    name, cp, worst_split, worst_whole));
  if (world.rank() == 0) {
    std::printf("ok f32 vs f64 %s cp %d: worst gradient, whole %.2e, split %.2e\n", name.c_str(),
                cp, worst_whole, worst_split);
  }
}

GptConfig gpt2(int cp) { return GptConfig::make(53, 2, 4, 32, 8 * cp, 64); }

GptConfig llama(int cp) {
  GptConfig c = GptConfig::make(53, 2, 4, 32, 8 * cp, 64);
  LlamaShape l;
  l.n_kv_head = 2;
  l.ffn = 40;
  l.rope_theta = 5e5;
  c.set_llama(l);
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  comm::CommOptions opts;
  opts.timeout_s = 60;
  {
    comm::Communicator world = comm::init_world(opts, &argc, &argv);
    g_rank = world.rank();
    const int cp = world.size();
    for (CpAttention v : {CpAttention::ring, CpAttention::all_gather, CpAttention::ulysses}) {
      run<double>(world, gpt2(cp), v, Recompute::none, "gpt2");
      run<double>(world, llama(cp), v, Recompute::none, "llama");
    }
    run<double>(world, gpt2(cp), CpAttention::ring, Recompute::full, "gpt2");
    run<double>(world, llama(cp), CpAttention::ring, Recompute::full, "llama");
    run<double>(world, llama(cp), CpAttention::ulysses, Recompute::full, "llama");
    if (cp % 2 == 0 && cp > 2) {
      // The hybrid: Ulysses over pairs (a key/value head each), a ring across them.
      run<double>(world, llama(cp), CpAttention::ulysses, Recompute::none, "llama", 2);
      run<double>(world, llama(cp), CpAttention::ulysses, Recompute::full, "llama", 2);
    }
    run<float>(world, gpt2(cp), CpAttention::ring, Recompute::none, "gpt2");
    run<float>(world, llama(cp), CpAttention::ring, Recompute::none, "llama");
    float_error_against_double(world, gpt2(cp), "gpt2");
    float_error_against_double(world, llama(cp), "llama");
    int bad = g_failures;
    world.all_reduce(std::span<int32_t>(&bad, 1)).wait();
    g_failures = bad;
  }
  return g_failures == 0 ? 0 : 1;
}
