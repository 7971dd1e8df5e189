// The `tetra train` configuration: schema (every known key with its default) and typed options.
#pragma once

#include <string>

#include "comm/communicator.h"
#include "core/config.h"
#include "model/gpt_config.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"
#include "parallel/mesh.h"

namespace tetra {

const ConfigSchema& train_config_schema();

struct TrainOptions {
  GptConfig model;
  std::string train_data, val_data;
  bool shuffle = false;
  int micro_batch = 8, seq_len = 128, grad_accum = 1;
  int64_t steps = 100;
  uint64_t seed = 1337;
  AdamWConfig adamw;
  LrSchedule schedule;
  double grad_clip = 1.0;
  int eval_every = 0, eval_batches = 4;
  std::string run_dir;
  int threads = 0;
  std::string progress;  // "auto" | "always" | "never"
  std::string init_from, save_final, dump_grads, dump_logits;
  double bucket_mb = 4.0;  // data-parallel gradient bucket size
  bool overlap = true;     // reduce buckets during backward
  comm::CommOptions comm;
  parallel::MeshShape mesh;

  /** Reads and validates every option; errors say which key to change. */
  static TrainOptions from(const Config& c);
  /** Tokens per optimizer step on one data-parallel rank. */
  int64_t tokens_per_rank_step() const { return int64_t(micro_batch) * seq_len * grad_accum; }
};

}  // namespace tetra
