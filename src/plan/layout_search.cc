#include "plan/layout_search.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "core/error.h"
#include "pipeline/simulate.h"
#include "plan/bubble.h"
#include "plan/units.h"

namespace tetra::plan {

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= n; ++i) {
    if (n % i == 0) d.push_back(i);
  }
  return d;
}

int64_t sequences_per_step(const ModelSpec& m, const TrainingSpec& t) {
  TETRA_CHECK(t.global_batch_tokens > 0 && t.global_batch_tokens % m.seq == 0,
              "[plan] training.global_batch={} tokens is not a positive multiple of seq={}; use "
              "a whole number of sequences, e.g. {}",
              t.global_batch_tokens, m.seq,
              std::max<int64_t>(1, t.global_batch_tokens / m.seq) * m.seq);
  return t.global_batch_tokens / m.seq;
}

}  // namespace

namespace {

// The output head's products in layers of compute (6VC per token against a layer's 6 x its
// matrices): the last virtual stage runs them after its layers, the first stage's embedding lookup
// costs next to nothing. This is what makes Llama 3 and Megatron give the end stages fewer layers.
double head_layers(const ModelSpec& m) {
  const ParamCounts pc = count_params(m);
  // A layer's mean matrices a token is multiplied by (MoE blocks: the router and top_k experts).
  const double layer = double(pc.matmul_active() - pc.head_matmul) / double(m.n_layer);
  return double(pc.head_matmul) / layer;
}

// Each virtual stage costs its layers (the last also the head) of a slot: the forward's share of
// the hardware FLOPs forward, the rest (backward and any recomputation) backward, of which the
// weight products are W.
pipeline::Timeline simulate_pipeline(const ModelSpec& m, const Layout& l, double slot,
                                     double transfer) {
  const int64_t v = chunks_per_rank(l);
  const int stages = int(l.pp * v);
  const FlopsPerToken f = flops_per_token(m, l.recompute);
  const double fwd = f.model() / 3.0 / f.hardware();
  const double head = head_layers(m);
  const double unit = slot * double(l.pp) / (double(m.n_layer) + head);
  pipeline::Costs costs;
  costs.transfer = transfer;
  for (int k = 0; k < stages; ++k) {
    const double layers = double(stage_layers(l, m.n_layer, k)) + (k == stages - 1 ? head : 0.0);
    const double stage = unit * layers;
    costs.forward.push_back(fwd * stage);
    costs.backward.push_back((1.0 - fwd) * stage);
    // Of backward, the weight products (W of a zero-bubble schedule): as many FLOPs as forward's.
    costs.weight.push_back(fwd * stage);
  }
  return pipeline::simulate(
      pipeline::make_schedule(l.schedule, int(l.pp), int(l.microbatches), int(v)), costs);
}

// A schedule's flush in slots and its bubble with instant sends: the simulation scales with the
// slot, so it is run once per schedule, split and forward share, and kept.
struct SimulatedPipeline {
  double flush_per_slot = 0, bubble = 0;
};
SimulatedPipeline simulated_pipeline(const ModelSpec& m, const Layout& l) {
  using Key = std::tuple<int, int64_t, int64_t, int64_t, std::vector<int>, int64_t, double>;
  static std::mutex mu;
  static std::map<Key, SimulatedPipeline> cache;
  const Key key{int(l.schedule),
                l.pp,
                l.microbatches,
                l.v,
                l.split,
                m.n_layer,
                head_layers(m) + 10.0 * double(int(l.recompute))};
  {
    const std::lock_guard<std::mutex> lock(mu);
    if (const auto it = cache.find(key); it != cache.end()) return it->second;
  }
  const pipeline::Timeline tl = simulate_pipeline(m, l, 1.0, 0.0);
  const SimulatedPipeline sim{tl.flush, tl.bubble()};
  const std::lock_guard<std::mutex> lock(mu);
  if (cache.size() > 100000) cache.clear();
  cache.emplace(key, sim);
  return sim;
}

double critical_seconds(const std::vector<DimComm>& comm) {
  double s = 0;
  for (const auto& d : comm) {
    if (d.dim == "tp" || d.dim == "ep") s += d.seconds;
    if (d.dim == "cp") s += d.exposed();
  }
  return s;
}

double pp_send_seconds(const std::vector<DimComm>& comm) {
  for (const auto& d : comm) {
    if (d.dim == "pp" && d.calls > 0) return d.seconds / double(d.calls);
  }
  return 0.0;
}

// Bytes every kernel that is not a matrix product reads and writes per token and layer: each
// saved activation is written once forward and read once backward, and its gradient written and
// read once (norms, GELU/SwiGLU, softmax, residual adds, dropout).
constexpr double kElementwisePasses = 3.0;
// An unfused attention's score tensors, in bytes per element of the n_head x T scores a token has
// in a layer, kernel by kernel (Megatron-LM before fused attention: the product, its fused
// scale-mask-softmax, then dropout). Forward: the product writes the
// scores (2), the softmax reads them and writes its output (4), dropout reads that and writes its
// output and its mask (5), the product with V reads it (2). Backward: the product with V reads
// the probabilities and writes their gradient (4), dropout's backward reads that and the mask and
// writes (5), the softmax's reads its output and gradient and writes (6), the two products that
// follow read the scores' gradient (4). Without dropout (Llama blocks): 8 and 14. A recomputed
// forward (selective or full) runs the forward's kernels again.
constexpr double kScoreBytesForward = 13.0, kScoreBytesBackward = 19.0;
constexpr double kScoreBytesForwardNoDropout = 8.0, kScoreBytesBackwardNoDropout = 14.0;
// Bytes the AdamW update moves per parameter it owns: fp32 parameter, gradient, m and v read;
// parameter, m and v written.
constexpr double kUpdateBytesPerParam = 28.0;

}  // namespace

pipeline::Timeline simulate_pipeline(const ModelSpec& m, const TrainingSpec&,
                                     const LayoutEstimate& e) {
  return simulate_pipeline(
      m, e.layout, e.microbatch_seconds + critical_seconds(e.comm) / double(e.layout.microbatches),
      pp_send_seconds(e.comm));
}

LayoutEstimate evaluate_layout(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t0,
                               const Layout& l, const CommModel& comm) {
  TrainingSpec t = t0;
  t.attention = resolve_attention(t0, c);
  LayoutEstimate e;
  e.layout = l;
  e.memory = memory_per_device(m, t, l);
  e.usable_bytes = c.memory_bytes * c.usable_fraction;
  e.fits = e.memory.total() <= e.usable_bytes;

  // Kernels of one micro-batch on one device: the whole model's work over tp x cp x pp devices
  // (context parallelism's causal chunks balanced: every cp rank has the same attention work).
  const double tokens = double(l.micro_batch * m.seq) / double(l.cp);
  const double share = tokens / double(l.tp * l.pp);
  const FlopsPerToken f = flops_per_token(m, l.recompute);
  const bool flash = t.attention == Attention::flash;
  const double attn_fwd = f.attention / 3.0;
  // Full recomputation runs the forward again; selective reruns the attention scores, which a
  // flash kernel recomputes in its own backward anyway (counted in its efficiency).
  const double re_dense = l.recompute == Recompute::full ? 2.0 * (f.dense / 6.0) : 0.0;
  const double re_attn =
      l.recompute == Recompute::full || (l.recompute == Recompute::selective && !flash) ? attn_fwd
                                                                                        : 0.0;
  // A product's efficiency falls when its smallest side is small: tokens of the micro-batch or
  // the hidden width one TP rank holds (tile and wave quantisation).
  const double side = std::min(tokens, double(m.d_model) / double(l.tp));
  const double e_max = t.kernel_efficiency > 0 ? t.kernel_efficiency : c.gemm_efficiency;
  const double e_gemm = e_max * (c.gemm_half_dim > 0 ? side / (side + c.gemm_half_dim) : 1.0);
  const double peak = c.peak_flops;
  KernelTime& k = e.microbatch;
  k.gemm_efficiency = e_gemm;
  k.ideal = f.model() * share / peak;
  // MFU counts attention's scores whole (PaLM's convention); a causal kernel computes only the
  // unmasked half of them (FlashAttention-2 skips the masked blocks, tetra's CPU kernel the masked
  // entries), at cluster.attention_efficiency of peak.
  const double e_attn = 2.0 * c.attention_efficiency;
  k.recompute = (re_dense / e_gemm + re_attn / e_attn) * share / peak;
  k.gemm = f.dense * share / peak / e_gemm;
  k.attention = f.attention * share / peak / e_attn;
  // The layer's saved tensors, three passes each; unfused attention's scores kernel by kernel
  // instead (its other tensors counted with a flash kernel's row statistics for the scores).
  const bool unfused = t.attention == Attention::unfused;
  const double act = activation_bytes_per_token_layer(m, Recompute::none, t.precision, l.tp,
                                                      unfused ? Attention::flash : t.attention,
                                                      t.sequence_parallel);
  const double rerun = l.recompute == Recompute::full ? 4.0 / 3.0 : 1.0;
  double scores = 0;
  if (unfused) {
    const double fwd = m.llama() ? kScoreBytesForwardNoDropout : kScoreBytesForward;
    const double bwd = m.llama() ? kScoreBytesBackwardNoDropout : kScoreBytesBackward;
    const double again = l.recompute == Recompute::none ? 0.0 : fwd;
    scores = double(m.n_head * m.seq) / double(l.tp) * (fwd + bwd + again) *
             act_bytes(t.precision) / 2.0;
  }
  const double logits = 3.0 * double(m.vocab_size) / double(l.tp) * 4.0;
  k.memory_bound = ((kElementwisePasses * act * rerun + scores) * double(m.n_layer) + logits) *
                   tokens / double(l.pp) / c.mem_bw;
  e.microbatch_seconds = k.total();

  e.comm = comm ? comm(e.microbatch_seconds) : comm_per_step(m, c, t, l, e.microbatch_seconds);
  const double mb = double(l.microbatches);
  for (auto& d : e.comm) {
    // The cp ring's hops hide behind the attention they feed: each chunk pair arrives while the
    // previous one is attended to (forward and backward), as far as the cluster overlaps at all.
    // Ulysses' all-to-alls are exposed: attention waits for its heads.
    if (d.dim != "cp" || d.seconds <= 0 || d.algorithm == "all-to-all") continue;
    const double exposed = ring_exposed_seconds(d.seconds, mb * k.attention, c.comm_overlap);
    d.overlap = 1.0 - exposed / d.seconds;
  }
  // TP and EP collectives stretch every pipeline slot, so the bubble scales them too.
  const double critical = critical_seconds(e.comm);
  const double slot = e.microbatch_seconds + critical / mb;
  e.compute_seconds = mb * e.microbatch_seconds;
  double pipeline_seconds = slot * mb;
  if (l.pp > 1) {
    // The bubble of the schedule with instant sends; the sends add their latency along the
    // pipeline's critical path, the first micro-batch's forward through every virtual stage and
    // the last one's backward back (the rest overlap the steady state's compute).
    const SimulatedPipeline sim = simulated_pipeline(m, l);
    pipeline_seconds = sim.flush_per_slot * slot;
    e.bubble = sim.bubble;
    e.bubble_formula = bubble_fraction(l.schedule, l.pp, l.microbatches, l.v);
    const int64_t v = chunks_per_rank(l);
    double pp_total = 0;
    for (const auto& d : e.comm) {
      if (d.dim == "pp") pp_total = d.seconds;
    }
    e.pp_exposed_seconds = std::min(pp_total, 2.0 * double(l.pp * v - 1) * pp_send_seconds(e.comm));
  }
  e.bubble_seconds = pipeline_seconds - slot * mb;
  double dp_exposed = 0;
  for (auto& d : e.comm) {
    if (d.dim != "dp") continue;
    // Gradients reduced after the last backward (plain DP, ZeRO-1) also run while the pipeline
    // drains: a stage whose last backward is done idles through the rest of the bubble.
    if (l.pp > 1 && l.zero <= 1 && !comm && d.seconds > 0) {
      d.overlap = c.comm_overlap *
                  std::min(1.0, (2.0 / 3.0 * e.microbatch_seconds + e.bubble_seconds) / d.seconds);
    }
    dp_exposed += d.exposed();
  }
  // The update: what this rank owns of the state, memory-bound.
  const LocalParams lp = rank_params(m, l, e.memory.rank);
  const double owned =
      (lp.dense + lp.expert) / (l.zero >= 1 ? double(std::max<int64_t>(1, l.dp_cp())) : 1.0);
  e.optimizer_seconds = kUpdateBytesPerParam * owned / c.mem_bw;

  e.time.data = 0;
  e.time.comm = critical + e.pp_exposed_seconds + dp_exposed;
  e.time.bubble = e.bubble_seconds;
  e.time.kernels = e.compute_seconds + e.optimizer_seconds;
  e.time.stragglers =
      straggler_fraction(c.gpus, c.jitter) * (e.time.comm + e.time.bubble + e.time.kernels);
  e.exposed_comm_seconds = e.time.comm;
  e.step_seconds = e.time.total();
  const double device_flops = double(c.gpus) * peak * e.step_seconds;
  e.mfu = f.model() * double(t.global_batch_tokens) / device_flops;
  e.hfu = f.hardware() * double(t.global_batch_tokens) / device_flops;
  return e;
}

std::vector<StepTerm> step_terms(const LayoutEstimate& e) {
  const KernelTime& k = e.microbatch;
  const double mb = e.compute_seconds / std::max(e.microbatch_seconds, 1e-300);
  std::vector<StepTerm> terms = {
      {"products", mb * k.gemm},        {"attention", mb * k.attention},
      {"recompute", mb * k.recompute},  {"memory-bound", mb * k.memory_bound},
      {"update", e.optimizer_seconds},  {"bubble", e.time.bubble},
      {"stragglers", e.time.stragglers}};
  // Exposed communication by dimension, as StepTime.comm adds it: the critical-path collectives,
  // the pipeline's sends on its critical path, the rest as far as it does not hide.
  for (const DimComm& d : e.comm) {
    double s = 0;
    if (d.dim == "tp" || d.dim == "ep") s = d.seconds;
    if (d.dim == "cp" || d.dim == "dp") s = d.exposed();
    if (d.dim == "pp") s = e.pp_exposed_seconds;
    if (s > 0) terms.push_back({d.dim + " comm", s});
  }
  std::stable_sort(terms.begin(), terms.end(),
                   [](const StepTerm& a, const StepTerm& b) { return a.seconds > b.seconds; });
  return terms;
}

Layout layout_from_constraints(const ModelSpec& m, const TrainingSpec& t,
                               const LayoutConstraints& k) {
  const int64_t seqs = sequences_per_step(m, t);
  Layout l;
  l.tp = k.tp;
  l.pp = k.pp;
  l.dp = k.dp;
  l.ep = k.ep ? k.ep : 1;
  l.cp = std::max<int64_t>(1, k.cp);
  l.cp_attention = k.cp_attention.value_or(CpAttention::ring);
  l.cp_ulysses = l.cp_attention == CpAttention::ulysses ? k.cp_ulysses.value_or(0) : 0;
  l.zero = k.zero;
  l.schedule = k.schedule.value_or(Schedule::one_f_one_b);
  l.v = l.schedule == Schedule::interleaved ? (k.v ? k.v : 2)
        : l.schedule == Schedule::zb_v      ? 2
                                            : 1;
  l.recompute = k.recompute.value_or(t.recompute);
  const int64_t per_replica = seqs / std::max<int64_t>(l.dp, 1);
  if (k.microbatches) {
    l.microbatches = k.microbatches;
    l.micro_batch =
        t.micro_batch ? t.micro_batch : std::max<int64_t>(1, per_replica / k.microbatches);
  } else {
    l.micro_batch = t.micro_batch ? t.micro_batch : 1;
    l.microbatches = std::max<int64_t>(1, per_replica / l.micro_batch);
  }
  if (const std::string problem = resolve_split(m, k.pp_layers, l); !problem.empty()) {
    throw Error(problem);
  }
  return l;
}

SearchResult search_layouts(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t,
                            const LayoutConstraints& k) {
  const int64_t seqs = sequences_per_step(m, t);
  SearchResult r;
  std::vector<LayoutEstimate> all;
  std::vector<Recompute> recomputes;
  if (k.recompute) {
    recomputes.push_back(*k.recompute);
  } else {
    recomputes = {Recompute::none, Recompute::selective, Recompute::full};
  }
  for (int64_t tp : divisors(c.gpus_per_node)) {
    if ((k.tp && tp != k.tp) || c.gpus % tp != 0) continue;
    // Every pp up to the layer count: stages that do not divide the layers are split unevenly,
    // balanced with the embedding and the head counted (pp.layers=auto), as Llama 3 did.
    for (int64_t pp : divisors(c.gpus)) {
      if (pp > m.n_layer) continue;
      if ((k.pp && pp != k.pp) || c.gpus % (tp * pp) != 0) continue;
      const int64_t dp = c.gpus / (tp * pp);
      if ((k.dp && dp != k.dp) || seqs % dp != 0) continue;
      const int64_t per_replica = seqs / dp;
      std::vector<int64_t> eps;
      for (int64_t ep : divisors(std::max<int64_t>(1, m.moe.experts))) {
        // Expert groups stay inside the node next to TP (004: TP/EP use up the node first).
        if ((k.ep && ep != k.ep) || dp % ep != 0 || (!k.ep && tp * ep > c.gpus_per_node)) continue;
        eps.push_back(ep);
      }
      std::vector<int64_t> mbss;
      for (int64_t mbs = 1; mbs <= per_replica; mbs *= 2) {
        if (per_replica % mbs != 0) continue;
        if (t.micro_batch && mbs != t.micro_batch) continue;
        if (k.microbatches && per_replica / mbs != k.microbatches) continue;
        mbss.push_back(mbs);
      }
      std::vector<std::pair<Schedule, int64_t>> schedules;
      if (k.schedule) {
        schedules.push_back({*k.schedule, *k.schedule == Schedule::interleaved ? (k.v ? k.v : 2)
                                          : *k.schedule == Schedule::zb_v      ? 2
                                                                               : 1});
      } else {
        schedules.push_back({Schedule::one_f_one_b, 1});
        if (pp > 1 && k.zero_bubble) schedules.push_back({Schedule::zb_h1, 1});
        if (pp > 1) {
          for (int64_t v : k.v ? std::vector<int64_t>{k.v} : std::vector<int64_t>{2, 3, 4}) {
            if (pp * v <= m.n_layer) schedules.push_back({Schedule::interleaved, v});
          }
        }
      }
      for (int64_t ep : eps) {
        for (int64_t mbs : mbss) {
          for (auto [sched, v] : schedules) {
            Layout base{tp, pp, dp, ep, 0, sched, v, mbs, per_replica / mbs, {}};
            const std::string spec = k.pp_layers.empty() && m.n_layer % (pp * v) != 0
                                         ? std::string("auto")
                                         : k.pp_layers;
            if (!resolve_split(m, spec, base).empty()) continue;
            if (!layout_problem(m, c, t, base).empty()) continue;
            for (Recompute rc : recomputes) {
              for (int zero = 0; zero <= 3; ++zero) {
                if (k.zero >= 0 && zero != k.zero) continue;
                Layout l = base;
                l.zero = zero;
                l.recompute = rc;
                ++r.considered;
                TrainingSpec tr = t;
                tr.attention = resolve_attention(t, c);
                const MemoryBreakdown mem = memory_per_device(m, tr, l);
                if (mem.total() > c.memory_bytes * c.usable_fraction) {
                  ++r.too_big;
                  if (!r.closest || mem.total() < r.closest->memory.total()) {
                    r.closest = evaluate_layout(m, c, t, l);
                  }
                  continue;
                }
                all.push_back(evaluate_layout(m, c, t, l));
              }
            }
          }
        }
      }
    }
  }
  // Fastest first; on a tie the layout that moves fewer bytes, then the one with more headroom
  // (ZeRO-1 is free next to plain DP: same bytes, less state).
  auto bytes = [](const LayoutEstimate& e) {
    double b = 0;
    for (const auto& d : e.comm) b += d.bytes;
    return b;
  };
  std::stable_sort(all.begin(), all.end(), [&](const LayoutEstimate& a, const LayoutEstimate& b) {
    if (std::abs(a.step_seconds - b.step_seconds) > 1e-6 * a.step_seconds) {
      return a.step_seconds < b.step_seconds;
    }
    const double ba = bytes(a), bb = bytes(b);
    if (std::abs(ba - bb) > 1e-6 * std::max(ba, bb)) return ba < bb;
    return a.memory.total() < b.memory.total();
  });
  std::set<std::tuple<int64_t, int64_t, int64_t, int64_t>> seen;
  for (auto& e : all) {
    if (seen.insert({e.layout.tp, e.layout.pp, e.layout.dp, e.layout.ep}).second) {
      r.ranked.push_back(std::move(e));
    }
  }
  if (!r.ranked.empty()) r.closest.reset();
  return r;
}

std::vector<std::string> layout_warnings(const ModelSpec& m, const ClusterSpec& c,
                                         const TrainingSpec& t, const LayoutEstimate& e) {
  std::vector<std::string> w;
  const Layout& l = e.layout;
  if (!e.fits) {
    w.push_back(fmt::format(
        "does not fit: needs {} per device but {} is usable ({} x {:.0f}%); raise the ZeRO "
        "stage, pp or tp, or use training.recompute=full",
        human_bytes(e.memory.total()), human_bytes(e.usable_bytes), human_bytes(c.memory_bytes),
        c.usable_fraction * 100));
  }
  if (l.tp * l.ep > c.gpus_per_node && l.ep > 1) {
    w.push_back(fmt::format(
        "EP {} x TP {} spans more than one node of {}: the all-to-all crosses the inter-node "
        "link (004: keep TP/EP inside the node)",
        l.ep, l.tp, c.gpus_per_node));
  }
  if (l.pp > 1 && e.bubble > 0.2) {
    w.push_back(fmt::format(
        "deep PP with few micro-batches: p={}, m={} leaves {:.0f}% of the step idle (000: p=8, "
        "m=8 is 47%, catastrophic); raise the global batch, lower pp, or use interleaved",
        l.pp, l.microbatches, e.bubble * 100));
  }
  const double state = double(count_params(m).total()) * state_bytes_per_param(t.precision).total();
  const double node = double(c.gpus_per_node) * c.memory_bytes * c.usable_fraction;
  if (l.tp > 1 && l.pp > 1 && state <= node) {
    w.push_back(fmt::format(
        "3D parallelism on a model whose training state ({}) fits one node ({}): complexity "
        "without need (001 よくある間違い); prefer ZeRO data parallelism",
        human_bytes(state), human_bytes(node)));
  }
  return w;
}

std::vector<std::string> explain_layout(const ModelSpec& m, const ClusterSpec& c,
                                        const TrainingSpec& t, const LayoutEstimate& e) {
  std::vector<std::string> x;
  const Layout& l = e.layout;
  const double P = double(count_params(m).total());
  const double per_param = state_bytes_per_param(t.precision).total();
  x.push_back(fmt::format(
      "training state {:.0f} B/param x {:.3g} params = {}; at least {} devices of {} before one "
      "token (000 メモリ台帳)",
      per_param, P, human_bytes(P * per_param),
      min_devices_for_state(P, c.memory_bytes, t.precision), human_bytes(c.memory_bytes)));
  if (l.tp > 1) {
    x.push_back(fmt::format(
        "TP {} inside a node of {}: its per-layer all-reduces sit on the critical path and need "
        "the intra-node link (000 テンソル並列: TP degree <= GPUs per node)",
        l.tp, c.gpus_per_node));
  } else {
    x.push_back("TP 1: no matrix is split, so no per-layer all-reduce is paid");
  }
  if (l.ep > 1) {
    x.push_back(fmt::format(
        "EP {} next to TP inside the node: the MoE all-to-all stays on the fast link (004 "
        "分割順序: TP/EP use up the node first)",
        l.ep));
  }
  if (l.pp > 1) {
    const bool inside = group_in_node(l.tp * l.dp, l.pp, c.gpus_per_node);
    x.push_back(fmt::format(
        "PP {} {}: only boundary activations cross it; bubble {:.1f}% at m={} with {} (000 "
        "パイプライン並列: PP tolerates slow links)",
        l.pp,
        inside ? std::string("inside the node")
               : fmt::format("across nodes (one model replica = TP x PP = {} GPUs)", l.tp * l.pp),
        e.bubble * 100, l.microbatches, to_string(l.schedule)));
  } else {
    x.push_back("PP 1: the model fits without a pipeline, so there is no bubble");
  }
  Layout plain_layout = l;
  plain_layout.zero = 0;
  TrainingSpec tr = t;
  tr.attention = resolve_attention(t, c);
  const MemoryBreakdown plain = memory_per_device(m, tr, plain_layout);
  x.push_back(fmt::format(
      "DP {} outermost{}: state {} per device{} (000 ZeRO: shard state before splitting "
      "compute further)",
      l.dp, l.zero ? fmt::format(" with ZeRO-{}", l.zero) : std::string(),
      human_bytes(e.memory.params + e.memory.grads + e.memory.optimizer),
      l.zero ? fmt::format(" instead of {} unsharded",
                           human_bytes(plain.params + plain.grads + plain.optimizer))
             : std::string()));
  x.push_back(fmt::format("recompute {}: activations {} per device on pipeline rank {} ({})",
                          recompute_name(l.recompute), human_bytes(e.memory.activations),
                          e.memory.rank,
                          l.recompute == Recompute::none ? "every tensor kept"
                          : l.recompute == Recompute::full
                              ? "each layer's input kept, the forward run again in backward"
                              : "the attention scores recomputed"));
  x.push_back(fmt::format(
      "step {} = communication {} + bubble {} + kernels {} + stragglers {}; estimated MFU "
      "{:.0f}%",
      human_seconds(e.step_seconds), human_seconds(e.time.comm), human_seconds(e.time.bubble),
      human_seconds(e.time.kernels), human_seconds(e.time.stragglers), e.mfu * 100));
  return x;
}

std::vector<std::string> rank_reasons(const std::vector<LayoutEstimate>& ranked) {
  std::vector<std::string> out;
  const char* const names[] = {"data", "communication", "bubble", "kernels", "stragglers"};
  for (size_t i = 0; i + 1 < ranked.size(); ++i) {
    const StepTime& a = ranked[i].time;
    const StepTime& b = ranked[i + 1].time;
    const double diff[] = {b.data - a.data, b.comm - a.comm, b.bubble - a.bubble,
                           b.kernels - a.kernels, b.stragglers - a.stragglers};
    // The saving that decides it, and the largest cost paid for it.
    size_t gain = 0, cost = 0;
    for (size_t j = 1; j < 5; ++j) {
      if (diff[j] > diff[gain]) gain = j;
      if (diff[j] < diff[cost]) cost = j;
    }
    const double total = b.total() - a.total();
    std::string why;
    if (total <= 1e-9 * std::max(a.total(), 1e-30)) {
      why = fmt::format(
          "ties with #{} on step time; ranked first for moving fewer bytes or "
          "holding less memory",
          i + 2);
    } else {
      why = fmt::format("beats #{} by {} a step: {} less {}", i + 2, human_seconds(total),
                        human_seconds(diff[gain]), names[gain]);
      if (diff[cost] < 0) {
        why += fmt::format(", for {} more {}", human_seconds(-diff[cost]), names[cost]);
      }
      const Layout& la = ranked[i].layout;
      const Layout& lb = ranked[i + 1].layout;
      std::string what;
      if (la.tp != lb.tp || la.pp != lb.pp) {
        what = fmt::format("TP {} x PP {} instead of TP {} x PP {}", la.tp, la.pp, lb.tp, lb.pp);
      } else {
        what = fmt::format("DP {} instead of {}", la.dp, lb.dp);
      }
      if (la.schedule != lb.schedule || la.v != lb.v) {
        what += fmt::format(
            ", {}{} instead of {}{}", to_string(la.schedule),
            la.schedule == Schedule::interleaved ? fmt::format(" v={}", la.v) : std::string(),
            to_string(lb.schedule),
            lb.schedule == Schedule::interleaved ? fmt::format(" v={}", lb.v) : std::string());
      }
      if (la.recompute != lb.recompute) {
        what += fmt::format(", recompute {} instead of {}", recompute_name(la.recompute),
                            recompute_name(lb.recompute));
      }
      if (la.zero != lb.zero) what += fmt::format(", ZeRO-{} instead of {}", la.zero, lb.zero);
      why += " (" + what + ")";
    }
    out.push_back(why);
  }
  return out;
}

std::vector<std::string> explain_step(const ModelSpec&, const ClusterSpec& c, const TrainingSpec& t,
                                      const LayoutEstimate& e) {
  std::vector<std::string> x;
  const Layout& l = e.layout;
  const double step = e.step_seconds;
  auto pct = [&](double s) { return step > 0 ? 100.0 * s / step : 0.0; };
  const double tokens = double(t.global_batch_tokens) / double(c.gpus);
  x.push_back(fmt::format(
      "1. data       {:>10} ({:4.1f}%)  the loader must deliver {:.3g} tokens per device per "
      "step; the planner assumes it keeps up (000: audit it first, by profiling a step)",
      human_seconds(e.time.data), pct(e.time.data), tokens));
  x.push_back(fmt::format("2. comm       {:>10} ({:4.1f}%)  exposed; by dimension:",
                          human_seconds(e.time.comm), pct(e.time.comm)));
  for (const auto& d : e.comm) {
    const double exposed = d.dim == "pp" ? e.pp_exposed_seconds : d.exposed();
    x.push_back(fmt::format(
        "   {:<3} group {} ({} per node over {} node(s){}), {} {} x {} calls = {} on the link, "
        "{} exposed{}",
        d.dim, d.group, d.placement.per_node, d.placement.nodes,
        c.nodes_per_pod > 0 && d.placement.span > c.nodes_per_pod
            ? fmt::format(", crossing the {}:1 tier", c.oversubscription)
            : std::string(),
        d.algorithm, human_bytes(d.calls ? d.bytes / double(d.calls) : 0.0), d.calls,
        human_seconds(d.seconds), human_seconds(exposed),
        d.dim == "dp"   ? fmt::format(" ({:.0f}% behind compute)", 100 * d.overlap)
        : d.dim == "pp" ? std::string(" (on the pipeline's critical path)")
                        : std::string(" (critical path)")));
  }
  x.push_back(fmt::format(
      "3. bubble     {:>10} ({:4.1f}%)  {}{}", human_seconds(e.time.bubble), pct(e.time.bubble),
      l.pp > 1 ? fmt::format("{} p={} m={}{}: {:.1f}% of the pipeline idle, simulated (closed "
                             "form {:.1f}%)",
                             to_string(l.schedule), l.pp, l.microbatches,
                             l.schedule == Schedule::interleaved ? fmt::format(" v={}", l.v)
                                                                 : std::string(),
                             100 * e.bubble, 100 * e.bubble_formula)
               : std::string("no pipeline"),
      l.split.empty() ? std::string()
                      : fmt::format(", stages of {} layers", fmt::join(l.split, ","))));
  const KernelTime& k = e.microbatch;
  const double mb = double(l.microbatches);
  x.push_back(fmt::format(
      "4. kernels    {:>10} ({:4.1f}%)  products {} (at {:.0f}% of peak) + attention {} (the "
      "causal half at {:.0f}%) + recompute {} + memory-bound {} + update {}; model FLOPs at peak "
      "would take {}",
      human_seconds(e.time.kernels), pct(e.time.kernels), human_seconds(mb * k.gemm),
      100 * k.gemm_efficiency, human_seconds(mb * k.attention), 100 * c.attention_efficiency,
      human_seconds(mb * k.recompute), human_seconds(mb * k.memory_bound),
      human_seconds(e.optimizer_seconds), human_seconds(mb * k.ideal)));
  x.push_back(fmt::format(
      "5. stragglers {:>10} ({:4.1f}%)  the slowest of {} devices at {:.1f}% spread each: "
      "+{:.1f}% (000 ストラグラー)",
      human_seconds(e.time.stragglers), pct(e.time.stragglers), c.gpus, 100 * c.jitter,
      100 * straggler_fraction(c.gpus, c.jitter)));
  x.push_back(
      fmt::format("   step       {:>10}  MFU {:.1f}% (model FLOPs), {:.1f}% with recomputation",
                  human_seconds(step), 100 * e.mfu, 100 * e.hfu));
  return x;
}

}  // namespace tetra::plan
