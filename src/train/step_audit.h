// What a run's steps measured against what the planner predicted and what the peak allows: the
// plan vs measured lines (step time, memory, bytes per group, the bubble; plan_vs_measured.json)
// and the MFU audit (the ideal step, data, exposed communication per group, the bubble, kernels,
// stragglers; audit.json). Reporter feeds it each step's times (docs/training.md, "Plan vs
// measured"; docs/health.md, "The MFU audit").
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/memory.h"
#include "core/profile.h"
#include "train/run_layout.h"
#include "train/run_plan.h"

namespace tetra {

/** One step of this rank as the audit splits it (ms unless named). */
struct StepTimes {
  double step_s = 0, data_ms = 0;
  // Exposed waits per group: dp, tp, pp (every transfer wait), ep, cp.
  double wait_ms[5] = {0, 0, 0, 0, 0};
  double bytes[5] = {0, 0, 0, 0, 0};  // sent per group, as the planner counts them
  bool pipelined = false;             // pp > 1: the bubble below was measured
  double bubble = 0, bubble_ms = 0;   // its share of the pipeline's time, and that time
};

class StepAudit {
 public:
  /** For the run `plan` of `tokens_per_step` tokens on `layout`; the files go to `run_dir`. */
  StepAudit(RunLayout& layout, const RunPlan& plan, bool expert_parallel, int64_t tokens_per_step,
            std::string run_dir);

  void add(const StepTimes& t);
  bool empty() const { return step_s_.empty(); }

  /** The planner's prediction of this run's step next to what it measured (collective: a
   *  multi-rank run first measures its MPI link, the cpu cluster's calibration, and caches it):
   *  step time, memory per rank, bytes per group and step, the pipeline bubble, at the peak
   *  `peak_gflops` per rank with `threads` threads; rank 0 prints them and writes
   *  run.dir/plan_vs_measured.json. */
  void plan_vs_measured(double peak_gflops, int threads, const MemoryLedger& ledger);
  /** The measured MFU audit of this rank's steps: the ideal step at the peak, then data, exposed
   *  communication per group, the bubble, kernels and stragglers (`rank_compute_ms`: every
   *  rank's mean compute time in the last telemetry window, empty when none), each the mean over
   *  the middle half of the steps; with `profile`, the compute per kernel kind. */
  nlohmann::json audit(double peak_gflops, const std::vector<double>& rank_compute_ms,
                       const Profile* profile) const;
  /** Rank 0: the audit as a table in the log and run.dir/audit.json. */
  void write_audit(double peak_gflops, const std::vector<double>& rank_compute_ms,
                   const Profile* profile) const;

 private:
  RunLayout& layout_;
  const RunPlan& plan_;
  const bool expert_parallel_;
  const int64_t tokens_per_step_;
  const std::string run_dir_;
  std::vector<double> step_s_, data_ms_, bubbles_, bubble_ms_, compute_ms_;
  std::vector<double> wait_ms_[5];
  double bytes_[5] = {0, 0, 0, 0, 0};  // the last step's
};

}  // namespace tetra
