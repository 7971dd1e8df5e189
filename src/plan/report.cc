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

}  // namespace tetra::plan
