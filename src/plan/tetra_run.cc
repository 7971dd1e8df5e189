#include "plan/tetra_run.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "pipeline/schedule.h"
#include "plan/ledger.h"

namespace tetra::plan {

RunShape run_shape(const ModelSpec& m, const TrainingSpec& t, const Layout& l, const RunOptions& o,
                   int64_t pp_rank) {
  RunShape s;
  s.model = m;
  // As GptConfig pads it: every tensor-parallel rank an equal slice of wte.
  const int64_t multiple = m.vocab_multiple * l.tp;
  s.padded_vocab = (m.vocab_size + multiple - 1) / multiple * multiple;
  s.micro_batch = l.micro_batch;
  s.seq = m.seq;
  s.recompute = l.recompute;
  s.zero = l.zero;
  s.dp = l.dp;
  s.tp = l.tp;
  s.cp = l.cp;
  s.sequence_parallel = o.sequence_parallel && l.tp > 1;
  s.reshard_after_forward = t.reshard_after_forward;
  s.prefetch = t.zero_prefetch;
  s.checkpoint = o.checkpoint;
  s.bf16 = t.precision == Precision::Bf16Mixed;
  s.reduce_bf16 = o.reduce_bf16;
  s.flash_attention = o.flash_attention;
  // model::Gpt::keep_bf16_weights: the CPU backend's bf16 copy of the parameters held whole.
  s.bf16_weights = s.bf16 && o.bf16_weight_cache && !o.flash_attention && l.zero < 3;
  s.cp_attention = l.cp_attention;
  s.cp_ulysses = l.cp_ulysses;
  s.ep = m.has_moe() ? l.ep : 1;
  // The chunks of this pipeline rank's program and the micro-batches each keeps in flight (GPipe
  // keeps all of them, even on one stage).
  if (l.pp > 1 || l.schedule == Schedule::gpipe) {
    const int64_t v = chunks_per_rank(l);
    const pipeline::Schedule sched =
        pipeline::make_schedule(l.schedule, int(l.pp), int(l.microbatches), int(v));
    const std::vector<int> slots = pipeline::peak_inflight_per_chunk(sched, int(pp_rank));
    for (int c = 0; c < sched.v; ++c) {
      const int stage = sched.stage(int(pp_rank), c);
      s.chunks.push_back({stage_layers(l, m.n_layer, stage), int64_t(slots[size_t(c)]),
                          stage_first_layer(l, m.n_layer, stage)});
    }
    s.pending_weight_grads = pipeline::pending_weight_grads(sched, int(pp_rank));
    s.embedding = sched.rank_of(0) == pp_rank;
    s.head = sched.rank_of(int(l.pp * v) - 1) == pp_rank;
    s.pp_rank = pp_rank;
  }
  return s;
}

double GroupTraffic::bytes() const {
  double b = 0;
  for (const TrafficOp& op : ops) {
    const int64_t n = op.group > 0 ? op.group : group;
    const double share = double(n - 1) / double(n);
    const double per = op.kind == Collective::all_reduce ? 2.0 * share * op.buffer
                       : op.kind == Collective::send     ? op.buffer
                                                         : share * op.buffer;
    b += op.count * per;
  }
  return b;
}

double GroupTraffic::calls() const {
  double n = 0;
  for (const TrafficOp& op : ops) n += op.count;
  return n;
}

double GroupTraffic::buffer_bytes() const {
  double b = 0;
  for (const TrafficOp& op : ops) b += op.count * op.buffer;
  return b;
}

std::vector<GroupTraffic> run_traffic(const RunShape& s, const Layout& l, double bucket_bytes) {
  std::vector<GroupTraffic> out;
  constexpr double f32 = 4.0;
  const double mb = double(l.microbatches);
  const double L = double(s.local_layers()), moe = double(s.local_moe_layers());
  const FlatLayout flat = flat_layout(s);
  // This rank's tokens of a micro-batch: B·T/cp under context parallelism.
  const double BT = double(s.micro_batch * s.seq) / double(s.cp);
  const int64_t dpcp = s.dp_cp();
  if (dpcp > 1) {
    // parallel/data_parallel.cc: stage 0 all-reduces the flat gradient in buckets, cut where the
    // units' group changes; the others work unit by unit, reduce-scattering (in bf16 with
    // dp.reduce_dtype=bf16) and all-gathering f32 parameters. Dense units run over the dp group
    // (the dp·cp ranks under context parallelism), expert units over their edp group (dp·cp/ep
    // ranks; with one rank, a local copy: nothing sent).
    GroupTraffic g{"dp", dpcp, {}};
    const double red = s.reduce_bf16 ? 2.0 : f32;
    const int64_t edp = s.edp();
    auto group_of = [&](const FlatUnit& u) { return u.expert ? edp : dpcp; };
    auto op = [&](Collective kind, double buffer, double count, int64_t group) {
      if (group > 1 && count > 0) g.ops.push_back({kind, buffer, count, group == dpcp ? 0 : group});
    };
    auto per_unit = [&](Collective kind, double bytes_per_elem, double times,
                        bool ends_once = false) {
      for (const FlatUnit& u : flat.units) {
        const bool end = !u.block && !u.expert;
        op(kind, u.elements * bytes_per_elem, end && ends_once ? mb : times, group_of(u));
      }
    };
    if (l.zero == 0) {
      const double bucket = std::max(1.0, std::floor(bucket_bytes / f32));
      // Each run of consecutive units of one group in buckets of its own.
      for (size_t u = 0, start = 0; u < flat.units.size(); ++u) {
        if (u + 1 < flat.units.size() && flat.units[u + 1].expert == flat.units[u].expert) {
          continue;
        }
        double run = 0;
        for (size_t v = start; v <= u; ++v) run += flat.units[v].elements;
        const double full = std::floor(run / bucket), rest = run - full * bucket;
        op(Collective::all_reduce, bucket * red, full, group_of(flat.units[u]));
        op(Collective::all_reduce, rest * red, rest > 0 ? 1 : 0, group_of(flat.units[u]));
        start = u + 1;
      }
    } else if (l.zero <= 2) {
      per_unit(Collective::reduce_scatter, red, l.zero == 2 ? mb : 1.0);
      per_unit(Collective::all_gather, f32, 1.0);
    } else {
      // Every unit is gathered before its forward and, resharded after it, again before its
      // backward; a last stage's wte and head only for the backward that runs the head.
      const double gathers = s.reshard_after_forward ? 2.0 : 1.0;
      per_unit(Collective::all_gather, f32, gathers * mb, s.head && !s.embedding);
      per_unit(Collective::reduce_scatter, red, mb);
    }
    if (!g.ops.empty()) out.push_back(std::move(g));
  }
  if (l.tp > 1) {
    // parallel/tp_layers.cc, per micro-batch. A block's forward: ln_1 and ln_2 (all-gathered
    // under sequence parallelism) and both row-parallel products (reduce-scattered, or all-reduced
    // without it); backward: both LayerNorms' input gradients (reduce-scatter or all-reduce), both
    // row-parallel gradients gathered (sequence parallel) and the norm weights' (and a
    // LayerNorm's biases') gradients; a Llama block's q, k and v read one gathered norm output
    // and its gate and up products another, so it has as many collectives of the same sizes. A
    // MoE block's MLP is whole and computed alike on every tp rank (model/block.cc): its forward
    // has no row-parallel product to reduce, its backward gathers the output's gradient in place
    // of the MLP's row-parallel one.
    GroupTraffic g{"tp", l.tp, {}};
    const double BTC = BT * double(s.model.d_model) * f32;
    const double C = double(s.model.d_model) * f32;
    const double forwards = s.recompute == Recompute::full ? 2.0 : 1.0;
    const double reductions = mb * (L * (2 * forwards + 2) - moe * forwards);
    const bool sp = s.sequence_parallel;
    // A norm's gradient tensors: a LayerNorm's weight and bias, an RMSNorm's weight.
    const double norm = s.model.llama() ? 1.0 : 2.0;
    if (sp) {
      g.ops.push_back({Collective::all_gather, BTC, mb * L * (2 * forwards + 2)});
      g.ops.push_back({Collective::reduce_scatter, BTC, reductions});
      g.ops.push_back({Collective::all_reduce, 2 * norm * C, mb * L});
    } else {
      g.ops.push_back({Collective::all_reduce, BTC, reductions});
    }
    if (s.embedding) {
      // The vocabulary-parallel lookup: summed (reduce-scattered) forward, gathered backward.
      if (sp) {
        g.ops.push_back({Collective::reduce_scatter, BTC, mb});
        g.ops.push_back({Collective::all_gather, BTC, mb});
      } else {
        g.ops.push_back({Collective::all_reduce, BTC, mb});
      }
    }
    if (s.head) {
      // ln_f forward and backward, the cross-entropy's row maxima and sums, ln_f's weights.
      if (sp) {
        g.ops.push_back({Collective::all_gather, BTC, mb});
        g.ops.push_back({Collective::reduce_scatter, BTC, mb});
        g.ops.push_back({Collective::all_reduce, norm * C, mb});
      } else {
        g.ops.push_back({Collective::all_reduce, BTC, mb});
      }
      g.ops.push_back({Collective::all_reduce, BT * f32, mb});
      g.ops.push_back({Collective::all_reduce, 2 * BT * f32, mb});
    }
    out.push_back(std::move(g));
  }
  if (l.pp > 1) {
    // pipeline/executor.cc: a chunk sends its output on unless it is the last virtual stage, and
    // its input's gradient back unless it is the first; rank 0's chunks are stages c x pp.
    GroupTraffic g{"pp", l.pp, {}};
    const int64_t v = chunks_per_rank(l);
    const double rows = BT / (s.sequence_parallel ? double(s.tp) : 1.0);
    const double boundary = rows * double(s.model.d_model) * f32;
    double sends = 0;
    for (int64_t c = 0; c < v; ++c) {
      const int64_t stage = stage_of(l, s.pp_rank, c);
      sends += (stage != l.pp * v - 1 ? 1 : 0) + (stage != 0 ? 1 : 0);
    }
    g.ops.push_back({Collective::send, boundary, mb * sends});
    out.push_back(std::move(g));
  }
  if (s.ep > 1 && moe > 0) {
    // parallel/expert_parallel.cc: each MoE block's forward dispatches its routes' rows to the
    // experts' ranks and combines them back, its backward sends their gradients both ways, and a
    // recomputed forward exchanges again: all-to-all(v)s of the rows this rank puts in, N·k rows
    // of C floats each when nothing is dropped (the trainer's a2a_bytes; the ring model's sent
    // bytes are the (ep-1)/ep of them that leave the rank).
    GroupTraffic g{"ep", s.ep, {}};
    const double exchanges = s.recompute == Recompute::full ? 6.0 : 4.0;
    const double rows = BT * double(s.model.moe.top_k);
    g.ops.push_back(
        {Collective::all_to_all, rows * double(s.model.d_model) * f32, mb * moe * exchanges});
    out.push_back(std::move(g));
  }
  if (s.cp > 1 && s.cp_attention == CpAttention::ulysses) {
    // Ulysses over groups of u cp ranks: every block's forward exchanges its f32 qkv and output
    // between sequence and head shards, its backward qkv again, dout, the softmax term and dqkv
    // (plan/comm_cost.h, cp_ulysses_traffic); with u < cp the groups' keys and values go around
    // the ring across them as the ring's below. Full recomputation repeats the forward's.
    GroupTraffic g{"cp", s.cp, {}};
    const int64_t hs = s.model.d_model / s.model.n_head;
    const UlyssesTraffic u =
        cp_ulysses_traffic(s.micro_batch, s.seq, s.cp, s.model.n_head / s.tp,
                           std::max<int64_t>(1, s.model.n_kv_head / s.tp), hs, f32, s.cp_ulysses);
    const double forwards = s.recompute == Recompute::full ? 2.0 : 1.0;
    g.ops.push_back({Collective::all_to_all, u.qkv, (forwards + 2.0) * mb * L, u.group});
    g.ops.push_back({Collective::all_to_all, u.out, (forwards + 1.0) * mb * L, u.group});
    g.ops.push_back({Collective::all_to_all, u.delta, mb * L, u.group});
    if (u.ring.hops > 0) {
      g.ops.push_back({Collective::send, u.ring.hop, forwards * mb * L * double(u.ring.hops)});
      g.ops.push_back({Collective::send, 2.0 * u.ring.hop, mb * L * double(u.ring.hops)});
    }
    out.push_back(std::move(g));
  } else if (s.cp > 1) {
    // Ring attention over the cp group: every block's forward passes this rank's f32 K and V (its
    // tp rank's KVH/tp heads) cp-1 hops on, its backward K and V again with dK and dV
    // (plan/comm_cost.h, cp_ring_traffic); sends to the ring's next rank.
    GroupTraffic g{"cp", s.cp, {}};
    const int64_t hs = s.model.d_model / s.model.n_head;
    const RingTraffic ring = cp_ring_traffic(
        s.micro_batch, s.seq, s.cp, hs * std::max<int64_t>(1, s.model.n_kv_head / s.tp), f32);
    // Full recomputation runs every block's forward, and so its ring, again in backward.
    const double forwards = s.recompute == Recompute::full ? 2.0 : 1.0;
    g.ops.push_back({Collective::send, ring.hop, forwards * mb * L * double(ring.hops)});
    g.ops.push_back({Collective::send, 2.0 * ring.hop, mb * L * double(ring.hops)});
    out.push_back(std::move(g));
  }
  return out;
}

namespace {

// The cp group's exchanges: the ring's sends, Ulysses' all-to-alls (over groups of op.group), or
// both (the hybrid: the ring across cp / op.group groups).
std::string cp_description(const GroupTraffic& g) {
  int64_t u = 0;
  bool sends = false;
  for (const TrafficOp& op : g.ops) {
    if (op.kind == Collective::all_to_all) u = op.group;
    sends = sends || op.kind == Collective::send;
  }
  if (u == 0) return cp_ring_description(g.group);
  const std::string a2a =
      fmt::format("ulysses: all-to-alls over {} ranks, 2 per layer and micro-batch fwd, 4 bwd", u);
  return sends ? a2a + "; " + cp_ring_description(g.group / u) : a2a;
}

}  // namespace

std::vector<DimComm> run_comm(const std::vector<GroupTraffic>& traffic, const Layout& l,
                              const ClusterSpec& c, double microbatch_seconds) {
  std::vector<DimComm> out;
  for (const GroupTraffic& g : traffic) {
    DimComm d;
    d.dim = g.dim;
    d.group = g.group;
    // Ranks are ordered tp fastest, then cp, then dp, then pp: a cp group and the dp·cp group are
    // ranks tp apart, an ep group consecutive dp ranks (tp·cp apart) and an edp group (ZeRO's
    // expert units) dp ranks ep apart.
    const int64_t stride = g.dim == "tp"                    ? 1
                           : g.dim == "dp" || g.dim == "cp" ? l.tp
                           : g.dim == "ep"                  ? l.tp * l.cp
                                                            : l.tp * l.cp * l.dp;
    d.placement = place_group(stride, g.group, c.gpus_per_node);
    d.intra_node = d.placement.nodes == 1;
    d.bytes = g.bytes();
    d.calls = int64_t(std::llround(g.calls()));
    // A pipeline's sends go to the next stage; a ring's between neighbours, as cp_ring_seconds.
    const GroupPlacement pair =
        g.dim == "cp" ? place_group(d.placement.nodes > 1 ? c.gpus_per_node : 1, 2, c.gpus_per_node)
                      : place_group(stride, 2, c.gpus_per_node);
    for (const TrafficOp& op : g.ops) {
      // A subgroup: ZeRO's expert units (dp ranks tp·cp·ep apart), Ulysses' all-to-all groups (cp
      // ranks tp apart).
      const int64_t sub_stride = g.dim == "cp" ? l.tp : l.tp * l.cp * l.ep;
      const GroupPlacement where = op.kind == Collective::send ? pair
                                   : op.group > 0
                                       ? place_group(sub_stride, op.group, c.gpus_per_node)
                                       : d.placement;
      d.seconds += op.count * collective_seconds(op.kind, op.buffer, where, c);
    }
    d.what = g.dim == "dp"   ? "tetra's ZeRO collectives (parallel/data_parallel.cc)"
             : g.dim == "tp" ? "tetra's tensor-parallel collectives (parallel/tp_layers.cc)"
             : g.dim == "ep" ? "tetra's expert-parallel all-to-all of rows, 4 per MoE block and "
                               "micro-batch (6 with full recomputation) (parallel/"
                               "expert_parallel.cc)"
             : g.dim == "cp" ? cp_description(g)
                             : "tetra's pipeline sends (pipeline/executor.cc)";
    // Ulysses' exchanges (the hybrid's ring with them) are exposed, as the model's ledger counts
    // them (layout_search.cc).
    const bool a2a = std::any_of(g.ops.begin(), g.ops.end(), [](const TrafficOp& op) {
      return op.kind == Collective::all_to_all;
    });
    d.algorithm = g.dim == "ep" || (g.dim == "cp" && a2a) ? "all-to-all"
                  : g.dim == "pp" || g.dim == "cp"        ? "p2p"
                                                          : "ring";
    if (g.dim == "dp" && d.seconds > 0) {
      // Reductions run behind the last micro-batch's backward, as far as the cluster lets
      // collectives overlap compute at all (the cpu cluster's ranks: not). The experts' exchanges
      // are on the critical path: their rows must arrive before the experts compute.
      d.overlap = c.comm_overlap * std::min(1.0, 2.0 / 3.0 * microbatch_seconds / d.seconds);
    }
    out.push_back(d);
  }
  return out;
}

RunPrediction predict_run(const ModelSpec& m, const TrainingSpec& t, const Layout& l,
                          const RunOptions& o) {
  RunPrediction p;
  p.params = count_params(m).total();
  // Model FLOPs, whatever the recomputation: MFU counts the work the model needs, not the work a
  // memory-saving schedule adds.
  p.flops_per_token = flops_per_token(m, t.recompute).model();
  const RunShape s = run_shape(m, t, l, o);
  p.memory = run_memory(s);
  p.experts = expert_memory(s);
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
