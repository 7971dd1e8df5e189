#include "train/train_data.h"

#include <algorithm>

#include "core/error.h"
#include "core/log.h"

namespace tetra {

namespace {

void check_vocab(const TokenDataset& data, const std::string& what, int vocab) {
  uint32_t mx = data.max_token();
  TETRA_CHECK(mx < uint32_t(vocab),
              "[data] {} holds token id {} but model.vocab_size={}; set model.vocab_size to at "
              "least {} or re-tokenize the data",
              what, mx, vocab, mx + 1);
}

}  // namespace

TrainData::TrainData(const DataOptions& data, const BatchOptions& batch, uint64_t seed,
                     int64_t vocab_size, const RunLayout& layout)
    : data_(data), batch_(batch), seed_(seed), layout_(layout) {
  train_ = std::make_unique<TokenDataset>(data.train, batch.seq_len, data.verify);
  check_vocab(*train_, "data.train", vocab_size);
  if (train_->verified_bytes() > 0) {
    log_info(
        "[data] verified {:.1f} MB of shards against their manifests in {:.2f} s ({:.2f} GB/s)",
        train_->verified_bytes() / 1e6, train_->verify_seconds(),
        train_->verified_bytes() / 1e9 / std::max(train_->verify_seconds(), 1e-9));
  }
  if (!data.val.empty()) {
    val_ = std::make_unique<TokenDataset>(data.val, batch.seq_len, data.verify);
    check_vocab(*val_, "data.val", vocab_size);
    TETRA_CHECK(val_->num_samples() >= int64_t(data.eval_batches) * batch.micro_batch,
                "[train] data.val has {} samples but eval.batches={} micro-batches of {} need {}; "
                "lower eval.batches or use more validation data",
                val_->num_samples(), data.eval_batches, batch.micro_batch,
                int64_t(data.eval_batches) * batch.micro_batch);
  }
  const int64_t global_batch = int64_t(batch.micro_batch) * batch.grad_accum * layout.data_size();
  if (global_batch > train_->num_samples()) {
    log_warn(
        "[train] a step takes {} sequences ({} ranks x {} micro-batches x {}) but data.train "
        "has only {} samples of {} tokens: every step repeats samples. Lower train.micro_batch, "
        "train.grad_accum or the rank count, or use more data",
        global_batch, layout.data_size(), batch.grad_accum, batch.micro_batch,
        train_->num_samples(), batch.seq_len);
  }
}

void TrainData::start(const std::optional<SamplerState>& resumed) {
  // A global batch is every rank's micro-batches of one step; rank r takes its slice.
  const int64_t global_batch =
      int64_t(batch_.micro_batch) * batch_.grad_accum * layout_.data_size();
  Sampler sampler(train_->num_samples(), data_.shuffle, seed_, global_batch, layout_.data_rank(),
                  layout_.data_size());
  if (resumed) sampler.restore(*resumed);
  prefetch_ = std::make_unique<Prefetcher>(*train_, std::move(sampler));
}

void TrainData::validation(std::vector<int32_t>& inputs, std::vector<int32_t>& targets) const {
  const size_t T = size_t(batch_.seq_len),
               n = size_t(data_.eval_batches) * size_t(batch_.micro_batch);
  SampleOrder order(val_->num_samples(), false, 0);
  std::vector<int32_t> window(T + 1);
  inputs.resize(n * T);
  targets.resize(n * T);
  for (size_t b = 0; b < n; ++b) {
    val_->sample(order.at(int64_t(b)), window.data());
    std::copy(window.begin(), window.begin() + ptrdiff_t(T), inputs.begin() + ptrdiff_t(b * T));
    std::copy(window.begin() + 1, window.end(), targets.begin() + ptrdiff_t(b * T));
  }
}

}  // namespace tetra
