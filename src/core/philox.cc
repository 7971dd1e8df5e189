#include "core/philox.h"

#include <xxhash.h>

#include <cmath>

namespace tetra {

namespace {
constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;

inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = uint64_t(a) * b;
  hi = uint32_t(p >> 32);
  lo = uint32_t(p);
}
}  // namespace

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMul0, c[0], hi0, lo0);
    mulhilo(kMul1, c[2], hi1, lo1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
    k[0] += kWeyl0;
    k[1] += kWeyl1;
  }
  return c;
}

uint64_t name_hash(std::string_view name) { return XXH3_64bits(name.data(), name.size()); }

Philox::Philox(uint64_t seed, std::string_view stream_name)
    : seed_(seed), stream_(name_hash(stream_name)) {}
Philox::Philox(uint64_t seed, uint64_t stream_id) : seed_(seed), stream_(stream_id) {}

static std::array<uint32_t, 4> block(uint64_t seed, uint64_t stream, uint64_t index) {
  return philox4x32(
      {uint32_t(index), uint32_t(index >> 32), uint32_t(stream), uint32_t(stream >> 32)},
      {uint32_t(seed), uint32_t(seed >> 32)});
}

// 24 high bits -> [0,1) exactly representable in f32.
static inline float to_unit(uint32_t x) { return float(x >> 8) * (1.0f / 16777216.0f); }

float Philox::normal(uint64_t index) const {
  auto r = block(seed_, stream_, index);
  // Box-Muller in double so the result does not depend on libm's float paths.
  double u1 = (double(r[0]) + 1.0) / 4294967296.0;  // (0, 1]
  double u2 = double(r[1]) / 4294967296.0;
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
}

float Philox::uniform(uint64_t index, int lane) const {
  return to_unit(block(seed_, stream_, index)[lane & 3]);
}

uint64_t Philox::bits(uint64_t index) const {
  auto r = block(seed_, stream_, index);
  return (uint64_t(r[0]) << 32) | r[1];
}

}  // namespace tetra
