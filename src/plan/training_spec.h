// What is being trained: token budget, batch, precision and activation recomputation.
#pragma once

#include <cstdint>
#include <string>

#include "core/recompute.h"

namespace tetra::plan {

/** bf16 mixed precision (bf16 weights/grads, fp32 master + Adam) or plain fp32 Adam. */
enum class Precision { Bf16Mixed, Fp32 };

/** Bytes of one activation element: bf16 under mixed precision, fp32 otherwise. */
inline double act_bytes(Precision p) { return p == Precision::Fp32 ? 4.0 : 2.0; }

Precision parse_precision(const std::string& text);
const char* to_string(Precision p);

/** How attention keeps its scores: a flash kernel keeps only each row's softmax statistics and
 *  recomputes the rest in backward; a materialized one stores the T x T probabilities (tetra's
 *  CPU backend, one kernel per row block); an unfused one stores them too, and passes them
 *  between separate kernels (product, softmax, dropout, product: GPU frameworks before fused
 *  attention), each reading and writing the whole score tensor. `automatic` resolves to flash on
 *  GPU clusters, materialized on `cpu`. */
enum class Attention { automatic, flash, materialized, unfused };

/** "" (automatic) | "flash" | "materialized"; throws tetra::Error listing them. */
Attention parse_attention(const std::string& text);
const char* to_string(Attention a);

struct TrainingSpec {
  double tokens = 0;                // total training tokens
  int64_t global_batch_tokens = 0;  // tokens per optimizer step
  int64_t micro_batch = 0;          // sequences per micro-batch; 0 = let the search choose
  Precision precision = Precision::Bf16Mixed;
  Recompute recompute = Recompute::selective;  // a given layout's; the search tries all three
  Attention attention = Attention::automatic;
  // Under TP, norms, dropout and the residual stream split along the sequence (Korthikanti et
  // al. 2022); false: every TP rank keeps and computes them whole, as software before it did.
  bool sequence_parallel = true;
  double target_mfu = 0.4;            // for the compute ledger's wall-clock
  double kernel_efficiency = 0;       // fraction of peak large matmuls reach (0: the cluster's)
  double restart_seconds = 600;       // detect + reschedule + reload after a failure
  double bucket_bytes = 25e6;         // DP gradient bucket
  bool reshard_after_forward = true;  // ZeRO-3: parameters gathered again for backward
  int64_t zero_prefetch = 1;          // ZeRO-3: parameter gathers in flight ahead
};

}  // namespace tetra::plan
