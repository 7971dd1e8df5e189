// The trainer's checkpoints (docs/checkpoints.md): resume from the newest loadable checkpoint (in
// memory or on disk), save on a cadence (every N steps, or the Young/Daly interval from the
// measured stall; in memory every ckpt.memory_every), write what this rank owns asynchronously, and
// report the saves that finished.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "data/sampler.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "train/memory_checkpoint.h"
#include "train/run_layout.h"
#include "train/train_config.h"
#include "train/update.h"

namespace tetra {

/** The trainer's state a checkpoint restores besides the tensors. */
struct ResumedState {
  int64_t step = 0;
  int64_t adamw_steps = 0;
  int64_t min_global_batch = 0, max_global_batch = 0;  // of the runs the checkpoint continues
  SkipCounters skips;
  SamplerState sampler;
  std::vector<double> loss_window;  // the spike policy's recent losses (train.spike_zscore)
};

class Checkpointer {
 public:
  Checkpointer(const TrainOptions& options, RunLayout& layout, ParamStore& store, AdamW& adamw,
               const Gpt& model, std::string config_toml);
  ~Checkpointer();

  /** ckpt.resume: loads the newest checkpoint every rank can read and verify into the store and
   *  the optimizer (its step count too); none when ckpt.resume=auto finds no checkpoint. With
   *  ckpt.memory_every, auto takes the newest step whole in the hosts' memory first, unless the
   *  disk holds a newer one.
   *  `num_samples` is the training data's. A checkpoint of another model shape, other data, or a
   *  step past train.steps is refused with both values (older ones would not fit either); a
   *  damaged one, or one whose counters do not add up, is passed over for the previous one.
   *  Then (rank 0) refuses a ckpt.dir holding another run's checkpoints. Collective. */
  std::optional<ResumedState> resume(int64_t num_samples);
  /** Starts the writer (with ckpt.dir) for a run that begins after step `start_step`. */
  void start(int64_t start_step, MemoryLedger& ledger);
  bool enabled() const { return writer_ != nullptr; }

  /** After 1-based step `step`: saves when due (the `last` step of the run always; in memory at
   *  its own cadence), returning the seconds the loop was blocked, or nothing. `trainer_state` goes
   * into the manifest. On the last step it waits until the checkpoint is in place. */
  std::optional<double> save_if_due(int64_t step, bool last, double median_step_s,
                                    const nlohmann::json& trainer_state);
  /** Adds the saves finished since the last call to `rec`; a failed save stops the run under
   *  ckpt.on_error=stop. */
  void note(nlohmann::json& rec);
  /** At the end of the run: throws when the last step's checkpoint was not published, whatever
   *  ckpt.on_error says (no later save can make up for it). */
  void finish();
  /** The newest checkpoint's step this run published or resumed from, or holds in memory on
   *  every rank. */
  int64_t newest_step() const;

 private:
  std::vector<ckpt::Source> sources();  // what this rank writes
  // A manifest's content besides ranks and tensors, and this rank's entry in its ranks.
  nlohmann::json header(const nlohmann::json& trainer_state) const;
  nlohmann::json rank_state() const;
  // Collective: loads checkpoint `m` (read and checked on every rank); the state it restores when
  // every rank loaded it, else nothing (each failing rank has logged why).
  std::optional<ResumedState> try_load(const ckpt::Manifest& m, int64_t num_samples);
  // After a save of `step` that blocked the loop `blocked` seconds: when the next one is due
  // (ckpt.every, or Young/Daly from the stall, decided by rank 0 for every rank).
  void schedule_next(int64_t step, double blocked, double median_step_s);
  // The trainer state `dir`'s manifest holds, every field range-checked and the counters checked
  // against each other (throws: the checkpoint is damaged or edited).
  ResumedState read_state(const ckpt::Manifest& m) const;
  // Throws, with both values and what to change, when checkpoint `m` (state `r`) cannot continue
  // this run: another model shape, other data, or a step past train.steps.
  void refuse_mismatch(const ckpt::Manifest& m, const ResumedState& r, int64_t num_samples) const;
  // Rank 0: refuses a ckpt.dir holding published checkpoints unless this run resumed from one of
  // them (`resumed`, after `resumed_step`), since its saves would mix with and prune another
  // run's; and, resuming a named checkpoint there, refuses when later ones exist (a rollback
  // would replace them).
  void check_ckpt_dir_is_this_runs(const std::filesystem::path& resumed,
                                   int64_t resumed_step) const;
  // This run's samples per optimizer step.
  int64_t global_batch() const;
  // A pipeline stage holds its layers' tensors, an expert-parallel rank its experts: a
  // checkpoint's others are not this rank's to load.
  bool stage_part() const;

  const TrainOptions& opt_;
  RunLayout& layout_;
  ParamStore& store_;
  AdamW& adamw_;
  const Gpt& model_;
  std::string config_toml_;
  std::unique_ptr<ckpt::Writer> writer_;
  std::unique_ptr<MemoryCheckpoint> memory_;  // ckpt.memory_every > 0
  int64_t resumed_from_memory_ = -1;          // the step the run resumed from memory, or -1
  bool memory_noted_ = false;                 // the first memory save has been logged
  int64_t start_step_ = 0;
  int64_t next_save_ = 0;   // the step after which the next checkpoint is saved
  int64_t auto_every_ = 0;  // ckpt.every=auto: the interval in use
  // The smallest and largest global batch of every run this one continues (it included), so that
  // a resumed sampler cursor can be checked against the steps that drew it.
  int64_t min_global_batch_ = 0, max_global_batch_ = 0;
  int64_t final_step_ = -1;  // the run's last step (train.steps, or where the launcher ended it)
  std::string final_error_;  // why the last step's checkpoint was not published
};

}  // namespace tetra
