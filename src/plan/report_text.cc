// `tetra plan`'s report as text: the JSON of plan_report (report.cc) as aligned tables.
#include <fmt/format.h>

#include "plan/report.h"
#include "plan/units.h"

namespace tetra::plan {

using nlohmann::json;

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
