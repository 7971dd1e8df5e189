// The end of a step after backward: the gradient reduction (data parallelism with ZeRO, then the
// tied embedding over the first and last pipeline stage), the step's scalars over every rank (the
// loss, the global gradient norm with each element counted once, a vote on non-finite values),
// the skip policy for bad numbers, clipping and the AdamW update.
#pragma once

#include <cstdint>
#include <string>

#include "core/param_store.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "parallel/data_parallel.h"
#include "train/run_layout.h"
#include "train/train_config.h"

namespace tetra {

/** What one step's update did. */
struct UpdateResult {
  double loss = 0.0, grad_norm = 0.0;
  double local_sq = 0.0;  // this rank's contribution to the squared norm
  bool skipped = false;
};

/** Skipped updates so far and in a row; part of the checkpointed trainer state. */
struct SkipCounters {
  int64_t total = 0, in_a_row = 0;
};

class Updater {
 public:
  Updater(const TrainOptions& options, RunLayout& layout, ParamStore& store, Gpt& model,
          parallel::DataParallel& zero, AdamW& adamw);

  /** Waits for every gradient reduction, then sums the tied wte's gradient over the embedding
   *  group (a pipeline's end stages): both copies update with the sum. */
  void reduce_gradients();
  /** The update of 1-based step `step` at learning rate `lr` from this rank's mean loss:
   *  scalars over every rank, then a skip (non-finite, debug.skip_step; stops the run per
   *  train.on_nonfinite / train.max_skipped) or the clipped AdamW step. `before_update` runs
   *  between the reduction of the scalars and the update (debug.dump_grads). */
  UpdateResult step(int64_t step, double lr, double local_loss,
                    const std::function<void()>& before_update);

  SkipCounters& skips() { return skips_; }

 private:
  // This rank's share of the squared gradient norm: every element counted once over the mesh.
  double local_sum_squares();

  const TrainOptions& opt_;
  RunLayout& layout_;
  ParamStore& store_;
  Gpt& model_;
  parallel::DataParallel& zero_;
  AdamW& adamw_;
  SkipCounters skips_;
};

}  // namespace tetra
