// safetensors files (Hugging Face): u64 little-endian header length, a JSON header mapping each
// tensor name to {dtype, shape, data_offsets}, then the raw little-endian data. Reader and writer
// are our own; every offset and size is bounds-checked against the file.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace tetra {

struct SafeTensor {
  DType dtype = DType::f32;  // F32, BF16, I32, U16, U32 are understood
  Shape shape;
  std::vector<uint8_t> bytes;  // raw little-endian data, size = numel * dtype_size

  /** The values converted to f32 (from F32 or BF16); throws for integer dtypes. */
  std::vector<float> to_f32() const;
  /** The same values in the same encoding. */
  bool operator==(const SafeTensor&) const = default;
};

struct SafeTensorsFile {
  std::map<std::string, SafeTensor> tensors;
  std::map<std::string, std::string> metadata;  // the optional "__metadata__" string map
};

/** Reads and validates a whole file. Errors name the path and the offending tensor. */
SafeTensorsFile read_safetensors(const std::string& path);

/** The same over a file's bytes in memory; origin names it in errors. */
SafeTensorsFile parse_safetensors(std::span<const uint8_t> bytes, const std::string& origin);

/** Writes tensors in name order (temp file + rename). */
void write_safetensors(const std::string& path, const SafeTensorsFile& file);

/** Convenience: an f32 tensor from a float range. */
SafeTensor safetensor_f32(const Shape& shape, const float* data);

}  // namespace tetra
