// A mixed-precision product's operands in bf16 for the CPU matmul (kernels/cpu/matmul.cc):
// rounded from f32, read from the parameters' kept copies, widened back for CPUs without bf16
// products, or made row-major.
#include "kernels/cpu/bf16_operands.h"

#include <bit>
#include <cstdint>
#include <utility>

#include "core/profile.h"

namespace tetra::cpu {

// A bf16 operand (b0, b1, rows, cols) widened into dense f32 `scratch`, keeping which of its
// dimensions is contiguous (as rounded() does); other operands unchanged. bf16 -> f32 is exact,
// so the f32 product sees the same inputs the bf16 primitive would.
MatOperand widened(const MatOperand& op, int64_t b0, int64_t b1, int64_t rows, int64_t cols,
                   float* dst) {
  if (op.dtype != DType::bf16) return op;
  const ProfileScope profile(ProfKind::bf16_cast, "bf16 operands to f32");
  const uint16_t* src = &static_cast<const bf16*>(op.data)->bits;
  const auto& s = op.strides;
  const bool by_cols = s[3] != 1 && s[2] == 1;  // column-major: walk columns, rows contiguous
  const int64_t outer = by_cols ? cols : rows, inner = by_cols ? rows : cols;
  const int64_t so = by_cols ? s[3] : s[2], si = by_cols ? s[2] : s[3];
#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t i0 = 0; i0 < b0; ++i0)
    for (int64_t i1 = 0; i1 < b1; ++i1)
      for (int64_t o = 0; o < outer; ++o) {
        const uint16_t* in = src + i0 * s[0] + i1 * s[1] + o * so;
        float* out = dst + ((i0 * b1 + i1) * outer + o) * inner;
        if (si == 1) {
#pragma omp simd
          for (int64_t i = 0; i < inner; ++i) out[i] = std::bit_cast<float>(uint32_t(in[i]) << 16);
        } else {
          for (int64_t i = 0; i < inner; ++i) {
            out[i] = std::bit_cast<float>(uint32_t(in[i * si]) << 16);
          }
        }
      }
  const int64_t m = rows * cols;
  if (by_cols) return {dst, {b1 * m, m, 1, rows}, DType::f32};
  return {dst, {b1 * m, m, cols, 1}, DType::f32};
}

// A bf16 operand (b0, b1, rows, cols) copied into dense row-major `scratch`.
MatOperand row_major_bf16(const MatOperand& op, int64_t b0, int64_t b1, int64_t rows, int64_t cols,
                          std::vector<bf16>& scratch) {
  scratch.resize(size_t(b0 * b1 * rows * cols));
  const bf16* src = static_cast<const bf16*>(op.data);
  const auto& s = op.strides;
  for (int64_t i0 = 0; i0 < b0; ++i0)
    for (int64_t i1 = 0; i1 < b1; ++i1)
      for (int64_t r = 0; r < rows; ++r) {
        const bf16* in = src + i0 * s[0] + i1 * s[1] + r * s[2];
        bf16* out = scratch.data() + ((i0 * b1 + i1) * rows + r) * cols;
        for (int64_t c = 0; c < cols; ++c) out[c] = in[c * s[3]];
      }
  return {scratch.data(), {b1 * rows * cols, rows * cols, cols, 1}, DType::bf16};
}

// An f32 operand (b0, b1, rows, cols) rounded to bf16 into dense `dst`, keeping which of its
// dimensions is contiguous (a transposed operand stays transposed: both the reads and the writes
// stream, and oneDNN takes either layout) unless `row_major`.
MatOperand rounded(const MatOperand& op, int64_t b0, int64_t b1, int64_t rows, int64_t cols,
                   bf16* dst, bool row_major) {
  const ProfileScope profile(ProfKind::bf16_cast, "operands to bf16");
  const float* src = static_cast<const float*>(op.data);
  uint16_t* out = &dst->bits;
  const auto& s = op.strides;
  // column-major: walk columns, rows contiguous
  const bool by_cols = !row_major && s[3] != 1 && s[2] == 1;
  const int64_t outer = by_cols ? cols : rows, inner = by_cols ? rows : cols;
  const int64_t so = by_cols ? s[3] : s[2], si = by_cols ? s[2] : s[3];
#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t i0 = 0; i0 < b0; ++i0)
    for (int64_t i1 = 0; i1 < b1; ++i1)
      for (int64_t o = 0; o < outer; ++o) {
        const float* in = src + i0 * s[0] + i1 * s[1] + o * so;
        uint16_t* w = out + ((i0 * b1 + i1) * outer + o) * inner;
        if (si == 1) {
#pragma omp simd
          for (int64_t i = 0; i < inner; ++i) w[i] = round_bf16(in[i]);
        } else {
          for (int64_t i = 0; i < inner; ++i) w[i] = round_bf16(in[i * si]);
        }
      }
  const int64_t m = rows * cols;
  if (by_cols) return {dst, {b1 * m, m, 1, rows}, DType::bf16};
  return {dst, {b1 * m, m, cols, 1}, DType::bf16};
}

// A mixed-precision product's f32 operand in bf16: a parameter's kept copy (Bf16Operands::
// keep_weights), rounded in place once after each invalidation and read with the parameter's own
// strides, or the operand rounded into `dst` (packed; row-major when asked).
MatOperand kept_or_rounded(const MatOperand& op, int64_t b0, int64_t b1, int64_t rows, int64_t cols,
                           bf16* dst, bool row_major, Bf16Operands& ops) {
  const auto& s = op.strides;
  const int64_t extent =
      (b0 - 1) * s[0] + (b1 - 1) * s[1] + (rows - 1) * s[2] + (cols - 1) * s[3] + 1;
  const float* src = static_cast<const float*>(op.data);
  const auto [kept, round] =
      row_major ? std::pair<bf16*, bool>{nullptr, false} : ops.weights(src, size_t(extent));
  if (!kept) return rounded(op, b0, b1, rows, cols, dst, row_major);
  if (round) round_to_bf16(kept, src, size_t(extent), "weights to bf16");
  return {kept, s, DType::bf16};
}

void round_to_bf16(bf16* dst, const float* src, size_t n, const char* label) {
  const ProfileScope profile(ProfKind::bf16_cast, label);
  uint16_t* out = &dst->bits;
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; ++i) out[i] = round_bf16(src[i]);
}

}  // namespace tetra::cpu
