// A backend: the Device that holds a run's tensors and the kernel tables that compute on them
// (kernels/kernels.h). A run picks one with run.device (cpu | cuda); the model, the optimizer, the
// parallel engines and the trainer are handed it and never ask which it is, except where a report
// names it (the run header, metrics).
#pragma once

#include <string>

#include "core/device.h"
#include "kernels/kernels.h"

namespace tetra {

class Backend {
 public:
  virtual ~Backend() = default;

  virtual Device& device() = 0;
  DeviceKind kind() { return device().kind(); }
  /** The f32 table (training). */
  virtual Kernels<float>& f32() = 0;
  /** The f64 table (whole-model gradient checks); throws tetra::Error where the backend has
   *  none. */
  virtual Kernels<double>& f64() = 0;
  template <typename F>
  Kernels<F>& kernels() {
    if constexpr (sizeof(F) == 8) {
      return f64();
    } else {
      return f32();
    }
  }

  /** The processor and its libraries, e.g. "cpu: Intel Xeon (oneDNN avx512_core_amx, OpenBLAS
   *  SapphireRapids)". */
  virtual std::string describe() = 0;
  /** How the products of a run in this precision are computed, for the header and metrics. */
  virtual std::string matmul_path(bool bf16) = 0;
  /** Which library computes each f32 product (kernels.matmul: auto | onednn | openblas, given by
   *  `key`): one fixed library makes two runs compute every product alike whatever the machine's
   *  timings. A backend with one library accepts only auto. */
  virtual void set_matmul_policy(const std::string& policy, const std::string& key) = 0;
  /** Empty when mixed precision (train.precision = bf16) runs here; otherwise why not and what to
   *  change. */
  virtual std::string bf16_unsupported() = 0;
  /** The rate MFU is measured against, in GFLOP/s per rank at `threads` host threads: the CPU's
   *  measured matmul peak in the run's precision (fp32 or bf16), a GPU's dense peak in it.
   *  `source` (if given) says where it came from: "measured" (", bf16 products"), "datasheet",
   *  or "TETRA_PEAK_GFLOPS" (the CPU's, given: kernels/cpu/peak.h). */
  virtual double peak_gflops(bool bf16, int threads, std::string* source = nullptr) = 0;
  /** Bytes per second the device's memory moves when one buffer is copied to another (read and
   *  written bytes counted), measured on first use: the rate memory-bound kernels are held to. */
  virtual double memory_bandwidth() = 0;
  /** Host threads the backend's kernels use (OpenMP on the CPU). */
  virtual void set_threads(int threads) = 0;
};

/** The CPU backend (oneDNN, OpenBLAS, OpenMP): always built, f32 and f64. */
Backend& cpu_backend();
/** The backend of `kind`; refuses a kind this tetra was built without, saying how to get it. */
Backend& backend_for(DeviceKind kind);
/** Whether this tetra was built with the CUDA backend, and (when it was) whether a GPU is
 *  present: "" when cuda runs here, else why not. */
std::string cuda_unavailable();

}  // namespace tetra
