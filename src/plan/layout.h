// A parallel layout: how the GPUs are split into TP x CP x PP x DP (EP borrowing DP ranks), the
// ZeRO stage, and the pipeline schedule.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/cp_attention.h"
#include "core/recompute.h"
#include "pipeline/schedule.h"

namespace tetra::plan {

/** The planner's schedules are the pipeline layer's: one representation, simulated here. */
using Schedule = pipeline::Kind;
using pipeline::to_string;

/** gpus = tp * cp * pp * dp. Rank order is tp fastest, then cp, then dp, then pp (parallel/mesh.h:
 *  tp-cp-ep-dp-pp); the ep expert groups are carved out of consecutive dp ranks, so ep divides dp.
 *  Context parallelism (cp) splits every sequence over cp ranks: what is per token is divided by
 *  cp, and gradients are reduced (and ZeRO shards) over the dp * cp ranks. */
struct Layout {
  int64_t tp = 1;
  int64_t pp = 1;
  int64_t dp = 1;
  int64_t ep = 1;
  int zero = 0;  // 0 = plain DP, 1/2/3 = ZeRO stage
  Schedule schedule = Schedule::one_f_one_b;
  int64_t v = 1;             // model chunks per pipeline rank (interleaved only)
  int64_t micro_batch = 1;   // sequences per micro-batch
  int64_t microbatches = 1;  // m: micro-batches per step per pipeline
  std::vector<int> split;    // layers per virtual stage (pp*v); empty: layers/(pp*v) each
  Recompute recompute = Recompute::selective;  // what backward recomputes instead of keeping
  int64_t cp = 1;                              // context parallel: ranks one sequence is split over
  CpAttention cp_attention = CpAttention::ring;  // how attention crosses the cp ranks
  int64_t cp_ulysses = 0;  // ulysses: ranks per all-to-all group (0: cp), a ring across the groups
  /** The ranks gradients are reduced and ZeRO-sharded over: dp * cp. */
  int64_t dp_cp() const { return dp * cp; }
};

/** Ranks of one Ulysses all-to-all group: cp_ulysses, or every cp rank when 0. */
inline int64_t ulysses_group(const Layout& l) { return l.cp_ulysses > 0 ? l.cp_ulysses : l.cp; }

/** Model chunks per pipeline rank: l.v under interleaved and zb_v, 1 otherwise. */
int64_t chunks_per_rank(const Layout& l);
/** The virtual stage of pipeline rank `rank`'s chunk `chunk` (pipeline::Schedule::stage: c·pp + r,
 *  zb_v's second chunk 2·pp-1-r). */
int64_t stage_of(const Layout& l, int64_t rank, int64_t chunk);

/** Layers of virtual stage `stage` (0..pp*v-1). */
int64_t stage_layers(const Layout& l, int64_t layers, int64_t stage);

/** The first layer of virtual stage `stage`: the layers of the stages before it. */
int64_t stage_first_layer(const Layout& l, int64_t layers, int64_t stage);

/** Layers held by pipeline rank `rank` (its chunks' layers together). */
int64_t rank_layers(const Layout& l, int64_t layers, int64_t rank);
/** The most layers any pipeline rank holds. */
int64_t max_rank_layers(const Layout& l, int64_t layers);

/** "TP 8 x PP 4 x DP 16, ZeRO-1, 1f1b, mbs=1 m=32, recompute selective"; with context parallelism
 *  "TP 8 x CP 2 (ring) x PP 4 x DP 16, ..." */
std::string describe(const Layout& l);

}  // namespace tetra::plan
