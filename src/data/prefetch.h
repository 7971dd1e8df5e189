// Batches assembled on a background thread ahead of the trainer, so a step only waits for data
// when the loader is slower than the model. The thread owns the sampler; the consumer sees the
// sampler's state as of the batches it has taken, which is what a checkpoint must save.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "data/sampler.h"
#include "data/token_dataset.h"

namespace tetra {

/** One global batch's share for this rank: n = sampler.local_batch() samples of T+1 tokens. */
struct Batch {
  std::vector<int32_t> inputs, targets;  // (n,T) each: a sample's first T and last T tokens
  int64_t cursor_after = 0;              // the sampler's cursor once this batch is consumed
};

class Prefetcher {
 public:
  /** Starts the thread, which keeps up to `depth` batches ready. data must outlive this. */
  Prefetcher(const TokenDataset& data, Sampler sampler, int depth = 3);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  /** The next batch, valid until the following call. Blocks only while none is ready; rethrows
   * an error the thread met (a shard that cannot be read). */
  const Batch& next();
  /** Milliseconds the last next() waited. */
  double last_wait_ms() const { return last_wait_ms_; }
  /** The sampler state after the batches returned so far (not the thread's read-ahead). */
  SamplerState state() const;

 private:
  void run();
  void fill(Batch& b);

  const TokenDataset& data_;
  Sampler sampler_;  // touched only by the thread once it runs
  SamplerState consumed_;
  const size_t depth_;
  std::mutex mu_;
  std::condition_variable ready_cv_, free_cv_;
  std::deque<std::unique_ptr<Batch>> ready_, free_;
  std::unique_ptr<Batch> current_;
  std::exception_ptr error_;
  bool stop_ = false;
  double last_wait_ms_ = 0.0;
  std::vector<int64_t> indices_;
  std::vector<int32_t> window_;
  std::thread thread_;  // last: starts after every member above exists
};

}  // namespace tetra
