#include "train/step_audit.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <utility>

#include "core/atomic_file.h"
#include "core/log.h"
#include "core/timer.h"

namespace tetra {

namespace fs = std::filesystem;

namespace {

// The 1-minute load average: plan-vs-measured step times are only as good as the machine is quiet.
double read_load_average() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  in >> load;
  return load;
}

}  // namespace

StepAudit::StepAudit(RunLayout& layout, const RunPlan& plan, bool expert_parallel,
                     int64_t tokens_per_step, std::string run_dir)
    : layout_(layout),
      plan_(plan),
      expert_parallel_(expert_parallel),
      tokens_per_step_(tokens_per_step),
      run_dir_(std::move(run_dir)) {}

void StepAudit::add(const StepTimes& t) {
  step_s_.push_back(t.step_s);
  data_ms_.push_back(t.data_ms);
  // This rank's compute: the step less every wait, as the per-rank telemetry counts it.
  double compute = 1e3 * t.step_s - t.data_ms;
  for (int g = 0; g < 5; ++g) {
    wait_ms_[g].push_back(t.wait_ms[g]);
    compute -= t.wait_ms[g];
    bytes_[g] = t.bytes[g];
  }
  if (t.pipelined) {
    bubbles_.push_back(t.bubble);
    bubble_ms_.push_back(t.bubble_ms);
  }
  compute_ms_.push_back(std::max(0.0, compute));
}

void StepAudit::plan_vs_measured(double peak_gflops, int threads, const MemoryLedger& ledger) {
  // The MPI link between this machine's ranks, measured once per run: all-reduces of a small and
  // a large buffer over every rank, the fastest of a few of each; α from the small one, the bus
  // bandwidth from the difference (the ring model the planner prices collectives with).
  plan::MeasuredLink link;
  if (layout_.multi() && layout_.world_size() > 1) {
    const comm::Communicator& world = layout_.world();
    const double n = double(world.size());
    auto fastest = [&](size_t floats, int reps) {
      std::vector<float> buf(floats, 1.0f);
      double best = 1e30;
      for (int i = 0; i < reps; ++i) {
        world.barrier().wait();
        const double t0 = now_s();
        world.all_reduce(std::span<float>(buf)).wait();
        best = std::min(best, now_s() - t0);
      }
      float slowest = float(best);
      world.all_reduce(std::span<float>(&slowest, 1), comm::ReduceOp::max).wait();
      return double(slowest);
    };
    const size_t small = 256, large = size_t(1) << 20;
    const double ts = fastest(small, 20), tl = fastest(large, 5);
    const double bytes = 2.0 * (n - 1) / n * double(large - small) * sizeof(float);
    link.bus_bw = tl > ts ? bytes / (tl - ts) : 0.0;
    link.latency = std::max(0.0, ts / (2.0 * (n - 1)));
    // Within one machine, kept as the best it has shown: a busy machine measures a slower link
    // than it has. Across hosts this run's link is the one between them, not this machine's.
    if (layout_.ranks_per_host() == 0) {
      if (layout_.is_root()) plan::save_cpu_measured_link(link);
      if (link.bus_bw > 0) link = plan::cpu_measured_link();
    }
  }
  if (!layout_.is_root()) return;

  const plan::ClusterSpec cluster =
      run_cluster(layout_.world_size(), peak_gflops, link, threads, layout_.ranks_per_host());
  const plan::LayoutEstimate e = predict_step(plan_, cluster);
  auto med = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double step = med(step_s_);
  const double memory = double(ledger.peak_total());
  const double planned_memory = plan_.prediction.memory.total();
  nlohmann::json out = {{"ranks", layout_.world_size()},
                        {"layout", plan::describe(plan_.layout)},
                        {"cluster",
                         {{"peak_gflops", cluster.peak_flops / 1e9},
                          {"link_gbs", cluster.intra_bw / 1e9},
                          {"link_latency_us", cluster.intra_latency * 1e6},
                          {"link_measured", link.bus_bw > 0},
                          {"mem_bw_gbs", cluster.mem_bw / 1e9}}},
                        {"load_average", read_load_average()},
                        {"steps_measured", step_s_.size()},
                        {"step_seconds", {{"predicted", e.step_seconds}, {"measured", step}}},
                        {"memory_bytes", {{"predicted", planned_memory}, {"measured", memory}}},
                        {"predicted_time",
                         {{"data", e.time.data},
                          {"comm", e.time.comm},
                          {"bubble", e.time.bubble},
                          {"kernels", e.time.kernels},
                          {"stragglers", e.time.stragglers}}},
                        {"measured_data_wait_seconds", med(data_ms_) / 1e3}};
  auto pct = [](double p, double m) { return m > 0 ? 100.0 * (p - m) / m : 0.0; };
  log_info(
      "[plan] plan vs measured for this run (tetra plan's model on the cpu cluster{}: {:.1f} "
      "GFLOP/s per rank, MPI {:.2f} GB/s and {:.1f} us per hop{}, memory {:.1f} GB/s; load "
      "average {:.1f}):",
      cluster.gpus_per_node < cluster.gpus
          ? fmt::format(" of {} nodes x {} ranks", cluster.gpus / cluster.gpus_per_node,
                        cluster.gpus_per_node)
          : "",
      cluster.peak_flops / 1e9, cluster.intra_bw / 1e9, cluster.intra_latency * 1e6,
      link.bus_bw > 0 && layout_.ranks_per_host() > 0 ? " (measured by this run across its hosts)"
      : link.bus_bw > 0                               ? " (the best measured on this machine)"
      : layout_.multi() ? " (this run could not measure it: the cpu preset's)"
                        : " (one rank: unused)",
      cluster.mem_bw / 1e9, read_load_average());
  log_info(
      "[plan]   step time     predicted {:>10.2f} ms  measured {:>10.2f} ms (median of {})  "
      "{:+.1f}%",
      1e3 * e.step_seconds, 1e3 * step, step_s_.size(), pct(e.step_seconds, step));
  log_info(
      "[plan]   memory/rank   predicted {:>10.2f} MiB measured {:>10.2f} MiB (peak)    {:+.1f}%",
      planned_memory / double(1 << 20), memory / double(1 << 20), pct(planned_memory, memory));
  const char* const groups[] = {"dp", "tp", "pp", "ep", "cp"};
  for (int g = 0; g < 5; ++g) {
    double planned = 0;
    bool present = false;
    for (const plan::GroupTraffic& t : plan_.traffic) {
      if (t.dim == groups[g]) planned = t.bytes(), present = true;
    }
    if (!present && bytes_[g] == 0) continue;
    out["bytes_per_step"][groups[g]] = {{"predicted", planned}, {"measured", bytes_[g]}};
    log_info("[plan]   {} bytes/step  predicted {:>14.0f} measured {:>14.0f}     {}", groups[g],
             planned, bytes_[g],
             planned == bytes_[g] ? std::string("exact")
                                  : fmt::format("{:+.2f}%", pct(planned, bytes_[g])));
  }
  if (layout_.pp_size() > 1) {
    const double bubble = med(bubbles_);
    out["bubble"] = {{"predicted", e.bubble}, {"measured", bubble}};
    log_info(
        "[plan]   bubble        predicted {:>9.1f}%  measured {:>9.1f}% (median)       {:+.1f} "
        "points",
        100 * e.bubble, 100 * bubble, 100 * (e.bubble - bubble));
  }
  log_info(
      "[plan]   predicted step by the audit order: data {:.2f} ms (measured wait {:.2f} ms) + "
      "comm {:.2f} ms + bubble {:.2f} ms + kernels {:.2f} ms + stragglers {:.2f} ms",
      1e3 * e.time.data, med(data_ms_), 1e3 * e.time.comm, 1e3 * e.time.bubble,
      1e3 * e.time.kernels, 1e3 * e.time.stragglers);
  const std::string text = out.dump(1) + "\n";
  write_file_atomically((fs::path(run_dir_) / "plan_vs_measured.json").string(),
                        {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}}, "train");
}

nlohmann::json StepAudit::audit(double peak_gflops, const std::vector<double>& rank_compute_ms,
                                const Profile* profile) const {
  // The steps measured: the middle half by step time (the run's first step, which builds plans
  // and chooses libraries, left out when there are others), and every part is its mean over them,
  // so that the parts add up to the measured step as each step's do, while the noise of a shared
  // machine (a step descheduled) is left out as a median would.
  std::vector<size_t> steps;
  for (size_t i = step_s_.size() > 1 ? 1 : 0; i < step_s_.size(); ++i) steps.push_back(i);
  std::sort(steps.begin(), steps.end(),
            [&](size_t a, size_t b) { return step_s_[a] < step_s_[b]; });
  const size_t quarter = steps.size() / 4;
  steps = std::vector<size_t>(steps.begin() + std::ptrdiff_t(quarter),
                              steps.end() - std::ptrdiff_t(quarter));
  auto mean = [&](const std::vector<double>& v, double scale = 1.0) {
    double sum = 0;
    for (size_t i : steps) sum += i < v.size() ? v[i] : 0.0;
    return steps.empty() ? 0.0 : scale * sum / double(steps.size());
  };
  const double measured = mean(step_s_, 1e3);
  // The step at the peak: every rank's share of the model FLOPs at the MFU denominator.
  const double ideal = 1e3 * plan_.prediction.flops_per_token * double(tokens_per_step_) /
                       (peak_gflops * 1e9 * layout_.world_size());
  const double bubble = mean(bubble_ms_);
  double comm[5];
  for (int g = 0; g < 5; ++g) comm[g] = mean(wait_ms_[g]);
  comm[2] -= bubble;  // the pipeline's transfer waits less its bubble
  // A slower rank makes this one wait in its next collective: the slowest rank's compute less
  // this rank's (the last telemetry window's means) is taken out of the waits, in proportion.
  double stragglers = 0;
  if (rank_compute_ms.size() > size_t(layout_.rank())) {
    stragglers = *std::max_element(rank_compute_ms.begin(), rank_compute_ms.end()) -
                 rank_compute_ms[size_t(layout_.rank())];
    const double waits = comm[0] + comm[1] + comm[2] + comm[3] + comm[4];
    stragglers = std::min(stragglers, waits);
    if (waits > 0) {
      for (double& c : comm) c *= 1.0 - stragglers / waits;
    }
  }
  const double kernels = std::max(0.0, mean(compute_ms_) - ideal);
  const char* const groups[5] = {"comm_dp", "comm_tp", "comm_pp", "comm_ep", "comm_cp"};
  const bool present[5] = {layout_.dp_size() > 1, layout_.tp().size() > 1, layout_.pp_size() > 1,
                           expert_parallel_, layout_.cp_size() > 1};
  nlohmann::json parts = nlohmann::json::array();
  double sum = 0;
  auto part = [&](const char* name, double ms) {
    parts.push_back({{"name", name}, {"ms", ms}});
    sum += ms;
  };
  part("ideal", ideal);
  part("data", mean(data_ms_));
  for (int g = 0; g < 5; ++g) {
    if (present[g] || comm[g] > 0) part(groups[g], comm[g]);
  }
  if (layout_.pp_size() > 1) part("bubble", bubble);
  part("kernels", kernels);
  part("stragglers", stragglers);
  nlohmann::json out = {{"measured_step_ms", measured},
                        {"mfu", measured > 0 ? ideal / measured : 0.0},
                        {"parts", parts},
                        {"sum_ms", sum},
                        {"steps", int64_t(steps.size())}};
  if (profile) {
    // Where the compute went, per kernel kind (ms per step from the per-kernel profile).
    const nlohmann::json kinds = profile->to_json()["kinds"];
    nlohmann::json split = nlohmann::json::object();
    for (auto it = kinds.begin(); it != kinds.end(); ++it) {
      if (it.key() != "data_wait" && it.key() != "comm" && it.key() != "other") {
        split[it.key()] = it.value()["ms_per_step"];
      }
    }
    out["kernel_kinds_ms"] = split;
  }
  return out;
}

void StepAudit::write_audit(double peak_gflops, const std::vector<double>& rank_compute_ms,
                            const Profile* profile) const {
  if (!layout_.is_root() || step_s_.empty()) return;
  {
    const nlohmann::json a = audit(peak_gflops, rank_compute_ms, profile);
    const double step = a["measured_step_ms"].get<double>();
    std::string table =
        fmt::format("[audit] measured MFU audit of rank 0's step (the middle {} steps by time):",
                    a["steps"].get<int64_t>());
    table += fmt::format("\n[audit]   {:<12} {:>10} {:>8}", "part", "ms", "% step");
    for (const nlohmann::json& part : a["parts"]) {
      const double ms = part["ms"].get<double>();
      table += fmt::format("\n[audit]   {:<12} {:>10.3f} {:>7.1f}%",
                           part["name"].get<std::string>(), ms, step > 0 ? 100 * ms / step : 0.0);
    }
    table += fmt::format(
        "\n[audit]   {:<12} {:>10.3f} {:>7.1f}%  (measured step {:.3f} ms; MFU {:.1f}%)", "sum",
        a["sum_ms"].get<double>(), step > 0 ? 100 * a["sum_ms"].get<double>() / step : 0.0, step,
        100 * a["mfu"].get<double>());
    log_info("{}", table);
    const std::string path = (fs::path(run_dir_) / "audit.json").string();
    const std::string text = a.dump(1) + "\n";
    write_file_atomically(path, {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}},
                          "train");
  }
}

}  // namespace tetra
