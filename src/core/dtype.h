// Element types. Compute is f32; bf16 is a storage type (weights/activations under mixed
// precision).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tetra {

enum class DType : uint8_t { f32, bf16, i32, u16, u32, f64 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::bf16:
      return 2;
    case DType::i32:
      return 4;
    case DType::u16:
      return 2;
    case DType::u32:
      return 4;
    case DType::f64:
      return 8;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::i32:
      return "i32";
    case DType::u16:
      return "u16";
    case DType::u32:
      return "u32";
    case DType::f64:
      return "f64";
  }
  return "?";
}

/** Brain float: the top 16 bits of an IEEE f32. Conversion rounds to nearest even. */
struct bf16 {
  uint16_t bits = 0;

  static bf16 from_float(float f) {
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40u)};  // keep NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return bf16{uint16_t(u >> 16)};
  }
  float to_float() const { return std::bit_cast<float>(uint32_t(bits) << 16); }
};
static_assert(sizeof(bf16) == 2);

}  // namespace tetra
