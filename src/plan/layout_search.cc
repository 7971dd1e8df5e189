#include "plan/layout_search.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
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

std::string resolve_split(const ModelSpec& m, const std::string& spec, Layout& l) {
  const int64_t v = l.schedule == Schedule::interleaved ? l.v : 1;
  l.split.clear();
  if (spec.empty() && m.layers % (l.pp * v) == 0) return "";
  const ParamCounts pc = count_params(m);
  const double layer = double(pc.attention + pc.norms + pc.router + pc.experts * pc.expert_mlp);
  const double embedding = double(pc.embedding) / layer;
  const double head = double(pc.head > 0 ? pc.head : m.vocab * m.d_model) / layer;
  try {
    l.split = pipeline::parse_split(spec, int(m.layers), int(l.pp * v), embedding, head,
                                    "layout.pp_layers");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string layout_problem(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t,
                           const Layout& l) {
  const int64_t gpn = c.gpus_per_node;
  if (l.tp < 1 || l.pp < 1 || l.dp < 1 || l.ep < 1 || l.micro_batch < 1 || l.microbatches < 1) {
    return fmt::format(
        "[plan] layout sizes must be >= 1 (tp={}, pp={}, dp={}, ep={}, micro_batch={}, m={})", l.tp,
        l.pp, l.dp, l.ep, l.micro_batch, l.microbatches);
  }
  if (l.tp > gpn) {
    return fmt::format(
        "[plan] tp={} exceeds gpus_per_node={}; TP must stay inside a node, use tp<={}", l.tp, gpn,
        gpn);
  }
  if (gpn % l.tp != 0) {
    return fmt::format(
        "[plan] tp={} does not divide gpus_per_node={}, so TP groups would straddle nodes; use a "
        "divisor of {}",
        l.tp, gpn, gpn);
  }
  if (l.tp * l.pp * l.dp != c.gpus) {
    const int64_t mp = l.tp * l.pp;
    return c.gpus % mp == 0
               ? fmt::format(
                     "[plan] tp*pp*dp = {}*{}*{} = {} but cluster.gpus = {}; set dp = "
                     "gpus/(tp*pp) = {}",
                     l.tp, l.pp, l.dp, mp * l.dp, c.gpus, c.gpus / mp)
               : fmt::format(
                     "[plan] tp*pp = {} does not divide cluster.gpus = {}; choose tp and "
                     "pp whose product divides the GPU count",
                     mp, c.gpus);
  }
  if (m.heads % l.tp != 0) {
    return fmt::format("[plan] heads={} is not divisible by tp={}; use a tp that divides heads",
                       m.heads, l.tp);
  }
  if (m.kv_heads % l.tp != 0 && l.tp % m.kv_heads != 0) {
    return fmt::format(
        "[plan] kv_heads={} and tp={}: one must divide the other so KV heads shard or replicate "
        "evenly; choose another tp",
        m.kv_heads, l.tp);
  }
  if (m.ffn % l.tp != 0) {
    return fmt::format("[plan] ffn={} is not divisible by tp={}; use a tp that divides ffn", m.ffn,
                       l.tp);
  }
  const int64_t v = l.schedule == Schedule::interleaved ? l.v : 1;
  if (l.split.empty() && m.layers % (l.pp * v) != 0) {
    return fmt::format(
        "[plan] layers={} is not divisible by pp={}{}; use pp (x v) dividing {}, or uneven "
        "stages with layout.pp_layers=auto or explicit counts",
        m.layers, l.pp, v > 1 ? fmt::format(" x v={}", v) : std::string(), m.layers);
  }
  if (!l.split.empty()) {
    int64_t sum = 0;
    for (int n : l.split) sum += n;
    if (int64_t(l.split.size()) != l.pp * v || sum != m.layers) {
      return fmt::format(
          "[plan] the stage split holds {} layers on {} stages, the layout has {} "
          "layers on pp x v = {}",
          sum, l.split.size(), m.layers, l.pp * v);
    }
  }
  if (m.experts == 1 && l.ep != 1) {
    return fmt::format("[plan] ep={} but model '{}' is dense (experts=1); set layout.ep=1", l.ep,
                       m.name);
  }
  if (m.experts % l.ep != 0) {
    return fmt::format("[plan] ep={} does not divide experts={}; use a divisor of {}", l.ep,
                       m.experts, m.experts);
  }
  if (l.dp % l.ep != 0) {
    return fmt::format(
        "[plan] ep={} does not divide dp={}; expert-parallel groups are carved out of the "
        "data-parallel ranks, use ep dividing dp",
        l.ep, l.dp);
  }
  if (l.zero < 0 || l.zero > 3) {
    return fmt::format("[plan] layout.zero={} is not a ZeRO stage; use 0 (plain DP), 1, 2 or 3",
                       l.zero);
  }
  if (l.pp > 1 || l.schedule == Schedule::interleaved) {
    // The pipeline layer refuses what it cannot schedule, with the reason.
    try {
      pipeline::make_schedule(l.schedule, int(l.pp), int(l.microbatches), int(l.v));
    } catch (const Error& e) {
      return e.what();
    }
  }
  if (t.global_batch_tokens % m.seq != 0) {
    return fmt::format("[plan] training.global_batch={} is not a multiple of seq={}",
                       t.global_batch_tokens, m.seq);
  }
  const int64_t seqs = t.global_batch_tokens / m.seq;
  if (seqs % (l.dp * l.micro_batch) != 0 || seqs / (l.dp * l.micro_batch) != l.microbatches) {
    return fmt::format(
        "[plan] the global batch of {} sequences does not split into dp={} x micro_batch={} x "
        "m={}; choose them so their product is {}",
        seqs, l.dp, l.micro_batch, l.microbatches, seqs);
  }
  return "";
}

void validate_layout(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t,
                     const Layout& l) {
  const std::string problem = layout_problem(m, c, t, l);
  if (!problem.empty()) throw Error(problem);
}

static pipeline::Timeline simulate_pipeline(const ModelSpec& m, const TrainingSpec& t,
                                            const Layout& l, double slot) {
  // Each virtual stage costs its share of the layers of a slot, a third forward (two thirds
  // backward and any recomputation).
  const int64_t v = l.schedule == Schedule::interleaved ? l.v : 1;
  const int stages = int(l.pp * v);
  const FlopsPerToken f = flops_per_token(m, t.recompute);
  const double fwd = f.model() / 3.0 / f.hardware();
  pipeline::Costs costs;
  for (int k = 0; k < stages; ++k) {
    const double layers = l.split.empty() ? double(m.layers) / stages : double(l.split[size_t(k)]);
    const double stage = slot * double(l.pp) * layers / double(m.layers);
    costs.forward.push_back(fwd * stage);
    costs.backward.push_back((1.0 - fwd) * stage);
  }
  return pipeline::simulate(
      pipeline::make_schedule(l.schedule, int(l.pp), int(l.microbatches), int(v)), costs);
}

pipeline::Timeline simulate_pipeline(const ModelSpec& m, const TrainingSpec& t,
                                     const LayoutEstimate& e) {
  double critical = 0;
  for (const auto& d : e.comm) {
    if (d.dim == "tp" || d.dim == "ep") critical += d.seconds;
  }
  return simulate_pipeline(m, t, e.layout,
                           e.microbatch_seconds + critical / double(e.layout.microbatches));
}

LayoutEstimate evaluate_layout(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t,
                               const Layout& l) {
  LayoutEstimate e;
  e.layout = l;
  e.memory = memory_per_device(m, t, l);
  e.usable_bytes = c.memory_bytes * c.usable_fraction;
  e.fits = e.memory.total() <= e.usable_bytes;

  const FlopsPerToken f = flops_per_token(m, t.recompute);
  const double tokens = double(l.micro_batch * m.seq);
  e.microbatch_seconds =
      f.hardware() * tokens / double(l.tp * l.pp) / (c.peak_flops * t.kernel_efficiency);
  e.comm = comm_per_step(m, c, t, l, e.microbatch_seconds);

  double critical = 0, pp_s = 0, dp_exposed = 0;
  for (const auto& d : e.comm) {
    if (d.dim == "tp" || d.dim == "ep") critical += d.seconds;
    if (d.dim == "pp") pp_s += d.seconds;
    if (d.dim == "dp") dp_exposed += d.exposed();
  }
  const double mb = double(l.microbatches);
  // TP and EP collectives stretch every pipeline slot, so the bubble scales them too.
  const double slot = e.microbatch_seconds + critical / mb;
  e.compute_seconds = mb * e.microbatch_seconds;
  double pipeline_seconds = slot * mb;
  if (l.pp > 1) {
    const pipeline::Timeline tl = simulate_pipeline(m, t, l, slot);
    pipeline_seconds = tl.flush;
    e.bubble = tl.bubble();
    e.bubble_formula = bubble_fraction(l.schedule, l.pp, l.microbatches, l.v);
  }
  e.bubble_seconds = pipeline_seconds - slot * mb;
  e.exposed_comm_seconds = critical + pp_s + dp_exposed;
  e.step_seconds = pipeline_seconds + pp_s + dp_exposed;
  e.mfu =
      f.model() * double(t.global_batch_tokens) / (double(c.gpus) * c.peak_flops * e.step_seconds);
  return e;
}

Layout layout_from_constraints(const ModelSpec& m, const TrainingSpec& t,
                               const LayoutConstraints& k) {
  const int64_t seqs = sequences_per_step(m, t);
  Layout l;
  l.tp = k.tp;
  l.pp = k.pp;
  l.dp = k.dp;
  l.ep = k.ep ? k.ep : 1;
  l.zero = k.zero;
  l.schedule = k.schedule.value_or(Schedule::one_f_one_b);
  l.v = l.schedule == Schedule::interleaved ? (k.v ? k.v : 2) : 1;
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
  for (int64_t tp : divisors(c.gpus_per_node)) {
    if ((k.tp && tp != k.tp) || c.gpus % tp != 0) continue;
    // Uneven stages (layout.pp_layers=auto) make every pp up to the layer count possible.
    for (int64_t pp : k.pp_layers == "auto" ? divisors(c.gpus) : divisors(m.layers)) {
      if (pp > m.layers) continue;
      if ((k.pp && pp != k.pp) || c.gpus % (tp * pp) != 0) continue;
      const int64_t dp = c.gpus / (tp * pp);
      if ((k.dp && dp != k.dp) || seqs % dp != 0) continue;
      const int64_t per_replica = seqs / dp;
      std::vector<int64_t> eps;
      for (int64_t ep : divisors(m.experts)) {
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
        schedules.push_back(
            {*k.schedule, *k.schedule == Schedule::interleaved ? (k.v ? k.v : 2) : 1});
      } else {
        schedules.push_back({Schedule::one_f_one_b, 1});
        if (pp > 1) schedules.push_back({Schedule::interleaved, k.v ? k.v : 2});
      }
      for (int64_t ep : eps) {
        for (int64_t mbs : mbss) {
          for (auto [sched, v] : schedules) {
            for (int zero = 0; zero <= 3; ++zero) {
              if (k.zero >= 0 && zero != k.zero) continue;
              Layout l{tp, pp, dp, ep, zero, sched, v, mbs, per_replica / mbs, {}};
              if (!resolve_split(m, k.pp_layers, l).empty()) continue;
              if (!layout_problem(m, c, t, l).empty()) continue;
              ++r.considered;
              LayoutEstimate e = evaluate_layout(m, c, t, l);
              if (!e.fits) {
                ++r.too_big;
                if (!r.closest || e.memory.total() < r.closest->memory.total()) r.closest = e;
                continue;
              }
              all.push_back(std::move(e));
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
  const MemoryBreakdown plain = memory_per_device(
      m, t,
      Layout{l.tp, l.pp, l.dp, l.ep, 0, l.schedule, l.v, l.micro_batch, l.microbatches, l.split});
  x.push_back(fmt::format(
      "DP {} outermost{}: state {} per device{} (000 ZeRO: shard state before splitting "
      "compute further)",
      l.dp, l.zero ? fmt::format(" with ZeRO-{}", l.zero) : std::string(),
      human_bytes(e.memory.params + e.memory.grads + e.memory.optimizer),
      l.zero ? fmt::format(" instead of {} unsharded",
                           human_bytes(plain.params + plain.grads + plain.optimizer))
             : std::string()));
  x.push_back(fmt::format(
      "step {} = compute {} + bubble {} + exposed communication {}; estimated MFU {:.0f}%",
      human_seconds(e.step_seconds), human_seconds(e.compute_seconds),
      human_seconds(e.bubble_seconds),
      human_seconds(e.step_seconds - e.compute_seconds - e.bubble_seconds), e.mfu * 100));
  return x;
}

}  // namespace tetra::plan
