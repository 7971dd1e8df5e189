#include "plan/report.h"

#include <fmt/format.h>

#include "core/error.h"
#include "plan/bubble.h"
#include "plan/checkpoint_math.h"
#include "plan/tetra_run.h"
#include "plan/units.h"
#include "plan/validation.h"

namespace tetra::plan {

namespace {

using nlohmann::json;

json memory_json(const MemoryBreakdown& m, double usable) {
  return {{"params", m.params},
          {"grads", m.grads},
          {"optimizer", m.optimizer},
          {"activations", m.activations},
          {"comm_buffers", m.comm_buffers},
          {"total", m.total()},
          {"usable", usable},
          {"fits", m.total() <= usable}};
}

json step_json(const StepTime& s) {
  return {{"data", s.data},
          {"comm", s.comm},
          {"bubble", s.bubble},
          {"kernels", s.kernels},
          {"stragglers", s.stragglers},
          {"total", s.total()}};
}

// The three terms that dominate the step (step_terms), with their share of it.
json dominant_json(const LayoutEstimate& e) {
  json out = json::array();
  const std::vector<StepTerm> terms = step_terms(e);
  for (size_t i = 0; i < terms.size() && i < 3; ++i) {
    out.push_back({{"term", terms[i].name},
                   {"seconds", terms[i].seconds},
                   {"share", e.step_seconds > 0 ? terms[i].seconds / e.step_seconds : 0.0}});
  }
  return out;
}

json layout_json(const LayoutEstimate& e) {
  const Layout& l = e.layout;
  return {{"tp", l.tp},
          {"pp", l.pp},
          {"dp", l.dp},
          {"ep", l.ep},
          {"cp", l.cp},
          {"cp_attention", cp_attention_name(l.cp_attention)},
          {"cp_ulysses", l.cp_attention == CpAttention::ulysses ? ulysses_group(l) : 0},
          {"zero", l.zero},
          {"schedule", to_string(l.schedule)},
          {"v", l.v},
          {"micro_batch", l.micro_batch},
          {"microbatches", l.microbatches},
          {"memory_per_device", e.memory.total()},
          {"fits", e.fits},
          {"bubble", e.bubble},
          {"compute_seconds", e.compute_seconds},
          {"bubble_seconds", e.bubble_seconds},
          {"exposed_comm_seconds", e.exposed_comm_seconds},
          {"step_seconds", e.step_seconds},
          {"mfu", e.mfu},
          {"hfu", e.hfu},
          {"recompute", recompute_name(l.recompute)},
          {"split", l.split},
          {"memory_rank", e.memory.rank},
          {"time", step_json(e.time)},
          {"dominant", dominant_json(e)},
          {"describe", describe(l)}};
}

}  // namespace

namespace {

// How attention may cross the cp ranks of a given layout: what cp.attention and cp.ulysses fix,
// or with cp.attention unset the ring, Ulysses over all cp ranks, and Ulysses over every smaller
// group size (a divisor of cp) with a ring across the groups.
struct CpChoice {
  CpAttention attention = CpAttention::ring;
  int64_t ulysses = 0;
};
std::vector<CpChoice> cp_choices(int64_t cp, std::optional<CpAttention> attention = {},
                                 std::optional<int64_t> ulysses = {}) {
  if (attention) return {{*attention, ulysses.value_or(0)}};
  std::vector<CpChoice> out = {{CpAttention::ring, 0}};
  if (cp <= 1) return out;
  out.push_back({CpAttention::ulysses, 0});
  for (int64_t u = 2; u < cp; ++u) {
    if (cp % u == 0) out.push_back({CpAttention::ulysses, u});
  }
  return out;
}

}  // namespace

ChosenLayout choose_layout(const PlanInputs& in) {
  const ModelSpec& m = in.model;
  const ClusterSpec& c = in.cluster;
  const TrainingSpec& t = in.training;
  ChosenLayout out;
  // The layout: given in full, or the best of the (constrained) search.
  // A fully given layout is refused before the search it is compared against, if it must be.
  if (in.layout.complete()) {
    LayoutConstraints k = in.layout;
    k.recompute = k.recompute.value_or(Recompute::none);
    k.cp_attention = k.cp_attention.value_or(CpAttention::ring);
    validate_layout(m, c, t, layout_from_constraints(m, t, k));
  }
  out.search = search_layouts(m, c, t, in.layout.complete() ? LayoutConstraints{} : in.layout);
  if (in.layout.complete()) {
    // A given layout without training.recompute takes the fastest mode that fits (else the one
    // needing the least memory); with cp > 1 and no cp.attention, the ring, Ulysses or the hybrid
    // (where the heads split over the group) alike.
    std::vector<Recompute> modes = {Recompute::none, Recompute::selective, Recompute::full};
    if (in.layout.recompute) modes = {*in.layout.recompute};
    const std::vector<CpChoice> attentions =
        cp_choices(in.layout.cp, in.layout.cp_attention, in.layout.cp_ulysses);
    bool have = false;
    for (Recompute r : modes) {
      for (const CpChoice& a : attentions) {
        LayoutConstraints k = in.layout;
        k.recompute = r;
        k.cp_attention = a.attention;
        k.cp_ulysses = a.ulysses;
        const Layout l = layout_from_constraints(m, t, k);
        if (!in.layout.cp_attention && a.attention == CpAttention::ulysses &&
            !layout_problem(m, c, t, l).empty()) {
          continue;
        }
        validate_layout(m, c, t, l);
        LayoutEstimate e = evaluate_layout(m, c, t, l);
        const bool better =
            !have || (e.fits && !out.chosen.fits) ||
            (e.fits == out.chosen.fits && (e.fits ? e.step_seconds < out.chosen.step_seconds
                                                  : e.memory.total() < out.chosen.memory.total()));
        if (better) out.chosen = std::move(e);
        have = true;
      }
    }
    out.source = "given";
  } else if (!out.search.ranked.empty()) {
    out.chosen = out.search.ranked.front();
    out.source = "search";
  } else if (out.search.closest) {
    out.chosen = *out.search.closest;
    out.source = "search (nothing fits; smallest shown)";
  } else {
    fail(
        "[plan] no layout of {} GPUs ({} per node) divides model '{}' (layers={}, heads={}) and "
        "the global batch of {} sequences; change cluster.gpus, training.global_batch or the "
        "[layout] constraints",
        c.gpus, c.gpus_per_node, m.name, m.n_layer, m.n_head, t.global_batch_tokens / m.seq);
  }
  return out;
}

json plan_report(const PlanInputs& in, int top) {
  const ModelSpec& m = in.model;
  const ClusterSpec& c = in.cluster;
  const TrainingSpec& t = in.training;
  const ParamCounts pc = count_params(m);
  const double P = double(pc.total());

  const ChosenLayout choice = choose_layout(in);
  const SearchResult& search = choice.search;
  const LayoutEstimate& chosen = choice.chosen;
  const std::string& source = choice.source;
  const Layout& l = chosen.layout;

  json r;
  // The model's keys by their config names (core/model_shape.h).
  r["model"] = {{"name", m.name},
                {"arch", m.llama() ? "llama" : "gpt2"},
                {"n_layer", m.n_layer},
                {"d_model", m.d_model},
                {"n_head", m.n_head},
                {"n_kv_head", m.n_kv_head},
                {"ffn", m.ffn},
                {"vocab_size", m.vocab_size},
                {"seq_len", m.seq},
                {"moe_experts", m.moe.experts},
                {"moe_top_k", m.has_moe() ? m.moe.top_k : 0},
                {"params", pc.total()},
                {"active_params", pc.active()},
                {"moe_layers", pc.moe_layers}};
  r["cluster"] = {{"name", c.name},
                  {"gpus", c.gpus},
                  {"gpus_per_node", c.gpus_per_node},
                  {"nodes", (c.gpus + c.gpus_per_node - 1) / c.gpus_per_node},
                  {"peak_tflops", c.peak_flops / 1e12},
                  {"memory_gb", c.memory_bytes / 1e9},
                  {"intra_bw_gbs", c.intra_bw / 1e9},
                  {"inter_bw_gbs", c.inter_bw / 1e9},
                  {"storage_bw_gbs", c.storage_bw / 1e9},
                  {"usable_fraction", c.usable_fraction},
                  {"calibration",
                   {{"gemm_efficiency", c.gemm_efficiency},
                    {"gemm_half_dim", c.gemm_half_dim},
                    {"attention_efficiency", c.attention_efficiency},
                    {"mem_bw_gbs", c.mem_bw / 1e9},
                    {"link_efficiency", c.link_efficiency},
                    {"half_bw_kb", c.half_bw_bytes / 1e3},
                    {"comm_overlap", c.comm_overlap},
                    {"nodes_per_pod", c.nodes_per_pod},
                    {"oversubscription", c.oversubscription},
                    {"jitter", c.jitter}}}};
  const double steps = t.tokens / double(t.global_batch_tokens);
  r["training"] = {
      {"tokens", t.tokens},
      {"global_batch", t.global_batch_tokens},
      {"steps", steps},
      {"precision", to_string(t.precision)},
      {"recompute", in.layout.recompute ? recompute_name(*in.layout.recompute) : "search"},
      {"attention", to_string(t.attention)},
      {"target_mfu", t.target_mfu}};

  // 1. Memory.
  const StateBytes sb = state_bytes_per_param(t.precision);
  json stages = json::array();
  for (int z = 0; z <= 3; ++z) {
    Layout lz = l;
    lz.zero = z;
    json s = memory_json(memory_per_device(m, t, lz), chosen.usable_bytes);
    s["stage"] = z;
    stages.push_back(s);
  }
  r["memory"] = {{"state_bytes_per_param",
                  {{"weights", sb.weights},
                   {"grads", sb.grads},
                   {"master", sb.master},
                   {"adam_m", sb.adam_m},
                   {"adam_v", sb.adam_v},
                   {"total", sb.total()}}},
                 {"unsharded_state", P * sb.total()},
                 {"min_devices_for_state", min_devices_for_state(P, c.memory_bytes, t.precision)},
                 {"layout", memory_json(chosen.memory, chosen.usable_bytes)},
                 {"zero_stages", stages}};

  // What `tetra train` allocates for this layout, by its own memory categories (plan/tetra_run):
  // for a tetra train config's run always (the numbers its trainer prints), else for a layout
  // tetra can run and run_memory models (GPT-2, or Llama with whole key/value heads and MLP
  // channels on every tensor-parallel rank; dense, one pipeline stage).
  const bool tetra_arch = !m.llama() || (m.n_kv_head % l.tp == 0 && m.ffn % l.tp == 0 &&
                                         (m.d_model / m.n_head) % 2 == 0);
  const bool tetra_layout =
      tetra_arch && !m.has_moe() && m.n_head % l.tp == 0 && l.pp == 1 && l.ep == 1;
  if (in.tetra_run || tetra_layout) {
    const RunPrediction run = predict_run(m, t, l, in.tetra_run.value_or(RunOptions{}));
    const RunMemory& x = run.memory;
    r["memory"]["tetra_run"] = {{"params", x.params},       {"grads", x.grads},
                                {"optimizer", x.optimizer}, {"activations", x.activations},
                                {"comm", x.comm},           {"temporaries", x.temporaries},
                                {"total", x.total()}};
    if (in.tetra_run) {
      // The trainer's header line, from the same values (train/run_plan.h).
      // Its step as the trainer's end-of-run plan-vs-measured line predicts it: the run's own
      // traffic per group (plan/tetra_run.h) on this cluster.
      const std::vector<GroupTraffic> traffic =
          run_traffic(run_shape(m, t, l, *in.tetra_run), l, t.bucket_bytes);
      const LayoutEstimate step = evaluate_layout(m, c, t, l, [&](double microbatch_seconds) {
        return run_comm(traffic, l, c, microbatch_seconds);
      });
      json bytes = json::object();
      for (const GroupTraffic& g : traffic) bytes[g.dim] = g.bytes();
      r["run"] = {{"ranks", c.gpus},
                  {"params", run.params},
                  {"flops_per_token", run.flops_per_token},
                  {"memory_per_rank", x.total()},
                  {"step_seconds", step.step_seconds},
                  {"bytes_per_step", bytes},
                  {"bubble", step.bubble},
                  {"summary", run_summary(run)}};
      if (m.has_moe()) {
        // The experts this rank holds and what they cost it: their state, the all-to-all rows per
        // step (and the part that leaves the rank), and that exchange's time on this cluster.
        const RunMemory& e = run.experts;
        double a2a = 0, sent = 0, seconds = 0;
        for (const GroupTraffic& g : traffic) {
          if (g.dim == "ep") a2a = g.buffer_bytes(), sent = g.bytes();
        }
        for (const DimComm& d : step.comm) {
          if (d.dim == "ep") seconds = d.seconds;
        }
        const RunShape shape = run_shape(m, t, l, *in.tetra_run);
        r["run"]["moe"] = {{"experts", m.moe.experts},
                           {"experts_per_rank", m.moe.experts / l.ep},
                           {"moe_blocks_per_rank", shape.local_moe_layers()},
                           {"top_k", m.moe.top_k},
                           {"expert_memory_per_rank", e.total()},
                           {"expert_memory",
                            {{"params", e.params},
                             {"grads", e.grads},
                             {"optimizer", e.optimizer},
                             {"comm", e.comm}}},
                           {"a2a_bytes_per_step", a2a},
                           {"ep_sent_bytes_per_step", sent},
                           {"ep_seconds", seconds}};
      }
      if (l.pp > 1) {
        r["run"]["note"] =
            "memory is pipeline rank 0's: the first stage, with the micro-batches its program "
            "keeps in flight";
      }
    }
  }

  // 2. Compute.
  const FlopsPerToken f = flops_per_token(m, l.recompute);
  const ComputeLedger cl = compute_ledger(m, t.tokens, c.gpus, c.peak_flops, t.target_mfu);
  r["compute"] = {
      {"convention",
       "model FLOPs = 6*N*T + 12*L*d*seq*T, N the weights in matrix products (active experts, "
       "the head; not embedding lookups, biases or norms) and the attention scores without the "
       "causal half; the MFU numerator of tetra plan and tetra train alike; hardware FLOPs add "
       "recomputation"},
      {"flops_per_token", f.model()},
      {"flops_6pt", cl.flops_6pt},
      {"flops_attention", cl.flops_total - cl.flops_6pt},
      {"flops_total", cl.flops_total},
      {"flops_hardware", f.hardware() * t.tokens},
      {"gpu_seconds", cl.gpu_seconds},
      {"gpu_years", cl.gpu_years},
      {"wall_seconds_at_target_mfu", cl.wall_seconds},
      {"estimated_step_seconds", chosen.step_seconds},
      {"estimated_mfu", chosen.mfu},
      {"estimated_hfu", chosen.hfu},
      {"estimated_wall_seconds", chosen.step_seconds * steps}};

  // 3. Communication.
  json comm = json::array();
  for (const auto& d : chosen.comm) {
    comm.push_back({{"dim", d.dim},
                    {"what", d.what},
                    {"group", d.group},
                    {"link", d.intra_node ? "intra-node" : "inter-node"},
                    {"calls", d.calls},
                    {"bytes", d.bytes},
                    {"seconds", d.seconds},
                    {"overlap", d.overlap},
                    {"exposed_seconds", d.exposed()}});
  }
  r["communication"] = comm;
  if (l.cp > 1) {
    // The ring against Ulysses over every group size on this cluster's links, the chosen layout
    // otherwise unchanged.
    json candidates = json::array();
    for (const CpChoice& a : cp_choices(l.cp)) {
      Layout la = l;
      la.cp_attention = a.attention;
      la.cp_ulysses = a.ulysses;
      if (!layout_problem(m, c, t, la).empty()) continue;
      const bool same = a.attention == l.cp_attention && (a.attention != CpAttention::ulysses ||
                                                          ulysses_group(la) == ulysses_group(l));
      const LayoutEstimate e = same ? chosen : evaluate_layout(m, c, t, la);
      double bytes = 0, exposed = 0;
      for (const DimComm& d : e.comm) {
        if (d.dim != "cp") continue;
        bytes += d.bytes;
        exposed += d.exposed();
      }
      candidates.push_back(
          {{"attention", cp_attention_label(a.attention, int(la.cp), int(a.ulysses))},
           {"bytes", bytes},
           {"exposed_seconds", exposed},
           {"step_seconds", e.step_seconds}});
    }
    r["cp_attention"] = {
        {"chosen", cp_attention_label(l.cp_attention, int(l.cp), int(l.cp_ulysses))},
        {"given", in.layout.cp_attention.has_value()},
        {"candidates", candidates}};
  }
  if (l.cp > 1 && l.cp_attention == CpAttention::ulysses) {
    // Ulysses' formula for one layer and micro-batch (plan/comm_cost.h, cp_ulysses_traffic).
    const double dtype = t.precision == Precision::Fp32 ? 4.0 : 2.0;
    const UlyssesTraffic u = cp_ulysses_traffic(l.micro_batch, m.seq, l.cp, m.n_head / l.tp,
                                                std::max<int64_t>(1, m.n_kv_head / l.tp),
                                                m.d_model / m.n_head, dtype, l.cp_ulysses);
    r["cp_ulysses"] = {{"cp", l.cp},
                       {"group", u.group},
                       {"qkv_bytes", u.qkv},
                       {"out_bytes", u.out},
                       {"delta_bytes", u.delta},
                       {"ring_hop_bytes", u.ring.hop},
                       {"ring_hops", u.ring.hops},
                       {"forward_bytes", u.forward()},
                       {"backward_bytes", u.backward()},
                       {"layers", max_rank_layers(l, m.n_layer)},
                       {"microbatches", l.microbatches}};
  } else if (l.cp > 1) {
    // Ring attention's formula for one layer and micro-batch (plan/comm_cost.h, cp_ring_traffic).
    const int64_t hs = m.d_model / m.n_head;
    const int64_t kv_width = hs * std::max<int64_t>(1, m.n_kv_head / l.tp);
    const double dtype = t.precision == Precision::Fp32 ? 4.0 : 2.0;
    const RingTraffic ring = cp_ring_traffic(l.micro_batch, m.seq, l.cp, kv_width, dtype);
    r["cp_ring"] = {{"cp", l.cp},
                    {"micro_batch", l.micro_batch},
                    {"seq", m.seq},
                    {"kv_width", kv_width},
                    {"dtype_bytes", dtype},
                    {"hop_bytes", ring.hop},
                    {"forward_bytes", ring.forward},
                    {"backward_bytes", ring.backward},
                    {"layers", max_rank_layers(l, m.n_layer)},
                    {"microbatches", l.microbatches}};
  }

  // 4. Bubble.
  r["bubble"] = {{"schedule", to_string(l.schedule)},
                 {"p", l.pp},
                 {"m", l.microbatches},
                 {"v", l.v},
                 {"split", l.split},
                 {"fraction", chosen.bubble},
                 {"formula", chosen.bubble_formula},
                 {"ratio", l.pp > 1 ? bubble_ratio(l.schedule, l.pp, l.microbatches, l.v) : 0.0},
                 {"seconds", chosen.bubble_seconds},
                 {"schedules", json::array()}};
  if (l.pp > 1) {
    // What each schedule buys on this grid: the same layout under 1F1B and zb_h1 (its stages),
    // and interleaved v=2 (twice the stages, balanced when the layers do not divide), simulated.
    for (auto [s, v] :
         {std::pair{Schedule::one_f_one_b, int64_t(1)},
          std::pair{Schedule::interleaved, int64_t(2)}, std::pair{Schedule::zb_h1, int64_t(1)}}) {
      Layout la = l;
      la.schedule = s;
      la.v = v;
      if (v != l.v) {
        la.split.clear();
        const std::string spec = m.n_layer % (l.pp * v) != 0 ? "auto" : "";
        if (!resolve_split(m, spec, la).empty()) continue;
      }
      if (!layout_problem(m, c, t, la).empty()) continue;
      const LayoutEstimate e = s == l.schedule && v == l.v ? chosen : evaluate_layout(m, c, t, la);
      r["bubble"]["schedules"].push_back(
          {{"schedule", s == Schedule::interleaved ? std::string("interleaved v=2")
                                                   : std::string(to_string(s))},
           {"bubble", e.bubble},
           {"step_seconds", e.step_seconds}});
    }
  }

  // 5. Checkpoint.
  const CheckpointPlan cp =
      checkpoint_plan(P, t.precision, c.storage_bw, c.gpu_mtbf_hours, c.gpus, t.restart_seconds);
  r["checkpoint"] = {{"bytes", cp.bytes},
                     {"bytes_per_param", checkpoint_bytes_per_param(t.precision)},
                     {"write_seconds", cp.write_seconds},
                     {"gpu_mtbf_hours", c.gpu_mtbf_hours},
                     {"cluster_mtbf_hours", cp.mtbf_seconds / 3600},
                     {"interval_seconds", cp.interval_seconds},
                     {"restart_seconds", t.restart_seconds},
                     {"loss_per_failure_seconds", cp.loss_per_failure_s},
                     {"loss_per_failure_gpu_hours", cp.loss_per_failure_gpu_h},
                     {"goodput", cp.goodput}};

  // 6. Layout and search.
  json lj = layout_json(chosen);
  lj["source"] = source;
  lj["explanation"] = explain_layout(m, c, t, chosen);
  lj["warnings"] = layout_warnings(m, c, t, chosen);
  lj["step"] = explain_step(m, c, t, chosen);
  r["layout"] = lj;
  json ranked = json::array();
  const std::vector<std::string> why = rank_reasons(search.ranked);
  for (size_t i = 0; i < search.ranked.size() && int(i) < top; ++i) {
    json e = layout_json(search.ranked[i]);
    e["rank"] = i + 1;
    e["warnings"] = layout_warnings(m, c, t, search.ranked[i]);
    if (i < why.size()) e["why"] = why[i];
    ranked.push_back(e);
  }
  r["search"] = {{"considered", search.considered},
                 {"discarded_memory", search.too_big},
                 {"fitting_grids", search.ranked.size()},
                 {"top", ranked}};
  // A GPU cluster's utilisation comes with the planner's error on published runs; the cpu
  // cluster's with its own runs (section 8 of docs/plan.md).
  if (c.name != "cpu") {
    const QuotedSpread q = quoted_spread();
    r["search"]["confidence"] = {{"mfu_points", q.points}, {"published_runs", q.runs}};
  }
  return r;
}

std::string format_report(const json& r, bool explain) {
  std::string o;
  auto line = [&o](const std::string& s) { o += s + "\n"; };
  auto hb = [](const json& v) { return human_bytes(v.get<double>()); };
  auto hs = [](const json& v) { return human_seconds(v.get<double>()); };
  const json& m = r["model"];
  const json& c = r["cluster"];
  const json& t = r["training"];
  line(fmt::format("tetra plan: {} ({:.4g} params, {:.4g} active) on {} x {} ({} nodes of {})",
                   m["name"].get<std::string>(), m["params"].get<double>(),
                   m["active_params"].get<double>(), c["gpus"].get<int64_t>(),
                   c["name"].get<std::string>(), c["nodes"].get<int64_t>(),
                   c["gpus_per_node"].get<int64_t>()));
  std::string moe;
  if (m["moe_experts"].get<int64_t>() > 0) {
    moe = fmt::format(" moe_experts={} moe_top_k={}", m["moe_experts"].get<int64_t>(),
                      m["moe_top_k"].get<int64_t>());
  }
  line(fmt::format(
      "  {} n_layer={} d_model={} n_head={} n_kv_head={} ffn={} vocab_size={} "
      "seq_len={}{}",
      m["arch"].get<std::string>(), m["n_layer"].get<int64_t>(), m["d_model"].get<int64_t>(),
      m["n_head"].get<int64_t>(), m["n_kv_head"].get<int64_t>(), m["ffn"].get<int64_t>(),
      m["vocab_size"].get<int64_t>(), m["seq_len"].get<int64_t>(), moe));
  line(fmt::format("  {:.3g} tokens, global batch {} tokens ({:.0f} steps), {}, recompute={}",
                   t["tokens"].get<double>(), t["global_batch"].get<int64_t>(),
                   t["steps"].get<double>(), t["precision"].get<std::string>(),
                   t["recompute"].get<std::string>()));
  if (r.contains("run")) {
    const json& run = r["run"];
    line(fmt::format("  tetra train, this run on {} rank(s): {} (its header's [plan] line){}",
                     run["ranks"].get<int64_t>(), run["summary"].get<std::string>(),
                     run.contains("note") ? "; " + run["note"].get<std::string>() : ""));
    std::string bytes;
    for (const auto& [dim, b] : run["bytes_per_step"].items()) {
      bytes += fmt::format(", {} {} per step", dim, hb(b));
    }
    line(fmt::format("  its step (as its end-of-run plan-vs-measured lines predict it): {}{}",
                     hs(run["step_seconds"]), bytes));
    if (run.contains("moe")) {
      const json& e = run["moe"];
      const json& em = e["expert_memory"];
      line(fmt::format(
          "  mixture of experts: {} of {} experts per rank in each of its {} MoE block(s), top-{}; "
          "expert state {} per rank (params {}, grads {}, optimizer {}, ZeRO workspaces {}); "
          "all-to-all {} per step and rank ({} of it to other ranks), EP {} a step, exposed",
          e["experts_per_rank"].get<int64_t>(), e["experts"].get<int64_t>(),
          e["moe_blocks_per_rank"].get<int64_t>(), e["top_k"].get<int64_t>(),
          hb(e["expert_memory_per_rank"]), hb(em["params"]), hb(em["grads"]), hb(em["optimizer"]),
          hb(em["comm"]), hb(e["a2a_bytes_per_step"]), hb(e["ep_sent_bytes_per_step"]),
          hs(e["ep_seconds"])));
    }
  }

  const json& mem = r["memory"];
  const json& sbp = mem["state_bytes_per_param"];
  line("");
  line("1. Memory per device");
  line(fmt::format(
      "  training state {} B/param = {} weights + {} grads + {} master + {} m + {} v;"
      " unsharded {} -> >= {} devices before one token",
      sbp["total"].get<double>(), sbp["weights"].get<double>(), sbp["grads"].get<double>(),
      sbp["master"].get<double>(), sbp["adam_m"].get<double>(), sbp["adam_v"].get<double>(),
      hb(mem["unsharded_state"]), mem["min_devices_for_state"].get<int64_t>()));
  line(fmt::format("  {:<14}{:>11}{:>11}{:>11}{:>12}{:>11}{:>11}  {}", "", "params", "grads",
                   "optimizer", "activations", "comm buf", "total", "fits"));
  auto mem_row = [&](const std::string& name, const json& x) {
    line(fmt::format("  {:<14}{:>11}{:>11}{:>11}{:>12}{:>11}{:>11}  {}", name, hb(x["params"]),
                     hb(x["grads"]), hb(x["optimizer"]), hb(x["activations"]),
                     hb(x["comm_buffers"]), hb(x["total"]),
                     x["fits"].get<bool>() ? "yes" : "NO - does not fit"));
  };
  mem_row("this layout", mem["layout"]);
  for (const auto& s : mem["zero_stages"]) {
    mem_row(
        s["stage"].get<int>() == 0 ? "  no ZeRO" : fmt::format("  ZeRO-{}", s["stage"].get<int>()),
        s);
  }
  line(fmt::format("  usable per device: {}", hb(mem["layout"]["usable"])));
  if (mem.contains("tetra_run")) {
    const json& x = mem["tetra_run"];
    line(fmt::format(
        "  tetra train, this layout, per rank: params {}, grads {}, optimizer {}, activations {}, "
        "comm {}, temporaries {}; total {}",
        hb(x["params"]), hb(x["grads"]), hb(x["optimizer"]), hb(x["activations"]), hb(x["comm"]),
        hb(x["temporaries"]), hb(x["total"])));
  }

  const json& cp = r["compute"];
  line("");
  line("2. Compute");
  line(fmt::format("  convention: {}", cp["convention"].get<std::string>()));
  line(fmt::format("  6PT {:.3g} + attention {:.3g} = {:.3g} FLOPs ({:.3g} with recompute)",
                   cp["flops_6pt"].get<double>(), cp["flops_attention"].get<double>(),
                   cp["flops_total"].get<double>(), cp["flops_hardware"].get<double>()));
  line(
      fmt::format("  at {:.0f}% MFU: {:.3g} GPU-seconds = {:.3g} GPU-years; wall-clock {} on {} "
                  "devices",
                  t["target_mfu"].get<double>() * 100, cp["gpu_seconds"].get<double>(),
                  cp["gpu_years"].get<double>(), hs(cp["wall_seconds_at_target_mfu"]),
                  c["gpus"].get<int64_t>()));
  line(fmt::format("  this layout's estimate: step {}, MFU {:.0f}%, wall-clock {}",
                   hs(cp["estimated_step_seconds"]), cp["estimated_mfu"].get<double>() * 100,
                   hs(cp["estimated_wall_seconds"])));

  line("");
  line("3. Communication per step (per device)");
  line(fmt::format("  {:<4}{:>6} {:<11}{:>8}{:>11}{:>11}{:>9}{:>11}  {}", "dim", "group", "link",
                   "calls", "bytes", "time", "overlap", "exposed", "what"));
  for (const auto& d : r["communication"]) {
    line(fmt::format("  {:<4}{:>6} {:<11}{:>8}{:>11}{:>11}{:>8.0f}%{:>11}  {}",
                     d["dim"].get<std::string>(), d["group"].get<int64_t>(),
                     d["link"].get<std::string>(), d["calls"].get<int64_t>(), hb(d["bytes"]),
                     hs(d["seconds"]), d["overlap"].get<double>() * 100, hs(d["exposed_seconds"]),
                     d["what"].get<std::string>()));
  }
  if (r["communication"].empty()) line("  none: a single device");
  if (r.contains("cp_ring")) {
    const json& g = r["cp_ring"];
    line(fmt::format(
        "  cp ring per layer and micro-batch: fwd (cp-1) x B x T/cp x 2 x kv_width x bytes = {} x "
        "{} x {} x 2 x {} x {:g} = {}, bwd 2x = {}; x {} layers x {} micro-batches per step",
        g["cp"].get<int64_t>() - 1, g["micro_batch"].get<int64_t>(),
        g["seq"].get<int64_t>() / g["cp"].get<int64_t>(), g["kv_width"].get<int64_t>(),
        g["dtype_bytes"].get<double>(), hb(g["forward_bytes"]), hb(g["backward_bytes"]),
        g["layers"].get<int64_t>(), g["microbatches"].get<int64_t>()));
  }
  if (r.contains("cp_ulysses")) {
    const json& g = r["cp_ulysses"];
    const int64_t u = g["group"].get<int64_t>();
    line(fmt::format(
        "  cp ulysses per layer and micro-batch: all-to-alls over {} ranks of the T/cp rows' qkv "
        "blocks {}, out {} and delta {}, (u-1)/u of each sent{}: fwd qkv + out{} = {}, bwd 2 qkv "
        "+ out + delta{} = {}; x {} layers x {} micro-batches per step",
        u, hb(g["qkv_bytes"]), hb(g["out_bytes"]), hb(g["delta_bytes"]),
        g["ring_hops"].get<int64_t>() > 0
            ? fmt::format("; a ring of {} across the groups, hops of {}",
                          g["cp"].get<int64_t>() / u, hb(g["ring_hop_bytes"]))
            : std::string(),
        g["ring_hops"].get<int64_t>() > 0 ? " + ring" : "", hb(g["forward_bytes"]),
        g["ring_hops"].get<int64_t>() > 0 ? " + 2 ring" : "", hb(g["backward_bytes"]),
        g["layers"].get<int64_t>(), g["microbatches"].get<int64_t>()));
  }
  if (r.contains("cp_attention")) {
    const json& a = r["cp_attention"];
    std::string alts;
    for (const json& k : a["candidates"]) {
      alts += fmt::format("{}{} {} sent, {} exposed, step {}", alts.empty() ? "" : "; ",
                          k["attention"].get<std::string>(), hb(k["bytes"]),
                          hs(k["exposed_seconds"]), hs(k["step_seconds"]));
    }
    line(fmt::format("  cp attention: {} ({}): {}", a["chosen"].get<std::string>(),
                     a["given"].get<bool>() ? "given" : "the faster step on these links", alts));
  }

  const json& b = r["bubble"];
  line("");
  line(fmt::format(
      "4. Pipeline bubble: {} p={} m={}{}: {:.1f}% of the step idle ({}), simulated{}",
      b["schedule"].get<std::string>(), b["p"].get<int64_t>(), b["m"].get<int64_t>(),
      b["schedule"] == "interleaved" ? fmt::format(" v={}", b["v"].get<int64_t>()) : std::string(),
      b["fraction"].get<double>() * 100, hs(b["seconds"]),
      b["p"].get<int64_t>() > 1
          ? fmt::format("; the closed form {} gives {:.1f}%",
                        b["schedule"] == "zb_h1" ? "(p-1)/(3m+p-1)" : "(p-1)/(v*m+p-1)",
                        b["formula"].get<double>() * 100)
          : std::string()));
  for (const json& s : b["schedules"]) {
    line(fmt::format("  {:<16} bubble {:5.1f}%  step {}{}", s["schedule"].get<std::string>(),
                     s["bubble"].get<double>() * 100, hs(s["step_seconds"]),
                     s["schedule"] == b["schedule"] ? "  (this layout)" : ""));
  }
  if (!b["split"].empty()) {
    line(fmt::format("  uneven stages, layers per stage: {}",
                     fmt::join(b["split"].get<std::vector<int>>(), ",")));
  }

  const json& k = r["checkpoint"];
  line("");
  line("5. Checkpoint");
  line(fmt::format("  size {} ({} B/param), write time {}; device MTBF {:.3g} h -> cluster MTBF {}",
                   hb(k["bytes"]), k["bytes_per_param"].get<double>(), hs(k["write_seconds"]),
                   k["gpu_mtbf_hours"].get<double>(),
                   hs(k["cluster_mtbf_hours"].get<double>() * 3600)));
  line(
      fmt::format("  Young/Daly interval sqrt(2*delta*MTBF) = {}; loss per failure {} ({:.3g} "
                  "GPU-hours); goodput {:.1f}%",
                  hs(k["interval_seconds"]), hs(k["loss_per_failure_seconds"]),
                  k["loss_per_failure_gpu_hours"].get<double>(), k["goodput"].get<double>() * 100));

  const json& l = r["layout"];
  const json& s = r["search"];
  line("");
  line(fmt::format("6. Layout ({}): {}", l["source"].get<std::string>(),
                   l["describe"].get<std::string>()));
  for (const auto& x : l["explanation"]) line("  - " + x.get<std::string>());
  for (const auto& w : l["warnings"]) line("  ! " + w.get<std::string>());
  line(
      fmt::format("  search: {} layouts divide the model and GPUs, {} discarded for memory, {} "
                  "fitting grids",
                  s["considered"].get<int64_t>(), s["discarded_memory"].get<int64_t>(),
                  s["fitting_grids"].get<size_t>()));
  if (s.contains("confidence")) {
    line(fmt::format(
        "  MFU ±{:.1f} points: the planner's root mean square error, leave-one-out, on {} "
        "published runs (docs/plan.md, \"Validation\")",
        s["confidence"]["mfu_points"].get<double>(), s["confidence"]["published_runs"].get<int>()));
  }
  line(fmt::format("  {:>4} {:<80}{:>10}{:>10}{:>8}{:>7}", "rank", "layout", "mem/dev", "step",
                   "bubble", "MFU"));
  for (const auto& e : s["top"]) {
    line(fmt::format("  {:>4} {:<80}{:>10}{:>10}{:>7.1f}%{:>6.0f}%", e["rank"].get<int>(),
                     e["describe"].get<std::string>(), hb(e["memory_per_device"]),
                     hs(e["step_seconds"]), e["bubble"].get<double>() * 100,
                     e["mfu"].get<double>() * 100));
    std::string terms;
    for (const auto& d : e["dominant"]) {
      terms += fmt::format("{}{} {:.0f}%", terms.empty() ? "" : ", ", d["term"].get<std::string>(),
                           d["share"].get<double>() * 100);
    }
    line("         dominated by " + terms);
    if (explain && e.contains("why")) line("         why: " + e["why"].get<std::string>());
    for (const auto& w : e["warnings"]) line("         ! " + w.get<std::string>());
  }
  if (explain) {
    line("");
    line(
        fmt::format("Step time of {} in the audit order (000 MFU: data, communication, bubble, "
                    "kernels, stragglers):",
                    l["describe"].get<std::string>()));
    for (const auto& x : l["step"]) line("  " + x.get<std::string>());
  }
  return o;
}

}  // namespace tetra::plan
