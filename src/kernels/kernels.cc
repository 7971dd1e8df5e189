#include "kernels/kernels.h"

#include <algorithm>
#include <iterator>

namespace tetra {

Bf16Operands::Bf16Operands(Device& device, size_t elements, MemTag tag)
    : mem_(elements, tag, device) {}

void Bf16Operands::keep_weights(const float* base, size_t n, MemTag tag) {
  base_ = base;
  weights_ = Buffer<bf16>(n, tag, mem_.device());
  fresh_.clear();
  updated_.clear();
}

void Bf16Operands::rounded_by_update(const std::vector<OwnedSegment>& segments) {
  updated_.clear();
  for (const OwnedSegment& g : segments) add(updated_, g.param_pos, g.param_pos + g.count);
}

std::pair<bf16*, bool> Bf16Operands::weights(const float* first, size_t extent) {
  if (!base_ || first < base_ || first + extent > base_ + weights_.size()) return {nullptr, false};
  const size_t offset = size_t(first - base_);
  const bool round = !covers(fresh_, offset, offset + extent);
  if (round) add(fresh_, offset, offset + extent);
  return {weights_.data() + offset, round};
}

void Bf16Operands::add(Ranges& ranges, size_t begin, size_t end) {
  if (begin >= end) return;
  auto it = ranges.upper_bound(begin);
  if (it != ranges.begin() && std::prev(it)->second >= begin) {
    --it;
    begin = it->first;
    end = std::max(end, it->second);
    it = ranges.erase(it);
  }
  while (it != ranges.end() && it->first <= end) {
    end = std::max(end, it->second);
    it = ranges.erase(it);
  }
  ranges.emplace(begin, end);
}

bool Bf16Operands::covers(const Ranges& ranges, size_t begin, size_t end) {
  auto it = ranges.upper_bound(begin);
  if (it == ranges.begin()) return false;
  return std::prev(it)->second >= end;
}

std::pair<bf16*, bf16*> Bf16Operands::take(size_t a, size_t b) {
  // Each operand starts on a cache line, so the rounding threads never share one.
  const size_t a_room = (a + 31) / 32 * 32;
  if (mem_.size() < a_room + b) mem_.resize(a_room + b);
  return {mem_.data(), mem_.data() + a_room};
}

namespace {

template <typename F>
MatmulArgs plain(F* out, int64_t M, int64_t N, int64_t K, bool accumulate, const char* role,
                 Bf16Operands* bf16) {
  MatmulArgs x;
  x.role = role;
  x.bf16 = bf16;
  x.M = M, x.N = N, x.K = K;
  x.a.dtype = x.b.dtype = dtype_of<F>();
  x.c = out;
  x.c_strides = {M * N, M * N, N, 1};
  x.accumulate = accumulate;
  return x;
}

}  // namespace

template <typename F>
MatmulArgs nt_args(F* out, const F* inp, const F* w, const F* bias, int64_t M, int64_t N, int64_t K,
                   bool accumulate, const char* role, Bf16Operands* bf16) {
  MatmulArgs x = plain(out, M, N, K, accumulate, role, bf16);
  x.a.data = inp, x.a.strides = {M * K, M * K, K, 1};
  x.b.data = w, x.b.strides = {N * K, N * K, 1, K};  // B(k, n) = W[n, k]
  x.bias = bias;
  return x;
}

template <typename F>
MatmulArgs nn_args(F* out, const F* a, const F* b, int64_t M, int64_t N, int64_t K, bool accumulate,
                   const char* role, Bf16Operands* bf16) {
  MatmulArgs x = plain(out, M, N, K, accumulate, role, bf16);
  x.a.data = a, x.a.strides = {M * K, M * K, K, 1};
  x.b.data = b, x.b.strides = {K * N, K * N, N, 1};
  return x;
}

template <typename F>
MatmulArgs tn_args(F* out, const F* a, const F* b, int64_t M, int64_t N, int64_t K, bool accumulate,
                   const char* role, Bf16Operands* bf16) {
  MatmulArgs x = plain(out, M, N, K, accumulate, role, bf16);
  x.a.data = a, x.a.strides = {M * K, M * K, 1, M};  // A(m, k) = a[k, m]
  x.b.data = b, x.b.strides = {K * N, K * N, N, 1};
  return x;
}

template <typename F>
void matmul_nt(Kernels<F>& k, F* out, const F* inp, const F* w, const F* bias, int64_t M, int64_t N,
               int64_t K, bool accumulate, const char* role, Bf16Operands* bf16) {
  k.matmul(nt_args(out, inp, w, bias, M, N, K, accumulate, role, bf16));
}

template <typename F>
void matmul_nn(Kernels<F>& k, F* out, const F* a, const F* b, int64_t M, int64_t N, int64_t K,
               bool accumulate, const char* role, Bf16Operands* bf16) {
  k.matmul(nn_args(out, a, b, M, N, K, accumulate, role, bf16));
}

template <typename F>
void matmul_tn(Kernels<F>& k, F* out, const F* a, const F* b, int64_t M, int64_t N, int64_t K,
               bool accumulate, const char* role, Bf16Operands* bf16) {
  k.matmul(tn_args(out, a, b, M, N, K, accumulate, role, bf16));
}

#define TETRA_INSTANTIATE(F)                                                                       \
  template MatmulArgs nt_args<F>(F*, const F*, const F*, const F*, int64_t, int64_t, int64_t,      \
                                 bool, const char*, Bf16Operands*);                                \
  template MatmulArgs nn_args<F>(F*, const F*, const F*, int64_t, int64_t, int64_t, bool,          \
                                 const char*, Bf16Operands*);                                      \
  template MatmulArgs tn_args<F>(F*, const F*, const F*, int64_t, int64_t, int64_t, bool,          \
                                 const char*, Bf16Operands*);                                      \
  template void matmul_nt<F>(Kernels<F>&, F*, const F*, const F*, const F*, int64_t, int64_t,      \
                             int64_t, bool, const char*, Bf16Operands*);                           \
  template void matmul_nn<F>(Kernels<F>&, F*, const F*, const F*, int64_t, int64_t, int64_t, bool, \
                             const char*, Bf16Operands*);                                          \
  template void matmul_tn<F>(Kernels<F>&, F*, const F*, const F*, int64_t, int64_t, int64_t, bool, \
                             const char*, Bf16Operands*);
TETRA_INSTANTIATE(float)
TETRA_INSTANTIATE(double)
#undef TETRA_INSTANTIATE

}  // namespace tetra
