#include "train/health.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <span>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/log.h"
#include "core/stats.h"

namespace tetra {

namespace {

// The q-quantile of `v` (nearest rank on the sorted values).
double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const size_t i = size_t(std::ceil(q * double(v.size()))) - (q > 0 ? 1 : 0);
  return v[std::min(i, v.size() - 1)];
}

// The median, the mean of the middle two of an even count: with two ranks it is their mean, not
// the faster one, so that the faster rank's noise alone does not make the other a straggler.
// Under tetra launch (TETRA_HEARTBEAT_DIR set), names the stragglers' hosts for the launcher. Each
// rank writes the same list through its own temporary file, so the last rename wins unharmed.
void write_straggler_hosts(const nlohmann::json& named) {
  const char* dir = std::getenv("TETRA_HEARTBEAT_DIR");
  if (!dir || !*dir) return;
  std::string text;
  for (const nlohmann::json& s : named) text += s["host"].get<std::string>() + "\n";
  write_file_atomically((std::filesystem::path(dir) / kStragglerHostsFile).string(),
                        {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}}, "health");
}

}  // namespace

std::vector<int> find_stragglers(const std::vector<double>& compute_ms,
                                 const std::vector<double>& step_ms, const HealthOptions& options) {
  std::vector<int> out;
  if (compute_ms.size() < 2) return out;
  const double mid = median(compute_ms);
  const double min_excess = options.straggler_min_share * median(step_ms);
  for (size_t r = 0; r < compute_ms.size(); ++r) {
    if (mid > 0 && compute_ms[r] > options.straggler_factor * mid &&
        compute_ms[r] - mid >= min_excess) {
      out.push_back(int(r));
    }
  }
  return out;
}

HealthMonitor::HealthMonitor(const HealthOptions& options, const RunLayout& layout)
    : opt_(options), layout_(layout) {
  // Two ranks' median is their mean, so neither reads over 2x it.
  if (opt_.telemetry_every > 0 && layout.world_size() == 2 && opt_.straggler_factor >= 2 &&
      layout.is_root()) {
    log_warn(
        "[health] health.straggler_factor={} can never name a straggler among two ranks: the "
        "median of two is their mean, which neither exceeds by 2x; set a factor below 2",
        opt_.straggler_factor);
  }
  for (int r = 0; r < layout.world_size(); ++r) {
    hosts_.push_back(layout.multi() ? layout.world().host(r) : std::string("localhost"));
  }
}

void HealthMonitor::step(int64_t step, const RankStep& s, nlohmann::json& rec) {
  if (opt_.telemetry_every <= 0) return;
  if (steps_ == 0) first_ = step;
  sum_.step_ms += s.step_ms;
  sum_.compute_ms += s.compute_ms;
  sum_.comm_ms += s.comm_ms;
  sum_.data_ms += s.data_ms;
  sum_.grad_sq = s.grad_sq;  // the window's last step: a norm, not a time, is not averaged
  if (++steps_ < opt_.telemetry_every) return;

  // One all-gather of five numbers per rank per window.
  constexpr size_t kFields = 5;
  const int world = layout_.world_size();
  const float mine[kFields] = {float(sum_.step_ms / steps_), float(sum_.compute_ms / steps_),
                               float(sum_.comm_ms / steps_), float(sum_.data_ms / steps_),
                               float(std::sqrt(std::max(0.0, sum_.grad_sq)))};
  std::vector<float> all(kFields * size_t(world));
  if (layout_.multi()) {
    layout_.world().all_gather(std::span<const float>(mine, kFields), std::span<float>(all)).wait();
  } else {
    std::copy(mine, mine + kFields, all.begin());
  }
  const char* const names[kFields] = {"step_ms", "compute_ms", "comm_ms", "data_ms", "grad_norm"};
  nlohmann::json ranks = nlohmann::json::object();
  for (size_t f = 0; f < kFields; ++f) {
    std::vector<double> v(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) v[size_t(r)] = all[size_t(r) * kFields + f];
    ranks[names[f]] = v;
    if (f == kFields - 1) continue;
    const int slowest = int(std::max_element(v.begin(), v.end()) - v.begin());
    ranks[std::string(names[f]) + "_summary"] = {{"p50", quantile(v, 0.5)},
                                                 {"p99", quantile(v, 0.99)},
                                                 {"max", v[size_t(slowest)]},
                                                 {"slowest_rank", slowest},
                                                 {"slowest_host", hosts_[size_t(slowest)]}};
  }
  ranks["steps"] = {first_, step};
  std::vector<double> compute(static_cast<size_t>(world)), step_ms(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    step_ms[size_t(r)] = all[size_t(r) * kFields];
    compute[size_t(r)] = all[size_t(r) * kFields + 1];
  }
  const double mid = median(compute);
  window_compute_ = compute;
  nlohmann::json named = nlohmann::json::array();
  std::vector<std::string> lines;
  for (const int r : find_stragglers(compute, step_ms, opt_)) {
    const double ratio = compute[size_t(r)] / mid;
    named.push_back({{"rank", r},
                     {"host", hosts_[size_t(r)]},
                     {"compute_ms", compute[size_t(r)]},
                     {"ratio", ratio}});
    lines.push_back(
        fmt::format("rank {} on {}: compute {:.1f} ms per step, {:.2f}x the median "
                    "{:.1f} ms",
                    r, hosts_[size_t(r)], compute[size_t(r)], ratio, mid));
    if (std::find(stragglers_.begin(), stragglers_.end(), r) == stragglers_.end()) {
      stragglers_.push_back(r);
    }
  }
  ranks["stragglers"] = named;
  rec["ranks"] = ranks;
  steps_ = 0;
  sum_ = RankStep();
  if (lines.empty()) return;
  const std::string what =
      fmt::format("steps {}..{}: straggler(s) (health.straggler_factor={}): {}", first_, step,
                  opt_.straggler_factor, fmt::join(lines, "; "));
  // Every rank names them: the first rank to stop aborts the job, perhaps before the root could.
  if (opt_.on_straggler == "stop") write_straggler_hosts(named);
  TETRA_CHECK(opt_.on_straggler != "stop",
              "[health] {}; stopping (health.on_straggler=stop): restart the job without that "
              "host, or set health.on_straggler=warn",
              what);
  if (layout_.is_root()) log_warn("[health] {}", what);
}

}  // namespace tetra
