// The single-process training loop: micro-batches with gradient accumulation, global-norm
// clipping, the LR schedule, AdamW, periodic validation, metrics and the progress line.
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "data/prefetch.h"
#include "data/token_dataset.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "parallel/mesh.h"
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
  /** Validates data against the model (token ids < vocab) and allocates everything. `world` is
   * the job's world group when launched on several ranks (invalid for a single process). */
  Trainer(const TrainOptions& options, const std::string& config_toml,
          const comm::Communicator& world = {});
  TrainResult run();

  Gpt& model() { return *model_; }

 private:
  void load_batch(TokenDataset& data, SampleOrder& order, int64_t first_sample);
  double evaluate();
  void print_header() const;

  bool is_root() const { return rank_ == 0; }
  int64_t tokens_per_step() const { return opt_.tokens_per_rank_step() * dp_size_; }

  TrainOptions opt_;
  std::unique_ptr<parallel::Mesh> mesh_;  // absent for a single process
  int rank_ = 0, dp_size_ = 1, dp_rank_ = 0;
  int threads_ = 1;
  double peak_gflops_ = 0.0;
  std::unique_ptr<Gpt> model_;
  std::unique_ptr<AdamW> adamw_;
  std::unique_ptr<TokenDataset> train_, val_;
  std::unique_ptr<Prefetcher> prefetch_;            // training batches, assembled ahead of the step
  std::vector<int32_t> window_, inputs_, targets_;  // (T+1) scratch, (B,T), (B,T)
};

}  // namespace tetra
