// Layout validation, the step-time estimate of one layout, and the search over all layouts.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "pipeline/simulate.h"
#include "plan/comm_cost.h"
#include "plan/layout.h"
#include "plan/ledger.h"
#include "plan/presets.h"
#include "plan/training_spec.h"

namespace tetra::plan {

/** A step's time in the seeds' audit order (000 MFU: data stalls, then communication, then the
 *  pipeline bubble, then kernels, then stragglers); they add up to the step. */
struct StepTime {
  double data = 0;        // waiting for input: the planner assumes the loader keeps up
  double comm = 0;        // exposed communication: TP and EP (critical path), PP sends, DP's tail
  double bubble = 0;      // pipeline fill and drain
  double kernels = 0;     // compute of every micro-batch and the optimizer update
  double stragglers = 0;  // the slowest of the step's devices (000 ストラグラー)
  double total() const { return data + comm + bubble + kernels + stragglers; }
};

/** Where a micro-batch's kernel time goes; `ideal` (model FLOPs at peak) is the yardstick. */
struct KernelTime {
  double gemm = 0;             // the model's matrix products at their efficiency
  double attention = 0;        // attention's score products (the causal half a kernel computes)
  double recompute = 0;        // what recomputation adds
  double memory_bound = 0;     // norms, activations, softmax: bytes over cluster.mem_bw
  double ideal = 0;            // model FLOPs at peak (not part of the total)
  double gemm_efficiency = 0;  // the products' fraction of peak at this layout's sizes
  double total() const { return gemm + attention + recompute + memory_bound; }
};

/** What one layout costs: memory per device, and time per step by the audit order. */
struct LayoutEstimate {
  Layout layout;
  MemoryBreakdown memory;
  double usable_bytes = 0;  // memory_bytes * usable_fraction
  bool fits = false;
  std::vector<DimComm> comm;
  double microbatch_seconds = 0;  // kernels of one micro-batch on one device
  KernelTime microbatch;          // the same, by where it goes
  double compute_seconds = 0;     // m micro-batches, no bubble, no communication
  double optimizer_seconds = 0;   // the update (memory-bound)
  double bubble_seconds = 0;
  double pp_exposed_seconds = 0;  // stage-to-stage sends on the pipeline's critical path
  double exposed_comm_seconds = 0;
  double step_seconds = 0;
  StepTime time;              // step_seconds by the audit order
  double bubble = 0;          // idle share of the pipeline phase, simulated (pipeline/simulate.h)
  double bubble_formula = 0;  // the closed form (p-1)/(v*m+p-1), for comparison
  double mfu = 0;             // model FLOPs / (devices * peak * step)
  double hfu = 0;             // hardware FLOPs (recomputation counted) / (devices * peak * step)
};

/** The communication of a layout given the kernel time of one micro-batch: comm_per_step for the
 *  planner's model, or a tetra run's own traffic (plan/tetra_run.h). */
using CommModel = std::function<std::vector<DimComm>(double microbatch_seconds)>;

/** Sets l.split from pp.layers (`spec`): "" even stages (pp*v must divide the layers),
 * "auto" balanced with the embedding on the first and the head on the last stage counted in
 * layers of parameters, or explicit counts "5,6,6,5". Returns why it cannot, or "". */
std::string resolve_split(const ModelSpec& m, const std::string& spec, Layout& l);

/** Why `l` cannot run this model on this cluster, or "" when it can (fitting memory aside). */
std::string layout_problem(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t,
                           const Layout& l);
/** Throws tetra::Error with layout_problem()'s message. */
void validate_layout(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t,
                     const Layout& l);

/** Memory and step time of `l`; `comm` replaces the planner's communication model. */
LayoutEstimate evaluate_layout(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t,
                               const Layout& l, const CommModel& comm = nullptr);

/** The pipeline schedule `e`'s layout runs, simulated with the costs evaluate_layout used: the
 * timeline behind its bubble and pipeline time. */
pipeline::Timeline simulate_pipeline(const ModelSpec& m, const TrainingSpec& t,
                                     const LayoutEstimate& e);

/** Layout keys fixed by the user; unset ones (0, -1, nullopt) are searched. */
struct LayoutConstraints {
  int64_t tp = 0, pp = 0, dp = 0, ep = 0;
  int64_t cp = 1;  // parallel.cp: context parallel, fixed (the search keeps cp = 1)
  // cp.attention; unset: a given layout with cp > 1 takes the ring, Ulysses or the hybrid
  // (Ulysses groups with a ring across), whichever makes the faster step on the cluster's links.
  std::optional<CpAttention> cp_attention;
  // cp.ulysses: Ulysses' all-to-all group size (0: cp); with cp.attention unset, every divisor
  // of cp that splits the heads is tried.
  std::optional<int64_t> cp_ulysses;
  int zero = -1;
  std::optional<Schedule> schedule;
  bool zero_bubble = true;  // training.zero_bubble: an unset schedule also tries zb_h1
  int64_t v = 0;
  int64_t microbatches = 0;
  std::string pp_layers;               // pp.layers: "" even, "auto" or explicit counts
  std::optional<Recompute> recompute;  // training.recompute; unset: searched
  /** True when every dimension is fixed: the layout is given, not searched. */
  bool complete() const { return tp && pp && dp && zero >= 0; }
};

struct SearchResult {
  std::vector<LayoutEstimate> ranked;     // fitting layouts, fastest first, one per tp/pp/dp/ep
  int64_t considered = 0;                 // layouts that divide the model and the GPUs
  int64_t too_big = 0;                    // of those, discarded for memory
  std::optional<LayoutEstimate> closest;  // the smallest-memory layout when none fits
};

/** Enumerates tp (a divisor of gpus_per_node), pp (uneven stages where the layers do not
 *  divide), dp, ep, ZeRO stage, schedule (1F1B, interleaved with 2 to 4 chunks), recomputation
 *  and micro-batch size; discards what does not divide or fit; ranks by estimated step time. */
SearchResult search_layouts(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t,
                            const LayoutConstraints& k);

/** Why each of `ranked` beats the next one: the components of the step where it saves most, and
 *  where it pays (one line per layout but the last). */
std::vector<std::string> rank_reasons(const std::vector<LayoutEstimate>& ranked);

/** The step-time decomposition of `e` in the seeds' audit order, one line each (`tetra plan
 *  --explain`): data, communication by dimension, bubble, kernels, stragglers. */
std::vector<std::string> explain_step(const ModelSpec& m, const ClusterSpec& c,
                                      const TrainingSpec& t, const LayoutEstimate& e);

/** Completes a fully constrained layout (micro-batch count and size from the batch). */
Layout layout_from_constraints(const ModelSpec& m, const TrainingSpec& t,
                               const LayoutConstraints& k);

/** One named part of a step's time (step_terms). */
struct StepTerm {
  std::string name;  // "products", "attention", "recompute", "memory-bound", "update",
                     // "<dim> comm", "bubble", "stragglers"
  double seconds = 0;
};

/** `e`'s step split into the terms a user can act on, largest first; they add up to its
 *  step_seconds (`tetra plan` prints the first three beside each layout). */
std::vector<StepTerm> step_terms(const LayoutEstimate& e);

/** The seeds' common mistakes this layout makes (001 よくある間違い, 004 崩壊). */
std::vector<std::string> layout_warnings(const ModelSpec& m, const ClusterSpec& c,
                                         const TrainingSpec& t, const LayoutEstimate& e);

/** Why this layout, in the seeds' terms: TP/EP inside the node, PP across, DP outermost. */
std::vector<std::string> explain_layout(const ModelSpec& m, const ClusterSpec& c,
                                        const TrainingSpec& t, const LayoutEstimate& e);

}  // namespace tetra::plan
