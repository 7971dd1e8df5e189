// The trainer's checkpoints (docs/checkpoints.md): resume from the newest loadable checkpoint,
// save on a cadence (every N steps, or the Young/Daly interval from the measured stall), write
// what this rank owns asynchronously, and report the saves that finished.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "data/sampler.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "train/run_layout.h"
#include "train/train_config.h"
#include "train/update.h"

namespace tetra {

/** The trainer's state a checkpoint restores besides the tensors. */
struct ResumedState {
  int64_t step = 0;
  SkipCounters skips;
  SamplerState sampler;
};

class Checkpointer {
 public:
  Checkpointer(const TrainOptions& options, RunLayout& layout, ParamStore& store, AdamW& adamw,
               const Gpt& model, std::string config_toml);
  ~Checkpointer();

  /** ckpt.resume: loads the newest checkpoint every rank can read and verify into the store and
   *  the optimizer (its step count too); none when ckpt.resume=auto finds no checkpoint.
   *  `num_samples` is the training data's, whose sampler state must fit. Collective. */
  std::optional<ResumedState> resume(int64_t num_samples);
  /** Starts the writer (with ckpt.dir) for a run that begins after step `start_step`. */
  void start(int64_t start_step, MemoryLedger& ledger);
  bool enabled() const { return writer_ != nullptr; }

  /** After 1-based step `step`: saves when due (the last step always), returning the seconds the
   *  loop was blocked, or nothing. `trainer_state` goes into the manifest. On the last step it
   *  waits until the checkpoint is in place. */
  std::optional<double> save_if_due(int64_t step, bool last, double median_step_s,
                                    const nlohmann::json& trainer_state);
  /** Adds the saves finished since the last call to `rec`; a failed save stops the run under
   *  ckpt.on_error=stop. */
  void note(nlohmann::json& rec);
  /** The newest checkpoint's step this run published or resumed from. */
  int64_t newest_step() const;

 private:
  std::vector<ckpt::Source> sources();  // what this rank writes
  // After a save of `step` that blocked the loop `blocked` seconds: when the next one is due
  // (ckpt.every, or Young/Daly from the stall, decided by rank 0 for every rank).
  void schedule_next(int64_t step, double blocked, double median_step_s);

  const TrainOptions& opt_;
  RunLayout& layout_;
  ParamStore& store_;
  AdamW& adamw_;
  const Gpt& model_;
  std::string config_toml_;
  std::unique_ptr<ckpt::Writer> writer_;
  int64_t start_step_ = 0;
  int64_t next_save_ = 0;   // the step after which the next checkpoint is saved
  int64_t auto_every_ = 0;  // ckpt.every=auto: the interval in use
};

}  // namespace tetra
