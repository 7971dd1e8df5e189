// Per-rank step telemetry and straggler detection (seed 000: a synchronous job runs at its
// slowest rank's pace, "ストラグラー: ワーカーに対するmax()"). Every rank measures its steps;
// every health.telemetry_every steps one all-gather of a few numbers per rank brings the window's
// per-rank means to every rank, which are written to metrics.jsonl (rank 0) as per-rank arrays
// with their p50, p99 and max and the slowest rank and host. A rank whose compute time (its step
// less the time it waited for data, collectives and pipeline transfers) exceeds the median over
// the ranks by health.straggler_factor (and by a share of the step, health.straggler_min_share)
// is a straggler: named with its host in the log and the
// metrics, and with health.on_straggler=stop the run stops (exit 2) so that a launcher can be
// restarted without that host. docs/health.md.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train/health_options.h"
#include "train/run_layout.h"

namespace tetra {

/** What one rank measured in one step, in milliseconds. */
struct RankStep {
  double step_ms = 0, compute_ms = 0, comm_ms = 0, data_ms = 0;
  double grad_sq = 0;  // this rank's contribution to the squared gradient norm
};

/** The ranks whose window means make them stragglers: compute time over
 *  health.straggler_factor × the median over the ranks (the mean of the middle two of an even
 *  count), by at least health.straggler_min_share × the median step time. */
std::vector<int> find_stragglers(const std::vector<double>& compute_ms,
                                 const std::vector<double>& step_ms, const HealthOptions& options);

/** The file in TETRA_HEARTBEAT_DIR where a run stopped for stragglers (health.on_straggler=stop)
 *  names their hosts, one per line, for `tetra launch` to restart without them. */
inline constexpr const char* kStragglerHostsFile = "straggler-hosts";

class HealthMonitor {
 public:
  HealthMonitor(const HealthOptions& options, const RunLayout& layout);

  /** Adds this rank's step; at the end of a window gathers every rank's means (collective) and
   *  adds the per-rank arrays, their summary and any stragglers to `rec`. Throws tetra::Error
   *  naming the stragglers under on_straggler=stop. */
  void step(int64_t step, const RankStep& s, nlohmann::json& rec);

  /** The ranks named stragglers so far (rank 0's view, every rank alike). */
  const std::vector<int>& stragglers() const { return stragglers_; }
  /** Every rank's mean compute time (ms) in the last complete window; empty before one. */
  const std::vector<double>& window_compute_ms() const { return window_compute_; }

 private:
  HealthOptions opt_;
  const RunLayout& layout_;
  std::vector<std::string> hosts_;
  RankStep sum_;
  int64_t steps_ = 0, first_ = 0;
  std::vector<int> stragglers_;
  std::vector<double> window_compute_;
};

}  // namespace tetra
