#include "kernels/cuda/allocator.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/runtime.h"
#include "kernels/cuda/state.h"

namespace tetra::cuda {

namespace {

constexpr size_t kMiB = size_t(1) << 20;

size_t round_up(size_t n, size_t step) { return (n + step - 1) / step * step; }

class CudaDevice final : public Device {
 public:
  DeviceKind kind() const override { return DeviceKind::cuda; }
  bool host_accessible() const override { return false; }

  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    const size_t size = allocation_size(bytes);
    runtime();  // binds this thread to the backend's GPU before cudaMalloc
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(size);
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      stats_.cached_bytes -= size;
      ++stats_.cache_hits;
      return hand_out(p, size);
    }
    void* p = nullptr;
    cudaError_t status = cudaMalloc(&p, size);
    if (status == cudaErrorMemoryAllocation) {
      // Out of memory is not sticky: clear it, give the cache back to the driver and try again.
      cudaGetLastError();
      flush_locked();
      status = cudaMalloc(&p, size);
      if (status == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        throw std::bad_alloc();
      }
    }
    check(status, "cudaMalloc");
    ++stats_.cuda_mallocs;
    return hand_out(p, size);
  }

  void release(void* p, size_t) override {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(p);
    if (it == live_.end()) {
      // release() runs in destructors, where an exception would terminate the process.
      std::fprintf(stderr, "[cuda] release of a pointer this allocator did not hand out: %p\n", p);
      return;
    }
    const size_t size = it->second;
    live_.erase(it);
    free_[size].push_back(p);
    stats_.in_use_bytes -= size;
    stats_.cached_bytes += size;
  }

  void fill_zero(void* p, size_t bytes) override {
    if (bytes == 0) return;
    check(cudaMemsetAsync(p, 0, bytes, compute_stream()), "cudaMemsetAsync (fill_zero)");
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0 || dst == src) return;
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, compute_stream()),
          "cudaMemcpyAsync (device to device)");
  }
  void to_host(void* host, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    const cudaStream_t s = compute_stream();
    check(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, s),
          "cudaMemcpyAsync (device to host)");
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize (device to host)");
  }
  void from_host(void* dst, const void* host, size_t bytes) override {
    if (bytes == 0) return;
    const cudaStream_t s = compute_stream();
    check(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, s),
          "cudaMemcpyAsync (host to device)");
    // The caller may reuse `host` as soon as this returns; a pageable source is only staged by
    // the copy call, so wait for the transfer itself.
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize (host to device)");
  }
  void synchronize() override {
    runtime();
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }

  AllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }
  void flush() {
    runtime();
    std::lock_guard<std::mutex> lock(mu_);
    flush_locked();
  }

 private:
  void* hand_out(void* p, size_t size) {
    live_[p] = size;
    stats_.in_use_bytes += size;
    return p;
  }
  // Waits for the device (queued work may still read cached blocks), then frees every cached
  // block.
  void flush_locked() {
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (freeing the allocator cache)");
    for (auto& [size, blocks] : free_) {
      for (void* p : blocks) check(cudaFree(p), "cudaFree (allocator cache)");
    }
    free_.clear();
    stats_.cached_bytes = 0;
    ++stats_.cache_flushes;
  }

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;  // size class -> released blocks
  std::unordered_map<void*, size_t> live_;               // handed out -> size class
  AllocatorStats stats_;
};

// Never destroyed: buffers of static objects may be released during exit, after any static
// allocator would be gone; the driver reclaims the memory with the process.
CudaDevice& the_device() {
  static CudaDevice* d = new CudaDevice;
  return *d;
}

}  // namespace

size_t allocation_size(size_t bytes) {
  // Below 1 MiB: multiples of 512 bytes. Up to 64 MiB: 8 classes per power of two (at most 12.5%
  // waste). Above: multiples of 2 MiB (under 3%); such buffers are few and long-lived.
  if (bytes <= kMiB) return round_up(std::max<size_t>(bytes, 1), 512);
  if (bytes < 64 * kMiB) return round_up(bytes, std::bit_floor(bytes) / 8);
  return round_up(bytes, 2 * kMiB);
}

Device& device() { return the_device(); }
AllocatorStats allocator_stats() { return the_device().stats(); }
void empty_cache() { the_device().flush(); }

Scratch::Scratch(size_t bytes) : bytes_(bytes), p_(the_device().allocate(bytes)) {}
Scratch::~Scratch() { the_device().release(p_, bytes_); }

}  // namespace tetra::cuda
