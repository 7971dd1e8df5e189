#include "core/device.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "core/error.h"

namespace tetra {

const char* device_kind_name(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::cpu:
      return "cpu";
    case DeviceKind::cuda:
      return "cuda";
  }
  return "?";
}

DeviceKind parse_device_kind(const std::string& text, const std::string& key) {
  if (text == "cpu") return DeviceKind::cpu;
  if (text == "cuda") return DeviceKind::cuda;
  fail("[config] {}='{}' is unknown; use cpu or cuda", key, text);
}

namespace {

constexpr size_t kParallelCopyBytes = size_t(4) << 20;

class HostDevice final : public Device {
 public:
  DeviceKind kind() const override { return DeviceKind::cpu; }
  bool host_accessible() const override { return true; }
  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void release(void* p, size_t) override { std::free(p); }
  void fill_zero(void* p, size_t bytes) override {
    if (bytes) std::memset(p, 0, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0 || dst == src) return;
    const char* in = static_cast<const char*>(src);
    char* out = static_cast<char*>(dst);
    // Large copies (checkpoint snapshots, gathered weights) over the OpenMP threads; overlapping
    // ranges (never between tensors) keep memmove's semantics on one thread.
    if (bytes < kParallelCopyBytes || (out < in + bytes && in < out + bytes)) {
      std::memmove(dst, src, bytes);
      return;
    }
    const int64_t chunks = int64_t((bytes + kParallelCopyBytes - 1) / kParallelCopyBytes);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const size_t at = size_t(c) * kParallelCopyBytes;
      std::memcpy(out + at, in + at, std::min(kParallelCopyBytes, bytes - at));
    }
  }
  void to_host(void* host, const void* src, size_t bytes) override { copy(host, src, bytes); }
  void from_host(void* dst, const void* host, size_t bytes) override { copy(dst, host, bytes); }
  void synchronize() override {}
};

}  // namespace

Device& host_device() {
  static HostDevice device;
  return device;
}

}  // namespace tetra
