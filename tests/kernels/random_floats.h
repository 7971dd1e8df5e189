// Uniform random operands in [-1, 1) for the matmul tests, reproducible by seed.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace tetra::testing {

inline std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

}  // namespace tetra::testing
