#include "kernels/cpu/peak.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "core/log.h"
#include "core/machine_cache.h"
#include "core/timer.h"
#include "kernels/backend.h"
#include "kernels/cpu/matmul.h"

namespace tetra::cpu {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// 3: a bf16 entry is the best library for bf16 operands, widened to f32 included (2 measured the
// bf16 primitive alone, below the f32 peak on CPUs whose bf16 instructions are slow).
constexpr int kThreadsSchema = 3;
// A peak measured above kBusyLoad is low (other work shared the cores); it is measured again
// once the load is below kQuietLoad, or below half the load it was measured under. A peak is the
// best rate seen, so the higher of the two measurements is kept.
constexpr double kBusyLoad = 1.0, kQuietLoad = 0.5;

double measure_peak(int threads, bool bf16_operands) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  const int64_t n = 2048;
  Buffer<float> a(n * n), b(n * n), c(n * n);
  for (int64_t i = 0; i < n * n; ++i) a[i] = b[i] = float(i % 7) * 0.1f;
  Kernels<float>& k = cpu_backend().f32();
  MatmulArgs args = nn_args<float>(c.data(), a.data(), b.data(), n, n, n, false, "peak", nullptr);
  std::vector<bf16> a16, b16;
  if (bf16_operands) {
    a16.resize(size_t(n * n));
    b16.resize(size_t(n * n));
    round_to_bf16(a16.data(), a.data(), a16.size(), "peak");
    round_to_bf16(b16.data(), b.data(), b16.size(), "peak");
    args.a.data = a16.data();
    args.a.dtype = DType::bf16;
    args.b.data = b16.data();
    args.b.dtype = DType::bf16;
  }
  k.matmul(args);  // warm-up (JIT, page faults)
  // The best of repeated products over at least a second: a peak, not an average.
  double best = 1e30;
  Stopwatch total;
  for (int rep = 0; rep < 5 || total.elapsed_s() < 1.0; ++rep) {
    Stopwatch sw;
    k.matmul(args);
    best = std::min(best, sw.elapsed_s());
  }
  omp_set_num_threads(saved);
  return 2.0 * n * n * n / best / 1e9;
}

double proc_load_average() {
  double load = 0.0;
  if (std::ifstream avg("/proc/loadavg"); avg) avg >> load;
  return load;
}

// What is wrong with one "threads" entry, or "" when it is usable.
std::string entry_problem(const json& e) {
  if (!e.is_object()) return "not an object";
  const auto g = e.find("gflops");
  if (g == e.end() || !g->is_number() || !std::isfinite(g->get<double>()) || g->get<double>() <= 0)
    return "\"gflops\" is not a positive number";
  const auto l = e.find("load_average");
  if (l == e.end() || !l->is_number() || !(l->get<double>() >= 0))
    return "\"load_average\" is not a number >= 0";
  return "";
}

void write_entry(const fs::path& path, const std::string& machine, const std::string& key,
                 const json& entry) {
  write_machine_cache(
      path, kThreadsSchema, machine, "threads", json::object({{key, entry}}),
      [](const json& e) { return entry_problem(e).empty(); }, "peak");
}

}  // namespace

double copy_bandwidth(const fs::path& path, double load, const std::function<double()>& measure) {
  if (path.empty()) return measure();
  constexpr int kMemorySchema = 1;
  const std::string machine = matmul_machine();
  // {"schema": 1, "machine": ..., "bandwidth": {"copy": {"bytes_per_s": ..., "load_average": ...,
  // "measured_at": ...}}}
  const json held = read_machine_cache(path, kMemorySchema, machine, "bandwidth").entries;
  const auto copy = held.find("copy");
  double cached = 0.0, cached_load = 0.0;
  if (copy != held.end() && copy->is_object()) {
    const auto v = copy->find("bytes_per_s");
    if (v != copy->end() && v->is_number() && std::isfinite(v->get<double>())) cached = *v;
    const auto l = copy->find("load_average");
    if (l != copy->end() && l->is_number()) cached_load = *l;
  }
  // A figure measured on a quiet machine is used as it is: measuring costs a process a fifth of a
  // second (64 MB touched for the first time). One measured under load is measured again, by the
  // peak's rule, once the machine is quieter; the better figure is kept.
  if (cached > 0 && (cached_load <= kBusyLoad || (load > kQuietLoad && load > 0.5 * cached_load))) {
    return cached;
  }
  const double best = measure();
  if (best > cached) {
    write_machine_cache(
        path, kMemorySchema, machine, "bandwidth",
        json::object(
            {{"copy",
              {{"bytes_per_s", best}, {"load_average", load}, {"measured_at", utc_now()}}}}),
        [](const json& e) { return e.is_object(); }, "memory bandwidth");
  }
  return std::max(best, cached);
}

double copy_bandwidth() {
  static const double bw =
      copy_bandwidth(machine_cache_path("memory.json"), proc_load_average(), [] {
        const size_t n = size_t(32) << 20;
        std::vector<char> a(n, 1), b(n, 2);
        double best = 0;
        for (int i = 0; i < 4; ++i) {
          Stopwatch sw;
          std::memcpy(i % 2 ? a.data() : b.data(), i % 2 ? b.data() : a.data(), n);
          const double dt = sw.elapsed_s();
          if (dt > 0) best = std::max(best, 2.0 * double(n) / dt);
        }
        return best;
      });
  return bw;
}

fs::path peak_cache_path() { return machine_cache_path("peak.json"); }

PeakSource machine_peak_source() { return {measure_peak, proc_load_average, matmul_machine()}; }

std::optional<double> given_peak_gflops(int threads) {
  const char* env = std::getenv("TETRA_PEAK_GFLOPS");
  if (!env || !*env) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(env, &end);
  TETRA_CHECK(end && *end == '\0' && std::isfinite(v) && v > 0,
              "[peak] TETRA_PEAK_GFLOPS={} is not a positive number of GFLOP/s per thread; set "
              "one (e.g. 50) or unset it to measure the peak",
              env);
  return v * threads;
}

namespace {

double cached_or_measured(int threads, bool bf16, bool* from_cache) {
  if (const std::optional<double> given = given_peak_gflops(threads)) {
    if (from_cache) *from_cache = false;
    return *given;
  }
  const fs::path path = peak_cache_path();
  if (path.empty()) {
    log_warn(
        "[peak] neither XDG_CACHE_HOME nor HOME is set, so the measured matmul peak is not "
        "cached; set HOME to keep it between runs");
  }
  return peak_gflops(threads, bf16, path, machine_peak_source(), from_cache);
}

}  // namespace

double fp32_peak_gflops(int threads, bool* from_cache) {
  return cached_or_measured(threads, false, from_cache);
}

double bf16_peak_gflops(int threads, bool* from_cache) {
  const Bf16MatmulPath& path = bf16_matmul_path();
  TETRA_CHECK(path.hardware || given_peak_gflops(threads),
              "[peak] this CPU has no bf16 matmul instructions ({}): its bf16 products are "
              "emulated, so there is no bf16 peak to measure; use the fp32 peak",
              path.describe());
  return cached_or_measured(threads, true, from_cache);
}

double peak_gflops(int threads, bool bf16, const fs::path& cache, const PeakSource& source,
                   bool* from_cache) {
  TETRA_CHECK(threads >= 1, "[peak] the thread count must be at least 1 (got {})", threads);
  const std::string key = (bf16 ? "bf16:" : "") + std::to_string(threads);
  const char* kind = bf16 ? "bf16" : "fp32";
  MachineCacheRead read =
      cache.empty() ? MachineCacheRead{}
                    : read_machine_cache(cache, kThreadsSchema, source.machine, "threads");
  const double load = source.load_average();
  double cached = 0.0, cached_load = 0.0;  // a busy entry being measured again
  if (const auto it = read.entries.find(key); it != read.entries.end()) {
    const std::string problem = entry_problem(*it);
    if (!problem.empty()) {
      read.problem = fmt::format("has a malformed {}-thread {} entry ({})", threads, kind, problem);
      read.damaged = true;
    } else if (const double then = (*it)["load_average"].get<double>();
               then > kBusyLoad && (load < kQuietLoad || load < then / 2)) {
      log_info(
          "[peak] the {}-thread {} peak in {} was measured with load average {:.1f}; the "
          "machine is quieter now (load {:.1f}), so it is measured again",
          threads, kind, cache.string(), then, load);
      cached = (*it)["gflops"].get<double>();
      cached_load = then;
    } else {
      if (from_cache) *from_cache = true;
      return (*it)["gflops"].get<double>();
    }
  }
  if (!read.problem.empty()) {
    const std::string what =
        fmt::format("[peak] {} {}; measuring the {}-thread {} matmul peak and rewriting it",
                    cache.string(), read.problem, threads, kind);
    if (read.damaged) {
      log_warn("{}", what);
    } else {
      log_info("{}", what);
    }
  }
  double g = source.measure(threads, bf16), g_load = load;
  if (g < cached) g = cached, g_load = cached_load;
  if (g_load > kBusyLoad) {
    log_warn(
        "[peak] the {} peak ({:.1f} GFLOP/s at {} threads) was measured with load average "
        "{:.1f}: other work was running, so it is low (MFU reads high, plan estimates slow); it "
        "is measured again once the machine is quieter",
        kind, g, threads, g_load);
  }
  if (!cache.empty()) {
    write_entry(cache, source.machine, key,
                {{"gflops", g}, {"load_average", g_load}, {"measured_at", utc_now()}});
  }
  if (from_cache) *from_cache = false;
  return g;
}

}  // namespace tetra::cpu
