// The CUDA backend's Device: GPU memory through a caching allocator over cudaMalloc, and byte
// movement queued on the backend's compute stream (kernels/cuda/runtime.h).
//
// Allocations are rounded up to a size class and released blocks go to a free list per class;
// the next allocation of that class takes a cached block instead of calling cudaMalloc, which
// synchronises the device and costs far more than a kernel. Every kernel and copy of the backend
// runs on one stream, so a block released while queued work still reads it is only handed to work
// queued after that work: stream order makes the reuse safe without events. When cudaMalloc runs
// out of memory the cache is freed (after waiting for the device) and the allocation retried once.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/device.h"

namespace tetra::cuda {

/** The backend's Device (kind cuda, not host accessible). */
Device& device();

/** The caching allocator's counters, for diagnostics and tests. */
struct AllocatorStats {
  size_t in_use_bytes = 0;    // handed out and not yet released (rounded sizes)
  size_t cached_bytes = 0;    // released and kept for reuse
  int64_t cuda_mallocs = 0;   // cudaMalloc calls that succeeded, over the process
  int64_t cache_hits = 0;     // allocations served from the free lists
  int64_t cache_flushes = 0;  // times the cache was returned to the driver (OOM retry, empty_cache)
};
AllocatorStats allocator_stats();
/** Returns every cached block to the driver (waits for the device first). */
void empty_cache();
/** The size class an allocation of `bytes` is rounded up to. */
size_t allocation_size(size_t bytes);

/** Device scratch for the duration of one operation, from the caching allocator. Released when it
 *  goes out of scope: later work on the compute stream may reuse it, never work queued before. */
class Scratch {
 public:
  explicit Scratch(size_t bytes);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  void* get() const { return p_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  size_t bytes_;
  void* p_;
};

}  // namespace tetra::cuda
