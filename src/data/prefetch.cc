#include "data/prefetch.h"

#include <algorithm>

#include "core/error.h"
#include "core/timer.h"

namespace tetra {

Prefetcher::Prefetcher(const TokenDataset& data, Sampler sampler, int depth)
    : data_(data),
      sampler_(std::move(sampler)),
      consumed_(sampler_.state()),
      depth_(size_t(std::max(depth, 1))) {
  const size_t n = size_t(sampler_.local_batch()) * size_t(data_.seq_len());
  for (size_t i = 0; i < depth_; ++i) {
    auto b = std::make_unique<Batch>();
    b->inputs.resize(n);
    b->targets.resize(n);
    free_.push_back(std::move(b));
  }
  indices_.resize(size_t(sampler_.local_batch()));
  window_.resize(size_t(data_.seq_len()) + 1);
  thread_ = std::thread([this] { run(); });
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  free_cv_.notify_all();
  thread_.join();
}

void Prefetcher::fill(Batch& b) {
  const size_t T = size_t(data_.seq_len());
  sampler_.next_batch(indices_.data());
  for (size_t i = 0; i < indices_.size(); ++i) {
    data_.sample(indices_[i], window_.data());
    std::copy(window_.begin(), window_.begin() + T, b.inputs.begin() + i * T);
    std::copy(window_.begin() + 1, window_.end(), b.targets.begin() + i * T);
  }
  b.cursor_after = sampler_.cursor();
}

void Prefetcher::run() {
  for (;;) {
    std::unique_ptr<Batch> b;
    {
      std::unique_lock<std::mutex> lock(mu_);
      free_cv_.wait(lock, [&] { return stop_ || !free_.empty(); });
      if (stop_) return;
      b = std::move(free_.front());
      free_.pop_front();
    }
    try {
      fill(*b);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = std::current_exception();
      ready_cv_.notify_all();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_.push_back(std::move(b));
    }
    ready_cv_.notify_one();
  }
}

const Batch& Prefetcher::next() {
  Stopwatch wait;
  std::unique_lock<std::mutex> lock(mu_);
  if (current_) {
    free_.push_back(std::move(current_));
    free_cv_.notify_one();
  }
  ready_cv_.wait(lock, [&] { return !ready_.empty() || error_; });
  if (ready_.empty()) std::rethrow_exception(error_);
  current_ = std::move(ready_.front());
  ready_.pop_front();
  consumed_.cursor = current_->cursor_after;
  consumed_.epoch = consumed_.cursor / consumed_.num_samples;
  last_wait_ms_ = wait.elapsed_ms();
  return *current_;
}

SamplerState Prefetcher::state() const { return consumed_; }

}  // namespace tetra
