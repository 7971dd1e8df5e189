// A `tetra train` run as the planner sees it: the mapping from a training config (TrainOptions and
// the world size) to the planner's inputs, and the planner's prediction for the run, its
// parameters, model FLOPs per token and per-rank memory (plan/tetra_run.h). The trainer prints
// that prediction in its header (run_plan_line) and takes its MFU numerator and its memory plan
// from it; `tetra plan --config <a training config>` plans the same run through the same mapping
// (plan_training_config), so the two report the same numbers.
#pragma once

#include <string>
#include <vector>

#include "core/config.h"
#include "plan/plan_config.h"
#include "plan/run_memory.h"
#include "plan/tetra_run.h"
#include "train/train_config.h"

namespace tetra {

/** The run that TrainOptions describe on a number of ranks, in the planner's terms. */
struct RunPlan {
  plan::ModelSpec model;        // the model's shape (GptConfig's, whole) and seq = train.seq_len
  plan::TrainingSpec training;  // tokens = train.steps x the global batch
  plan::LayoutConstraints constraints;  // all given: tp, pp, dp, ep, ZeRO, schedule, split
  plan::Layout layout;                  // plan::layout_from_constraints of the above
  plan::RunOptions options;             // sequence parallelism, checkpoint snapshot, bf16 reduce
  plan::RunShape shape;                 // plan::run_shape: the per-rank shape run_memory prices
  int world = 1;                        // ranks: dp x tp x pp
  int configured_dp = 0;                // parallel.dp as configured (0: world / (tp x pp))
  plan::RunPrediction prediction;       // params, model FLOPs/token, memory per rank by category
  std::vector<plan::GroupTraffic> traffic;  // bytes per step per group, as the trainer counts them
};

/** The planner's prediction for the run `o` describes on `world_size` ranks: dp is parallel.dp,
 *  or world_size / (tp x pp) when 0, and 1 for a single process (world_size 1), as the trainer's
 *  mesh resolves it. Throws tetra::Error (the mesh's message) when the sizes do not fit the world.
 *  The trainer calls it once its world is known. */
RunPlan plan_run(const TrainOptions& o, int world_size);

/** Refuses, before anything is allocated, a run whose pipeline rank `pp_rank` would hold more
 *  than run.memory_limit_gb by the ledger's plan (run_memory: what the trainer allocates, to the
 *  byte on the CPU backend), naming what would fit: the smallest context-parallel size (on that
 *  many times the ranks) and full recomputation. A no-op when the limit is 0. */
void refuse_over_memory_limit(const TrainOptions& o, int world_size, int pp_rank);

/** The cpu cluster a run's `world` ranks form: one node (tetra launch on this machine), or nodes
 *  of `ranks_per_host` when the job spans hosts. Each rank is a device at `peak_gflops` (the run's
 *  MFU denominator, at `threads` threads; shared out when a node's ranks x threads exceed the
 *  cores) with RAM / ranks on its node, and `link` (measured over the whole world, so across
 *  hosts the link between them) as its MPI link when measured (else the cpu preset's, from the
 *  cache when a run measured it). */
plan::ClusterSpec run_cluster(int world, double peak_gflops, const plan::MeasuredLink& link,
                              int threads = 1, int ranks_per_host = 0);

/** The planner's estimate of one optimizer step of the run on `c`, with the run's own traffic
 *  (RunPlan::traffic) as its communication: step time by the audit order, the simulated bubble. */
plan::LayoutEstimate predict_step(const RunPlan& p, const plan::ClusterSpec& c);

/** The trainer's header line: "[plan] 4.24M params, 2.67e+07 FLOPs/token, 168.8 MiB per rank
 *  (tetra plan --config CONFIG plans this run)", with --cluster.gpus=N added when dp was inferred
 *  from a world larger than tp x pp, and --cluster.gpus_per_node=R when the job's hosts hold R
 *  ranks each (`ranks_per_host`, 0: one host). `config_path` is the training config to show,
 *  e.g. the run directory's config.toml. */
std::string run_plan_line(const RunPlan& p, const std::string& config_path, int ranks_per_host = 0);

// `tetra plan` with a training config.

/** The keys `tetra plan` accepts in a training config: every `tetra train` key, the cluster.*
 *  keys and the planner's assumptions (training.target_mfu, kernel_efficiency,
 *  restart_minutes). */
const ConfigSchema& training_plan_schema();

/** True when `config_path` (may be empty) with `overrides` is a `tetra train` config: it sets a
 *  key that only `tetra train` has (model.n_layer, train.*, data.*, parallel.*, ...). Any other
 *  config is a planner config (configs/plan/). An unreadable or malformed file is not one; its
 *  load reports why. */
bool is_training_config(const std::string& config_path, const std::vector<std::string>& overrides);

/** A training config planned as the run `tetra train` would launch. */
struct TrainingPlan {
  TrainOptions options;
  RunPlan run;
  plan::PlanInputs inputs;  // the run on the cpu cluster preset with run.world devices
};

/** Reads a training config as `tetra train --config config_path overrides...` would (the
 *  command line over the file) and plans its run on cluster.gpus ranks, else dp x tp x pp (dp = 1
 * when 0). The cluster is the cpu preset with one node of that many devices (tetra launch runs
 * every rank on this machine) and run.peak_gflops as the device peak when set; cluster.* keys
 * override it. Throws tetra::Error for a planner-only key, conflicting spellings and whatever
 * `tetra train` refuses. */
TrainingPlan plan_training_config(const std::string& config_path,
                                  const std::vector<std::string>& overrides);

}  // namespace tetra
