#include "model/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/philox.h"

namespace tetra {

const float* Generator::step(int32_t token) {
  const GptConfig& c = model_.config();
  TETRA_CHECK(pos_ < c.max_seq,
              "[generate] the sequence reached model.max_seq={} tokens; use a shorter prompt or "
              "fewer --max-tokens",
              c.max_seq);
  TETRA_CHECK(token >= 0 && token < c.vocab_size,
              "[generate] token id {} is outside the model's vocabulary of {}; the tokenizer does "
              "not match the model",
              token, c.vocab_size);
  const float* logits = model_.decode(*state_, &token, pos_);
  ++pos_;
  parallel::TensorParallel& tp = model_.tp();
  Device& device = model_.backend().device();
  if (tp.size() > 1) {
    if (full_.size() == 0) full_ = Buffer<float>(size_t(c.padded_vocab), {}, device);
    tp.gather_columns(logits, full_.data(), 1, c.local_vocab());
    logits = full_.data();
  }
  // Sampling runs on the host.
  host_.resize(size_t(c.padded_vocab));
  device.to_host(host_.data(), logits, host_.size() * sizeof(float));
  return host_.data();
}

const float* Generator::prefill(std::span<const int32_t> prompt) {
  TETRA_CHECK(!prompt.empty(), "[generate] the prompt is empty; give at least one token");
  reset();
  const float* logits = nullptr;
  for (int32_t token : prompt) logits = step(token);
  return logits;
}

int32_t sample_token(const float* logits, int V, const SamplingOptions& options, uint64_t draw) {
  TETRA_CHECK(options.temperature >= 0 && std::isfinite(options.temperature),
              "[generate] temperature must be >= 0 (got {})", options.temperature);
  TETRA_CHECK(options.top_k >= 0, "[generate] top-k must be >= 0 (got {})", options.top_k);
  // Candidates by descending logit, ties to the lower id, so the choice is deterministic.
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  auto better = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  const int k = options.top_k > 0 ? std::min(options.top_k, V) : V;
  if (options.temperature == 0 || k == 1) return *std::min_element(ids.begin(), ids.end(), better);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), better);
  std::vector<double> p(static_cast<size_t>(k));
  const double top = logits[ids[0]];
  double sum = 0;
  for (int i = 0; i < k; ++i) {
    p[size_t(i)] = std::exp((double(logits[ids[size_t(i)]]) - top) / options.temperature);
    sum += p[size_t(i)];
  }
  const double u = double(Philox(options.seed, "generate/sample").uniform(draw)) * sum;
  double acc = 0;
  for (int i = 0; i < k; ++i) {
    acc += p[size_t(i)];
    if (u < acc) return ids[size_t(i)];
  }
  return ids[size_t(k) - 1];
}

std::vector<int32_t> generate(Generator& gen, std::span<const int32_t> prompt, int max_new,
                              const SamplingOptions& options, int32_t stop_token) {
  const int maxT = gen.config().max_seq;
  TETRA_CHECK(max_new >= 0, "[generate] --max-tokens must be >= 0 (got {})", max_new);
  TETRA_CHECK(int64_t(prompt.size()) + max_new <= maxT,
              "[generate] the prompt ({} tokens) plus --max-tokens {} exceeds the model's "
              "max_seq={}; lower --max-tokens to at most {} or shorten the prompt",
              prompt.size(), max_new, maxT, std::max<int64_t>(0, maxT - int64_t(prompt.size())));
  std::vector<int32_t> out;
  if (max_new == 0) return out;
  const float* logits = gen.prefill(prompt);
  const int V = gen.config().vocab_size;
  for (int i = 0; i < max_new; ++i) {
    int32_t next = sample_token(logits, V, options, uint64_t(gen.position()));
    out.push_back(next);
    if (next == stop_token || i + 1 == max_new) break;
    logits = gen.step(next);
  }
  return out;
}

}  // namespace tetra
