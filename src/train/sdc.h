// Bad numbers per rank (silent data corruption; docs/health.md "Bad numbers per rank"): checks
// that name a rank whose memory or compute produced wrong numbers before the optimizer uses its
// gradient.
//
//   replica    zero.stage=0: after the all-reduce every rank of a data-parallel group holds the
//              same reduced gradient, so the sums of squares of their copies agree bitwise; a rank
//              that disagrees with the group's majority is named.
//   zscore     every stage, dp >= 3: each rank's gradient before the reduction (its own
//              micro-batches') has a norm; a rank whose log norm is more than health.grad_zscore
//              robust standard deviations (median and MAD over its dp group) from the median is
//              named.
//   known_answer  every health.known_answer_every steps each rank multiplies fixed inputs on its
//              backend and compares the result with a constant; a rank that differs is named.
//
// One all-gather over every rank of a few numbers per checked step gives every rank the same
// verdicts, so every rank takes the same decision (train/update.h applies health.on_bad_rank).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/param_store.h"
#include "kernels/backend.h"
#include "train/options.h"
#include "train/run_layout.h"

namespace tetra {

/** A rank a check named: world rank, host, the check ("replica", "zscore", "known_answer") and
 *  what it saw. */
struct BadRank {
  int rank = 0;
  std::string host, check, detail;
};

/** Which after_backward call hands a unit's gradient to the data-parallel reduction: under
 *  stages 0 and 1 the last micro-batch's (the gradient accumulated over the step), under stages 2
 *  and 3 every micro-batch's. */
class ReductionCalls {
 public:
  ReductionCalls(int stage, int micro_batches, size_t units);
  void begin_step();
  /** Counts this after_backward call of `unit`; true when it is a reduction's. */
  bool reduces(int unit);

 private:
  int stage_, micro_batches_;
  std::vector<int> calls_;
};

/** The known-answer test's inputs: element i of the pair of fixed (128 x 128) matrices, an
 *  integer in [-63, 63] (the value is that over 16). */
int known_answer_input(int64_t i);
/** The exact sum of squares of their product, times 2^16 (computed once with integers). */
inline constexpr int64_t kKnownAnswerSumSq = 4797570269784;
inline constexpr int kKnownAnswerSize = 128;

/** The checks, as a layer of unit hooks between the model's fault injection and the
 *  data-parallel engine (it sees each unit's gradient just before its reduction). */
class SdcCheck final : public UnitHooks {
 public:
  /** The checks of `health` (with the wrong answer of `faults` injected), around `inner`, for a
   *  run of `zero_stage` with `grad_accum` micro-batches per step. */
  SdcCheck(const HealthOptions& health, const FaultOptions& faults, int zero_stage, int grad_accum,
           RunLayout& layout, Backend& backend, ParamStore& store, UnitHooks& inner);

  /** Arms the checks due at 1-based step `step`. */
  void begin_step(int64_t step);
  /** After the gradient reduction, before the update: the checks due this step, collective over
   *  every rank; the ranks named, the same list on every rank (empty when none or none due). */
  std::vector<BadRank> check(int64_t step);
  /** Milliseconds this rank spent on the checks this step (0 when none was due). */
  double spent_ms() const { return ms_; }
  /** Of which waiting for the all-gather: communication, not compute, in the health telemetry. */
  double wait_ms() const { return wait_ms_; }
  /** The largest |z| of the z-score check this step over every dp group; -1 when it did not
   *  run. */
  double max_z() const { return max_z_; }
  /** Whether a check ran this step. */
  bool ran() const { return grad_due_ || kat_due_; }

  void before_forward(int unit, int next) override { inner_.before_forward(unit, next); }
  void after_forward(int unit) override { inner_.after_forward(unit); }
  void before_backward(int unit, int next) override { inner_.before_backward(unit, next); }
  void after_backward(int unit) override;
  void end_forward_only() override { inner_.end_forward_only(); }

 private:
  // This rank's sum of squares of its reduced dense gradient (the stage-0 replica).
  double replica_sum_squares();
  // Runs the known-answer computation; true when it gives the constant.
  bool known_answer(int64_t step);

  const HealthOptions health_;
  const FaultOptions faults_;
  const int zero_stage_;
  RunLayout& layout_;
  Backend& backend_;
  Kernels<float>& k_;
  ParamStore& store_;
  UnitHooks& inner_;
  ReductionCalls calls_;
  bool grad_due_ = false, kat_due_ = false;
  double pre_sq_ = 0.0;  // this step's local gradient before its reduction, squared
  double ms_ = 0.0, wait_ms_ = 0.0;
  double max_z_ = -1.0;
  std::vector<float> kat_host_;  // both inputs, then room for the product
  Buffer<float> kat_a_, kat_b_, kat_c_;
};

}  // namespace tetra
