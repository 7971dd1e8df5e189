// The `tetra train` configuration: schema (every known key with its default and valid range) and
// typed options.
#pragma once

#include <string>

#include "comm/communicator.h"
#include "core/config.h"
#include "model/gpt_config.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"
#include "parallel/data_parallel.h"
#include "parallel/mesh.h"

namespace tetra {

const ConfigSchema& train_config_schema();

struct TrainOptions {
  GptConfig model;
  std::string train_data, val_data;
  bool shuffle = false;
  bool verify_data = true;  // check the manifest's shard checksums before step 1
  int micro_batch = 8, seq_len = 128, grad_accum = 1;
  int64_t steps = 100;
  uint64_t seed = 1337;
  std::string on_nonfinite = "skip";  // a non-finite gradient: "skip" the update or "stop"
  int max_skipped = 5;                // consecutive skipped updates that stop the run
  AdamWConfig adamw;
  LrSchedule schedule;
  double grad_clip = 1.0;
  int eval_every = 0, eval_batches = 4;
  std::string run_dir;
  int threads = 0;
  std::string progress;  // "auto" | "always" | "never"
  std::string init_from, save_final, dump_grads, dump_logits;
  int64_t nan_grad_step = 0;  // 1-based step whose gradient gets a NaN injected; 0 = never
  int nan_grad_rank = 0;      // the rank that injects it
  int64_t skip_step = 0;      // 1-based step whose update is skipped as if non-finite; 0 = never
  int64_t fail_step = 0;      // 1-based step in whose backward fail_rank throws; 0 = never
  int fail_rank = 0;
  std::string recompute = "none";  // "none" | "selective" | "full"
  parallel::ZeroOptions zero;      // stage, resharding, prefetch, stage-0 buckets, overlap
  comm::CommOptions comm;
  parallel::MeshShape mesh;

  /** Reads and validates every option; errors say which key to change. */
  static TrainOptions from(const Config& c);
  /** Tokens per optimizer step on one data-parallel rank. */
  int64_t tokens_per_rank_step() const { return int64_t(micro_batch) * seq_len * grad_accum; }
};

/** The model.* keys of `c` as a checked model shape. */
GptConfig gpt_config_from(const Config& c);

}  // namespace tetra
