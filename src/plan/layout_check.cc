// A layout's validity for a model, cluster and run (plan/layout_search.h: resolve_split,
// layout_problem, validate_layout): what each dimension must divide, what fits a node, and the
// pipeline's split of the layers.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "pipeline/schedule.h"
#include "plan/layout_search.h"

namespace tetra::plan {

std::string resolve_split(const ModelSpec& m, const std::string& spec, Layout& l) {
  const int64_t v = chunks_per_rank(l);
  l.split.clear();
  if (spec.empty() && m.n_layer % (l.pp * v) == 0) return "";
  const ParamCounts pc = count_params(m);
  // A layer's mean parameters (MoE blocks with all their experts).
  const double layer = double(pc.blocks()) / double(m.n_layer);
  const double embedding = double(pc.embedding) / layer;
  const double head = double(pc.head > 0 ? pc.head : m.vocab_size * m.d_model) / layer;
  try {
    l.split =
        pipeline::parse_split(spec, int(m.n_layer), int(l.pp * v), embedding, head, "pp.layers");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string layout_problem(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t,
                           const Layout& l) {
  const int64_t gpn = c.gpus_per_node;
  if (l.tp < 1 || l.pp < 1 || l.dp < 1 || l.ep < 1 || l.cp < 1 || l.micro_batch < 1 ||
      l.microbatches < 1) {
    return fmt::format(
        "[plan] layout sizes must be >= 1 (tp={}, cp={}, pp={}, dp={}, ep={}, micro_batch={}, "
        "m={})",
        l.tp, l.cp, l.pp, l.dp, l.ep, l.micro_batch, l.microbatches);
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
  if (l.cp > 1) {
    if (l.tp * l.cp * l.pp * l.dp != c.gpus) {
      return fmt::format(
          "[plan] tp*cp*pp*dp = {}*{}*{}*{} = {} but cluster.gpus = {}; {}", l.tp, l.cp, l.pp, l.dp,
          l.tp * l.cp * l.pp * l.dp, c.gpus,
          c.gpus % (l.tp * l.cp * l.pp) == 0
              ? fmt::format("set dp = gpus/(tp*cp*pp) = {}", c.gpus / (l.tp * l.cp * l.pp))
              : std::string("choose tp, cp and pp whose product divides the GPU count"));
    }
    if (m.seq % (2 * l.cp) != 0) {
      return fmt::format(
          "[plan] seq={} is not divisible by 2*cp = {}: each rank holds two chunks of T/(2cp) "
          "tokens; use a seq that is a multiple of 2*cp, e.g. {}",
          m.seq, 2 * l.cp, std::max<int64_t>(1, m.seq / (2 * l.cp)) * 2 * l.cp);
    }
    if (m.has_moe()) {
      return fmt::format(
          "[plan] cp={} with model '{}' ({} experts): context parallelism is planned for dense "
          "models only; use cp=1 for a MoE model",
          l.cp, m.name, m.moe.experts);
    }
  } else if (l.tp * l.pp * l.dp != c.gpus) {
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
  if (m.n_head % l.tp != 0) {
    return fmt::format("[plan] heads={} is not divisible by tp={}; use a tp that divides heads",
                       m.n_head, l.tp);
  }
  if (m.n_kv_head % l.tp != 0 && l.tp % m.n_kv_head != 0) {
    return fmt::format(
        "[plan] kv_heads={} and tp={}: one must divide the other so KV heads shard or replicate "
        "evenly; choose another tp",
        m.n_kv_head, l.tp);
  }
  if (m.ffn % l.tp != 0) {
    return fmt::format("[plan] ffn={} is not divisible by tp={}; use a tp that divides ffn", m.ffn,
                       l.tp);
  }
  if (l.cp > 1 && l.cp_attention == CpAttention::ulysses) {
    // Ulysses gives each rank of an all-to-all group whole heads of its tp rank's
    // (parallel/context_parallel.h); the groups split cp.
    const int64_t u = ulysses_group(l);
    if (l.cp % u != 0) {
      return fmt::format(
          "[plan] cp.ulysses={} does not divide cp={}: the all-to-all groups split the cp ranks; "
          "use a divisor of {}",
          u, l.cp, l.cp);
    }
    const int64_t heads = m.n_head / l.tp, kv = std::max<int64_t>(1, m.n_kv_head / l.tp);
    if (heads % u != 0 || (kv % u != 0 && u % kv != 0)) {
      return fmt::format(
          "[plan] ulysses attention over {} ranks: the {} query and {} key/value heads of a tp "
          "rank do not split {} ways (the group must divide the query heads, and divide the "
          "key/value heads or be a multiple of them); use the ring, or a cp (or cp.ulysses) that "
          "splits them",
          u, heads, kv, u);
    }
  }
  const int64_t v = chunks_per_rank(l);
  if (l.split.empty() && m.n_layer % (l.pp * v) != 0) {
    return fmt::format(
        "[plan] layers={} is not divisible by pp={}{}; use pp (x v) dividing {}, or uneven "
        "stages with pp.layers=auto or explicit counts",
        m.n_layer, l.pp, v > 1 ? fmt::format(" x v={}", v) : std::string(), m.n_layer);
  }
  if (!l.split.empty()) {
    int64_t sum = 0;
    for (int n : l.split) sum += n;
    if (int64_t(l.split.size()) != l.pp * v || sum != m.n_layer) {
      return fmt::format(
          "[plan] the stage split holds {} layers on {} stages, the layout has {} "
          "layers on pp x v = {}",
          sum, l.split.size(), m.n_layer, l.pp * v);
    }
  }
  if (!m.has_moe() && l.ep != 1) {
    return fmt::format(
        "[plan] ep={} but model '{}' is dense (model.moe_experts=0); set parallel.ep=1", l.ep,
        m.name);
  }
  if (m.moe.experts % l.ep != 0) {
    return fmt::format("[plan] ep={} does not divide experts={}; use a divisor of {}", l.ep,
                       m.moe.experts, m.moe.experts);
  }
  if (l.dp % l.ep != 0) {
    return fmt::format(
        "[plan] ep={} does not divide dp={}; expert-parallel groups are carved out of the "
        "data-parallel ranks, use ep dividing dp",
        l.ep, l.dp);
  }
  if (l.zero < 0 || l.zero > 3) {
    return fmt::format("[plan] zero.stage={} is not a ZeRO stage; use 0 (plain DP), 1, 2 or 3",
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

}  // namespace tetra::plan
