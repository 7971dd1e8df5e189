// Counter-based RNG (Philox 4x32-10, Salmon et al. 2011). A draw is a pure function of
// (seed, stream, index): a tensor's element i gets the same value whichever rank initialises it,
// so any sharding of a model starts identical to the unsharded one.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace tetra {

/** Philox4x32-10 block: 4 random 32-bit words for (counter, key). */
std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

/** A stream of draws keyed by (seed, name); element index selects the counter. */
class Philox {
 public:
  Philox(uint64_t seed, std::string_view stream_name);
  Philox(uint64_t seed, uint64_t stream_id);

  /** Standard normal for element `index` (Box-Muller on one Philox block). */
  float normal(uint64_t index) const;
  /** Uniform in [0, 1) for element `index`, draw `lane` in 0..3 of its block. */
  float uniform(uint64_t index, int lane = 0) const;
  /** Raw 64 bits for element `index`. */
  uint64_t bits(uint64_t index) const;

  uint64_t seed() const { return seed_; }
  uint64_t stream() const { return stream_; }

 private:
  uint64_t seed_;
  uint64_t stream_;
};

/** Stable 64-bit hash of a name (xxh3), used to key RNG streams by global tensor name. */
uint64_t name_hash(std::string_view name);

}  // namespace tetra
