// The one seam for matrix products on CPU. Operands are described by sizes and element strides,
// so transposes and the strided views of attention (q, k, v inside the fused qkv buffer) need no
// copies. A and B may be f32 or bf16 with f32 C and bias. f64 operands (all of A, B, C) take a
// plain reference loop: it exists for double-precision gradient checks and for testing the
// libraries against, never for training.
//
// f32 products have more than one implementation (MatmulLib): oneDNN's matmul primitive (cached
// per shape), OpenBLAS's sgemm (batched products as one single-threaded sgemm per matrix, the
// batch spread over the threads, so a head costs no parallel region of its own), oneDNN on a
// contiguous copy of a transposed operand, and either library with the product split between the
// threads instead of inside the library (one output slab per thread). Which one is fastest depends
// on the shape, the layout, the thread count and the CPU (oneDNN's AVX2 kernels run some backward
// layouts at a third of OpenBLAS's rate; on AVX-512 oneDNN mostly wins), so each product is
// measured once per machine and the choice cached (kernels/cpu/matmul_choice.h). The libraries
// round differently, so a run's numbers depend on the choices made; they are fixed per machine once
// cached. A run that must compute every product the same way whatever the machine's timings (two
// runs compared number for number, as the layout tests do) fixes one library instead: the policy
// (kernels.matmul, or the TETRA_MATMUL environment variable for every tetra process) below.
//
// bf16 operands: oneDNN 2.6 has bf16 matmuls only from AVX-512 (native on avx512_core_bf16 and
// AMX, emulated on plain avx512_core); on AVX2 machines (e.g. AMD Zen 3) it cannot create one at
// all. The first bf16 product of the process probes by creating a small bf16 primitive, once:
// where that works every bf16 product runs oneDNN's bf16 primitive, whole or split between the
// threads (chosen per product like an f32 product's library); where it does not, bf16
// operands are widened (exactly) to f32 scratch and run through the f32 primitive, so a bf16
// tensor can be multiplied everywhere. bf16_matmul_path() says which.
//
// Mixed precision (train.precision = bf16) is the other use: f32 operands rounded to bf16 for the
// product, in scratch a Bf16Operands (kernels/kernels.h) provides. It needs bf16 instructions
// (bf16_matmul_path().hardware): emulated or widened bf16 costs more than the f32 product it
// replaces, so a run asks for it only where it pays.
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "core/arena.h"
#include "core/dtype.h"
#include "kernels/kernels.h"

namespace tetra::cpu {

/** C = A·B (+ bias) (+ C) through the library chosen for this product on this machine. */
void matmul(const MatmulArgs& args);
/** Independent f32 products as one group, their work spread over the threads in one parallel
 *  region (matmul.cc, "groups of products"); any other group runs product by product. */
void matmul_group(std::span<const MatmulArgs> products);

enum class MatmulLib : uint8_t {
  onednn,
  openblas,
  onednn_copy,
  onednn_split,
  openblas_split,
  widened,
  widened_split
};
constexpr MatmulLib kMatmulLibs[] = {MatmulLib::onednn,         MatmulLib::openblas,
                                     MatmulLib::onednn_copy,    MatmulLib::onednn_split,
                                     MatmulLib::openblas_split, MatmulLib::widened,
                                     MatmulLib::widened_split};
/** "onednn", "openblas", "onednn-copy", "onednn-split", "openblas-split", "f32-widened",
 *  "f32-widened-split". */
const char* matmul_lib_name(MatmulLib lib);
/** Which library runs each f32 product: `choose` measures and caches the fastest per product
 *  (kernels.matmul=auto); `onednn` runs every product on oneDNN's primitive; `openblas` every
 *  product OpenBLAS can run (unit-stride operands) on OpenBLAS and the others on oneDNN. A
 *  product of bf16 operands has up to four: oneDNN's bf16 primitive whole and split where it is
 *  native, and its operands widened to f32 (exact) for oneDNN's f32 primitive, whole and split,
 *  which a CPU whose bf16 instructions run slower than its f32 ones prefers (an Intel Xeon with
 *  AVX512_BF16 and no AMX: 90 against 160 GFLOP/s). `choose` measures them; either fixed policy
 *  runs it on the bf16 primitive where that is native, widened where not. */
enum class MatmulPolicy : uint8_t { choose, onednn, openblas };
/** "auto", "onednn" or "openblas"; anything else throws tetra::Error naming `what` (the key or
 *  variable it came from) and the accepted values. */
MatmulPolicy parse_matmul_policy(const std::string& text, const std::string& what);
/** The policy in force: the last set_matmul_policy, else $TETRA_MATMUL (read once), else auto. */
MatmulPolicy matmul_policy();
/** Sets the process's policy; `source` names where it came from (for matmul_policy_describe). */
void set_matmul_policy(MatmulPolicy policy, const std::string& source);
/** "library chosen per product" or "onednn for every product (TETRA_MATMUL)", for run headers
 *  and metrics. */
std::string matmul_policy_describe();
/** Whether `lib` runs this product: OpenBLAS needs f32 operands, each of A and B with a unit
 *  column or row stride and C with a unit column stride; the copy path needs f32 operands and an
 *  unbatched product with a transposed A or B; the split paths (the output cut into one slab per
 *  OpenMP thread, each a single-threaded product of that library) an unbatched product, more than
 *  one thread and an output of more than 16 rows or columns, outside a parallel region. oneDNN
 *  runs every f32 product; oneDNN and its split also bf16 operands where its bf16 primitive is
 *  native (and B needs no copy first); the widened pair every product with a bf16 operand (the
 *  other bf16 or f32), the split one under the split's conditions. */
bool matmul_lib_supports(MatmulLib lib, const MatmulArgs& args);
/** The product through `lib` (must be supported), bypassing the choice: for the choice's
 *  measurements and for tests. */
void matmul_with(MatmulLib lib, const MatmulArgs& args);
/** This machine as the library choices depend on it: CPU model, oneDNN ISA, OpenBLAS core. */
std::string matmul_machine();
/** The reference loop (f32 or f64, all operands alike), for tests. */
void matmul_reference(const MatmulArgs& args);

/** f32 -> bf16 bits, nearest even (NaN kept quiet): bf16::from_float without its branch, so that
 *  loops over it vectorise. */
inline uint16_t round_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

/** dst[i] = round_bf16(src[i]) for n elements, over the OpenMP threads; profiled as bf16_cast
 *  under `label`. */
void round_to_bf16(bf16* dst, const float* src, size_t n, const char* label);

/** Number of cached oneDNN primitives (for tests and diagnostics). */
size_t matmul_cache_size();

/** oneDNN's effective CPU ISA ("avx2", "avx512_core_bf16", ...), after any ONEDNN_MAX_CPU_ISA cap.
 */
std::string onednn_isa();

/** How bf16 operands are multiplied on this CPU, decided once per process. */
struct Bf16MatmulPath {
  bool native = false;    // true: oneDNN's bf16 primitive; false: widened to f32, f32 primitive
  bool hardware = false;  // bf16 instructions: oneDNN ISA avx512_core_bf16 or avx512_core_amx
  std::string isa;        // oneDNN's effective ISA, e.g. "avx512_core_bf16" or "avx2"
  /** "onednn-bf16 (avx512_core_bf16)" or "f32-widened (avx2)", for logs and run headers. */
  std::string describe() const;
};
const Bf16MatmulPath& bf16_matmul_path();

}  // namespace tetra::cpu
