#include "kernels/cpu/matmul_choice.h"

#include <fcntl.h>
#include <omp.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/log.h"
#include "core/machine_cache.h"
#include "core/timer.h"

namespace tetra::cpu {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// 2: the split libraries (entries of 1 never measured them); 3: bf16 operands widened to f32
constexpr int kSchema = 3;
constexpr int kRounds = 2;

char layout_letter(const std::array<int64_t, 4>& s) {
  return s[3] == 1 ? 'n' : s[2] == 1 ? 't' : 's';
}

// The library an entry names, if it is well formed.
bool parse_entry(const json& e, MatmulLib* lib) {
  if (!e.is_object()) return false;
  const auto name = e.find("library");
  const auto rates = e.find("gflops");
  if (name == e.end() || !name->is_string() || rates == e.end() || !rates->is_object())
    return false;
  for (MatmulLib l : kMatmulLibs) {
    if (*name == matmul_lib_name(l)) {
      if (lib) *lib = l;
      return true;
    }
  }
  return false;
}

// GFLOP/s of `lib` on this product: the best of repeated runs (at least one after a warm-up that
// builds oneDNN's primitive and touches the pages, more while under 50 ms), into a scratch C.
double measure(MatmulLib lib, const MatmulArgs& x) {
  const auto& s = x.c_strides;
  const int64_t extent =
      1 + (x.b0 - 1) * s[0] + (x.b1 - 1) * s[1] + (x.M - 1) * s[2] + (x.N - 1) * s[3];
  std::unique_ptr<float[]> c(new float[size_t(extent)]());
  MatmulArgs y = x;
  y.c = c.get();
  matmul_with(lib, y);
  double best = 1e30;
  Stopwatch total;
  for (int rep = 0; rep < 1 || (rep < 20 && total.elapsed_s() < 0.05); ++rep) {
    Stopwatch sw;
    matmul_with(lib, y);
    best = std::min(best, sw.elapsed_s());
  }
  return 2.0 * double(x.b0 * x.b1) * double(x.M) * double(x.N) * double(x.K) / best * 1e-9;
}

// An exclusive flock on <cache>.lock while it lives; none when the file cannot be opened (the
// processes then at worst measure the same product twice).
class CacheLock {
 public:
  explicit CacheLock(const fs::path& cache) {
    if (cache.empty()) return;
    std::error_code ec;
    fs::create_directories(cache.parent_path(), ec);
    fd_ = ::open((cache.string() + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ >= 0) ::flock(fd_, LOCK_EX);
  }
  ~CacheLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
  }
  CacheLock(const CacheLock&) = delete;
  CacheLock& operator=(const CacheLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace

std::string matmul_choice_key(const MatmulArgs& x, int threads) {
  return fmt::format("{}x{}x{} b{} {}{}{}{} t{}", x.M, x.K, x.N, x.b0 * x.b1,
                     layout_letter(x.a.strides), layout_letter(x.b.strides), x.bias ? " bias" : "",
                     x.a.dtype == DType::bf16 ? " bf16" : "", threads);
}

MatmulChoiceSource machine_matmul_source() { return {measure, matmul_machine()}; }

fs::path matmul_cache_path() { return machine_cache_path("matmul.json"); }

MatmulChooser::MatmulChooser(fs::path cache, MatmulChoiceSource source)
    : cache_(std::move(cache)), source_(std::move(source)) {}

void MatmulChooser::load(bool warn) {
  if (cache_.empty()) return;
  const MachineCacheRead read = read_machine_cache(cache_, kSchema, source_.machine, "products");
  std::string problem = read.problem;
  bool damaged = read.damaged;
  for (const auto& [key, entry] : read.entries.items()) {
    MatmulLib lib;
    if (parse_entry(entry, &lib)) {
      known_[key] = lib;
    } else if (problem.empty()) {
      problem = fmt::format("has a malformed entry for \"{}\"", key);
      damaged = true;
    }
  }
  if (!warn || problem.empty()) return;
  const std::string what =
      fmt::format("[matmul] {} {}; measuring the libraries of each product again and rewriting it",
                  cache_.string(), problem);
  if (damaged) {
    log_warn("{}", what);
  } else {
    log_info("{}", what);
  }
}

MatmulLib MatmulChooser::choose(const MatmulArgs& x) {
  // Inside a parallel region a product runs on the calling thread alone (and is not split).
  const std::string key = matmul_choice_key(x, omp_in_parallel() ? 1 : omp_get_max_threads());
  if (!loaded_) {
    load(true);
    loaded_ = true;
  }
  auto usable = [&] {
    const auto it = known_.find(key);
    return it != known_.end() && matmul_lib_supports(it->second, x);
  };
  if (usable()) return known_[key];
  // Under the lock another process may have measured it meanwhile.
  const CacheLock lock(cache_);
  load(false);
  if (usable()) return known_[key];
  if (known_.count(key)) {
    log_warn("[matmul] {}: the entry for \"{}\" names {}, which cannot run it; measuring again",
             cache_.string(), key, matmul_lib_name(known_[key]));
  }
  // Rounds over the libraries, each keeping its best: a burst of other work on the machine then
  // slows one run of every library rather than all runs of one.
  std::map<MatmulLib, double> rate;
  for (int round = 0; round < kRounds; ++round) {
    for (MatmulLib lib : kMatmulLibs) {
      if (matmul_lib_supports(lib, x)) rate[lib] = std::max(rate[lib], source_.measure(lib, x));
    }
  }
  json rates = json::object();
  MatmulLib best = rate.begin()->first;  // oneDNN runs every product the chooser sees
  for (const auto& [lib, g] : rate) {
    rates[matmul_lib_name(lib)] = g;
    if (g > rate.at(best)) best = lib;
  }
  known_[key] = best;
  ++measured_;
  if (!cache_.empty()) {
    const json entry = {{"library", matmul_lib_name(best)},
                        {"role", x.role},
                        {"gflops", rates},
                        {"measured_at", utc_now()}};
    write_machine_cache(
        cache_, kSchema, source_.machine, "products", json::object({{key, entry}}),
        [](const json& e) { return parse_entry(e, nullptr); }, "matmul");
  }
  return best;
}

MatmulChooser& matmul_chooser() {
  static MatmulChooser chooser(matmul_cache_path(), machine_matmul_source());
  return chooser;
}

}  // namespace tetra::cpu
