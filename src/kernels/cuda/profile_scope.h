// Per-kernel profiling of the CUDA backend (core/profile.h). Kernels run asynchronously, so a
// ProfileScope alone would time the launch. While a profile is active, a KernelScope waits for the
// stream when it opens (so earlier work is not charged to it) and again before its ProfileScope
// closes, so the entry holds the kernel's own time. Without a profile it never synchronises.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/profile.h"
#include "kernels/cuda/runtime.h"

namespace tetra::cuda {

class KernelScope {
 public:
  KernelScope(ProfKind kind, const char* label) : stream_(begin()), scope_(kind, label) {}
  /** A matrix product, as ProfileScope's shape constructor. */
  KernelScope(const char* label, int64_t b, int64_t M, int64_t K, int64_t N)
      : stream_(begin()), scope_(label, b, M, K, N) {}
  // Runs before scope_ closes (members are destroyed after the destructor's body). An error here
  // is left to the next CUDA call to report: a destructor must not throw.
  ~KernelScope() {
    if (stream_) cudaStreamSynchronize(stream_);
  }
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;

 private:
  // The stream to wait for at the end (null when no profile is active), drained now.
  static cudaStream_t begin() {
    if (!Profile::active()) return nullptr;
    const cudaStream_t s = compute_stream();
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize (profile)");
    return s;
  }

  cudaStream_t stream_;  // declared before scope_: the stream is drained before the scope opens
  ProfileScope scope_;
};

}  // namespace tetra::cuda
