// One `tetra train` run of a parallel layout (metrics and saved weights) and the comparison of two
// runs' trajectories, shared by the data- and tensor-parallel equivalence tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "tests/train/run_tetra.h"

namespace tetra::testing {

struct LayoutRun {
  int code = 0;
  std::string output;
  std::vector<double> loss, grad_norm, comm_bytes;
  SafeTensorsFile weights;
};

/** The result of `ran`: its metrics.jsonl in `run_dir` and the weights it saved to `weights`. */
inline LayoutRun read_layout_run(const Ran& ran, const std::filesystem::path& run_dir,
                                 const std::filesystem::path& weights) {
  LayoutRun r;
  r.code = ran.code;
  r.output = ran.output;
  if (r.code != 0) return r;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    r.loss.push_back(j["loss"]);
    r.grad_norm.push_back(j["grad_norm"]);
    r.comm_bytes.push_back(j["comm_bytes"]);
  }
  r.weights = read_safetensors(weights.string());
  return r;
}

/** ||a - b|| / ||a|| over two tensors' values. */
inline double norm_rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, ref = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += double(a[i] - b[i]) * (a[i] - b[i]);
    ref += double(a[i]) * a[i];
  }
  return std::sqrt(diff / ref);
}

/** Final weights within `tol` per tensor (norm-relative), or, when `tensor_tol` is given, within
 *  `tol` over all tensors together and within `tensor_tol` per tensor. Records the worst tensor's
 *  error as max_weight_rel_error and the whole model's as weight_rel_error. */
inline void expect_same_weights(const LayoutRun& a, const LayoutRun& b, double tol,
                                double tensor_tol = 0) {
  // Per tensor, ||a - b|| / ||a||: Adam turns float noise in gradients that are zero in exact
  // arithmetic (the key bias: softmax ignores a shift shared by all keys) into lr-sized steps
  // of arbitrary sign, so an elementwise maximum would measure noise, not the layout.
  // The key third of c_attn.bias is therefore compared on its own: it must stay at noise level.
  if (tensor_tol == 0) tensor_tol = tol;
  double worst = 0, diff = 0, ref = 1e-30;
  std::string worst_name;
  ASSERT_EQ(a.weights.tensors.size(), b.weights.tensors.size());
  for (const auto& [name, t] : a.weights.tensors) {
    auto x = t.to_f32(), y = b.weights.tensors.at(name).to_f32();
    ASSERT_EQ(x.size(), y.size()) << name;
    if (name.ends_with("attn.c_attn.bias")) {
      const size_t C = x.size() / 3;
      for (size_t i = C; i < 2 * C; ++i) {
        EXPECT_LT(std::abs(x[i]), 1e-3) << name << " key bias " << i - C;
        EXPECT_LT(std::abs(y[i]), 1e-3) << name << " key bias " << i - C;
        x[i] = y[i] = 0.0f;
      }
    }
    const double rel = norm_rel_error(x, y);
    if (rel > worst) worst = rel, worst_name = " (" + name + ")";
    EXPECT_LT(rel, tensor_tol) << name;
    for (size_t i = 0; i < x.size(); ++i) {
      diff += double(x[i] - y[i]) * (x[i] - y[i]);
      ref += double(x[i]) * x[i];
    }
  }
  const double whole = std::sqrt(diff / ref);
  EXPECT_LT(whole, tol) << "all weights together";
  ::testing::Test::RecordProperty("max_weight_rel_error", std::to_string(worst));
  ::testing::Test::RecordProperty("weight_rel_error", std::to_string(whole));
  // One line per comparison, in the test's order, for scripts/measure-floors.sh (docs/testing.md).
  static int comparisons = 0;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::cout << "[ floor    ] " << info->test_suite_name() << "." << info->name() << " #"
            << ++comparisons << " whole " << whole << " tensor " << worst << " bounds " << tol
            << " " << tensor_tol << worst_name << std::endl;
}

/** Every step's loss within `tol` relative, grad norms within 1e-4, final weights within
 *  `weights_tol` over the model and `tensor_tol` per tensor (norm-relative, expect_same_weights;
 *  0: `tol`). Bounds follow docs/testing.md: the measured floor times at least 3. */
inline void expect_same_trajectory(const LayoutRun& a, const LayoutRun& b, double tol, size_t steps,
                                   double weights_tol = 0, double tensor_tol = 0) {
  ASSERT_EQ(a.loss.size(), steps);
  ASSERT_EQ(a.loss.size(), b.loss.size());
  double loss = 0, norm = 0;
  for (size_t i = 0; i < a.loss.size(); ++i) {
    EXPECT_NEAR(b.loss[i], a.loss[i], tol * a.loss[i]) << "step " << i + 1;
    EXPECT_NEAR(b.grad_norm[i], a.grad_norm[i], 1e-4 * a.grad_norm[i]) << "step " << i + 1;
    loss = std::max(loss, std::abs(b.loss[i] - a.loss[i]) / a.loss[i]);
    norm = std::max(norm, std::abs(b.grad_norm[i] - a.grad_norm[i]) / a.grad_norm[i]);
  }
  std::cout << "[ floor    ] loss " << loss << " grad_norm " << norm << std::endl;
  expect_same_weights(a, b, weights_tol > 0 ? weights_tol : tol, tensor_tol);
}

}  // namespace tetra::testing
