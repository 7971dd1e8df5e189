// The machine's measured matmul rates, fp32 and bf16: the trainer's MFU denominator (the bf16 one
// for a bf16 run whose products use bf16 instructions) and the planner's `cpu` device. Measured
// per thread count through the matmul seam the model uses, on the library chosen for a 2048^3
// product (the best such product over a second; bf16: bf16 A and B, f32 C, on the library chosen
// for them: oneDNN's bf16 primitive, or the operands widened to f32 where that is faster or the
// CPU has no bf16 primitive), and kept in one cache,
// $XDG_CACHE_HOME/tetra/peak.json (default $HOME/.cache/tetra/peak.json; the format of
// core/machine_cache.h), that the trainer and the planner both read and write here:
//
//   {"schema": 3, "machine": "<CPU model> (oneDNN <ISA>, OpenBLAS <core>)",
//    "threads": {"2": {"gflops": 151.2, "load_average": 0.31,
//                      "measured_at": "2025-01-31T12:00:00Z"},
//                "bf16:2": {"gflops": 402.7, ...}, ...}}
//
// The cache never stops a run: a missing, damaged, older-format or other-machine file, or a
// missing or malformed entry, is measured (again) and the file rewritten, with a warning at most.
// A value measured on a busy machine (load average > 1) is measured again the first time the
// machine is quiet (< 0.5). Writes are atomic, so concurrent runs see the old file or the new.
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <string>

namespace tetra::cpu {

/** GFLOP/s of an fp32 2048^3 matmul at `threads` threads: given_peak_gflops, else from the cache
 *  or measured now. */
double fp32_peak_gflops(int threads, bool* from_cache = nullptr);
/** The same for bf16 operands (f32 accumulation and result), on a CPU with bf16 instructions
 *  (bf16_matmul_path().hardware; refused elsewhere unless given). */
double bf16_peak_gflops(int threads, bool* from_cache = nullptr);

/** $TETRA_PEAK_GFLOPS: one thread's GFLOP/s, given instead of measured for fp32 and bf16 alike (a
 *  datasheet figure, or the fixed figure tests/hermetic.sh gives every test, whose fresh HOME
 *  would otherwise measure it for a second or more), times `threads`. Nothing when unset; a value
 *  that is not a positive number is refused. */
std::optional<double> given_peak_gflops(int threads);

/** Bytes per second one thread copies between two 32 MB buffers (past the caches; read and written
 *  bytes counted): the best of a few copies, once per process, through the cache below. */
double copy_bandwidth();
/** The copy bandwidth kept in `path` (memory.json) with the load average it was measured under:
 *  a figure measured on a quiet machine (load <= 1) is returned as it is; otherwise, or with none
 *  kept, `measure()` runs, the better figure is kept with `load`, and it is returned. A figure
 *  measured under load is measured again once `load` is below 0.5 or half of that load (the rule
 *  of the peak's cache). An empty path measures and keeps nothing. */
double copy_bandwidth(const std::filesystem::path& path, double load,
                      const std::function<double()>& measure);

/** $XDG_CACHE_HOME/tetra/peak.json, else $HOME/.cache/tetra/peak.json; empty when neither is
 *  set (the peak is then measured each time and not cached). */
std::filesystem::path peak_cache_path();

/** What the cache logic reads from the machine; tests substitute their own. */
struct PeakSource {
  std::function<double(int threads, bool bf16)> measure;  // GFLOP/s at `threads` threads
  std::function<double()> load_average;                   // 1-minute load average
  std::string machine;  // cache entries of another machine or ISA are measured again
};
/** The real machine: the measurement, /proc/loadavg, matmul_machine(). */
PeakSource machine_peak_source();

/** fp32_peak_gflops (bf16_peak_gflops when `bf16`) with the cache at `cache` (none when empty)
 *  and the machine `source`. */
double peak_gflops(int threads, bool bf16, const std::filesystem::path& cache,
                   const PeakSource& source, bool* from_cache = nullptr);

}  // namespace tetra::cpu
