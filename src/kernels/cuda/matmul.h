// Matrix products of the CUDA backend through cuBLASLt (kernels/cuda/matmul.cc).
#pragma once

#include <cstddef>
#include <string>

#include "kernels/kernels.h"

namespace tetra::cuda {

/** C = A·B (+ bias) (+ C) as MatmulArgs describes it: f32 or bf16 A and B, f32 C, accumulated in
 *  f32 without TF32; `bf16` rounds f32 operands to bf16 first. Synchronises nothing. */
void matmul(const MatmulArgs& args);

/** cuBLASLt's version, "13.0.2". */
std::string cublaslt_version();

/** Number of cached cuBLASLt plans (descriptors and the heuristic's algorithm), for tests. */
size_t matmul_plan_count();

}  // namespace tetra::cuda
