// Model and cluster descriptions for the planner, with the named presets of `tetra plan`.
// Parameter counts are computed from the shape, never typed in.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/model_shape.h"

namespace tetra::plan {

/** A model to plan: its shape (core/model_shape.h: the model.* keys of `tetra train`, resolved)
 *  with a name and the training sequence length (train.seq_len). */
struct ModelSpec : ModelShape {
  std::string name;
  int64_t seq = 0;  // T
};

/** Parameter count by part; per-layer parts are for one layer. The *_matmul parts are the
 *  weights of those parts that take part in matrix products (no biases, no norms). A dense block
 *  has attention, norms and one MLP (expert_mlp); a MoE block (moe_layers of the layers) has
 *  attention, norms, the router and `experts` MLPs of that shape instead. */
struct ParamCounts {
  int64_t embedding = 0;   // token (+ learned position) embedding
  int64_t head = 0;        // output projection; 0 when tied to the embedding
  int64_t attention = 0;   // per layer: q, k, v, o (+ biases)
  int64_t expert_mlp = 0;  // per layer, ONE expert's MLP (the MLP of a dense block)
  int64_t router = 0;      // per MoE layer: E x C (a matrix: all of it is multiplied)
  int64_t norms = 0;       // per layer
  int64_t final_norm = 0;
  int64_t layers = 0;
  int64_t moe_layers = 0;  // of the layers, the MoE blocks
  int64_t experts = 1;
  int64_t top_k = 1;
  int64_t attention_matmul = 0;   // per layer: the q, k, v and o matrices
  int64_t expert_mlp_matmul = 0;  // per layer, one expert's MLP matrices
  int64_t head_matmul = 0;        // the output projection V x C, tied or not

  int64_t dense_layers() const { return layers - moe_layers; }
  /** Parameters of a dense block and of a MoE block (all experts). */
  int64_t dense_layer() const { return attention + expert_mlp + norms; }
  int64_t moe_layer() const { return attention + experts * expert_mlp + router + norms; }
  /** Parameters of the largest block: a MoE block's when the model has any. */
  int64_t per_layer() const { return moe_layers > 0 ? moe_layer() : dense_layer(); }
  /** Parameters of all blocks together. */
  int64_t blocks() const { return dense_layers() * dense_layer() + moe_layers * moe_layer(); }
  /** Every parameter of the model. */
  int64_t total() const { return embedding + head + final_norm + blocks(); }
  /** Parameters one token passes through (MoE blocks: the router and top_k of the experts). */
  int64_t active() const {
    return embedding + head + final_norm + layers * (attention + norms) +
           dense_layers() * expert_mlp + moe_layers * (top_k * expert_mlp + router);
  }
  /** Weights one token is multiplied by (MoE blocks: the router and top_k experts): every block
   *  matrix and the output head (a tied head is the embedding, counted once). Each costs 2 FLOPs
   *  forward and 4 backward per token, so 6x this is the dense part of the model FLOPs
   *  (flops_per_token): for a MoE model the ACTIVE FLOPs, whatever E. The embedding lookups,
   *  biases and norms cost O(1) per parameter, not 6, and are left out. */
  int64_t matmul_active() const {
    return layers * attention_matmul + dense_layers() * expert_mlp_matmul +
           moe_layers * (top_k * expert_mlp_matmul + router) + head_matmul;
  }
};

/** The one parameter count of tetra: the planner's ledgers and `tetra train`'s header both use it
 *  (GPT-2 124M = 124,439,808). The vocabulary is the real one: tetra's padding rows of wte
 *  (model.vocab_multiple) are storage that never trains, counted by the memory ledger only. */
ParamCounts count_params(const ModelSpec& m);

/** Checks the shape (check_model_shape) and the sequence length; throws tetra::Error. */
void validate_model(const ModelSpec& m);

ModelSpec model_preset(const std::string& name);
std::vector<std::string> model_preset_names();

/** One cluster: identical devices, `gpus_per_node` of them behind the fast intra-node link. */
struct ClusterSpec {
  std::string name;
  int64_t gpus = 0;
  int64_t gpus_per_node = 0;
  double peak_flops = 0;       // dense FLOP/s per device at the training precision
  double memory_bytes = 0;     // per device
  double intra_bw = 0;         // bytes/s per device per direction inside a node
  double inter_bw = 0;         // bytes/s per device per direction between nodes
  double intra_latency = 0;    // seconds per message hop inside a node
  double inter_latency = 0;    // seconds per message hop between nodes
  double gpu_mtbf_hours = 0;   // mean time between failures of ONE device
  double storage_bw = 0;       // aggregate checkpoint write bytes/s
  double usable_fraction = 0;  // share of memory the ledger may fill (rest: fragmentation)

  // Calibration: what the hardware and its libraries reach of the nominal figures above. Each is a
  // cluster.* key whose preset value and source docs/plan.md ("Calibration") lists.
  double gemm_efficiency = 0;       // fraction of peak a large matrix product reaches
  double gemm_half_dim = 0;         // the smallest GEMM dimension at which half of that is lost
  double attention_efficiency = 0;  // fraction of peak attention's score products reach
  double mem_bw = 0;                // device memory bytes/s (memory-bound kernels, the update)
  double link_efficiency = 0;       // share of a link's nominal bandwidth collectives reach
  double half_bw_bytes = 0;         // message bytes at which a collective gets half the bandwidth
  double comm_overlap = 0;          // share of a collective that can run behind compute
  int64_t nodes_per_pod = 0;        // nodes behind the non-blocking switch tier (0 = all)
  double oversubscription = 1;      // bandwidth divisor for traffic above that tier
  double jitter = 0;                // coefficient of variation of one device's step time
};

ClusterSpec cluster_preset(const std::string& name);
std::vector<std::string> cluster_preset_names();

/** Link bandwidth of the `cpu` cluster's ranks (this machine's MPI over shared memory), measured
 *  by a multi-rank `tetra train` at its end and cached beside the peak ($XDG_CACHE_HOME/tetra/
 *  comm.json); `bus_bw` bytes/s and `latency` seconds per hop, 0 when never measured here. */
struct MeasuredLink {
  double bus_bw = 0, latency = 0;
};
MeasuredLink cpu_measured_link();
void save_cpu_measured_link(const MeasuredLink& link);

/** Cores one device of the `cpu` cluster has: a pair, or 1 on a 1-core machine. Its peak is the
 *  measured fp32 matmul rate at that many threads (the CPU backend's peak, measured if not cached).
 */
int cpu_device_threads();

}  // namespace tetra::plan
