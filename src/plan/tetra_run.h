// What `tetra plan` predicts for a run of tetra's own trainer: its parameters, model FLOPs per
// token and per-rank memory by the trainer's categories. `tetra train` prints the same three
// numbers in its header (train/run_plan.h) and `tetra plan --config <a training config>` reports
// them, both through predict_run, so the two cannot disagree.
#pragma once

#include <cstdint>
#include <string>

#include "plan/layout.h"
#include "plan/presets.h"
#include "plan/run_memory.h"
#include "plan/training_spec.h"

namespace tetra::plan {

/** Options of a tetra run that the planner's model, training and layout do not carry. */
struct RunOptions {
  bool sequence_parallel = false;  // tp.sequence_parallel (no effect at tp = 1)
  bool checkpoint = false;         // ckpt.dir set: the host snapshot a save writes
  bool reduce_bf16 = false;        // dp.reduce_dtype = bf16
  bool flash_attention = false;    // run.device = cuda: attention keeps no T x T matrix
};

/** The per-rank shape of a tetra run of GPT-2 model `m` (m.positions rows of wpe, the vocabulary
 *  padded to m.vocab_multiple x tp) under `t` and layout `l`, for run_memory. A pipeline layout
 *  (pp > 1) gets the whole model's shape: run_memory does not model a stage's share. */
RunShape run_shape(const ModelSpec& m, const TrainingSpec& t, const Layout& l,
                   const RunOptions& o = {});

/** The planner's three numbers for a tetra run. */
struct RunPrediction {
  int64_t params = 0;          // count_params(m).total()
  double flops_per_token = 0;  // flops_per_token(m, ...).model(): the MFU numerator
  RunMemory memory;            // run_memory(run_shape(...)), bytes per rank
};
RunPrediction predict_run(const ModelSpec& m, const TrainingSpec& t, const Layout& l,
                          const RunOptions& o = {});

/** "4.24M params, 2.55e+07 FLOPs/token, 60.2 MiB per rank" (2^20 bytes, the unit of the trainer's
 *  memory table); the trainer's header line and the plan report print it from the same values. */
std::string run_summary(int64_t params, double flops_per_token, double bytes_per_rank);
std::string run_summary(const RunPrediction& p);

}  // namespace tetra::plan
