#include "kernels/cpu/rope.h"

#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/profile.h"

namespace tetra::cpu {

namespace {

// Below this many table entries the cosines and sines are computed on the calling thread: a
// parallel region costs more.
constexpr int64_t kParallelAngles = 4096;

}  // namespace

template <typename F>
void rope(F* qkv, const AttentionShape& s, int pos0, double theta, bool inverse) {
  const ProfileScope profile(ProfKind::attention, inverse ? "rope backward" : "rope");
  TETRA_CHECK(s.NH > 0 && s.C % s.NH == 0 && s.head_size() % 2 == 0,
              "[rope] C = {} over NH = {} heads: the head size must be a whole, even number", s.C,
              s.NH);
  const int hs = s.head_size(), half = hs / 2, T = s.T;
  const int64_t W = s.width();
  // The q heads and then the k heads fill the start of each row: NH + KVH heads of hs, contiguous.
  const int heads = s.NH + s.kv_heads();

  // The call's T·hs/2 angles, shared by every head, q and k, and every sequence. The inverse
  // negates the sines, which is exact, so the two directions are transposes of one another.
  std::vector<double> freq(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) freq[size_t(i)] = std::pow(theta, -2.0 * i / hs);
  const double sign = inverse ? -1.0 : 1.0;
  std::vector<F> cos_t(size_t(T) * half), sin_t(size_t(T) * half);
#pragma omp parallel for schedule(static) if (int64_t(T) * half >= kParallelAngles)
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < half; ++i) {
      const double a = double(pos0 + t) * freq[size_t(i)];
      cos_t[size_t(t) * half + i] = F(std::cos(a));
      sin_t[size_t(t) * half + i] = F(sign * std::sin(a));
    }
  }

#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < int64_t(s.B) * T; ++r) {
    const F* c = cos_t.data() + (r % T) * half;
    const F* sn = sin_t.data() + (r % T) * half;
    F* row = qkv + r * W;
    for (int h = 0; h < heads; ++h) {
      F* x = row + int64_t(h) * hs;
      F* y = x + half;
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const F a = x[i], b = y[i];
        x[i] = a * c[i] - b * sn[i];
        y[i] = b * c[i] + a * sn[i];
      }
    }
  }
}

template void rope<float>(float*, const AttentionShape&, int, double, bool);
template void rope<double>(double*, const AttentionShape&, int, double, bool);

}  // namespace tetra::cpu
