// What `tetra plan` predicts for a run of tetra's own trainer: its parameters, model FLOPs per
// token and per-rank memory by the trainer's categories. `tetra train` prints the same three
// numbers in its header (train/run_plan.h) and `tetra plan --config <a training config>` reports
// them, both through predict_run, so the two cannot disagree.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan/comm_cost.h"
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
  bool bf16_weight_cache = true;   // debug.bf16_weight_cache (CPU, bf16, ZeRO 0-2)
};

/** The per-rank shape of a tetra run of GPT-2 or Llama model `m` (m.gpt2_style; GPT-2:
 *  m.positions rows of wpe; Llama: m.kv_heads, m.ffn, m.tie_embeddings), the vocabulary
 *  padded to m.vocab_multiple x tp; MoE blocks as m's pattern, E/l.ep experts each on this rank)
 *  under `t` and layout `l`, for run_memory: on pipeline rank
 *  `pp_rank` (0, the first stage, is the rank whose metrics the trainer records), its chunks with
 *  the micro-batches its program keeps in flight (pipeline/schedule.h), as RunLayout::model_part
 *  builds them. */
RunShape run_shape(const ModelSpec& m, const TrainingSpec& t, const Layout& l,
                   const RunOptions& o = {}, int64_t pp_rank = 0);

/** `count` collectives of one kind over a `buffer` of bytes (a reduce-scatter's input, an
 *  all-gather's output, the rows one rank puts into an all-to-all) per optimizer step, over the
 *  group's ranks or, when `group` > 0, over that many (ZeRO's expert units: the edp group, dp
 *  ranks tp·ep apart). */
struct TrafficOp {
  Collective kind = Collective::all_reduce;
  double buffer = 0;
  double count = 0;
  int64_t group = 0;
};
/** One group's traffic per step and rank, as the trainer counts it (comm::Work::sent_bytes: the
 *  ring model's bytes): "dp" (parallel/data_parallel.cc, over dp·cp ranks, expert units over their
 *  edp group), "tp" (parallel/tp_layers.cc), "pp" (pipeline/executor.cc), "ep"
 *  (parallel/expert_parallel.cc: the MoE blocks' all-to-alls, of which (ep-1)/ep of the rows leave
 *  the rank), "cp" (ring attention's K,V and dK,dV sends, cp_ring_traffic in f32). */
struct GroupTraffic {
  std::string dim;
  int64_t group = 1;
  std::vector<TrafficOp> ops;
  /** Bytes sent to other ranks (the ring model's). */
  double bytes() const;
  double calls() const;
  /** The buffers' bytes: for "ep" the rows this rank puts into its all-to-alls, itself among the
   *  destinations (EpCounters::row_bytes, the a2a_bytes of metrics.jsonl). */
  double buffer_bytes() const;
};
/** What `s`'s rank sends per optimizer step in each of its groups under layout `l`. The tied
 *  embedding's all-reduce between the first and the last stage, the loss and the gradient norm
 *  are not counted by the trainer and not here. */
std::vector<GroupTraffic> run_traffic(const RunShape& s, const Layout& l, double bucket_bytes);

/** The traffic as the planner's communication per dimension on cluster `c`: each collective's
 *  time there (collective_seconds), dp's overlapped as far as c.comm_overlap lets it; tp's and
 *  ep's all-to-alls exposed (the critical path). */
std::vector<DimComm> run_comm(const std::vector<GroupTraffic>& traffic, const Layout& l,
                              const ClusterSpec& c, double microbatch_seconds);

/** The planner's three numbers for a tetra run. */
struct RunPrediction {
  int64_t params = 0;          // count_params(m).total(): every expert
  double flops_per_token = 0;  // flops_per_token(m, ...).model(): the MFU numerator (MoE: active)
  RunMemory memory;            // run_memory(run_shape(...)), bytes per rank
  RunMemory experts;           // expert_memory(run_shape(...)): the expert units' part of it
};
RunPrediction predict_run(const ModelSpec& m, const TrainingSpec& t, const Layout& l,
                          const RunOptions& o = {});

/** "4.24M params, 2.55e+07 FLOPs/token, 60.2 MiB per rank" (2^20 bytes, the unit of the trainer's
 *  memory table); the trainer's header line and the plan report print it from the same values. */
std::string run_summary(int64_t params, double flops_per_token, double bytes_per_rank);
std::string run_summary(const RunPrediction& p);

}  // namespace tetra::plan
