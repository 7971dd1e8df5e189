#include "kernels/cpu/moe_rows.h"

#include <cstring>

#include "core/profile.h"

namespace tetra::cpu {

namespace {
// Below this many elements a call runs on one thread (the fork costs more than the copy).
constexpr int64_t kParallelElements = int64_t(1) << 15;
}  // namespace

template <typename F>
void gather_rows(F* out, const F* in, const int32_t* idx, int64_t rows, int C) {
  const ProfileScope profile(ProfKind::moe, "gather rows");
#pragma omp parallel for schedule(static) if (rows * C >= kParallelElements)
  for (int64_t i = 0; i < rows; ++i) {
    F* o = out + i * C;
    if (idx[i] < 0) {
      std::memset(o, 0, sizeof(F) * size_t(C));
    } else {
      std::memcpy(o, in + int64_t(idx[i]) * C, sizeof(F) * size_t(C));
    }
  }
}

template <typename F>
void moe_combine(F* out, const F* in, const int32_t* pos, const F* gate, int64_t N, int k, int C) {
  const ProfileScope profile(ProfKind::moe, "combine");
#pragma omp parallel for schedule(static) if (N * k * C >= kParallelElements)
  for (int64_t t = 0; t < N; ++t) {
    F* o = out + t * C;
    for (int j = 0; j < k; ++j) {
      const int32_t p = pos[t * k + j];
      if (p < 0) continue;
      const F g = gate ? gate[t * k + j] : F(1);
      const F* x = in + int64_t(p) * C;
#pragma omp simd
      for (int c = 0; c < C; ++c) o[c] += g * x[c];
    }
  }
}

template <typename F>
void moe_combine_backward(F* din, F* dgate, const F* dout, const F* in, const int32_t* pos,
                          const F* gate, int64_t N, int k, int C) {
  const ProfileScope profile(ProfKind::moe, "combine backward");
#pragma omp parallel for schedule(static) if (N * k * C >= kParallelElements)
  for (int64_t t = 0; t < N; ++t) {
    const F* dy = dout + t * C;
    for (int j = 0; j < k; ++j) {
      const int32_t p = pos[t * k + j];
      if (p < 0) {
        dgate[t * k + j] = F(0);
        continue;
      }
      const F g = gate[t * k + j];
      const F* x = in + int64_t(p) * C;
      F* dx = din + int64_t(p) * C;
      F dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int c = 0; c < C; ++c) {
        dx[c] = g * dy[c];
        dot += dy[c] * x[c];
      }
      dgate[t * k + j] = dot;
    }
  }
}

#define TETRA_INSTANTIATE(F)                                                                  \
  template void gather_rows<F>(F*, const F*, const int32_t*, int64_t, int);                   \
  template void moe_combine<F>(F*, const F*, const int32_t*, const F*, int64_t, int, int);    \
  template void moe_combine_backward<F>(F*, F*, const F*, const F*, const int32_t*, const F*, \
                                        int64_t, int, int);
TETRA_INSTANTIATE(float)
TETRA_INSTANTIATE(double)
#undef TETRA_INSTANTIATE

}  // namespace tetra::cpu
