// Autoregressive inference for a trained GPT: one token at a time with a key/value cache, so
// the cost of a new token is linear in the tokens before it (attention reads the cached keys and
// values; nothing is recomputed). Sampling draws from Philox keyed by (seed, position), so a seed
// reproduces a continuation exactly.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/gpt.h"

namespace tetra {

struct SamplingOptions {
  float temperature = 1.0f;  // logits are divided by it; 0 picks the most likely token
  int top_k = 0;             // draw among the k most likely tokens; 0 means all of them
  uint64_t seed = 1;
};

class Generator {
 public:
  /** Reads the weights of `model` in place (it must outlive this); its micro-batch shape does not
   * matter. The cache holds model.config().max_seq positions. */
  explicit Generator(const Gpt& model);

  /** Empties the cache: the next step() is position 0. */
  void reset() { pos_ = 0; }
  /** Feeds `token` at position position() and returns the logits for the next token, (V). Valid
   * until the next call. */
  const float* step(int32_t token);
  /** reset(), then feeds every prompt token; returns the logits after the last one, (V). */
  const float* prefill(std::span<const int32_t> prompt);

  int position() const { return pos_; }
  const GptConfig& config() const { return config_; }

 private:
  struct Layer {
    const float *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb;
    const float *ln2w, *ln2b, *fcw, *fcb, *fcprojw, *fcprojb;
  };

  GptConfig config_;
  const float *wte_, *wpe_, *lnfw_, *lnfb_;
  std::vector<Layer> layers_;
  std::vector<float> cache_;  // (L, 2, maxT, C): keys then values of every position fed so far
  // one-position activations: x, ln (C); qkv (3C); atty (C); fch (4C); scores (maxT); logits (Vp)
  std::vector<float> x_, ln_, qkv_, atty_, fch_, scores_, logits_;
  float mean_ = 0, rstd_ = 0;
  int pos_ = 0;
};

/** The token to emit given logits (V): greedy for temperature 0 or top_k 1, else a draw from the
 * softmax of logits/temperature over the top_k tokens, using Philox(seed) element `draw`. */
int32_t sample_token(const float* logits, int V, const SamplingOptions& options, uint64_t draw);

/** Feeds the prompt, then samples up to max_new tokens (stopping after stop_token when it is
 * >= 0). Returns the new tokens. Refuses prompt + max_new beyond model.max_seq. */
std::vector<int32_t> generate(Generator& gen, std::span<const int32_t> prompt, int max_new,
                              const SamplingOptions& options, int32_t stop_token = -1);

}  // namespace tetra
