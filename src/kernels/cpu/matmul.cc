#include "kernels/cpu/matmul.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cmath>
#include <exception>
#include <map>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "core/machine_cache.h"
#include "core/profile.h"
#include "kernels/cpu/bf16_operands.h"
#include "kernels/cpu/matmul_choice.h"

namespace tetra::cpu {

namespace {

using Key = std::vector<int64_t>;

// A primitive with its memory objects: each call only swaps the data pointers in.
struct Cached {
  dnnl::matmul prim;
  dnnl::memory src, weights, dst, bias;
  std::unordered_map<int, dnnl::memory> args;
};

struct Engine {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::vector<dnnl::stream> slab_streams;  // one per thread of a split product (see below)
  std::map<Key, Cached> cache;
  std::vector<float> scratch_a, scratch_b;  // bf16 operands widened to f32 (copy_scratch)
  std::vector<bf16> scratch_b16;            // a transposed bf16 B made row-major (see below)
};

// oneDNN 2.6's AMX bf16 kernels return wrong columns for a product with a transposed B (column
// stride not 1) when M <= 32 (seen for 49 <= N <= 63, errors of order 1; M >= 33, a row-major B
// and the avx512_core_bf16 kernels are right: tests/kernels/conformance_test.cc). Such a B is
// passed row-major; a product that small costs less than the copy's O(K·N) would matter.
bool transposed_b_needs_copy(const MatmulArgs& x) { return x.M <= 32 && x.b.strides[3] != 1; }

// The engine and its primitive cache are created on first use and live for the process: oneDNN
// primitives are expensive to build (JIT) and cheap to reuse.
Engine& engine() {
  static Engine e;
  return e;
}

dnnl::memory::data_type to_dnnl(DType t) {
  switch (t) {
    case DType::f32:
      return dnnl::memory::data_type::f32;
    case DType::bf16:
      return dnnl::memory::data_type::bf16;
    default:
      fail("[matmul] unsupported operand dtype {}", dtype_name(t));
  }
}

dnnl::memory::desc md(int64_t b0, int64_t b1, int64_t r, int64_t c, DType t,
                      const std::array<int64_t, 4>& s) {
  return dnnl::memory::desc({b0, b1, r, c}, to_dnnl(t), {s[0], s[1], s[2], s[3]});
}

std::string_view isa_name(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_mic:
      return "avx512_mic";
    case dnnl::cpu_isa::avx512_mic_4ops:
      return "avx512_mic_4ops";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "unknown";
  }
}

// The probe behind bf16_matmul_path(): oneDNN either creates a bf16 matmul for this ISA or
// throws; it supports every shape and stride once it supports one (its reference matmul takes
// any), so one small product decides for the process.
Bf16MatmulPath probe_bf16_path() {
  Bf16MatmulPath p;
  p.isa = onednn_isa();
  const auto bf16 = dnnl::memory::data_type::bf16, f32 = dnnl::memory::data_type::f32;
  const auto tag = dnnl::memory::format_tag::ab;
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(dnnl::memory::desc({16, 16}, bf16, tag),
                                                       dnnl::memory::desc({16, 16}, bf16, tag),
                                                       dnnl::memory::desc({16, 16}, f32, tag)),
                                    engine().engine);
    p.native = true;
  } catch (const dnnl::error&) {
    p.native = false;
  }
  // cpu_isa values are bit sets: an ISA has bf16 instructions when it has all of
  // avx512_core_bf16's bits (AMX does).
  const auto isa = unsigned(dnnl::get_effective_cpu_isa());
  const auto with_bf16 = unsigned(dnnl::cpu_isa::avx512_core_bf16);
  p.hardware = p.native && (isa & with_bf16) == with_bf16;
  return p;
}

template <typename T>
void reference_loop(const MatmulArgs& x) {
  const T* A = static_cast<const T*>(x.a.data);
  const T* B = static_cast<const T*>(x.b.data);
  const T* bias = static_cast<const T*>(x.bias);
  T* C = static_cast<T*>(x.c);
  const auto &sa = x.a.strides, &sb = x.b.strides, &sc = x.c_strides;
  for (int64_t i0 = 0; i0 < x.b0; ++i0)
    for (int64_t i1 = 0; i1 < x.b1; ++i1)
      for (int64_t m = 0; m < x.M; ++m)
        for (int64_t n = 0; n < x.N; ++n) {
          T acc = bias ? bias[n] : T(0);
          for (int64_t k = 0; k < x.K; ++k) {
            acc += A[i0 * sa[0] + i1 * sa[1] + m * sa[2] + k * sa[3]] *
                   B[i0 * sb[0] + i1 * sb[1] + k * sb[2] + n * sb[3]];
          }
          T& c = C[i0 * sc[0] + i1 * sc[1] + m * sc[2] + n * sc[3]];
          c = x.accumulate ? c + acc : acc;
        }
}

}  // namespace

void matmul_reference(const MatmulArgs& x) {
  TETRA_CHECK(x.a.dtype == x.b.dtype && (x.a.dtype == DType::f32 || x.a.dtype == DType::f64),
              "[matmul] the reference path takes f32 or f64 operands of one dtype");
  if (x.a.dtype == DType::f64) {
    reference_loop<double>(x);
  } else {
    reference_loop<float>(x);
  }
}

namespace {

// The cached oneDNN primitive of this product (f32 or, where bf16_matmul_path() is native, bf16
// operands), created on first use. `slab` tells apart the slabs of a split product, which may
// have one shape but run at once: each needs memory objects of its own.
Cached& onednn_primitive(const MatmulArgs& x, int64_t slab = 0) {
  Key key = {
      x.b0,         x.b1, x.M, x.N, x.K, int64_t(x.a.dtype), int64_t(x.b.dtype), x.bias != nullptr,
      x.accumulate, slab};
  for (auto s : x.a.strides) key.push_back(s);
  for (auto s : x.b.strides) key.push_back(s);
  for (auto s : x.c_strides) key.push_back(s);

  Engine& e = engine();
  auto it = e.cache.find(key);
  if (it == e.cache.end()) {
    auto a_md = md(x.b0, x.b1, x.M, x.K, x.a.dtype, x.a.strides);
    auto b_md = md(x.b0, x.b1, x.K, x.N, x.b.dtype, x.b.strides);
    auto c_md = md(x.b0, x.b1, x.M, x.N, DType::f32, x.c_strides);
    dnnl::memory::desc bias_md;
    if (x.bias) {
      bias_md = dnnl::memory::desc({1, 1, 1, x.N}, dnnl::memory::data_type::f32,
                                   dnnl::memory::format_tag::abcd);
    }
    dnnl::primitive_attr attr;
    if (x.accumulate) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    dnnl::matmul::desc desc = x.bias ? dnnl::matmul::desc(a_md, b_md, bias_md, c_md)
                                     : dnnl::matmul::desc(a_md, b_md, c_md);
    dnnl::matmul::primitive_desc pd;
    try {
      pd = dnnl::matmul::primitive_desc(desc, attr, e.engine);
    } catch (const dnnl::error& err) {
      fail(
          "[matmul] oneDNN has no matmul for {} x {} operands of {}x{}x{} on this CPU (ISA {}): "
          "{}; use f32 or bf16 operands",
          dtype_name(x.a.dtype), dtype_name(x.b.dtype), x.M, x.N, x.K, bf16_matmul_path().isa,
          err.what());
    }
    Cached c{dnnl::matmul(pd),
             dnnl::memory(pd.src_desc(), e.engine, DNNL_MEMORY_NONE),
             dnnl::memory(pd.weights_desc(), e.engine, DNNL_MEMORY_NONE),
             dnnl::memory(pd.dst_desc(), e.engine, DNNL_MEMORY_NONE),
             {},
             {}};
    c.args = {{DNNL_ARG_SRC, c.src}, {DNNL_ARG_WEIGHTS, c.weights}, {DNNL_ARG_DST, c.dst}};
    if (x.bias) {
      c.bias = dnnl::memory(pd.bias_desc(), e.engine, DNNL_MEMORY_NONE);
      c.args.emplace(DNNL_ARG_BIAS, c.bias);
    }
    it = e.cache.emplace(key, std::move(c)).first;
  }
  return it->second;
}

// Runs `c`, the primitive of `x`, on x's operands.
void onednn_run(Cached& c, const MatmulArgs& x, dnnl::stream& stream) {
  c.src.set_data_handle(const_cast<void*>(x.a.data));
  c.weights.set_data_handle(const_cast<void*>(x.b.data));
  c.dst.set_data_handle(x.c);
  if (x.bias) c.bias.set_data_handle(const_cast<void*>(x.bias));
  c.prim.execute(stream, c.args);
  stream.wait();
}

// C = A·B through a cached oneDNN primitive.
void onednn_matmul(const MatmulArgs& x) {
  Engine& e = engine();
  onednn_run(onednn_primitive(x), x, e.stream);
}

using Strides = std::array<int64_t, 4>;

// How BLAS can read a (rows, cols) matrix with element strides (.., .., row, col): 'n' row-major
// (unit column stride), 't' stored transposed (unit row stride), or 0 when neither; `ld` is its
// leading dimension.
char blas_layout(const Strides& s, int64_t rows, int64_t cols, int64_t* ld = nullptr) {
  char layout = 0;
  int64_t l = 0;
  if (s[3] == 1 && (rows == 1 || s[2] >= cols)) {
    layout = 'n', l = rows == 1 ? cols : s[2];
  } else if (s[2] == 1 && (cols == 1 || s[3] >= rows)) {
    layout = 't', l = cols == 1 ? rows : s[3];
  }
  if (ld) *ld = std::max<int64_t>(1, l);
  return l < INT_MAX ? layout : 0;
}

bool fits_blasint(const MatmulArgs& x) { return std::max({x.M, x.N, x.K}) < INT_MAX; }

// C = A·B with OpenBLAS's sgemm. A batch runs one sgemm per matrix with the batch spread over the
// OpenMP threads (OpenBLAS runs single-threaded inside a parallel region), so many small products
// pay one parallel region in all rather than one each.
void openblas_matmul(const MatmulArgs& x) {
  int64_t lda = 0, ldb = 0, ldc = 0;
  const char la = blas_layout(x.a.strides, x.M, x.K, &lda);
  const char lb = blas_layout(x.b.strides, x.K, x.N, &ldb);
  blas_layout(x.c_strides, x.M, x.N, &ldc);
  const auto ta = la == 'n' ? CblasNoTrans : CblasTrans, tb = lb == 'n' ? CblasNoTrans : CblasTrans;
  const float* A = static_cast<const float*>(x.a.data);
  const float* B = static_cast<const float*>(x.b.data);
  float* C = static_cast<float*>(x.c);
  const float beta = x.accumulate ? 1.0f : 0.0f;
  if (x.b0 * x.b1 == 1) {
    if (x.bias) {
      // sgemm has no bias: C starts as the bias (plus C when accumulating), then C += A·B.
      const float* bias = static_cast<const float*>(x.bias);
#pragma omp parallel for schedule(static)
      for (int64_t m = 0; m < x.M; ++m) {
        float* row = C + m * ldc;
        if (x.accumulate) {
          for (int64_t n = 0; n < x.N; ++n) row[n] += bias[n];
        } else {
          std::copy_n(bias, x.N, row);
        }
      }
    }
    cblas_sgemm(CblasRowMajor, ta, tb, int(x.M), int(x.N), int(x.K), 1.0f, A, int(lda), B, int(ldb),
                x.bias ? 1.0f : beta, C, int(ldc));
    return;
  }
  const Strides &sa = x.a.strides, &sb = x.b.strides, &sc = x.c_strides;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i0 = 0; i0 < x.b0; ++i0) {
    for (int64_t i1 = 0; i1 < x.b1; ++i1) {
      cblas_sgemm(CblasRowMajor, ta, tb, int(x.M), int(x.N), int(x.K), 1.0f,
                  A + i0 * sa[0] + i1 * sa[1], int(lda), B + i0 * sb[0] + i1 * sb[1], int(ldb),
                  beta, C + i0 * sc[0] + i1 * sc[1], int(ldc));
    }
  }
}

// A (rows, cols) operand copied into dense row-major `dst`, in 64x64 tiles so that a transposed
// source is read and written a cache line at a time.
void copy_dense(float* dst, const float* src, const Strides& s, int64_t rows, int64_t cols) {
  constexpr int64_t kTile = 64;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
      for (int64_t c = c0; c < c1; ++c) {
        for (int64_t r = r0; r < r1; ++r) dst[r * cols + c] = src[r * s[2] + c * s[3]];
      }
    }
  }
}

// oneDNN on a dense row-major copy of each transposed operand (fresh scratch per call, so a
// choice that loses costs no memory afterwards; the measurement includes the allocation).
void onednn_copy_matmul(const MatmulArgs& x) {
  MatmulArgs d = x;
  std::unique_ptr<float[]> a, b;
  if (x.a.strides[3] != 1) {
    a.reset(new float[size_t(x.M * x.K)]);
    copy_dense(a.get(), static_cast<const float*>(x.a.data), x.a.strides, x.M, x.K);
    d.a = {a.get(), {x.M * x.K, x.M * x.K, x.K, 1}, DType::f32};
  }
  if (x.b.strides[3] != 1) {
    b.reset(new float[size_t(x.K * x.N)]);
    copy_dense(b.get(), static_cast<const float*>(x.b.data), x.b.strides, x.K, x.N);
    d.b = {b.get(), {x.K * x.N, x.K * x.N, x.N, 1}, DType::f32};
  }
  onednn_matmul(d);
}

// Scratch for operands widened to f32: up to kKeptCopy floats (16 MB) in the thread's scratch,
// kept for the next product (no allocation and no page faults per product); a larger operand (a
// head's weight) in a fresh allocation freed after the product, so that no large buffer outlives
// it outside the memory ledger.
constexpr int64_t kKeptCopy = int64_t(1) << 22;

// `n` floats of scratch: `kept` (grown, and kept for the next product) up to kKeptCopy, else
// `fresh`, freed by its owner after the product.
float* copy_scratch(std::vector<float>& kept, std::unique_ptr<float[]>& fresh, int64_t n) {
  if (n <= kKeptCopy) {
    if (int64_t(kept.size()) < n) kept.resize(size_t(n));
    return kept.data();
  }
  fresh.reset(new float[size_t(n)]);
  return fresh.get();
}

// A product split between the threads: the output cut into one slab per thread along its larger
// dimension (rows of A and C, or columns of B, C and the bias), in multiples of kSlabAlign, each
// slab a single-threaded product of its own. A library parallelises inside one product; on the
// small products of small models at two threads that partition, its barriers and each thread
// packing the shared operand cost 10-25% of the rate, which slabs of a few hundred rows do not
// (bench/kernel_lab.py). Which one wins is measured per product like any other library choice.
constexpr int64_t kSlabAlign = 16;

// The slab length along the cut dimension, and that dimension; 0 slabs outside parallel use.
struct SlabCut {
  bool rows = true;
  int64_t step = 0, parts = 0;
};

SlabCut slab_cut(const MatmulArgs& x) {
  SlabCut cut;
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (threads < 2 || x.b0 * x.b1 != 1) return cut;
  cut.rows = x.M >= x.N;
  const int64_t dim = cut.rows ? x.M : x.N;
  cut.step = (dim + threads - 1) / threads;
  cut.step = (cut.step + kSlabAlign - 1) / kSlabAlign * kSlabAlign;
  cut.parts = (dim + cut.step - 1) / cut.step;
  return cut;
}

// `op` moved by `elements` of its own type (f32 or bf16).
const void* advanced(const MatOperand& op, int64_t elements) {
  return static_cast<const char*>(op.data) + elements * int64_t(dtype_size(op.dtype));
}

MatmulArgs slab(const MatmulArgs& x, const SlabCut& cut, int64_t p) {
  MatmulArgs s = x;
  const int64_t begin = p * cut.step;
  float* c = static_cast<float*>(x.c);
  if (cut.rows) {
    s.M = std::min(x.M - begin, cut.step);
    s.a.data = advanced(x.a, begin * x.a.strides[2]);
    s.c = c + begin * x.c_strides[2];
  } else {
    s.N = std::min(x.N - begin, cut.step);
    s.b.data = advanced(x.b, begin * x.b.strides[3]);
    s.c = c + begin * x.c_strides[3];
    if (x.bias) s.bias = static_cast<const float*>(x.bias) + begin;
  }
  return s;
}

// Runs body(p) for every slab p, slab p on thread p (a thread takes more slabs if the runtime gives
// the region fewer threads than asked); an exception thrown on a thread is rethrown after.
template <typename Body>
void for_each_slab(const SlabCut& cut, Body&& body) {
  std::exception_ptr error;
#pragma omp parallel num_threads(int(cut.parts))
  {
    try {
      for (int64_t p = omp_get_thread_num(); p < cut.parts; p += omp_get_num_threads()) body(p);
    } catch (...) {
#pragma omp critical(tetra_matmul_slab_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// oneDNN per slab: the primitives are found or created first, on this thread (the cache is not
// shared between threads), then run one per thread, each on a stream of its own.
void onednn_split_matmul(const MatmulArgs& x) {
  const SlabCut cut = slab_cut(x);
  Engine& e = engine();
  std::vector<MatmulArgs> slabs;
  std::vector<Cached*> prims;
  for (int64_t p = 0; p < cut.parts; ++p) {
    slabs.push_back(slab(x, cut, p));
    prims.push_back(&onednn_primitive(slabs.back(), p + 1));
  }
  while (int64_t(e.slab_streams.size()) < cut.parts) e.slab_streams.emplace_back(e.engine);
  for_each_slab(cut, [&](int64_t p) { onednn_run(*prims[p], slabs[p], e.slab_streams[p]); });
}

// OpenBLAS per slab (inside a parallel region its sgemm runs on the calling thread alone).
void openblas_split_matmul(const MatmulArgs& x) {
  const SlabCut cut = slab_cut(x);
  for_each_slab(cut, [&](int64_t p) { openblas_matmul(slab(x, cut, p)); });
}

// ---- groups of products -------------------------------------------------------------------------
// A group of independent f32 products (model/moe.cc: a mixture of experts' experts, each with its
// own weight and rows) runs in one parallel region: each product is cut along its larger output
// dimension into pieces of about a quarter of a thread's share of the group's work (multiples of
// kSlabAlign), the pieces are dealt largest first to the least loaded thread, and every thread
// runs its pieces as single-threaded products of the library the policy gives the group's
// largest product: oneDNN's primitive (a stream and memory objects per thread) or OpenBLAS's
// sgemm. One product after another, each
// parallelised inside the library, pays a fork, a join and a partition per product and leaves a
// thread idle on a product too small to split well; the group pays them once.

// Pieces in the order dealt, each with the thread that runs it.
struct GroupPlan {
  std::vector<MatmulArgs> pieces;
  std::vector<int> thread;
};

GroupPlan plan_group(std::span<const MatmulArgs> products, int threads) {
  double work = 0;
  for (const MatmulArgs& x : products) work += double(x.M) * double(x.N) * double(x.K);
  const double target = std::max(1.0, work / (4.0 * threads));
  std::vector<std::pair<double, MatmulArgs>> pieces;
  for (const MatmulArgs& x : products) {
    if (x.M == 0 || x.N == 0) continue;
    SlabCut cut;
    cut.rows = x.M >= x.N;
    const int64_t dim = cut.rows ? x.M : x.N;
    const double cost = double(x.M) * double(x.N) * double(x.K);
    const int64_t parts = std::clamp<int64_t>(int64_t(std::ceil(cost / target)), 1,
                                              (dim + kSlabAlign - 1) / kSlabAlign);
    cut.step = ((dim + parts - 1) / parts + kSlabAlign - 1) / kSlabAlign * kSlabAlign;
    cut.parts = (dim + cut.step - 1) / cut.step;
    for (int64_t p = 0; p < cut.parts; ++p) {
      const MatmulArgs piece = slab(x, cut, p);
      pieces.emplace_back(double(piece.M) * double(piece.N) * double(piece.K), piece);
    }
  }
  std::stable_sort(pieces.begin(), pieces.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  GroupPlan plan;
  std::vector<double> load(size_t(threads), 0.0);
  for (auto& [cost, piece] : pieces) {
    const int t = int(std::min_element(load.begin(), load.end()) - load.begin());
    load[size_t(t)] += cost;
    plan.pieces.push_back(piece);
    plan.thread.push_back(t);
  }
  return plan;
}

// Both operands bf16, on oneDNN's bf16 primitive as they are (no copy of B first).
bool native_bf16_operands(const MatmulArgs& x) {
  return x.a.dtype == DType::bf16 && x.b.dtype == DType::bf16 && bf16_matmul_path().native &&
         !transposed_b_needs_copy(x);
}

// A product with a bf16 operand, the other bf16 or f32: what the widened libraries run.
bool widenable(const MatmulArgs& x) {
  const auto ok = [](DType d) { return d == DType::bf16 || d == DType::f32; };
  return (x.a.dtype == DType::bf16 || x.b.dtype == DType::bf16) && ok(x.a.dtype) && ok(x.b.dtype) &&
         !x.bf16;
}

// The bf16 operands widened to f32 (exact, so the f32 product sees the values the bf16 primitive
// would) into this thread's scratch, then oneDNN's f32 primitive, whole or one slab per thread.
void widened_matmul(const MatmulArgs& x, bool split) {
  Engine& e = engine();
  MatmulArgs w = x;
  std::unique_ptr<float[]> fresh_a, fresh_b;
  const int64_t batch = x.b0 * x.b1;
  if (x.a.dtype == DType::bf16) {
    w.a = widened(x.a, x.b0, x.b1, x.M, x.K, copy_scratch(e.scratch_a, fresh_a, batch * x.M * x.K));
  }
  if (x.b.dtype == DType::bf16) {
    w.b = widened(x.b, x.b0, x.b1, x.K, x.N, copy_scratch(e.scratch_b, fresh_b, batch * x.K * x.N));
  }
  if (split) return onednn_split_matmul(w);
  onednn_matmul(w);
}

}  // namespace

bool matmul_lib_supports(MatmulLib lib, const MatmulArgs& x) {
  const bool f32 = x.a.dtype == DType::f32 && x.b.dtype == DType::f32;
  switch (lib) {
    case MatmulLib::onednn:
      return f32 || native_bf16_operands(x);
    case MatmulLib::openblas:
      return f32 && fits_blasint(x) && blas_layout(x.a.strides, x.M, x.K) &&
             blas_layout(x.b.strides, x.K, x.N) && blas_layout(x.c_strides, x.M, x.N) == 'n';
    case MatmulLib::onednn_copy:
      return f32 && x.b0 * x.b1 == 1 && (x.a.strides[3] != 1 || x.b.strides[3] != 1);
    case MatmulLib::onednn_split:
      return (f32 || native_bf16_operands(x)) && slab_cut(x).parts > 1;
    case MatmulLib::openblas_split:
      return matmul_lib_supports(MatmulLib::openblas, x) && slab_cut(x).parts > 1;
    case MatmulLib::widened:
      return widenable(x);
    case MatmulLib::widened_split:
      return widenable(x) && slab_cut(x).parts > 1;
  }
  return false;
}

void matmul_with(MatmulLib lib, const MatmulArgs& x) {
  TETRA_CHECK(matmul_lib_supports(lib, x),
              "[matmul] {} cannot run a {}x{}x{} product of {} x {} operands with these strides",
              matmul_lib_name(lib), x.M, x.K, x.N, dtype_name(x.a.dtype), dtype_name(x.b.dtype));
  switch (lib) {
    case MatmulLib::onednn:
      return onednn_matmul(x);
    case MatmulLib::openblas:
      return openblas_matmul(x);
    case MatmulLib::onednn_copy:
      return onednn_copy_matmul(x);
    case MatmulLib::onednn_split:
      return onednn_split_matmul(x);
    case MatmulLib::openblas_split:
      return openblas_split_matmul(x);
    case MatmulLib::widened:
      return widened_matmul(x, false);
    case MatmulLib::widened_split:
      return widened_matmul(x, true);
  }
}

namespace {

// The library this product (f32, or with bf16 operands) runs on under the policy in force. A
// fixed policy runs bf16 operands whole on oneDNN's bf16 primitive where it is native and takes
// them as they are, else widened; `auto` measures every library that runs the product.
MatmulLib library_for(const MatmulArgs& x) {
  const bool widen = widenable(x) && !native_bf16_operands(x);
  switch (matmul_policy()) {
    case MatmulPolicy::onednn:
      return widen ? MatmulLib::widened : MatmulLib::onednn;
    case MatmulPolicy::openblas:
      if (widen) return MatmulLib::widened;
      return matmul_lib_supports(MatmulLib::openblas, x) ? MatmulLib::openblas : MatmulLib::onednn;
    case MatmulPolicy::choose:
      break;
  }
  return matmul_chooser().choose(x);
}

}  // namespace

void matmul_group(std::span<const MatmulArgs> products) {
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const bool plain = std::all_of(products.begin(), products.end(), [](const MatmulArgs& x) {
    return x.a.dtype == DType::f32 && x.b.dtype == DType::f32 && !x.bf16 && x.b0 * x.b1 == 1 &&
           matmul_lib_supports(MatmulLib::openblas, x);
  });
  if (threads < 2 || !plain || products.size() < 2) {
    for (const MatmulArgs& x : products) matmul(x);
    return;
  }
  double flops = 0;
  for (const MatmulArgs& x : products) {
    TETRA_CHECK(x.M == 0 || x.N == 0 || x.K > 0, "[matmul] K must be positive (got {})", x.K);
    flops += 2.0 * double(x.M) * double(x.N) * double(x.K);
  }
  const ProfileScope profile(products.front().role, int64_t(products.size()), flops);
  const GroupPlan plan = plan_group(products, threads);
  // The pieces' library: the policy's, or under `auto` the family the chooser picks for the
  // group's largest product (oneDNN's primitive for onednn, onednn-copy and onednn-split).
  const MatmulArgs& largest = *std::max_element(
      products.begin(), products.end(), [](const MatmulArgs& x, const MatmulArgs& y) {
        return double(x.M) * double(x.N) * double(x.K) < double(y.M) * double(y.N) * double(y.K);
      });
  const MatmulLib lib = library_for(largest);
  const bool onednn = lib != MatmulLib::openblas && lib != MatmulLib::openblas_split;
  std::vector<Cached*> prims(plan.pieces.size(), nullptr);
  Engine& e = engine();
  if (onednn) {
    // Found or created on this thread (the cache is not shared), a thread's own per shape.
    for (size_t i = 0; i < plan.pieces.size(); ++i) {
      prims[i] = &onednn_primitive(plan.pieces[i], plan.thread[i] + 1);
    }
    while (int(e.slab_streams.size()) < threads) e.slab_streams.emplace_back(e.engine);
  }
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    try {
      for (size_t i = 0; i < plan.pieces.size(); ++i) {
        // A runtime that gives the region fewer threads than asked deals their pieces round.
        if (plan.thread[i] % n != t) continue;
        if (onednn) {
          onednn_run(*prims[i], plan.pieces[i], e.slab_streams[size_t(plan.thread[i])]);
        } else {
          openblas_matmul(plan.pieces[i]);
        }
      }
    } catch (...) {
#pragma omp critical(tetra_matmul_group_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

std::string matmul_machine() {
  return fmt::format("{} (oneDNN {}, OpenBLAS {})", cpu_model(), onednn_isa(),
                     openblas_get_corename());
}

void matmul(const MatmulArgs& x) {
  if (x.M == 0 || x.N == 0) return;
  const ProfileScope profile(x.role, x.b0 * x.b1, x.M, x.K, x.N);
  TETRA_CHECK(x.K > 0, "[matmul] K must be positive (got {})", x.K);
  TETRA_CHECK(!x.bias || (x.b0 == 1 && x.b1 == 1), "[matmul] bias only for unbatched products");
  if (x.bf16) {
    const Bf16MatmulPath& path = bf16_matmul_path();
    TETRA_CHECK(path.hardware,
                "[matmul] mixed-precision products need bf16 instructions (oneDNN ISA "
                "avx512_core_bf16 or avx512_core_amx); this CPU has oneDNN ISA {}",
                path.isa);
    TETRA_CHECK(x.a.dtype == DType::f32 && x.b.dtype == DType::f32,
                "[matmul] a mixed-precision product takes f32 operands (got {} x {})",
                dtype_name(x.a.dtype), dtype_name(x.b.dtype));
    const int64_t batch = x.b0 * x.b1;
    const auto [a, b] = x.bf16->take(size_t(batch * x.M * x.K), size_t(batch * x.K * x.N));
    MatmulArgs r = x;
    r.bf16 = nullptr;
    r.a = kept_or_rounded(x.a, x.b0, x.b1, x.M, x.K, a, false, *x.bf16);
    r.b = kept_or_rounded(x.b, x.b0, x.b1, x.K, x.N, b, transposed_b_needs_copy(x), *x.bf16);
    return matmul_with(library_for(r), r);
  }
  if (x.a.dtype == DType::f64) return matmul_reference(x);
  const bool has_bf16 = x.a.dtype == DType::bf16 || x.b.dtype == DType::bf16;
  if (!has_bf16 || native_bf16_operands(x) || matmul_policy() == MatmulPolicy::choose) {
    return matmul_with(library_for(x), x);
  }
  // A fixed policy: one bf16 operand with an f32 one, or a transposed bf16 B the bf16 primitive
  // must not take as it is (copied row-major first), stay on that primitive where it is native.
  if (bf16_matmul_path().native) {
    if (x.b.dtype != DType::bf16 || !transposed_b_needs_copy(x)) return onednn_matmul(x);
    MatmulArgs r = x;
    r.b = row_major_bf16(x.b, x.b0, x.b1, x.K, x.N, engine().scratch_b16);
    return onednn_matmul(r);
  }
  widened_matmul(x, false);
}

std::string onednn_isa() { return std::string(isa_name(dnnl::get_effective_cpu_isa())); }

const Bf16MatmulPath& bf16_matmul_path() {
  static const Bf16MatmulPath path = probe_bf16_path();
  return path;
}

std::string Bf16MatmulPath::describe() const {
  return std::string(native ? "onednn-bf16" : "f32-widened") + " (" + isa + ")";
}

size_t matmul_cache_size() { return engine().cache.size(); }

}  // namespace tetra::cpu
