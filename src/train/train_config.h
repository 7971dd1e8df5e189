// The `tetra train` configuration: schema (every known key with its default and valid range) and
// typed options.
#pragma once

#include <string>

#include "core/config.h"
#include "model/gpt_config.h"
#include "train/options.h"

namespace tetra {

const ConfigSchema& train_config_schema();

/** Every option of a run, by the groups that read them (train/options.h). */
struct TrainOptions {
  GptConfig model;                 // the shape split over tp and ep, sequence parallel, bf16
  std::string recompute = "none";  // "none" | "selective" | "full"
  std::string init_from;           // init.from: the weights to start from
  int64_t steps = 100;
  uint64_t seed = 1337;  // the initial weights and the data order
  RuntimeOptions run;
  BatchOptions batch;
  DataOptions data;
  OptimOptions optim;
  ParallelOptions parallel;
  CkptOptions ckpt;
  HealthOptions health;  // per-rank telemetry, stragglers, bad-number checks (health.*)
  OutputOptions outputs;
  FaultOptions faults;

  /** Reads and validates every option; errors say which key to change. */
  static TrainOptions from(const Config& c);
};

/** The model.* and moe.* keys of `c` as a checked model shape, split `tp` ways, its experts
 *  spread over `ep` ranks. */
GptConfig gpt_config_from(const Config& c, int tp = 1, int ep = 1);

}  // namespace tetra
