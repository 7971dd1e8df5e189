// What a training run tells the person running it: the run header (model, data, layout, the
// memory table next to the plan, the MFU denominator), one metrics.jsonl record per step (loss,
// rates, MFU, communication, memory, the pipeline's bubble), the progress line, and at the end the
// per-kernel profile, the pipeline trace and the summary (docs/training.md). What the steps
// measured against the plan and the peak is StepAudit's (train/step_audit.h), the per-rank
// health HealthMonitor's (train/health.h), the experts' routing MoeReport's (train/moe_report.h).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/memory.h"
#include "core/profile.h"
#include "core/timer.h"
#include "kernels/backend.h"
#include "model/gpt.h"
#include "parallel/data_parallel.h"
#include "pipeline/executor.h"
#include "train/metrics.h"
#include "train/run_layout.h"
#include "train/run_plan.h"
#include "train/step_audit.h"
#include "train/train_config.h"
#include "train/train_data.h"
#include "train/update.h"

namespace tetra {

struct TrainResult {
  int64_t steps = 0;
  int64_t skipped = 0;  // updates skipped for a non-finite gradient
  double final_loss = 0.0;
  double final_val_loss = -1.0;  // < 0 when no validation data
  double tokens_per_s = 0.0;     // median over steps
};

class Reporter {
 public:
  /** `program` is this rank's pipeline program (the bubble's reference). */
  Reporter(const TrainOptions& options, RunLayout& layout, Backend& backend,
           const MemoryLedger& ledger, const Gpt& model, const TrainData& data,
           const pipeline::Schedule& program);

  /** Rank 0: sets a previous run's metrics.jsonl and config.toml aside (same suffix) and writes
   *  this run's config. */
  void start_run_dir(const std::string& config_toml);
  /** Measures (or reads) the MFU denominator on rank 0 and shares it with every rank. */
  void measure_peak(int threads);
  /** The run header, then (rank 0) metrics.jsonl opened — a resumed run's copy of its history up
   *  to `start_step` — and the profile started. */
  void begin(int64_t start_step);

  /** The record of a step that took `step_s` seconds (its pipeline program started
   *  `step_start_s` after begin()). */
  nlohmann::json step_record(int64_t step, double lr, const UpdateResult& update, int64_t skipped,
                             double step_s, double data_wait_ms, const parallel::DataParallel& zero,
                             const pipeline::StepStats& pipe, double step_start_s);
  /** Seconds since begin(). */
  double elapsed_s() const { return clock_.elapsed_s(); }
  /** The median step time so far. */
  double median_step_s() const;
  /** Appends the record to metrics.jsonl (rank 0). */
  void write(const nlohmann::json& rec);
  /** The progress line (or log line every tenth of the run), and after the first step the memory
   *  table. */
  void progress(int64_t step, const UpdateResult& update);
  /** Closes metrics.jsonl; plan vs measured and the MFU audit (train/step_audit.h;
   *  `rank_compute_ms`: every rank's mean compute time in the last telemetry window, empty when
   *  none), the profile table and profile.json, the trace files. */
  TrainResult finish(TrainResult result, const std::vector<double>& rank_compute_ms);
  /** The run's last line. */
  void summary(const TrainResult& result) const;

 private:
  std::string memory_table(const char* when) const;
  void header() const;
  // Whole sequences of every data-parallel rank (the cp ranks of one share its sequences).
  int64_t tokens_per_step() const {
    return opt_.batch.tokens_per_rank_step() * layout_.data_size();
  }

  const TrainOptions& opt_;
  RunLayout& layout_;
  Backend& backend_;
  const MemoryLedger& ledger_;
  const Gpt& model_;
  const TrainData& data_;
  const pipeline::Schedule& program_;
  int64_t start_step_ = 0;
  int threads_ = 1;
  double peak_gflops_ = 0.0;
  std::string peak_source_ = "measured";  // Backend::peak_gflops's, on rank 0
  RunPlan plan_;  // the planner's prediction for this run: params, FLOPs/token, memory
  std::string previous_metrics_;  // the metrics file a resumed run continues
  std::unique_ptr<MetricsWriter> metrics_;
  std::unique_ptr<Profile> profile_;  // rank 0, run.profile
  std::unique_ptr<ProfileActivation> profiling_;
  std::vector<pipeline::Span> trace_;  // run.trace: every step's spans, seconds from begin()
  std::vector<double> rates_;          // tokens/s per step
  std::unique_ptr<StepAudit> audit_;   // plan vs measured and the MFU audit of the steps
  bool mfu_warned_ = false, tty_ = false;
  double last_mfu_ = 0.0, last_tps_ = 0.0;
  Stopwatch clock_;
};

}  // namespace tetra
