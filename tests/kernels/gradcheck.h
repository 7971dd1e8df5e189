// Finite-difference gradient checking in double precision for the kernel tests.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace tetra::testing {

inline std::vector<double> random_vector(size_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

/** Compares analytic to central differences of loss() with respect to every element of x.
 * Returns the max relative error max|a - n| / max(|n|_inf, tiny) over the tensor. */
inline double max_grad_error(std::vector<double>& x, const std::vector<double>& analytic,
                             const std::function<double()>& loss, double eps = 1e-6) {
  EXPECT_EQ(x.size(), analytic.size());
  double max_diff = 0.0, max_ref = 1e-12;
  for (size_t i = 0; i < x.size(); ++i) {
    double saved = x[i];
    x[i] = saved + eps;
    double up = loss();
    x[i] = saved - eps;
    double down = loss();
    x[i] = saved;
    double numeric = (up - down) / (2 * eps);
    max_diff = std::max(max_diff, std::abs(numeric - analytic[i]));
    max_ref = std::max(max_ref, std::abs(numeric));
  }
  return max_diff / max_ref;
}

/** sum(out * r): a random linear functional of a kernel's output, so dL/dout = r. */
inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

constexpr double kGradTolerance = 1e-6;

}  // namespace tetra::testing
