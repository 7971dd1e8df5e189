// The trainer's fault tolerance seams, kept out of the step loop: the heartbeat `tetra launch`
// watches (TETRA_HEARTBEAT_DIR) and the debug.* fault injections tests use — a NaN written into a
// gradient just before its unit is reduced, an error thrown in the middle of backward right after
// a unit's reduction was issued (collectives in flight), a rank that dies or hangs after a
// step, and a rank whose gradient is silently wrong by a finite amount (debug.corrupt_grad).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/param_store.h"
#include "kernels/backend.h"
#include "train/options.h"
#include "train/sdc.h"

namespace tetra {

/** Wraps the data-parallel engine's unit hooks (the model reports to this). */
class FaultInjection final : public UnitHooks {
 public:
  /** The faults of `faults` on this `rank`, around `inner` (a run of `zero_stage` with
   *  `grad_accum` micro-batches per step). */
  FaultInjection(const FaultOptions& faults, int zero_stage, int grad_accum, int rank,
                 UnitHooks& inner, ParamStore& store);

  /** Arms this step's injections (debug.nan_grad_step, debug.fail_step on their ranks) and,
   *  with debug.slow_ms, sleeps that long on debug.fault_rank. */
  void begin_step(int64_t step);
  /** In an evaluation: with debug.slow_eval_ms, sleeps that long on debug.fault_rank. */
  void in_evaluation() const;
  /** After the step: dies by SIGKILL (debug.kill_step) or stops making progress
   *  (debug.hang_step) on debug.fault_rank. */
  void end_step(int64_t step);
  /** After the gradient reduction: under zero.stage=0, debug.fault_rank's copy of the reduced
   *  gradient is scaled by 1 + debug.corrupt_grad at debug.corrupt_step (its replica alone is
   *  wrong). Under ZeRO the scaling happens to its local gradient before the reduction. */
  void after_reduction();

  void before_forward(int unit, int next) override { inner_.before_forward(unit, next); }
  void after_forward(int unit) override { inner_.after_forward(unit); }
  void before_backward(int unit, int next) override { inner_.before_backward(unit, next); }
  void after_backward(int unit) override;
  void end_forward_only() override { inner_.end_forward_only(); }

 private:
  const FaultOptions faults_;
  const int zero_stage_;
  int rank_;
  UnitHooks& inner_;
  ParamStore& store_;
  ReductionCalls calls_;
  bool nan_ = false, fail_ = false, corrupt_ = false;
};

/** Where a rank is, for the launcher's bound on its silence. */
enum class BeatPhase {
  training = 0,       // in the next step: bounded by the step time once it is known
  finishing = 1,      // past its last step (the final save, the summary): the start-up deadline
  between_steps = 2,  // after a step's update: its evaluation, checkpoint and reports
};

/** "<step> <newest checkpoint step> <phase> <median step s>" in TETRA_HEARTBEAT_DIR/rank-N,
 *  overwritten in place, twice a step (between_steps once its update is done, training once its
 *  evaluation and checkpoint are); the median step is 0 until measured. Nothing when the
 *  variable is unset. The launcher asks the run to end after its next step, with a checkpoint,
 *  by creating kStopFile there (tetra launch --regrow, to grow the job back). */
class Heartbeat {
 public:
  static constexpr const char* kStopFile = "stop";
  explicit Heartbeat(int rank);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;
  void beat(int64_t step, int64_t newest_checkpoint, BeatPhase phase, double median_step_s = 0);
  /** The launcher asked the run to end (and why, the file's text). */
  std::optional<std::string> stop_requested() const;

 private:
  std::string dir_;
  int fd_ = -1;
};

}  // namespace tetra
