#include "plan/tetra_run.h"

#include <fmt/format.h>

#include "plan/ledger.h"

namespace tetra::plan {

RunShape run_shape(const ModelSpec& m, const TrainingSpec& t, const Layout& l,
                   const RunOptions& o) {
  RunShape s;
  s.vocab = m.vocab;
  // As GptConfig::make pads it: every tensor-parallel rank an equal slice of wte.
  const int64_t multiple = m.vocab_multiple * l.tp;
  s.padded_vocab = (m.vocab + multiple - 1) / multiple * multiple;
  s.layers = m.layers;
  s.d_model = m.d_model;
  s.heads = m.heads;
  s.max_seq = m.positions > 0 ? m.positions : m.seq;
  s.micro_batch = l.micro_batch;
  s.seq = m.seq;
  s.recompute = t.recompute;
  s.zero = l.zero;
  s.dp = l.dp;
  s.tp = l.tp;
  s.sequence_parallel = o.sequence_parallel && l.tp > 1;
  s.reshard_after_forward = t.reshard_after_forward;
  s.prefetch = t.zero_prefetch;
  s.checkpoint = o.checkpoint;
  s.bf16 = t.precision == Precision::Bf16Mixed;
  s.reduce_bf16 = o.reduce_bf16;
  s.flash_attention = o.flash_attention;
  return s;
}

RunPrediction predict_run(const ModelSpec& m, const TrainingSpec& t, const Layout& l,
                          const RunOptions& o) {
  RunPrediction p;
  p.params = count_params(m).total();
  // Model FLOPs, whatever the recomputation: MFU counts the work the model needs, not the work a
  // memory-saving schedule adds.
  p.flops_per_token = flops_per_token(m, t.recompute).model();
  p.memory = run_memory(run_shape(m, t, l, o));
  return p;
}

std::string run_summary(int64_t params, double flops_per_token, double bytes_per_rank) {
  const double P = double(params);
  const std::string count =
      P >= 1e9 ? fmt::format("{:.3g}B", P / 1e9) : fmt::format("{:.3g}M", P / 1e6);
  return fmt::format("{} params, {:.3g} FLOPs/token, {:.1f} MiB per rank", count, flops_per_token,
                     bytes_per_rank / double(1 << 20));
}

std::string run_summary(const RunPrediction& p) {
  return run_summary(p.params, p.flops_per_token, p.memory.total());
}

}  // namespace tetra::plan
