// Fixed-length training samples over token shards. A sample is a window of T+1 tokens (inputs
// are the first T, targets the last T); windows never cross a shard boundary. The order samples
// are visited in is data/sampler.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/token_shard.h"

namespace tetra {

class TokenDataset {
 public:
  /** `spec` is a shard path, a comma-separated list of paths, or a glob ("data/train_*.bin").
   * With `verify`, every shard that has a manifest.json beside it (as `tetra data prepare`
   * writes) is checked against the manifest: listed, same token count and version, same xxh3
   * of the whole file. A mismatch throws tetra::Error naming the shard, as do shards of both
   * token widths (uint16 beside uint32: one dataset has one format). */
  TokenDataset(const std::string& spec, int seq_len, bool verify = true);

  int64_t num_samples() const { return total_; }
  int seq_len() const { return T_; }
  size_t num_tokens() const;
  /** Copies sample j (T+1 tokens) into out. */
  void sample(int64_t j, int32_t* out) const;
  /** Largest token id over all shards. */
  uint32_t max_token() const;
  const std::vector<std::unique_ptr<TokenShard>>& shards() const { return shards_; }
  /** Bytes checksummed against manifests at construction (0 without verify or manifests). */
  uint64_t verified_bytes() const { return verified_bytes_; }
  /** Seconds the checksums took. */
  double verify_seconds() const { return verify_seconds_; }
  /** The tokenizer.json that the manifest.json beside the first shard names (the tokenizer of a
   * `tetra data prepare` dataset), or "" when there is no manifest. */
  std::string tokenizer_path() const;

 private:
  int T_;
  std::vector<std::unique_ptr<TokenShard>> shards_;
  std::vector<int64_t> first_;  // first global sample index of each shard
  int64_t total_ = 0;
  uint64_t verified_bytes_ = 0;
  double verify_seconds_ = 0;
};

}  // namespace tetra
