// The single-process training loop: micro-batches with gradient accumulation, global-norm
// clipping, the LR schedule, AdamW, periodic validation, metrics and the progress line.
#pragma once

#include <memory>
#include <vector>

#include "data/token_dataset.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "train/metrics.h"
#include "train/train_config.h"

namespace tetra {

struct TrainResult {
  int64_t steps = 0;
  double final_loss = 0.0;
  double final_val_loss = -1.0;  // < 0 when no validation data
  double tokens_per_s = 0.0;     // median over steps
};

class Trainer {
 public:
  /** Validates data against the model (token ids < vocab) and allocates everything. */
  Trainer(const TrainOptions& options, const std::string& config_toml);
  TrainResult run();

  Gpt& model() { return *model_; }

 private:
  void load_batch(TokenDataset& data, SampleOrder& order, int64_t first_sample);
  double evaluate();
  void print_header() const;

  TrainOptions opt_;
  int threads_ = 1;
  double peak_gflops_ = 0.0;
  std::unique_ptr<Gpt> model_;
  std::unique_ptr<AdamW> adamw_;
  std::unique_ptr<TokenDataset> train_, val_;
  std::unique_ptr<SampleOrder> order_;
  std::vector<int32_t> window_, inputs_, targets_;  // (T+1) scratch, (B,T), (B,T)
};

}  // namespace tetra
