// The training loop as a composition of parts with one job each (docs/ARCHITECTURE.md, "train/"):
//
//   RunLayout     the mesh and its groups, this rank's coordinates and model part
//   TrainData     datasets, the prefetched batches, validation batches
//   Gpt           the model part this rank holds, on the run's backend (run.device)
//   DataParallel  ZeRO 0-3 as the model's unit hooks, wrapped by FaultInjection
//   Executor      the pipeline program (accumulation is its one-rank case), also for validation
//   Updater       gradient reduction, the step's scalars, the skip policy, clipping, AdamW
//   Checkpointer  resume and the save cadence
//   Reporter      header, metrics, progress, profile and trace
//   RunOutputs    save.final and the debug dumps
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/memory.h"
#include "core/param_store.h"
#include "kernels/backend.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "parallel/data_parallel.h"
#include "pipeline/executor.h"
#include "train/checkpointer.h"
#include "train/fault_hooks.h"
#include "train/goodput.h"
#include "train/health.h"
#include "train/model_stage.h"
#include "train/moe_report.h"
#include "train/report.h"
#include "train/run_layout.h"
#include "train/run_outputs.h"
#include "train/sdc.h"
#include "train/train_config.h"
#include "train/train_data.h"
#include "train/update.h"

namespace tetra {

class Trainer {
 public:
  /** Checks every input and output path, then allocates everything. `world` is the job's world
   * group when launched on several ranks (invalid for a single process); an error on any rank
   * then ends the whole job with that rank's message (comm::run_or_abort). */
  Trainer(const TrainOptions& options, const std::string& config_toml,
          const comm::Communicator& world = {});
  ~Trainer();
  TrainResult run();

 private:
  void setup(const std::string& config_toml);
  /** The watchdog's deadline for the step after `steps_run` steps of this process (see
   *  dist.step_timeout_factor). */
  void set_step_deadline(int64_t steps_run);
  TrainResult train();
  // The mean validation loss over eval.batches micro-batches (every rank gets the last stage's).
  double evaluate();
  // The trainer's state after `step` that a checkpoint restores.
  nlohmann::json state_after(int64_t step) const;

  TrainOptions opt_;
  comm::Communicator world_;
  Backend& backend_;
  MemoryLedger ledger_;
  std::unique_ptr<RunLayout> layout_;
  std::unique_ptr<TrainData> data_;
  std::unique_ptr<RunOutputs> outputs_;
  // Destroyed in reverse order: the data-parallel engine completes its pending collectives before
  // the model's and the store's buffers go.
  std::unique_ptr<ParamStore> store_;
  std::unique_ptr<Gpt> model_;
  std::unique_ptr<AdamW> adamw_;
  std::unique_ptr<parallel::DataParallel> zero_;
  std::unique_ptr<SdcCheck> sdc_;  // bad numbers per rank, between faults_ and zero_
  std::unique_ptr<FaultInjection> faults_;
  std::unique_ptr<pipeline::Executor> executor_;
  std::unique_ptr<ModelStage> stage_;
  std::unique_ptr<Updater> updater_;
  std::unique_ptr<Checkpointer> ckpt_;
  std::unique_ptr<Reporter> report_;
  std::unique_ptr<MoeReport> moe_report_;
  std::unique_ptr<HealthMonitor> health_;
  std::unique_ptr<Heartbeat> heartbeat_;
  std::unique_ptr<Goodput> goodput_;
  int64_t start_step_ = 0;  // steps done before this process started (a resume)
};

}  // namespace tetra
