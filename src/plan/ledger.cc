#include "plan/ledger.h"

#include <algorithm>
#include <cmath>

#include "pipeline/schedule.h"
#include "plan/bubble.h"
#include "plan/comm_cost.h"

namespace tetra::plan {

StateBytes state_bytes_per_param(Precision p) {
  if (p == Precision::Fp32) return StateBytes{4, 4, 0, 4, 4};
  return StateBytes{2, 2, 4, 4, 4};
}

StateMemory zero_state_memory(double params, int64_t n, int stage, Precision p) {
  const StateBytes b = state_bytes_per_param(p);
  const double N = double(std::max<int64_t>(n, 1));
  StateMemory s;
  s.optimizer = b.optimizer() * params / (stage >= 1 ? N : 1.0);
  s.grads = b.grads * params / (stage >= 2 ? N : 1.0);
  s.params = b.weights * params / (stage >= 3 ? N : 1.0);
  return s;
}

int64_t min_devices_for_state(double params, double device_bytes, Precision p) {
  return int64_t(std::ceil(params * state_bytes_per_param(p).total() / device_bytes));
}

double activation_bytes_per_token_layer(const ModelSpec& m, Recompute r, Precision p, int64_t tp,
                                        Attention a, bool sequence_parallel) {
  // Element counts per token, each stored in 2 bytes (bf16) except dropout masks (1 byte);
  // Korthikanti et al. Table 2 gives 34*C + 5*NH*T bytes for GPT with ffn = 4C.
  const double C = double(m.d_model), kvd = double(m.d_model / m.n_head * m.n_kv_head);
  const double ffn = double(m.ffn), NH = double(m.n_head), T = double(m.seq);
  // MLPs a token passes through per layer: top_k in a MoE block, one in a dense block.
  const ParamCounts pc = count_params(m);
  const double k = double(pc.dense_layers() + pc.moe_layers * m.moe.top_k) / double(m.n_layer);
  const double e = act_bytes(p) / 2.0;  // scale the bf16 counts for fp32
  // Without sequence parallelism every TP rank keeps the whole residual stream's tensors: the
  // norms' inputs, the inputs of the QKV and first MLP products, the dropout masks (Korthikanti
  // et al., Table 2: 10*C of the 34*C).
  const double whole = sequence_parallel ? 1.0 : double(tp);
  if (r == Recompute::full) return 2.0 * C * e * whole / double(tp);  // the layer input only
  double attn, scores, mlp;
  const double norms = 4.0 * C;  // inputs of the two norms
  const double replicated = norms + (m.llama() ? 4.0 * C : 6.0 * C);
  if (!m.llama()) {
    attn = 2 * C + 2 * C + 4 * kvd + 2 * C + C;  // qkv in, q, k+v, proj in, dropout mask
    scores = 5.0 * NH * T;                       // softmax out, dropout mask, dropout out
    mlp = 2 * C + k * 4 * ffn + C;               // fc in, fc out, gelu out, dropout mask
  } else {
    attn = 2 * C + 2 * C + 4 * kvd + 2 * C;  // no dropout in Llama-style blocks
    scores = 2.0 * NH * T;                   // softmax out
    mlp = 2 * C + k * 6 * ffn;               // in, gate, up, gate*up
  }
  // A flash kernel keeps each row's log-sum-exp (fp32 per head) and recomputes the scores in its
  // backward, whatever the recomputation mode; a materialized one keeps them unless recomputed.
  if (a == Attention::flash) {
    scores = 4.0 * NH / e;
  } else if (r == Recompute::selective) {
    scores = 0;
  }
  return (attn + mlp + norms + scores + (whole - 1.0) * replicated) * e / double(tp);
}

Attention resolve_attention(const TrainingSpec& t, const ClusterSpec& c) {
  if (t.attention != Attention::automatic) return t.attention;
  return c.name == "cpu" ? Attention::materialized : Attention::flash;
}

LocalParams rank_params(const ModelSpec& m, const Layout& l, int64_t r) {
  const ParamCounts pc = count_params(m);
  double extra = 0;
  if (r == 0) extra += double(pc.embedding);
  if (r == l.pp - 1) {
    extra += l.pp == 1 ? double(pc.head) : double(pc.head > 0 ? pc.head : m.vocab_size * m.d_model);
    extra += double(pc.final_norm);
  }
  const double layers = double(rank_layers(l, m.n_layer, r));
  const double moe = double(rank_moe_layers(m, l, r));
  LocalParams lp;
  lp.dense = (layers * double(pc.attention + pc.norms) + (layers - moe) * double(pc.expert_mlp) +
              moe * double(pc.router) + extra) /
             double(l.tp);
  lp.expert = moe * double(pc.experts * pc.expert_mlp) / double(l.tp * l.ep);
  return lp;
}

int64_t rank_moe_layers(const ModelSpec& m, const Layout& l, int64_t r) {
  const int64_t v = chunks_per_rank(l);
  int64_t n = 0;
  for (int64_t c = 0; c < v; ++c) {
    const int64_t stage = stage_of(l, r, c);
    const int64_t first = stage_first_layer(l, m.n_layer, stage);
    n += m.moe_layers(first, first + stage_layers(l, m.n_layer, stage));
  }
  return n;
}

LocalParams local_params(const ModelSpec& m, const Layout& l) {
  // The rank holding the most: first stage the embedding, last stage the head (a copy of the
  // embedding when tied), each with its own layers.
  LocalParams lp;
  for (int64_t r = 0; r < l.pp; ++r) {
    const LocalParams x = rank_params(m, l, r);
    if (x.dense >= lp.dense) lp = x;
  }
  return lp;
}

std::vector<double> held_layer_microbatches(const Layout& l, int64_t layers) {
  if (l.pp == 1) {
    // One stage: micro-batches run one after another, except GPipe's all-forwards-first.
    const double held = l.schedule == Schedule::gpipe ? double(l.microbatches) : 1.0;
    return {held * double(layers)};
  }
  const int64_t v = chunks_per_rank(l);
  const pipeline::Schedule s =
      pipeline::make_schedule(l.schedule, int(l.pp), int(l.microbatches), int(v));
  std::vector<double> out(size_t(l.pp), 0.0);
  for (int r = 0; r < s.p; ++r) {
    double now = 0, peak = 0;
    for (const pipeline::Instr& in : s.ranks[size_t(r)]) {
      const double n = double(stage_layers(l, layers, s.stage(r, in.chunk)));
      if (in.op == pipeline::Op::forward) peak = std::max(peak, now += n);
      if (in.op == pipeline::Op::backward || in.op == pipeline::Op::backward_weight) now -= n;
    }
    out[size_t(r)] = peak;
  }
  return out;
}

MemoryBreakdown memory_per_device(const ModelSpec& m, const TrainingSpec& t, const Layout& l) {
  // A rank's tokens of a micro-batch: context parallelism splits each sequence cp ways, and every
  // per-token tensor with it. Its attention is blockwise (parallel/context_parallel.h): a rank
  // keeps each of its rows' log-sum-exp, as a flash kernel does, whatever kernel runs at cp = 1.
  const double tokens = double(l.micro_batch * m.seq) / double(l.cp);
  const double ab = act_bytes(t.precision);
  const ParamCounts pc = count_params(m);
  const std::vector<double> held = held_layer_microbatches(l, m.n_layer);
  const Attention a =
      t.attention == Attention::automatic || l.cp > 1 ? Attention::flash : t.attention;
  const double per_layer =
      activation_bytes_per_token_layer(m, l.recompute, t.precision, l.tp, a, t.sequence_parallel);
  MemoryBreakdown worst;
  for (int64_t r = 0; r < l.pp; ++r) {
    const LocalParams lp = rank_params(m, l, r);
    // ZeRO shards over the ranks that reduce the gradients: dp * cp.
    const StateMemory dense = zero_state_memory(lp.dense, l.dp_cp(), l.zero, t.precision);
    const StateMemory expert =
        zero_state_memory(lp.expert, std::max<int64_t>(1, l.dp_cp() / l.ep), l.zero, t.precision);
    MemoryBreakdown mem;
    mem.rank = r;
    mem.params = dense.params + expert.params;
    mem.grads = dense.grads + expert.grads;
    mem.optimizer = dense.optimizer + expert.optimizer;

    // What the schedule keeps in flight on this rank. A stage sends its output on and frees it
    // (Megatron's deallocation of pipeline outputs, which the Llama 3 paper names), so a layer's
    // saved input is the only boundary tensor counted.
    mem.activations = per_layer * tokens * held[size_t(r)];
    if (l.recompute == Recompute::full && rank_layers(l, m.n_layer, r) > 0) {
      // The layer being recomputed materialises its activations once more.
      mem.activations += activation_bytes_per_token_layer(m, Recompute::none, t.precision, l.tp, a,
                                                          t.sequence_parallel) *
                         tokens;
    }
    // The last stage's fp32 logits of the micro-batch whose loss it computes.
    if (r == l.pp - 1) mem.activations += tokens * double(m.vocab_size) / double(l.tp) * 4.0;

    mem.comm_buffers = 2.0 * t.bucket_bytes;
    if (l.zero >= 3) {
      // Prefetch: the next layer's parameters gathered while this one computes.
      mem.comm_buffers += 2.0 * double(pc.per_layer()) / double(l.tp * l.ep) *
                          state_bytes_per_param(t.precision).weights;
    }
    if (l.tp > 1) mem.comm_buffers += 2.0 * tokens * double(m.d_model) * ab;
    if (l.pp > 1) mem.comm_buffers += 2.0 * tokens * double(m.d_model) * ab / double(l.tp);
    if (l.ep > 1) {
      // Dispatch and combine buffers at capacity factor 1.25.
      mem.comm_buffers +=
          2.0 * 1.25 * tokens / double(l.tp) * double(m.moe.top_k) * double(m.d_model) * ab;
    }
    if (l.cp > 1 && l.cp_attention == CpAttention::ulysses) {
      // Ulysses (parallel/context_parallel.cc): the qkv blocks sent and received and their
      // gradients, the output's blocks sent and received; across groups smaller than cp, six of
      // the ring's hops as below.
      const UlyssesTraffic u = cp_ulysses_traffic(l.micro_batch, m.seq, l.cp, m.n_head / l.tp,
                                                  std::max<int64_t>(1, m.n_kv_head / l.tp),
                                                  m.d_model / m.n_head, ab, l.cp_ulysses);
      mem.comm_buffers += 3.0 * u.qkv + 2.0 * u.out + 6.0 * u.ring.hop;
    } else if (l.cp > 1) {
      // Ring attention (parallel/context_parallel.cc): the K, V chunks being attended to and the
      // next ones arriving, and in backward two partial sums of their gradients travelling, the
      // rank's own share and the one arriving: six of a hop's bytes.
      const int64_t hs = m.d_model / m.n_head;
      mem.comm_buffers += 6.0 * cp_ring_traffic(l.micro_batch, m.seq, l.cp,
                                                hs * std::max<int64_t>(1, m.n_kv_head / l.tp), ab)
                                    .hop;
    }
    if (r == 0 || mem.total() > worst.total()) worst = mem;
  }
  return worst;
}

FlopsPerToken flops_per_token(const ModelSpec& m, Recompute r) {
  const double N = double(count_params(m).matmul_active());
  const double attn_fwd = 4.0 * double(m.n_layer) * double(m.d_model) * double(m.seq);
  FlopsPerToken f;
  f.dense = 6.0 * N;
  f.attention = 3.0 * attn_fwd;
  if (r == Recompute::selective) f.recompute = attn_fwd;
  if (r == Recompute::full) f.recompute = 2.0 * N + attn_fwd;
  return f;
}

double gpu_seconds(double flops, double peak_flops, double mfu) {
  return flops / (peak_flops * mfu);
}

ComputeLedger compute_ledger(const ModelSpec& m, double tokens, int64_t devices, double peak_flops,
                             double mfu) {
  const FlopsPerToken f = flops_per_token(m, Recompute::none);
  ComputeLedger c;
  c.flops_6pt = f.dense * tokens;
  c.flops_total = f.model() * tokens;
  c.gpu_seconds = gpu_seconds(c.flops_total, peak_flops, mfu);
  c.gpu_years = c.gpu_seconds / kSecondsPerYear;
  c.wall_seconds = c.gpu_seconds / double(std::max<int64_t>(devices, 1));
  return c;
}

}  // namespace tetra::plan
