// Uniform random operands in [-1, 1) for the matmul tests, reproducible by seed; and the OpenMP
// thread count set for a scope.
#pragma once

#include <omp.h>

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

/** Sets the OpenMP thread count while it lives. */
class Threads {
 public:
  explicit Threads(int n) : before_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~Threads() { omp_set_num_threads(before_); }
  Threads(const Threads&) = delete;
  Threads& operator=(const Threads&) = delete;

 private:
  int before_;
};

}  // namespace tetra::testing
