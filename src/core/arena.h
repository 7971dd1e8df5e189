// Owning, 64-byte-aligned flat buffers. Parameters, gradients and optimizer state each live in
// one of these; tensors are views (pointers + shape) into them. A buffer may be charged to a
// category of a MemoryLedger for as long as it holds memory.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#include "core/memory.h"

namespace tetra {

template <typename T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t n, MemTag tag = {}) : tag_(tag) { resize(n); }
  Buffer(Buffer&& o) noexcept
      : data_(std::move(o.data_)), size_(std::exchange(o.size_, 0)), tag_(o.tag_) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::move(o.data_);
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

  /** Reallocates to n zeroed elements (0 frees). */
  void resize(size_t n) {
    release();
    size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
    T* p = n ? static_cast<T*>(std::aligned_alloc(64, bytes)) : nullptr;
    if (n && !p) throw std::bad_alloc();
    if (n) std::memset(static_cast<void*>(p), 0, bytes);
    data_.reset(p);
    size_ = n;
    charge(+1);
  }
  void zero() {
    if (size_) std::memset(static_cast<void*>(data_.get()), 0, size_ * sizeof(T));
  }

  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  size_t size() const { return size_; }
  T& operator[](size_t i) { return data_.get()[i]; }
  const T& operator[](size_t i) const { return data_.get()[i]; }
  size_t bytes() const { return size_ * sizeof(T); }

 private:
  void charge(int sign) {
    if (tag_.ledger && size_) tag_.ledger->add(tag_.category, sign * int64_t(bytes()));
  }
  void release() {
    charge(-1);
    data_.reset();
    size_ = 0;
  }

  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  size_t size_ = 0;
  MemTag tag_;
};

}  // namespace tetra
