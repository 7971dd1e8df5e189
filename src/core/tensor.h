// Non-owning tensor views. A view is a pointer into a flat buffer plus a shape; it never frees.
#pragma once

#include <cstdint>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace tetra {

using Shape = std::vector<int64_t>;

inline int64_t shape_numel(const Shape& s) {
  return std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<>());
}

std::string shape_str(const Shape& s);  // "(768, 2304)"

/** A named tensor living inside a flat buffer at `offset` elements; the owner of the buffer
 * turns it into a pointer (one layout serves parameters, gradients and optimizer state). */
struct TensorView {
  std::string name;
  Shape shape;
  size_t offset = 0;  // elements from the start of the owning flat buffer

  int64_t numel() const { return shape_numel(shape); }
};

}  // namespace tetra
