// Autoregressive inference for a trained GPT: one token at a time with a key/value cache, so
// the cost of a new token is linear in the tokens before it (attention reads the cached keys and
// values; nothing is recomputed). Sampling draws from Philox keyed by (seed, position), so a seed
// reproduces a continuation exactly.
#pragma once

#include <cstdint>
#include <memory>
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
  /** Runs `model` (which must outlive this) one token at a time; its micro-batch shape does not
   *  matter. The cache holds model.config().max_seq positions. */
  explicit Generator(Gpt& model) : model_(model), state_(model.make_decode_state()) {}

  /** Empties the cache: the next step() is position 0. */
  void reset() { pos_ = 0; }
  /** Feeds `token` at position position() and returns the logits for the next token, (Vp) in
   * host memory, on every rank of a tensor-parallel model (each rank's columns gathered). Valid
   * until the next call. */
  const float* step(int32_t token);
  /** reset(), then feeds every prompt token; returns the logits after the last one, (Vp). */
  const float* prefill(std::span<const int32_t> prompt);

  int position() const { return pos_; }
  const GptConfig& config() const { return model_.config(); }

 private:
  Gpt& model_;
  std::unique_ptr<Gpt::DecodeState> state_;
  Buffer<float> full_;       // (Vp): gathered logits of a tensor-parallel model, on the device
  std::vector<float> host_;  // (Vp): the logits sampling reads
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
