// What a mixture-of-experts run reports (docs/moe.md, "Diagnostics"; seed 004's symptom table):
// per step, over every rank, the routing statistics of each MoE block — aux and z losses, routes
// dropped over capacity, tokens per expert and their max/mean — and the all-to-all bytes and
// wait of the expert-parallel exchanges next to the seed's formula; at the end, a table per block.
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/gpt.h"
#include "train/run_layout.h"

namespace tetra {

class MoeReport {
 public:
  /** `micro_batches` per step and `recompute_full` (forward exchanges repeated in backward) set
   *  the predicted all-to-all bytes. */
  MoeReport(const GptConfig& config, RunLayout& layout, Gpt& model, int micro_batches, int B, int T,
            bool recompute_full);

  bool active() const { return config_.moe.experts > 0; }
  /** Clears the step's statistics and counters. */
  void begin_step();
  /** Adds the step's MoE fields to `rec`; collective over the world. */
  void add_to(nlohmann::json& rec);
  /** The per-block table over the run so far (rank 0 prints it). */
  std::string summary() const;
  /** From now on, every step's routing decisions go to `dir`/routes-rank-N.jsonl (the model
   *  records them, Gpt::record_moe_routes): one line per step, MoE block and sequence of the
   *  global batch, {"step", "layer", "seq", "expert", "kept", "margin"}, written by the ranks of
   *  tp rank 0 that hold the block. "seq" numbers the step's global batch as the sampler deals it
   *  (data rank r's micro-batch m, sequence b: r·B·accum + m·B + b), so every layout's lines name
   *  the same sequences. */
  void dump_routes_to(const std::string& dir);

 private:
  void write_routes(int64_t step);

  const GptConfig& config_;
  RunLayout& layout_;
  Gpt& model_;
  std::vector<int> layers_;  // the MoE blocks, by layer index
  // Bytes this rank's all-to-alls move per step when nothing is dropped (the seed's tokens · k ·
  // C · 4 · 2 per block and micro-batch, forward and backward), averaged over the ranks.
  double predicted_bytes_ = 0.0;
  // Over the run: per block, routes, drops, the sum of steps' load max/mean and of aux; steps.
  struct Totals {
    double routes = 0, dropped = 0, imbalance = 0, aux = 0;
  };
  std::vector<Totals> totals_;
  int64_t steps_ = 0;
  double bytes_ = 0.0, wait_ms_ = 0.0;
  int micro_batches_ = 0, B_ = 0;
  std::unique_ptr<std::ofstream> routes_;  // debug.dump_routes, when asked
};

}  // namespace tetra
