// Owning, 64-byte-aligned flat buffers on a device (core/device.h; the host unless one is named).
// Parameters, gradients, optimizer state, activations and communication workspaces each live in
// one of these; tensors are views (pointers + shape) into them. A buffer may be charged to a
// category of a MemoryLedger for as long as it holds memory, so the ledger counts the bytes of
// whichever device holds them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "core/device.h"
#include "core/memory.h"

namespace tetra {

template <typename T>
class Buffer {
 public:
  Buffer() = default;
  /** n zeroed elements on `device`, charged to `tag`. */
  explicit Buffer(size_t n, MemTag tag = {}, Device& device = host_device())
      : device_(&device), tag_(tag) {
    resize(n);
  }
  Buffer(Buffer&& o) noexcept
      : device_(o.device_),
        data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        tag_(o.tag_) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      release();
      device_ = o.device_;
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      tag_ = o.tag_;
    }
    return *this;
  }
  ~Buffer() { release(); }

  /** Charges this buffer's memory, now and later, to `tag`. */
  void set_tag(MemTag tag) {
    charge(-1);
    tag_ = tag;
    charge(+1);
  }

  /** Reallocates to n zeroed elements on the same device (0 frees). */
  void resize(size_t n) {
    release();
    if (n) {
      data_ = static_cast<T*>(device_->allocate(n * sizeof(T)));
      device_->fill_zero(data_, n * sizeof(T));
    }
    size_ = n;
    charge(+1);
  }
  void zero() {
    if (size_) device_->fill_zero(data_, size_ * sizeof(T));
  }

  Device& device() const { return *device_; }
  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  size_t bytes() const { return size_ * sizeof(T); }
  /** Element access for host-accessible devices only (the host, the CPU backend). */
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }

 private:
  void charge(int sign) {
    if (tag_.ledger && size_) tag_.ledger->add(tag_.category, sign * int64_t(bytes()));
  }
  void release() {
    charge(-1);
    if (data_) device_->release(data_, size_ * sizeof(T));
    data_ = nullptr;
    size_ = 0;
  }

  Device* device_ = &host_device();
  T* data_ = nullptr;
  size_t size_ = 0;
  MemTag tag_;
};

}  // namespace tetra
