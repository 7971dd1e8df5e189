#include "kernels/cpu/embedding.h"

#include "core/profile.h"

namespace tetra::cpu {

template <typename F>
void embedding_forward(F* out, const int32_t* tokens, const F* wte, const F* wpe, int B, int T,
                       int C, int pos0, int v0, int Vl) {
  const ProfileScope profile(ProfKind::embedding, "forward");
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      F* o = out + (int64_t(b) * T + t) * C;
      const int row = tokens[b * T + t] - v0;
      if (Vl > 0 && (row < 0 || row >= Vl)) {
        for (int c = 0; c < C; ++c) o[c] = 0;
      } else {
        const F* e = wte + int64_t(row) * C;
        for (int c = 0; c < C; ++c) o[c] = e[c];
      }
      if (wpe) {
        const F* p = wpe + int64_t(pos0 + t) * C;
        for (int c = 0; c < C; ++c) o[c] += p[c];
      }
    }
  }
}

template <typename F>
void embedding_backward(F* dwte, F* dwpe, const F* dout, const int32_t* tokens, int B, int T, int C,
                        int v0, int Vl) {
  const ProfileScope profile(ProfKind::embedding, "backward");
  // Channels are split across threads so that repeated tokens never race; within a thread the
  // (b, t) order is fixed, so the sums are deterministic for any thread count.
#pragma omp parallel for schedule(static)
  for (int c0 = 0; c0 < C; c0 += 16) {
    int c1 = c0 + 16 < C ? c0 + 16 : C;
    for (int b = 0; b < B; ++b) {
      for (int t = 0; t < T; ++t) {
        const F* d = dout + (int64_t(b) * T + t) * C;
        if (dwpe) {
          F* p = dwpe + int64_t(t) * C;
          for (int c = c0; c < c1; ++c) p[c] += d[c];
        }
        const int row = tokens[b * T + t] - v0;
        if (Vl > 0 && (row < 0 || row >= Vl)) continue;
        F* e = dwte + int64_t(row) * C;
        for (int c = c0; c < c1; ++c) e[c] += d[c];
      }
    }
  }
}

template void embedding_forward<float>(float*, const int32_t*, const float*, const float*, int, int,
                                       int, int, int, int);
template void embedding_forward<double>(double*, const int32_t*, const double*, const double*, int,
                                        int, int, int, int, int);
template void embedding_backward<float>(float*, float*, const float*, const int32_t*, int, int, int,
                                        int, int);
template void embedding_backward<double>(double*, double*, const double*, const int32_t*, int, int,
                                         int, int, int);

}  // namespace tetra::cpu
