// Where tensor memory lives and how bytes move to, from and within it. Every buffer of a training
// run (parameters, gradients, optimizer state, activations, communication workspaces) is allocated
// through the Device of the run's backend (kernels/backend.h): host memory for the CPU backend,
// GPU memory for the CUDA backend. Host copies exist only where data must reach a file or the
// host's own code (checkpoint staging, safetensors, the sampler's logits), and go through
// to_host/from_host, so that one grep finds every crossing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tetra {

enum class DeviceKind : uint8_t { cpu, cuda };

/** "cpu" | "cuda". */
const char* device_kind_name(DeviceKind kind);
/** Parses run.device's value; `key` names the config key in the error. */
DeviceKind parse_device_kind(const std::string& text, const std::string& key);

class Device {
 public:
  virtual ~Device() = default;

  virtual DeviceKind kind() const = 0;
  /** Whether the host can read and write this device's memory through its pointers. */
  virtual bool host_accessible() const = 0;

  /** `bytes` of uninitialised device memory, 64-byte aligned (nullptr for 0); throws
   *  std::bad_alloc when the device has no room. */
  virtual void* allocate(size_t bytes) = 0;
  /** Returns memory from allocate() (`bytes` as allocated). Waits for nothing: memory handed back
   *  while queued work still uses it stays reserved until that work is done. */
  virtual void release(void* p, size_t bytes) = 0;

  /** Sets `bytes` at p to zero. */
  virtual void fill_zero(void* p, size_t bytes) = 0;
  /** Device to device, in the order of the device's queued work; the ranges are equal (nothing
   *  to do) or do not overlap. */
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  /** Device to host: returns once the bytes are in `host` (after the work queued before it). */
  virtual void to_host(void* host, const void* src, size_t bytes) = 0;
  /** Host to device: `host` may be reused as soon as this returns. */
  virtual void from_host(void* dst, const void* host, size_t bytes) = 0;
  /** Waits for every operation queued on the device so far. */
  virtual void synchronize() = 0;
};

/** The host's own memory: aligned_alloc and memcpy. The CPU backend's device, and the default of
 *  every buffer that names none. */
Device& host_device();

}  // namespace tetra
