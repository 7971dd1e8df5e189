// cuBLASLt products over tetra's row-major strided operands.
//
// cuBLASLt is column-major. A row-major C (M,N) with row stride ldc is a column-major Cᵀ (N,M)
// with the same leading dimension, and Cᵀ = Bᵀ·Aᵀ: cuBLASLt's A is our B and its B our A, with
// m = N, n = M. An operand with unit column stride is row-major (read untransposed, ld = its row
// stride); one with unit row stride is column-major (read transposed, ld = its column stride).
// An operand with neither, or a C without unit column stride, goes through a dense copy.
//
// Batches: one strided-batch call over b1 (or b0, or b0·b1 when the b0 stride is b1 b1-strides
// for every operand), else a loop over b0 of strided-batch calls over b1.
//
// f32 products use CUBLAS_COMPUTE_32F, which never uses TF32. Mixed precision rounds f32 operands
// to bf16 (nearest even, kernels/cuda/elementwise.cu) into the caller's Bf16Operands, keeping each
// operand's orientation, and multiplies bf16 x bf16 with f32 accumulation into f32 C.
//
// cuBLASLt's heuristic assumes 256-byte aligned matrices unless told otherwise, and the strided
// views of attention or of a flat parameter buffer are not: each plan is made for the actual
// alignments (of the pointers, leading dimensions and batch strides) and cached under them with
// the shape, layouts, dtypes and epilogue. The bias epilogue is used for 16-byte aligned biases;
// others are added by a small kernel after the product.
#include "kernels/cuda/matmul.h"

#include <cublasLt.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "core/error.h"
#include "core/profile.h"
#include "kernels/cuda/allocator.h"
#include "kernels/cuda/cublaslt.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/profile_scope.h"
#include "kernels/cuda/runtime.h"
#include "kernels/cuda/state.h"

namespace tetra::cuda {

namespace {

using Strides = std::array<int64_t, 4>;

// One operand as it will be read: data, element strides (b0, b1, row, col), dtype.
struct Operand {
  const void* data;
  Strides s;
  DType t;
};

// 'n': unit column stride (row-major); 't': unit row stride (column-major); 0: neither. `ld` is
// the leading dimension cuBLASLt gets (at least the stored matrix's row count, as it requires).
char layout_of(const Strides& s, int64_t rows, int64_t cols, int64_t* ld) {
  if (s[3] == 1 && (rows == 1 || s[2] >= cols)) {
    *ld = std::max<int64_t>(1, rows == 1 ? cols : s[2]);
    return 'n';
  }
  if (s[2] == 1 && (cols == 1 || s[3] >= rows)) {
    *ld = std::max<int64_t>(1, cols == 1 ? rows : s[3]);
    return 't';
  }
  *ld = 0;
  return 0;
}

launch::Elem elem(DType t) { return t == DType::bf16 ? launch::Elem::bf16 : launch::Elem::f32; }
cudaDataType_t cuda_type(DType t) { return t == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F; }

// The largest power of two (at most 256) dividing the address and every byte offset added to it.
uint32_t alignment(const void* p, std::initializer_list<int64_t> byte_offsets) {
  uint64_t bits = uint64_t(reinterpret_cast<uintptr_t>(p));
  for (int64_t o : byte_offsets) bits |= uint64_t(o < 0 ? -o : o);
  if (bits == 0) return 256;
  return uint32_t(std::min<uint64_t>(256, uint64_t(1) << std::countr_zero(bits)));
}

// A dense copy of `op` (b0, b1, rows, cols) in `dst`, of dtype `to` (rounding f32 to bf16 or
// widening bf16 to f32 as needed), column-major when `col_major`.
Operand densify(const Operand& op, int64_t b0, int64_t b1, int64_t rows, int64_t cols, DType to,
                void* dst, bool col_major) {
  launch::gather(dst, elem(to), op.data, elem(op.t), op.s.data(), b0, b1, rows, cols, col_major);
  const int64_t m = rows * cols;
  if (col_major) return {dst, {b1 * m, m, 1, rows}, to};
  return {dst, {b1 * m, m, cols, 1}, to};
}

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

// Everything a plan depends on; its key in the cache.
struct Problem {
  int64_t m, n, k;  // cuBLASLt's: N, M, K
  cublasOperation_t transa, transb;
  int64_t a_rows, a_cols, lda, b_rows, b_cols, ldb, ldc;
  int32_t batch;
  int64_t stride_a, stride_b, stride_c;
  DType type;  // of cuBLASLt's A and B
  bool bias;
  uint32_t align_a, align_b, align_c, align_bias;

  std::vector<int64_t> key() const {
    return {m,
            n,
            k,
            int64_t(transa),
            int64_t(transb),
            a_rows,
            a_cols,
            lda,
            b_rows,
            b_cols,
            ldb,
            ldc,
            batch,
            stride_a,
            stride_b,
            stride_c,
            int64_t(type),
            int64_t(bias),
            align_a,
            align_b,
            align_c,
            align_bias};
  }
};

cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld,
                                   int32_t batch, int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  check_lt(cublaslt().MatrixLayoutCreate(&l, type, uint64_t(rows), uint64_t(cols), ld),
           "cublasLtMatrixLayoutCreate");
  if (batch > 1) {
    check_lt(cublaslt().MatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch,
                                                 sizeof(batch)),
             "cublasLtMatrixLayoutSetAttribute (batch count)");
    check_lt(cublaslt().MatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                 &stride, sizeof(stride)),
             "cublasLtMatrixLayoutSetAttribute (batch stride)");
  }
  return l;
}

Plan make_plan(const Problem& p, const void* bias) {
  Runtime& rt = runtime();
  Plan plan;
  check_lt(cublaslt().MatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
           "cublasLtMatmulDescCreate");
  check_lt(cublaslt().MatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &p.transa,
                                             sizeof(p.transa)),
           "cublasLtMatmulDescSetAttribute (transa)");
  check_lt(cublaslt().MatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &p.transb,
                                             sizeof(p.transb)),
           "cublasLtMatmulDescSetAttribute (transb)");
  if (p.bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    check_lt(cublaslt().MatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                               sizeof(epilogue)),
             "cublasLtMatmulDescSetAttribute (epilogue)");
    const int32_t bias_type = CUDA_R_32F;
    check_lt(cublaslt().MatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                               &bias_type, sizeof(bias_type)),
             "cublasLtMatmulDescSetAttribute (bias type)");
    // The heuristic reads the bias pointer's alignment from it.
    check_lt(cublaslt().MatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                               sizeof(bias)),
             "cublasLtMatmulDescSetAttribute (bias)");
  }
  const cudaDataType_t ab = cuda_type(p.type);
  plan.a = make_layout(ab, p.a_rows, p.a_cols, p.lda, p.batch, p.stride_a);
  plan.b = make_layout(ab, p.b_rows, p.b_cols, p.ldb, p.batch, p.stride_b);
  plan.c = make_layout(CUDA_R_32F, p.m, p.n, p.ldc, p.batch, p.stride_c);

  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(cublaslt().MatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const uint64_t workspace = rt.workspace_bytes;
  check_lt(cublaslt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                   &workspace, sizeof(workspace)),
           "cublasLtMatmulPreferenceSetAttribute (workspace)");
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, p.align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, p.align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, p.align_c},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, p.align_c}};
  for (const auto& [attr, value] : aligns) {
    check_lt(cublaslt().MatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)),
             "cublasLtMatmulPreferenceSetAttribute (alignment)");
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublaslt().MatmulAlgoGetHeuristic(
      rt.lt, plan.desc, plan.a, plan.b, plan.c, plan.c, pref, 1, &result, &found);
  cublaslt().MatmulPreferenceDestroy(pref);
  TETRA_CHECK(status == CUBLAS_STATUS_SUCCESS && found > 0,
              "[cuda] cuBLASLt has no algorithm for a {}x{}x{} product (batch {}, {} operands, "
              "transa {}, transb {}, lda {}, ldb {}, ldc {}, alignments {}/{}/{}, bias {}): {}",
              p.n, p.k, p.m, p.batch, dtype_name(p.type), int(p.transa), int(p.transb), p.lda,
              p.ldb, p.ldc, p.align_a, p.align_b, p.align_c, p.bias,
              status == CUBLAS_STATUS_SUCCESS ? std::string("none found")
                                              : cublaslt().GetStatusString(status));
  plan.algo = result.algo;
  return plan;
}

std::mutex plans_mu;
std::map<std::vector<int64_t>, Plan>& plans() {
  static auto* p = new std::map<std::vector<int64_t>, Plan>;  // never destroyed (exit order)
  return *p;
}

// One cuBLASLt call: D (= C) = lt_a · lt_b (+ bias) (+ C).
void run(const Problem& p, const void* lt_a, const void* lt_b, float* c, const void* bias,
         bool accumulate) {
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(plans_mu);
  auto& cache = plans();
  const std::vector<int64_t> key = p.key();
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, make_plan(p, bias)).first;
  Plan& plan = it->second;
  if (p.bias) {
    check_lt(cublaslt().MatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                               sizeof(bias)),
             "cublasLtMatmulDescSetAttribute (bias)");
  }
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  check_lt(cublaslt().Matmul(rt.lt, plan.desc, &alpha, lt_a, plan.a, lt_b, plan.b, &beta, c, plan.c,
                             c, plan.c, &plan.algo, rt.workspace, rt.workspace_bytes, rt.stream),
           "cublasLtMatmul");
}

const char* bytes_of(const void* p) { return static_cast<const char*>(p); }

}  // namespace

void matmul(const MatmulArgs& x) {
  if (x.M == 0 || x.N == 0) return;
  const KernelScope profile(x.role, x.b0 * x.b1, x.M, x.K, x.N);
  TETRA_CHECK(x.K > 0, "[cuda] matmul: K must be positive (got {})", x.K);
  TETRA_CHECK(x.M > 0 && x.N > 0 && x.b0 > 0 && x.b1 > 0,
              "[cuda] matmul: negative sizes {}x{}x{} (batch {}x{})", x.M, x.K, x.N, x.b0, x.b1);
  TETRA_CHECK(!x.bias || (x.b0 == 1 && x.b1 == 1),
              "[cuda] matmul: bias only for unbatched products");
  const auto supported = [](DType t) { return t == DType::f32 || t == DType::bf16; };
  TETRA_CHECK(supported(x.a.dtype) && supported(x.b.dtype),
              "[cuda] matmul takes f32 or bf16 operands (got {} x {}); f64 products (gradient "
              "checks) run on run.device=cpu",
              dtype_name(x.a.dtype), dtype_name(x.b.dtype));
  runtime();

  const int64_t b0 = x.b0, b1 = x.b1, M = x.M, N = x.N, K = x.K;
  const int64_t batch = b0 * b1;
  Operand A{x.a.data, x.a.strides, x.a.dtype}, B{x.b.data, x.b.strides, x.b.dtype};
  std::optional<Scratch> scratch_a, scratch_b, scratch_c;

  // Operands rounded to bf16 (mixed precision) or widened to f32 (one bf16 and one f32 operand,
  // which cuBLASLt does not mix), keeping their orientation so the copy streams.
  const auto col_major = [](const Operand& op) { return op.s[3] != 1 && op.s[2] == 1; };
  if (x.bf16) {
    TETRA_CHECK(A.t == DType::f32 && B.t == DType::f32,
                "[cuda] a mixed-precision product takes f32 operands (got {} x {})",
                dtype_name(A.t), dtype_name(B.t));
    const KernelScope cast(ProfKind::bf16_cast, "operands to bf16");
    const auto [a16, b16] = x.bf16->take(size_t(batch * M * K), size_t(batch * K * N));
    A = densify(A, b0, b1, M, K, DType::bf16, a16, col_major(A));
    B = densify(B, b0, b1, K, N, DType::bf16, b16, col_major(B));
  } else if (A.t != B.t) {
    if (A.t == DType::bf16) {
      scratch_a.emplace(size_t(batch * M * K) * sizeof(float));
      A = densify(A, b0, b1, M, K, DType::f32, scratch_a->get(), col_major(A));
    } else {
      scratch_b.emplace(size_t(batch * K * N) * sizeof(float));
      B = densify(B, b0, b1, K, N, DType::f32, scratch_b->get(), col_major(B));
    }
  }

  // Operands cuBLASLt cannot read in place: dense row-major copies.
  int64_t lda = 0, ldb = 0, ldc = 0;
  char la = layout_of(A.s, M, K, &lda), lb = layout_of(B.s, K, N, &ldb);
  if (!la) {
    scratch_a.emplace(size_t(batch * M * K) * dtype_size(A.t));
    A = densify(A, b0, b1, M, K, A.t, scratch_a->get(), false);
    la = layout_of(A.s, M, K, &lda);
  }
  if (!lb) {
    scratch_b.emplace(size_t(batch * K * N) * dtype_size(B.t));
    B = densify(B, b0, b1, K, N, B.t, scratch_b->get(), false);
    lb = layout_of(B.s, K, N, &ldb);
  }
  // C must be row-major: otherwise the product goes to a dense C (holding C's values when
  // accumulating) that is scattered back at the end.
  float* c = static_cast<float*>(x.c);
  Strides sc = x.c_strides;
  const bool c_dense = layout_of(sc, M, N, &ldc) != 'n';
  if (c_dense) {
    scratch_c.emplace(size_t(batch * M * N) * sizeof(float));
    if (x.accumulate) {
      launch::gather(scratch_c->get(), launch::Elem::f32, x.c, launch::Elem::f32,
                     x.c_strides.data(), b0, b1, M, N, false);
    }
    c = scratch_c->as<float>();
    sc = {b1 * M * N, M * N, N, 1};
    ldc = N;
  }

  // Batches: one strided-batch call where the strides allow, else a loop over b0.
  int64_t count = batch, loops = 1, sa = A.s[1], sb = B.s[1], scs = sc[1];
  int64_t la0 = 0, lb0 = 0, lc0 = 0;  // per-loop offsets (elements)
  if (b0 == 1) {
    count = b1;
  } else if (b1 == 1) {
    count = b0, sa = A.s[0], sb = B.s[0], scs = sc[0];
  } else if (!(A.s[0] == b1 * A.s[1] && B.s[0] == b1 * B.s[1] && sc[0] == b1 * sc[1])) {
    count = b1, loops = b0, la0 = A.s[0], lb0 = B.s[0], lc0 = sc[0];
  }
  TETRA_CHECK(count <= INT32_MAX, "[cuda] matmul: batch of {} products exceeds cuBLASLt's limit",
              count);

  const int64_t ea = int64_t(dtype_size(A.t)), eb = int64_t(dtype_size(B.t));
  // The bias epilogue needs a 16-byte aligned bias; others are added after the product.
  const bool bias_epilogue = x.bias && alignment(x.bias, {}) >= 16;
  Problem p{};
  p.m = N, p.n = M, p.k = K;
  // cuBLASLt's A is our B: row-major B (K,N) is column-major Bᵀ (N,K), read as is.
  p.transa = lb == 'n' ? CUBLAS_OP_N : CUBLAS_OP_T;
  p.a_rows = lb == 'n' ? N : K, p.a_cols = lb == 'n' ? K : N, p.lda = ldb;
  // cuBLASLt's B is our A: row-major A (M,K) is column-major Aᵀ (K,M).
  p.transb = la == 'n' ? CUBLAS_OP_N : CUBLAS_OP_T;
  p.b_rows = la == 'n' ? K : M, p.b_cols = la == 'n' ? M : K, p.ldb = lda;
  p.ldc = ldc;
  p.batch = int32_t(count);
  p.stride_a = count > 1 ? sb : 0, p.stride_b = count > 1 ? sa : 0;
  p.stride_c = count > 1 ? scs : 0;
  p.type = A.t;
  p.bias = bias_epilogue;
  p.align_a = alignment(B.data, {ldb * eb, p.stride_a * eb, lb0 * eb});
  p.align_b = alignment(A.data, {lda * ea, p.stride_b * ea, la0 * ea});
  p.align_c = alignment(c, {ldc * 4, p.stride_c * 4, lc0 * 4});
  p.align_bias = bias_epilogue ? alignment(x.bias, {}) : 0;

  for (int64_t i = 0; i < loops; ++i) {
    run(p, bytes_of(B.data) + i * lb0 * eb, bytes_of(A.data) + i * la0 * ea, c + i * lc0,
        bias_epilogue ? x.bias : nullptr, x.accumulate);
  }
  if (x.bias && !bias_epilogue) {
    launch::add_bias_rows(c, ldc, static_cast<const float*>(x.bias), M, N);
  }
  if (c_dense) launch::scatter(static_cast<float*>(x.c), x.c_strides.data(), c, b0, b1, M, N);
}

std::string cublaslt_version() {
  const size_t v = cublaslt().GetVersion();  // major * 10000 + minor * 100 + patch
  return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
}

size_t matmul_plan_count() {
  std::lock_guard<std::mutex> lock(plans_mu);
  return plans().size();
}

}  // namespace tetra::cuda
