#include "kernels/cpu/matmul.h"

#include <map>
#include <oneapi/dnnl/dnnl.hpp>
#include <string_view>
#include <vector>

#include "core/error.h"

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
  std::map<Key, Cached> cache;
  std::vector<float> scratch_a, scratch_b;  // bf16 operands widened to f32 (fallback path)
};

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
  return p;
}

// A bf16 operand (b0, b1, rows, cols) widened into dense f32 `scratch`; other operands unchanged.
// bf16 -> f32 is exact, so the f32 product sees the same inputs the bf16 primitive would.
MatOperand widened(const MatOperand& op, int64_t b0, int64_t b1, int64_t rows, int64_t cols,
                   std::vector<float>& scratch) {
  if (op.dtype != DType::bf16) return op;
  scratch.resize(size_t(b0 * b1 * rows * cols));
  const bf16* src = static_cast<const bf16*>(op.data);
  float* dst = scratch.data();
  const auto& s = op.strides;
#pragma omp parallel for collapse(3)
  for (int64_t i0 = 0; i0 < b0; ++i0)
    for (int64_t i1 = 0; i1 < b1; ++i1)
      for (int64_t r = 0; r < rows; ++r) {
        const bf16* in = src + i0 * s[0] + i1 * s[1] + r * s[2];
        float* out = dst + ((i0 * b1 + i1) * rows + r) * cols;
        for (int64_t c = 0; c < cols; ++c) out[c] = in[c * s[3]].to_float();
      }
  return {dst, {b1 * rows * cols, rows * cols, cols, 1}, DType::f32};
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

// C = A·B through a cached oneDNN primitive (f32 or, where bf16_matmul_path() is native, bf16
// operands).
void onednn_matmul(const MatmulArgs& x) {
  Key key = {
      x.b0,        x.b1, x.M, x.N, x.K, int64_t(x.a.dtype), int64_t(x.b.dtype), x.bias != nullptr,
      x.accumulate};
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

  Cached& c = it->second;
  c.src.set_data_handle(const_cast<void*>(x.a.data));
  c.weights.set_data_handle(const_cast<void*>(x.b.data));
  c.dst.set_data_handle(x.c);
  if (x.bias) c.bias.set_data_handle(const_cast<void*>(x.bias));
  c.prim.execute(e.stream, c.args);
  e.stream.wait();
}

}  // namespace

void matmul(const MatmulArgs& x) {
  if (x.M == 0 || x.N == 0) return;
  TETRA_CHECK(x.K > 0, "[matmul] K must be positive (got {})", x.K);
  TETRA_CHECK(!x.bias || (x.b0 == 1 && x.b1 == 1), "[matmul] bias only for unbatched products");
  if (x.a.dtype == DType::f64) return matmul_reference(x);
  const bool has_bf16 = x.a.dtype == DType::bf16 || x.b.dtype == DType::bf16;
  if (!has_bf16 || bf16_matmul_path().native) return onednn_matmul(x);
  Engine& e = engine();
  MatmulArgs w = x;
  w.a = widened(x.a, x.b0, x.b1, x.M, x.K, e.scratch_a);
  w.b = widened(x.b, x.b0, x.b1, x.K, x.N, e.scratch_b);
  onednn_matmul(w);
}

std::string onednn_isa() { return std::string(isa_name(dnnl::get_effective_cpu_isa())); }

const Bf16MatmulPath& bf16_matmul_path() {
  static const Bf16MatmulPath path = probe_bf16_path();
  return path;
}

std::string Bf16MatmulPath::describe() const {
  return std::string(native ? "onednn-bf16" : "f32-widened") + " (" + isa + ")";
}

namespace {

template <typename T>
MatmulArgs plain(T* out, int64_t M, int64_t N, int64_t K, bool accumulate) {
  MatmulArgs x;
  x.M = M, x.N = N, x.K = K;
  x.a.dtype = x.b.dtype = dtype_of<T>();
  x.c = out;
  x.c_strides = {M * N, M * N, N, 1};
  x.accumulate = accumulate;
  return x;
}

}  // namespace

template <typename T>
void matmul_nt(T* out, const T* inp, const T* w, const T* bias, int64_t M, int64_t N, int64_t K,
               bool accumulate) {
  MatmulArgs x = plain(out, M, N, K, accumulate);
  x.a.data = inp, x.a.strides = {M * K, M * K, K, 1};
  x.b.data = w, x.b.strides = {N * K, N * K, 1, K};  // B(k, n) = W[n, k]
  x.bias = bias;
  matmul(x);
}

template <typename T>
void matmul_nn(T* out, const T* a, const T* b, int64_t M, int64_t N, int64_t K, bool accumulate) {
  MatmulArgs x = plain(out, M, N, K, accumulate);
  x.a.data = a, x.a.strides = {M * K, M * K, K, 1};
  x.b.data = b, x.b.strides = {K * N, K * N, N, 1};
  matmul(x);
}

template <typename T>
void matmul_tn(T* out, const T* a, const T* b, int64_t M, int64_t N, int64_t K, bool accumulate) {
  MatmulArgs x = plain(out, M, N, K, accumulate);
  x.a.data = a, x.a.strides = {M * K, M * K, 1, M};  // A(m, k) = a[k, m]
  x.b.data = b, x.b.strides = {K * N, K * N, N, 1};
  matmul(x);
}

#define TETRA_INSTANTIATE(T)                                                                     \
  template void matmul_nt<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t, bool); \
  template void matmul_nn<T>(T*, const T*, const T*, int64_t, int64_t, int64_t, bool);           \
  template void matmul_tn<T>(T*, const T*, const T*, int64_t, int64_t, int64_t, bool);
TETRA_INSTANTIATE(float)
TETRA_INSTANTIATE(double)
#undef TETRA_INSTANTIATE

size_t matmul_cache_size() { return engine().cache.size(); }

}  // namespace tetra::cpu
