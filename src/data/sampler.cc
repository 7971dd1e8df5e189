#include "data/sampler.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "core/philox.h"

namespace tetra {

SampleOrder::SampleOrder(int64_t num_samples, bool shuffle, uint64_t seed)
    : n_(num_samples), shuffle_(shuffle), seed_(seed) {
  TETRA_CHECK(n_ > 0, "[data] the dataset has no samples");
}

int64_t SampleOrder::at(int64_t g) {
  TETRA_CHECK(g >= 0, "[data] sample draw {} is negative", g);
  int64_t epoch = g / n_, pos = g % n_;
  if (!shuffle_) return pos;
  if (epoch != cached_epoch_) {
    // A permutation keyed by (seed, epoch): sort indices by a Philox draw each.
    Philox rng(seed_, "data/order/epoch" + std::to_string(epoch));
    std::vector<std::pair<uint64_t, int64_t>> keyed(static_cast<size_t>(n_));
    for (int64_t i = 0; i < n_; ++i) keyed[size_t(i)] = {rng.bits(uint64_t(i)), i};
    std::sort(keyed.begin(), keyed.end());
    perm_.resize(size_t(n_));
    for (int64_t i = 0; i < n_; ++i) perm_[size_t(i)] = keyed[size_t(i)].second;
    cached_epoch_ = epoch;
  }
  return perm_[size_t(pos)];
}

nlohmann::json SamplerState::to_json() const {
  return {{"seed", seed},      {"num_samples", num_samples}, {"shuffle", shuffle},
          {"epoch", epoch},    {"cursor", cursor},           {"global_batch", global_batch},
          {"dp_size", dp_size}};
}

SamplerState SamplerState::from_json(const nlohmann::json& j) {
  SamplerState s;
  auto get = [&](const char* key, auto& out) {
    TETRA_CHECK(j.is_object() && j.contains(key),
                "[data] sampler state lacks '{}'; the checkpoint's data section is damaged or from "
                "another version",
                key);
    try {
      j.at(key).get_to(out);
    } catch (const nlohmann::json::exception& e) {
      fail("[data] sampler state field '{}' is malformed ({})", key, e.what());
    }
  };
  get("seed", s.seed);
  get("num_samples", s.num_samples);
  get("shuffle", s.shuffle);
  get("epoch", s.epoch);
  get("cursor", s.cursor);
  get("global_batch", s.global_batch);
  get("dp_size", s.dp_size);
  TETRA_CHECK(s.cursor >= 0 && s.num_samples > 0,
              "[data] sampler state has cursor {} and {} samples; both must be positive", s.cursor,
              s.num_samples);
  return s;
}

Sampler::Sampler(int64_t num_samples, bool shuffle, uint64_t seed, int64_t global_batch,
                 int dp_rank, int dp_size)
    : order_(num_samples, shuffle, seed),
      seed_(seed),
      shuffle_(shuffle),
      global_(global_batch),
      rank_(dp_rank),
      size_(dp_size) {
  TETRA_CHECK(dp_size > 0 && dp_rank >= 0 && dp_rank < dp_size,
              "[data] data-parallel rank {} is outside 0..{}", dp_rank, dp_size - 1);
  TETRA_CHECK(global_batch > 0, "[data] the global batch must be positive (got {})", global_batch);
  TETRA_CHECK(global_batch % dp_size == 0,
              "[data] the global batch of {} samples does not split over {} data-parallel ranks; "
              "make train.micro_batch * train.grad_accum * dp_size a multiple of dp_size (change "
              "the batch or the number of ranks)",
              global_batch, dp_size);
  local_ = global_batch / dp_size;
}

void Sampler::next_batch(int64_t* out) {
  const int64_t first = cursor_ + int64_t(rank_) * local_;
  for (int64_t i = 0; i < local_; ++i) out[i] = order_.at(first + i);
  cursor_ += global_;
}

std::vector<int64_t> Sampler::next_batch() {
  std::vector<int64_t> out(static_cast<size_t>(local_));
  next_batch(out.data());
  return out;
}

void Sampler::set_cursor(int64_t cursor) {
  TETRA_CHECK(cursor >= 0, "[data] sampler cursor must be >= 0 (got {})", cursor);
  cursor_ = cursor;
}

SamplerState Sampler::state() const {
  SamplerState s;
  s.seed = seed_;
  s.num_samples = order_.num_samples();
  s.shuffle = shuffle_;
  s.epoch = epoch();
  s.cursor = cursor_;
  s.global_batch = global_;
  s.dp_size = size_;
  return s;
}

void Sampler::restore(const SamplerState& s) {
  TETRA_CHECK(s.num_samples == order_.num_samples(),
              "[data] the checkpoint's data order covers {} samples but this dataset has {}; "
              "resume with the same data.train and train.seq_len",
              s.num_samples, order_.num_samples());
  TETRA_CHECK(s.shuffle == shuffle_ && s.seed == seed_,
              "[data] the checkpoint was written with data.shuffle={} and train.seed={}, this run "
              "has {} and {}; resume with the saved values",
              s.shuffle, s.seed, shuffle_, seed_);
  set_cursor(s.cursor);
}

}  // namespace tetra
