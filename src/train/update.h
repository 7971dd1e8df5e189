// The end of a step after backward: the gradient reduction (data parallelism with ZeRO, then the
// tied embedding over the first and last pipeline stage), the step's scalars over every rank (the
// loss, the global gradient norm with each element counted once, a vote on non-finite values),
// the skip policy for bad numbers (non-finite values, a rank with bad numbers per train/sdc.h, a
// loss spike), clipping and the AdamW update.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/param_store.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "parallel/data_parallel.h"
#include "parallel/tied_weight.h"
#include "train/options.h"
#include "train/run_layout.h"
#include "train/sdc.h"

namespace tetra {

/** What one step's update did. */
struct UpdateResult {
  double loss = 0.0, grad_norm = 0.0;
  double local_sq = 0.0;  // this rank's contribution to the squared norm
  bool skipped = false;
  std::vector<BadRank> bad_ranks;  // named by the bad-number checks (health.*)
  bool checked = false;            // whether those checks ran this step
  double check_ms = 0.0;           // this rank's time in them
  double check_wait_ms = 0.0;      // of which waiting for their all-gather
  double max_z = -1.0;             // the z-score check's largest |z|; -1: not run
  double spike_z = 0.0;            // a loss spike's z (train.spike_zscore); 0: none
  bool stop = false;  // some rank was asked to end the run after this step (to resize it)
};

/** Skipped updates so far and in a row; part of the checkpointed trainer state. */
struct SkipCounters {
  int64_t total = 0, in_a_row = 0;
};

class Updater {
 public:
  /** The update by `optim`, a bad rank handled by health.on_bad_rank, the skips and spikes of
   *  `faults` injected. */
  Updater(const OptimOptions& optim, const HealthOptions& health, const FaultOptions& faults,
          RunLayout& layout, ParamStore& store, Gpt& model, parallel::DataParallel& zero,
          AdamW& adamw, SdcCheck* sdc = nullptr);

  /** Waits for every gradient reduction, then sums the tied wte's gradient over the embedding
   *  group (a pipeline's end stages; parallel/tied_weight.h): both copies update with the sum. */
  void reduce_gradients();
  /** The update of 1-based step `step` at learning rate `lr` from this rank's mean loss:
   *  scalars over every rank, the bad-number checks due, then a skip (non-finite, a rank with bad
   *  numbers, a loss spike, debug.skip_step; stops the run per train.on_nonfinite,
   *  health.on_bad_rank and train.max_skipped) or the clipped AdamW step. `before_update` runs
   *  between the reduction of the scalars and the update (debug.dump_grads). `stop`: this rank
   *  was asked to end the run after this step; reduced with the scalars, so that every rank
   *  stops after the same one. */
  UpdateResult step(int64_t step, double lr, double local_loss,
                    const std::function<void()>& before_update, bool stop = false);

  SkipCounters& skips() { return skips_; }
  /** The spike policy's rolling window of recent losses, oldest first; part of the checkpointed
   *  trainer state (restored with the last train.spike_window of them). */
  std::vector<double> loss_window() const { return {losses_.begin(), losses_.end()}; }
  void set_loss_window(const std::vector<double>& losses);
  /** The step's bad ranks, check time and spike into its metrics record. */
  static void add_to(nlohmann::json& rec, const UpdateResult& r);

 private:
  // This rank's share of the squared gradient norm: every element counted once over the mesh.
  double local_sum_squares();
  // The spike policy: the loss's z over the window when it is a spike, else 0; a finite loss
  // that is no spike joins the window.
  double spike(int64_t step, double loss);

  const OptimOptions optim_;
  const std::string on_bad_rank_;
  const int64_t skip_step_, spike_step_;
  RunLayout& layout_;
  ParamStore& store_;
  Gpt& model_;
  parallel::DataParallel& zero_;
  AdamW& adamw_;
  SdcCheck* sdc_;
  parallel::TiedWeight tied_;  // the tied embedding over a pipeline's end stages
  SkipCounters skips_;
  std::deque<double> losses_;
};

}  // namespace tetra
