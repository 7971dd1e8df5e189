// The order training samples are visited in, and each data-parallel rank's share of it.
//
// The g-th sample drawn (g counts across epochs) is sample perm_e(g mod N) of the dataset, with
// epoch e = g / N and perm_e a permutation that is a pure function of (seed, e) (the identity when
// shuffling is off). Global batch k is draws [k*GB, (k+1)*GB); rank r of R takes the contiguous
// slice [r*GB/R, (r+1)*GB/R) of it. The cursor is the number of global draws consumed, so
// {seed, cursor} (plus the dataset size as a guard) is the whole state of the data order: a
// resume from a cursor sees exactly what the uninterrupted run would have seen. Because the
// cursor counts global draws, a resume with another data-parallel size R' continues at the same
// draw with the new split; the union over ranks is still draws [cursor, cursor + GB'), so no
// sample is lost or repeated within an epoch. See docs/data.md, "Sampler and resume".
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

namespace tetra {

/** Maps the g-th sample drawn (across epochs) to a dataset sample index: pure in (seed, g). */
class SampleOrder {
 public:
  SampleOrder(int64_t num_samples, bool shuffle, uint64_t seed);
  /** The same value for the same g, whatever was asked before (one epoch's permutation is
   * cached, which is why this is not const). */
  int64_t at(int64_t g);
  int64_t num_samples() const { return n_; }

 private:
  int64_t n_;
  bool shuffle_;
  uint64_t seed_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> perm_;
};

/** Everything a checkpoint needs to resume the data order, as a few integers. num_samples and
 * shuffle guard against resuming over other data; global_batch and dp_size record the layout that
 * saved it and may differ on resume. */
struct SamplerState {
  uint64_t seed = 0;
  int64_t num_samples = 0;
  bool shuffle = false;
  int64_t epoch = 0;   // cursor / num_samples (derived; stored for people reading checkpoints)
  int64_t cursor = 0;  // global samples consumed
  int64_t global_batch = 0;
  int dp_size = 1;

  nlohmann::json to_json() const;
  /** Throws tetra::Error naming the missing or malformed field. */
  static SamplerState from_json(const nlohmann::json& j);
};

class Sampler {
 public:
  /** global_batch = micro_batch * grad_accum * dp_size samples per optimizer step; it must be a
   * multiple of dp_size. dp_rank is this rank's index in 0..dp_size-1. */
  Sampler(int64_t num_samples, bool shuffle, uint64_t seed, int64_t global_batch, int dp_rank,
          int dp_size);

  /** This rank's samples per global batch: global_batch / dp_size. */
  int64_t local_batch() const { return local_; }
  int64_t global_batch() const { return global_; }
  int dp_rank() const { return rank_; }
  int dp_size() const { return size_; }
  int64_t num_samples() const { return order_.num_samples(); }

  /** Writes this rank's share of the next global batch (local_batch() dataset indices, in draw
   * order) into out and advances the cursor by global_batch(). */
  void next_batch(int64_t* out);
  std::vector<int64_t> next_batch();

  int64_t cursor() const { return cursor_; }
  /** Any cursor >= 0 is valid, including one that is not a multiple of global_batch() (a resume
   * under another data-parallel size). */
  void set_cursor(int64_t cursor);
  int64_t epoch() const { return cursor_ / order_.num_samples(); }

  SamplerState state() const;
  /** Continues from a saved state. Refuses a state from other data (sample count, shuffle, seed);
   * accepts another global_batch / dp_size (the resume rule above). */
  void restore(const SamplerState& state);

 private:
  SampleOrder order_;
  uint64_t seed_;
  bool shuffle_;
  int64_t global_, local_;
  int rank_, size_;
  int64_t cursor_ = 0;
};

}  // namespace tetra
