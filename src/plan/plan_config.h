// The configuration of `tetra plan`: [model], [cluster], [training] and the optional [layout].
#pragma once

#include <optional>

#include "core/config.h"
#include "plan/layout_search.h"
#include "plan/presets.h"
#include "plan/tetra_run.h"
#include "plan/training_spec.h"

namespace tetra::plan {

/** Every key `tetra plan` accepts; 0 or "" means "from the preset" or "search". */
const ConfigSchema& plan_schema();

struct PlanInputs {
  ModelSpec model;
  ClusterSpec cluster;
  TrainingSpec training;
  LayoutConstraints layout;
  // Set when the inputs are the run a `tetra train` config describes (train/run_plan.h): the
  // report then adds that run's prediction (plan/tetra_run.h), whatever its layout.
  std::optional<RunOptions> tetra_run;
};

/** Resolves presets and explicit keys into checked inputs; throws tetra::Error on bad input. */
PlanInputs plan_inputs(const Config& config);

/** `base` with the cluster.* keys `config` sets (all but cluster.preset) applied, the defaults of
 *  usable_fraction and gpu_mtbf_years filled in, and checked. */
ClusterSpec apply_cluster_keys(const Config& config, ClusterSpec base);

/** The planner's assumptions of `config` (training.target_mfu, kernel_efficiency,
 *  restart_minutes) into `t`. */
void apply_assumptions(const Config& config, TrainingSpec& t);

}  // namespace tetra::plan
