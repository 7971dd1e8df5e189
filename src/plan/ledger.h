// The two ledgers of the seeds: memory (training-state bytes, ZeRO sharding, activations, buffers)
// and compute (6*P*T plus attention).
#pragma once

#include <cstdint>
#include <vector>

#include "plan/layout.h"
#include "plan/presets.h"
#include "plan/training_spec.h"

namespace tetra::plan {

/** Training-state bytes per parameter by part. bf16 mixed: 2+2+4+4+4 = 16; fp32: 4+4+0+4+4 = 16. */
struct StateBytes {
  double weights = 0, grads = 0, master = 0, adam_m = 0, adam_v = 0;
  double optimizer() const { return master + adam_m + adam_v; }
  double total() const { return weights + grads + optimizer(); }
};
StateBytes state_bytes_per_param(Precision p);

/** Per-rank training state for `params` parameters, ZeRO `stage` over `n` data-parallel ranks:
 *  plain 16P; ZeRO-1 4P + 12P/N; ZeRO-2 2P + 14P/N; ZeRO-3 16P/N (bf16 mixed). */
struct StateMemory {
  double params = 0, grads = 0, optimizer = 0;
  double total() const { return params + grads + optimizer; }
};
StateMemory zero_state_memory(double params, int64_t n, int stage, Precision p);

/** Devices needed to hold the unsharded training state before one token is processed. */
int64_t min_devices_for_state(double params, double device_bytes, Precision p);

/** Activation bytes one token leaves behind in one layer, tensor by tensor (Korthikanti et al.
 *  2022 for GPT, generalised to GQA, SwiGLU and top-k experts, averaged over the layers when only
 *  some are MoE blocks), split over `tp` ranks by tensor + sequence parallelism; without
 *  `sequence_parallel` the norms' inputs, the first products' inputs and the dropout masks stay
 *  whole on every rank (their Table 2). `a` decides the score term: materialized (or unfused)
 *  attention keeps the softmax output (and GPT's dropout mask and output), flash attention only
 * each row's statistics. */
double activation_bytes_per_token_layer(const ModelSpec& m, Recompute r, Precision p, int64_t tp,
                                        Attention a = Attention::materialized,
                                        bool sequence_parallel = true);

/** Memory of one device under a layout, by category: the pipeline rank with the largest total
 *  (its layers' activations times the micro-batches its schedule holds in flight, and the
 *  embedding on the first stage or the head and its logits on the last). Context parallelism
 *  divides every per-token category (activations, logits, tp/pp/ep buffers) by cp, adds the ring's
 *  two K,V chunk buffers and shards ZeRO over dp * cp. */
struct MemoryBreakdown {
  double params = 0, grads = 0, optimizer = 0, activations = 0, comm_buffers = 0;
  int64_t rank = 0;  // the pipeline rank these are of
  double total() const { return params + grads + optimizer + activations + comm_buffers; }
};
MemoryBreakdown memory_per_device(const ModelSpec& m, const TrainingSpec& t, const Layout& l);

/** Layer-micro-batches each pipeline rank holds at its peak: the most sum of (layers of a chunk)
 *  over the (micro-batch, chunk) activations its program keeps between their forward and
 *  backward (pipeline/schedule.h), walked instruction by instruction. Uneven stages weigh each
 *  chunk by its own layers. */
std::vector<double> held_layer_microbatches(const Layout& l, int64_t layers);

/** Parameters one device holds before ZeRO (dense and expert parts), tightest stage. */
struct LocalParams {
  double dense = 0;   // sharded over tp, ZeRO over dp
  double expert = 0;  // sharded over tp*ep, ZeRO over dp/ep
};
LocalParams local_params(const ModelSpec& m, const Layout& l);
/** The same for pipeline rank `rank`. */
LocalParams rank_params(const ModelSpec& m, const Layout& l, int64_t rank);
/** MoE blocks pipeline rank `rank` holds (its chunks' stages, model.moe_every's pattern). */
int64_t rank_moe_layers(const ModelSpec& m, const Layout& l, int64_t rank);

/** The attention kernel `t` asks for on cluster `c` (automatic: flash on GPUs, materialized on
 *  the cpu cluster, whose backend keeps the probabilities). */
Attention resolve_attention(const TrainingSpec& t, const ClusterSpec& c);

/** FLOPs per trained token: the one formula of tetra, the numerator of every MFU it prints
 *  (`tetra plan`'s estimate and `tetra train`'s measurement). Model FLOPs = 6*N + 12*L*d*T, N the
 *  weights in matrix products (ParamCounts::matmul_active: the seeds' 6PT with P the weights a
 *  token is multiplied by) and 12*L*d*T the attention scores, forward and backward, the causal
 *  half NOT applied, as in PaLM's MFU. Hardware FLOPs add recomputation. */
struct FlopsPerToken {
  double dense = 0;      // 6 * N (matmul_active)
  double attention = 0;  // 12 * L * d * T
  double recompute = 0;  // extra forward work recomputation costs
  double model() const { return dense + attention; }
  double hardware() const { return model() + recompute; }
};
FlopsPerToken flops_per_token(const ModelSpec& m, Recompute r);

struct ComputeLedger {
  double flops_6pt = 0;    // 6 * N * T, the seeds' 6PT (N: weights in matrix products)
  double flops_total = 0;  // 6 * N * T + attention: model FLOPs
  double gpu_seconds = 0;  // flops_total / (peak * mfu)
  double gpu_years = 0;
  double wall_seconds = 0;  // on `devices` devices
};
ComputeLedger compute_ledger(const ModelSpec& m, double tokens, int64_t devices, double peak_flops,
                             double mfu);

/** GPU-seconds for `flops` at `mfu` of `peak_flops`. */
double gpu_seconds(double flops, double peak_flops, double mfu);
inline constexpr double kSecondsPerYear = 365.25 * 24 * 3600;

}  // namespace tetra::plan
