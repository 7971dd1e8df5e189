// The CPU matmul's bf16 operands (kernels/cpu/matmul.cc): each returns the operand (b0, b1, rows,
// cols) as the product reads it.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/matmul.h"
#include "kernels/kernels.h"

namespace tetra::cpu {

/** A bf16 operand widened into dense f32 at `dst` (b0 * b1 * rows * cols floats; exact),
 *  transposed if it was; other operands unchanged (`dst` unused). */
MatOperand widened(const MatOperand& op, int64_t b0, int64_t b1, int64_t rows, int64_t cols,
                   float* dst);
/** A bf16 operand copied into dense row-major `scratch`. */
MatOperand row_major_bf16(const MatOperand& op, int64_t b0, int64_t b1, int64_t rows, int64_t cols,
                          std::vector<bf16>& scratch);
/** An f32 operand rounded to bf16 into dense `dst`, keeping which dimension is contiguous unless
 *  `row_major`. */
MatOperand rounded(const MatOperand& op, int64_t b0, int64_t b1, int64_t rows, int64_t cols,
                   bf16* dst, bool row_major = false);
/** An f32 operand in bf16: a parameter's kept copy in `ops` (rounded there first when stale), or
 *  rounded into `dst` as rounded() does. */
MatOperand kept_or_rounded(const MatOperand& op, int64_t b0, int64_t b1, int64_t rows, int64_t cols,
                           bf16* dst, bool row_major, Bf16Operands& ops);

}  // namespace tetra::cpu
