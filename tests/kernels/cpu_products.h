// The CPU backend's 2-D product helpers (kernels/kernels.h) under the names the CPU kernel tests
// call them by: these tests exercise the CPU kernels directly, f32 and f64.
#pragma once

#include <utility>

#include "kernels/backend.h"

namespace tetra::cpu::test_products {

template <typename F, typename... Args>
void matmul_nt(F* out, Args&&... args) {
  tetra::matmul_nt<F>(cpu_backend().kernels<F>(), out, std::forward<Args>(args)...);
}
template <typename F, typename... Args>
void matmul_nn(F* out, Args&&... args) {
  tetra::matmul_nn<F>(cpu_backend().kernels<F>(), out, std::forward<Args>(args)...);
}
template <typename F, typename... Args>
void matmul_tn(F* out, Args&&... args) {
  tetra::matmul_tn<F>(cpu_backend().kernels<F>(), out, std::forward<Args>(args)...);
}

}  // namespace tetra::cpu::test_products
