// The `tetra train` options by who reads them. TrainOptions (train/train_config.h) holds one of
// each; every part of the trainer takes only the groups it reads (the fault injection its
// FaultOptions, the data its DataOptions and BatchOptions, ...).
#pragma once

#include <cstdint>
#include <string>

#include "comm/communicator.h"
#include "core/device.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"
#include "parallel/data_parallel.h"
#include "parallel/mesh.h"
#include "pipeline/schedule.h"
#include "train/health_options.h"

namespace tetra {

/** The process: backend, directory, threads and what it reports (run.*, kernels.matmul). */
struct RuntimeOptions {
  DeviceKind device = DeviceKind::cpu;  // run.device: the backend tensors live and compute on
  std::string dir;                      // run.dir: metrics, config.toml, profile, trace
  int threads = 0;
  // The f32 products' library policy ("auto" | "onednn" | "openblas") and the key or variable
  // that set it; an empty policy leaves the backend's default.
  struct {
    std::string policy, source;
  } matmul;
  double peak_gflops = 0;      // the MFU denominator per rank; 0: measured (and cached) per machine
  double memory_limit_gb = 0;  // run.memory_limit_gb: the planned bytes per rank must fit; 0: any
  std::string progress;        // "auto" | "always" | "never"
  bool profile = false;        // per-kernel profile: table at the end, profile.json in run.dir
  bool trace = false;          // run.trace: a Chrome trace of every step per rank
};

/** One data-parallel rank's batch (train.micro_batch, seq_len, grad_accum). */
struct BatchOptions {
  int micro_batch = 8, seq_len = 128, grad_accum = 1;
  /** Tokens per optimizer step on one data-parallel rank. */
  int64_t tokens_per_rank_step() const { return int64_t(micro_batch) * seq_len * grad_accum; }
};

/** The token shards and their order (data.*), and the validation pass (train.eval_*). */
struct DataOptions {
  std::string train, val;
  bool shuffle = false;
  bool verify = true;  // check the manifest's shard checksums before step 1
  int eval_every = 0, eval_batches = 4;
};

/** The update (optim.*, the clip, and what a bad step does). */
struct OptimOptions {
  AdamWConfig adamw;
  LrSchedule schedule;
  double grad_clip = 1.0;
  std::string on_nonfinite = "skip";  // a non-finite gradient: "skip" the update or "stop"
  int max_skipped = 5;                // consecutive skipped updates that stop the run
  // The loss-spike policy (train.spike_*): a loss above the rolling mean of the last
  // spike_window losses by more than spike_zscore standard deviations skips the update; 0: off.
  double spike_zscore = 0.0;
  int spike_window = 50;
};

/** How the run is laid over its ranks beyond the model's own split (parallel.*, zero.*, dp.*,
 *  comm.*, pp.*, cp.*). */
struct ParallelOptions {
  parallel::MeshShape mesh;
  parallel::ZeroOptions zero;  // stage, resharding, prefetch, stage-0 buckets, overlap
  comm::CommOptions comm;
  // Context parallelism over mesh.cp ranks (docs/context_parallel.md): attention's exchange.
  std::string cp_attention = "ring";  // "ring" | "all_gather" | "ulysses"
  int cp_ulysses = 0;  // ulysses: ranks per all-to-all group (0: all cp), a ring across the groups
  // Pipeline parallelism over mesh.pp ranks (docs/pipeline.md); train.grad_accum micro-batches.
  std::string pp_schedule = "1f1b", pp_layers;
  pipeline::Kind pp_kind = pipeline::Kind::one_f_one_b;
  int pp_chunks = 1;         // v: model chunks per pipeline rank
  pipeline::Split pp_split;  // layers per virtual stage (mesh.pp * pp_chunks)
};

/** Checkpointing and resume (ckpt.*); see docs/checkpoints.md. */
struct CkptOptions {
  std::string dir;           // empty: no checkpoints
  int64_t every = 0;         // steps between checkpoints; 0: only after the last step
  bool every_auto = false;   // ckpt.every=auto: the Young/Daly interval from the measured stall
  int keep = 3;              // published checkpoints kept; 0 keeps all
  bool async = true;         // write on a background thread
  double mtbf_hours = 24.0;  // the job's mean time between failures, for every=auto
  std::string on_error = "continue";  // a failed save: "continue" training or "stop"
  std::string resume;                 // "" | "auto" | a checkpoint directory
  int64_t memory_every = 0;           // steps between in-memory checkpoints; 0: none
  std::string memory_dir = "/dev/shm";
};

/** What a run writes besides metrics and checkpoints (save.final, debug.dump_*). */
struct OutputOptions {
  std::string save_final, dump_grads, dump_logits;
  std::string dump_routes;  // debug.dump_routes: a directory for each rank's routing decisions
  bool bf16_weight_cache = true;  // debug.bf16_weight_cache: round each weight once per step
};

/** Faults injected for tests (debug.*; train/fault_hooks.h). Steps are 1-based; 0 = never. */
struct FaultOptions {
  int64_t nan_grad_step = 0;  // the step whose gradient gets a NaN injected
  int nan_grad_rank = 0;      // the rank that injects it
  int64_t skip_step = 0;      // the step whose update is skipped as if non-finite
  int64_t fail_step = 0;      // the step in whose backward fail_rank throws
  int fail_rank = 0;
  int64_t kill_step = 0;          // the step after which fault_rank dies by SIGKILL
  int64_t kill_in_save_step = 0;  // fault_rank dies halfway through writing this step's checkpoint
  int64_t save_error_step = 0;    // fault_rank's write of this step's checkpoint fails (disk full)
  int64_t hang_step = 0;          // fault_rank stops making progress after this step
  int fault_rank = 0;
  double slow_ms = 0;       // fault_rank sleeps this long in every step
  double slow_eval_ms = 0;  // and this long in every evaluation
  // Bad numbers on fault_rank: its gradient scaled by 1 + corrupt_grad at corrupt_step, its
  // known-answer test computed wrong at wrong_answer_step, and (on every rank) the loss of
  // spike_step read as 100 times larger by the spike policy.
  double corrupt_grad = 0.0;
  int64_t corrupt_step = 0, wrong_answer_step = 0, spike_step = 0;
};

}  // namespace tetra
