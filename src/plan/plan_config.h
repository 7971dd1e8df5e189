// The configuration of `tetra plan`: [model], [cluster], [training] and the optional [layout].
#pragma once

#include "core/config.h"
#include "plan/layout_search.h"
#include "plan/presets.h"
#include "plan/training_spec.h"

namespace tetra::plan {

/** Every key `tetra plan` accepts; 0 or "" means "from the preset" or "search". */
const ConfigSchema& plan_schema();

struct PlanInputs {
  ModelSpec model;
  ClusterSpec cluster;
  TrainingSpec training;
  LayoutConstraints layout;
};

/** Resolves presets and explicit keys into checked inputs; throws tetra::Error on bad input. */
PlanInputs plan_inputs(const Config& config);

}  // namespace tetra::plan
