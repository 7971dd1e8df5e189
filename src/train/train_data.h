// The trainer's data: the training and validation token datasets (checked against the model's
// vocabulary and, when asked, their manifests' checksums), this rank's batches assembled ahead of
// the step by the prefetcher from a resumable sampler, and the validation micro-batches.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "data/prefetch.h"
#include "data/sampler.h"
#include "data/token_dataset.h"
#include "train/options.h"
#include "train/run_layout.h"

namespace tetra {

class TrainData {
 public:
  /** Opens and checks data.train and data.val (every rank) for `batch`, their tokens below
   *  `vocab_size`; `seed` orders the samples (data.shuffle). */
  TrainData(const DataOptions& data, const BatchOptions& batch, uint64_t seed, int64_t vocab_size,
            const RunLayout& layout);

  /** Starts the prefetcher at `resumed` (a checkpoint's sampler state) or at the beginning. */
  void start(const std::optional<SamplerState>& resumed);
  /** This rank's share of the next global batch; see Prefetcher::next. */
  const Batch& next() { return prefetch_->next(); }
  double last_wait_ms() const { return prefetch_->last_wait_ms(); }
  SamplerState state() const { return prefetch_->state(); }

  const TokenDataset& train() const { return *train_; }
  bool has_validation() const { return val_ != nullptr; }
  /** The first eval.batches micro-batches of data.val, unshuffled, back to back. */
  void validation(std::vector<int32_t>& inputs, std::vector<int32_t>& targets) const;

 private:
  const DataOptions data_;
  const BatchOptions batch_;
  const uint64_t seed_;
  const RunLayout& layout_;
  std::unique_ptr<TokenDataset> train_, val_;
  std::unique_ptr<Prefetcher> prefetch_;  // training batches, assembled ahead of the step
};

}  // namespace tetra
