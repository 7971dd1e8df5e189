// The planner against published training runs it was not tuned on (`tetra plan --validate`,
// configs/plan/validation/, docs/plan.md "Validation"): each run's model, cluster, global batch
// and the software facts of its time are planned, and the layout its authors chose and the
// utilisation they measured are compared with the planner's ranking and prediction. The one
// fitted constant, the products' efficiency of a GPU kind, is fitted leave-one-out: never on the
// run being predicted.
#pragma once

#include <string>
#include <vector>

#include "core/config.h"
#include "plan/plan_config.h"

namespace tetra::plan {

/** plan_schema() and the [published] keys: what the run's authors published. */
const ConfigSchema& published_run_schema();

/** A published run: what the planner is given, and what its authors published. */
struct PublishedRun {
  std::string name;       // the file's stem
  std::string framework;  // published.framework
  std::string source;     // published.source: paper and table
  PlanInputs inputs;      // model, cluster (with its software facts), batch; the layout searched
  LayoutConstraints published;   // the published layout (tp, pp, dp; zero, recompute when given)
  std::vector<int> zero_stages;  // the ZeRO stages its software offered; empty: every stage
  std::vector<Recompute> recompute_modes;  // the recomputation modes it offered; empty: all
  double utilisation = 0;                  // the published utilisation, a fraction of peak
  bool hardware_flops = false;  // it counts recomputed FLOPs (HFU) rather than model FLOPs (MFU)
};

/** Loads configs/plan/validation/<name>.toml; throws tetra::Error naming the key to fix. */
PublishedRun load_published_run(const std::string& path);
/** Every *.toml of `dir`, sorted by name; throws when there is none. */
std::vector<PublishedRun> load_published_runs(const std::string& dir);

/** One run's line of the validation. */
struct ValidationRow {
  std::string name, framework, source, gpu_kind;
  int64_t gpus = 0;
  std::string published_layout;  // describe() of the published layout as the planner runs it
  std::string first_choice;      // describe() of the planner's first choice
  size_t rank = 0;               // the published grid's place among the fitting grids; 0 = absent
  size_t grids = 0;              // fitting (tp, pp, dp, ep) grids the search ranked
  double gemm_efficiency = 0;    // fitted without this run (the preset's when no other run fits)
  int fitted_on = 0;             // the runs that fit was made on
  double predicted = 0;          // the published layout's utilisation, in the published counting
  double published = 0;
  bool hardware_flops = false;
  double error() const { return predicted - published; }
};

struct Validation {
  std::vector<ValidationRow> rows;
  int top3 = 0;       // published grid among the first three
  int within5 = 0;    // |error| <= 5 points
  double worst = 0;   // largest |error|
  double spread = 0;  // root mean square error: the confidence `tetra plan` quotes
};

/** The spread `tetra plan` quotes beside a GPU cluster's MFU: the root mean square error of
 *  validate() over configs/plan/validation in points, and its run count
 *  (tests/cli/plan_validation_test.cc checks them against `tetra plan --validate`, so they
 *  follow the runs and the model). */
struct QuotedSpread {
  double points = 0;
  int runs = 0;
};
QuotedSpread quoted_spread();

/** The published layout's utilisation with cluster.gemm_efficiency = `gemm_efficiency`. */
double predict_published(const PublishedRun& run, double gemm_efficiency);

/** The gemm_efficiency (0.45 to 0.90 by 0.01) that minimises the squared error of
 *  predict_published over `runs` with `runs[skip]` left out (skip = -1: none), among the runs of
 *  `gpu_kind`; sets `fitted_on`. Returns the preset's value when no run is left. */
double fit_gemm_efficiency(const std::vector<PublishedRun>& runs, int skip,
                           const std::string& gpu_kind, int* fitted_on);

/** Leave-one-out over `runs`: each run ranked and predicted with the efficiency fitted on the
 *  others of its GPU kind. */
Validation validate(const std::vector<PublishedRun>& runs);

/** The validation as a Markdown table with its summary (docs/plan.md prints it). */
std::string format_validation(const Validation& v);

}  // namespace tetra::plan
