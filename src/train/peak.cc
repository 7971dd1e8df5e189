#include "train/peak.h"

#include <omp.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/arena.h"
#include "core/atomic_file.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "kernels/cpu/matmul.h"

namespace tetra {

namespace {

std::filesystem::path cache_path() {
  const char* home = std::getenv("HOME");
  return std::filesystem::path(home ? home : "/tmp") / ".cache" / "tetra" / "peak.json";
}

double measure(int threads) {
  int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  const int64_t n = 2048;
  Buffer<float> a(n * n), b(n * n), c(n * n);
  for (int64_t i = 0; i < n * n; ++i) a[i] = b[i] = float(i % 7) * 0.1f;
  cpu::matmul_nn(c.data(), a.data(), b.data(), n, n, n);  // warm-up (JIT, page faults)
  // The best of repeated products over at least a second: a peak, not an average.
  double best = 1e30;
  Stopwatch total;
  for (int rep = 0; rep < 5 || total.elapsed_s() < 1.0; ++rep) {
    Stopwatch sw;
    cpu::matmul_nn(c.data(), a.data(), b.data(), n, n, n);
    best = std::min(best, sw.elapsed_s());
  }
  omp_set_num_threads(saved);
  return 2.0 * n * n * n / best / 1e9;
}

double load_average() {
  double load = 0.0;
  if (std::ifstream avg("/proc/loadavg"); avg) avg >> load;
  return load;
}

}  // namespace

double fp32_peak_gflops(int threads, bool* from_cache) {
  const std::string key = "fp32_gflops_" + std::to_string(threads) + "t";
  const std::string load_key = "load_at_" + key;
  nlohmann::json cache = nlohmann::json::object();
  auto path = cache_path();
  if (std::ifstream in(path); in) {
    try {
      in >> cache;
    } catch (const std::exception&) {
      cache = nlohmann::json::object();  // a damaged cache is remeasured, not fatal
    }
  }
  // A value measured while the machine was busy is low (and MFU reads high): measure again
  // once the machine is quiet.
  const double load = load_average();
  bool usable = cache.contains(key) && cache[key].is_number() && cache[key].get<double>() > 0;
  if (usable && cache.contains(load_key) && cache[load_key].is_number()) {
    usable = !(cache[load_key].get<double>() > 1.0 && load < 0.5);
  }
  if (usable) {
    if (from_cache) *from_cache = true;
    return cache[key].get<double>();
  }
  double g = measure(threads);
  if (load > 1.0) {
    log_warn(
        "[train] the fp32 peak ({:.1f} GFLOP/s at {} threads) was measured with load average "
        "{:.1f}: other work was running, so it is low and MFU reads high; it is measured "
        "again once the machine is quieter",
        g, threads, load);
  }
  cache[key] = g;
  cache[load_key] = load;
  if (threads == omp_get_num_procs()) cache["fp32_gflops"] = g;
  // Written atomically: concurrent runs (parallel tests, ranks on other hosts sharing a home)
  // read either the old cache or the new one. A cache that cannot be written is not an error.
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  const std::string text = cache.dump(2) + "\n";
  try {
    write_file_atomically(path.string(),
                          {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}}, "train");
  } catch (const Error& e) {
    log_warn("{}", e.what());
  }
  if (from_cache) *from_cache = false;
  return g;
}

}  // namespace tetra
