// Fixed-length training samples over token shards, and the order they are visited in.
// A sample is a window of T+1 tokens (inputs are the first T, targets the last T); windows never
// cross a shard boundary. Sample order is a pure function of (seed, epoch, index): no hidden
// state, so a cursor (the count of samples consumed) is all a resume needs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/token_shard.h"

namespace tetra {

class TokenDataset {
 public:
  /** `spec` is a shard path, a comma-separated list of paths, or a glob ("data/train_*.bin"). */
  TokenDataset(const std::string& spec, int seq_len);

  int64_t num_samples() const { return total_; }
  int seq_len() const { return T_; }
  size_t num_tokens() const;
  /** Copies sample j (T+1 tokens) into out. */
  void sample(int64_t j, int32_t* out) const;
  /** Largest token id over all shards. */
  uint32_t max_token() const;
  const std::vector<std::unique_ptr<TokenShard>>& shards() const { return shards_; }

 private:
  int T_;
  std::vector<std::unique_ptr<TokenShard>> shards_;
  std::vector<int64_t> first_;  // first global sample index of each shard
  int64_t total_ = 0;
};

/** Maps the g-th sample drawn (across epochs) to a dataset sample index. */
class SampleOrder {
 public:
  SampleOrder(int64_t num_samples, bool shuffle, uint64_t seed);
  int64_t at(int64_t g);
  int64_t epoch_of(int64_t g) const { return g / n_; }

 private:
  int64_t n_;
  bool shuffle_;
  uint64_t seed_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> perm_;
};

}  // namespace tetra
