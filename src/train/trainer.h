// The training loop: a step is the pipeline executor running this rank's program over the part of
// the model it holds (with one pipeline rank, gradient accumulation), data parallelism with ZeRO,
// the global gradient norm with its non-finite check, clipping, the LR schedule, AdamW, periodic
// validation, metrics (with the memory ledger) and the progress line.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/safetensors.h"
#include "comm/communicator.h"
#include "core/memory.h"
#include "core/param_store.h"
#include "core/profile.h"
#include "data/prefetch.h"
#include "data/token_dataset.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "parallel/data_parallel.h"
#include "parallel/mesh.h"
#include "parallel/pipeline_executor.h"
#include "parallel/tensor_parallel.h"
#include "plan/run_memory.h"
#include "train/metrics.h"
#include "train/train_config.h"

namespace tetra {

struct TrainResult {
  int64_t steps = 0;
  int64_t skipped = 0;  // updates skipped for a non-finite gradient
  double final_loss = 0.0;
  double final_val_loss = -1.0;  // < 0 when no validation data
  double tokens_per_s = 0.0;     // median over steps
};

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
  class DebugHooks;
  class Stage;

  void setup(const std::string& config_toml);
  void start_run_dir(const std::string& config_toml);  // sets a previous run aside
  TrainResult train();
  void load_batch(TokenDataset& data, SampleOrder& order, int64_t first_sample);
  double evaluate();
  // One validation micro-batch (inputs_, targets_) through the pipeline's stages in order; the
  // last stage's loss, 0 on the others.
  double evaluate_stages();
  void print_header() const;
  plan::RunShape run_shape() const;  // this run, for the planner's memory ledger
  std::string memory_table(const char* when) const;
  void save_final();
  // Pipeline stages other than the first send their tensors to the first (rank 0's), which adds
  // them to `file`; collective over the pipeline group of dp and tp rank 0.
  void gather_stages(SafeTensorsFile& file);
  // After the data-parallel reduction: the wte gradient this rank owns summed over the embedding
  // group (the first and the last pipeline stage).
  void reduce_tied_grad();
  // The measured and simulated bubble of the step that made `stats` (rank 0's metrics).
  void note_pipeline(const parallel::PipelineStepStats& stats, double step_start_s,
                     nlohmann::json& rec);
  // Checkpoints (docs/checkpoints.md).
  // ckpt.resume: loads the newest checkpoint every rank can read and verify; returns its sampler
  // state (none when ckpt.resume=auto finds no checkpoint).
  std::optional<SamplerState> resume();
  std::vector<ckpt::Source> checkpoint_sources();  // what this rank writes
  // Returns the seconds the step loop was blocked.
  double save_checkpoint(int64_t step, double median_step_s);
  void note_checkpoints(nlohmann::json& rec);  // saves finished since the last step, into rec
  void heartbeat(int64_t step);
  void write_profile(const Profile& profile) const;  // table to the log, profile.json to run.dir

  bool is_root() const { return rank_ == 0; }
  int64_t tokens_per_step() const { return opt_.tokens_per_rank_step() * dp_size_; }

  TrainOptions opt_;
  comm::Communicator world_;
  std::unique_ptr<parallel::Mesh> mesh_;          // absent for a single process
  comm::Communicator dp_;                         // invalid for a single process
  std::unique_ptr<parallel::TensorParallel> tp_;  // the mesh's tp group (one rank without a mesh)
  comm::Communicator pp_;                         // the pipeline group (invalid for one process)
  comm::Communicator embed_;  // first and last pipeline stage of this dp x tp coordinate (pp > 1)
  int rank_ = 0, world_size_ = 1, dp_size_ = 1, dp_rank_ = 0, pp_size_ = 1, pp_rank_ = 0;
  int threads_ = 1;
  double peak_gflops_ = 0.0;
  MemoryLedger ledger_;
  Recompute recompute_ = Recompute::none;
  // Destroyed in reverse order: the data-parallel engine completes its pending collectives before
  // the model's and the store's buffers go.
  ParamStore store_;
  std::unique_ptr<Gpt> model_;
  std::unique_ptr<AdamW> adamw_;
  std::unique_ptr<parallel::DataParallel> zero_;
  std::unique_ptr<DebugHooks> debug_hooks_;
  std::unique_ptr<parallel::PipelineExecutor> executor_;
  std::unique_ptr<Stage> stage_;
  std::vector<pipeline::Span> trace_;  // run.trace: every step's spans, seconds from the run start
  std::unique_ptr<TokenDataset> train_, val_;
  std::unique_ptr<Prefetcher> prefetch_;  // training batches, assembled ahead of the step
  std::unique_ptr<ckpt::Writer> ckpt_;    // absent without ckpt.dir
  std::string config_toml_;
  int64_t start_step_ = 0;  // steps done before this process started (a resume)
  int64_t skipped_ = 0, consecutive_skips_ = 0;
  int64_t next_save_ = 0;         // the step after which the next checkpoint is saved
  int64_t auto_every_ = 0;        // ckpt.every=auto: the interval in use
  std::string previous_metrics_;  // the metrics file a resume continues
  int heartbeat_fd_ = -1;         // TETRA_HEARTBEAT_DIR/rank-N, watched by tetra launch
  std::vector<int32_t> window_, inputs_, targets_;  // (T+1) scratch, (B,T), (B,T)
};

}  // namespace tetra
