// Owning, 64-byte-aligned flat buffers. Parameters, gradients and optimizer state each live in
// one of these; tensors are views (pointers + shape) into them.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace tetra {

template <typename T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t n) { resize(n); }

  void resize(size_t n) {
    size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
    T* p = n ? static_cast<T*>(std::aligned_alloc(64, bytes)) : nullptr;
    if (n && !p) throw std::bad_alloc();
    if (n) std::memset(static_cast<void*>(p), 0, bytes);
    data_.reset(p);
    size_ = n;
  }
  void zero() {
    if (size_) std::memset(static_cast<void*>(data_.get()), 0, size_ * sizeof(T));
  }

  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  size_t size() const { return size_; }
  T& operator[](size_t i) { return data_.get()[i]; }
  const T& operator[](size_t i) const { return data_.get()[i]; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  size_t size_ = 0;
};

}  // namespace tetra
