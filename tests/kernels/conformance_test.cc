// Backend conformance, in the spirit of ggml's test-backend-ops: every operation of the device
// seam (kernels/kernels.h) on every backend compiled in — the CPU's f32 and f64 tables, and the
// CUDA f32 table where a GPU is present — against f64 references written from the contracts
// (tests/kernels/conformance.h), on shapes drawn from fixed seeds that always include the odd ones
// (T = 1, T = 70 across the CPU's 64-row causal blocks, head sizes 7 and 12, grouped-query
// attention with 2 to 4 query heads per key/value head, N not a multiple of a vector width, C = 1,
// V < Vp). Data reaches the kernels through the backend's Device, so the
// same code runs on a GPU. Outputs the contract overwrites are poisoned with a NaN first (every
// element must be written); outputs it accumulates into are pre-filled with random values (every
// element must be added to); memory around an output (gaps between strided rows, other ranges)
// must be left alone.
//
// Each checked output is recorded as (op, backend, shape, error, bound); the run ends with the
// table "op x backend: worst error / bound", written as Markdown to $TETRA_CONFORMANCE_REPORT when
// that names a file (docs/performance.md, "Backend conformance", says how to regenerate it).
#include "tests/kernels/conformance.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "core/arena.h"
#include "core/device.h"
#include "kernels/backend.h"
#include "kernels/kernels.h"

namespace tetra::conformance {

// ---- the backends under test ------------------------------------------------------------------

// Outside the anonymous namespace: CTest names each case after its type parameter, and a type in an
// anonymous namespace prints as "(anonymous namespace)::...".
struct CpuF32 {
  using F = float;
  static constexpr const char* kName = "cpu f32";
  static std::string unavailable() { return ""; }
  static Backend& backend() { return cpu_backend(); }
};
struct CpuF64 {
  using F = double;
  static constexpr const char* kName = "cpu f64";
  static std::string unavailable() { return ""; }
  static Backend& backend() { return cpu_backend(); }
};
struct CudaF32 {
  using F = float;
  static constexpr const char* kName = "cuda f32";
  static std::string unavailable() { return cuda_unavailable(); }
  static Backend& backend() { return backend_for(DeviceKind::cuda); }
};

namespace {

using Targets = ::testing::Types<CpuF32, CpuF64, CudaF32>;

// The random shapes of each op come from these seeds, after its fixed odd shapes.
constexpr uint64_t kShapeSeeds[] = {101, 202, 303};

std::string shape_str(std::initializer_list<std::pair<const char*, int64_t>> dims) {
  std::string s;
  for (const auto& [name, v] : dims) {
    // Appended piece by piece: g++ 12 warns (-Wrestrict, falsely) on "literal" + std::string.
    if (!s.empty()) s += ' ';
    s.append(name).append("=").append(std::to_string(v));
  }
  return s;
}

template <typename P>
class Conformance : public ::testing::Test {
 public:  // the shared case bodies below are free functions over the fixture
  using F = typename P::F;
  static constexpr bool kIsF32 = std::is_same_v<F, float>;

  void SetUp() override {
    const std::string why = P::unavailable();
    if (!why.empty()) {
      Report::get().skip("", P::kName, why);
      GTEST_SKIP() << P::kName << " is not tested here: " << why;
    }
    backend_ = &P::backend();
    Report::get().describe(P::kName, backend_->describe());
  }

  Kernels<F>& k() { return backend_->template kernels<F>(); }
  Device& device() { return backend_->device(); }

  template <typename T>
  Buffer<T> upload(const std::vector<T>& host) {
    Buffer<T> b(host.size(), MemTag{}, device());
    if (!host.empty()) device().from_host(b.data(), host.data(), b.bytes());
    return b;
  }
  template <typename T>
  std::vector<T> download(const Buffer<T>& b) {
    std::vector<T> host(b.size());
    if (!host.empty()) device().to_host(host.data(), b.data(), b.bytes());
    return host;
  }
  Buffer<F> poisoned(size_t n) { return upload(std::vector<F>(n, poison<F>())); }

  /** Holds `got` to `want` within the bound of `tol` for this precision and records the case. */
  void check(const std::string& op, const std::string& shape, const std::string& output,
             const Vec& got, const Vec& want, Tol tol) {
    const double b = bound<F>(tol);
    const Error e = measure_error(got, want);
    Report::get().record(op, P::kName, shape, output, e.value, b);
    EXPECT_LE(e.value, b) << op << " on " << P::kName << ", " << shape << ": " << output
                          << " error " << e.value << " > bound " << b << "; worst element "
                          << e.index << " got " << (e.index < got.size() ? got[e.index] : NAN)
                          << " want " << (e.index < want.size() ? want[e.index] : NAN);
  }
  void check(const std::string& op, const std::string& shape, const std::string& output,
             const Buffer<F>& got, const Vec& want, Tol tol) {
    check(op, shape, output, wide(download(got)), want, tol);
  }
  void check_value(const std::string& op, const std::string& shape, const std::string& output,
                   double got, double want, Tol tol) {
    check(op, shape, output, Vec{got}, Vec{want}, tol);
  }
  /** An error the caller measured itself (e.g. a cancellation ratio) against `tol`'s bound. */
  void check_error(const std::string& op, const std::string& shape, const std::string& output,
                   double error, Tol tol) {
    const double b = bound<F>(tol);
    Report::get().record(op, P::kName, shape, output, error, b);
    EXPECT_LE(error, b) << op << " on " << P::kName << ", " << shape << ": " << output << " "
                        << error << " > bound " << b;
  }

  /** Why this table has no mixed precision here ("" when it has); the ops `pattern` names
   *  (Report::skip) are then recorded as skipped, with the reason. */
  std::string mixed_unavailable(const std::string& pattern) {
    std::string why = kIsF32 ? backend_->bf16_unsupported()
                             : "mixed precision rounds f32 operands; the f64 table has none";
    if (!why.empty()) Report::get().skip(pattern, P::kName, why);
    return why;
  }

  Backend* backend_ = nullptr;
};

// Cases are Conformance/0 (cpu f32), /1 (cpu f64), /2 (cuda f32): CMake's test discovery names a
// typed case after its type (Conformance.Gelu<tetra::conformance::CpuF32>) only for numbered ones.
TYPED_TEST_SUITE(Conformance, Targets);

// ---- memory -----------------------------------------------------------------------------------

TYPED_TEST(Conformance, CopyZeroCopyRows) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  // copy and zero of n elements in the middle of a buffer: the 3 guard elements on each side
  // keep their values.
  const size_t kGuard = 3;
  for (size_t n : {size_t(1), size_t(7), size_t(1000), size_t(40001)}) {
    Inputs in(seed_of("copy", n));
    const std::string shape = shape_str({{"n", int64_t(n)}});
    const std::vector<F> src = in.values<F>(n), around = in.values<F>(n + 2 * kGuard);
    std::vector<F> init = around;
    std::fill_n(init.begin() + kGuard, n, poison<F>());
    Buffer<F> s = this->upload(src), d = this->upload(init);
    k.copy(d.data() + kGuard, s.data(), n);
    Vec want = wide(around);
    std::copy(src.begin(), src.end(), want.begin() + kGuard);
    this->check("copy", shape, "dst and guards", d, want, Tol::exact);

    Buffer<F> z = this->upload(around);
    k.zero(z.data() + kGuard, n);
    want = wide(around);
    std::fill_n(want.begin() + kGuard, n, 0.0);
    this->check("zero", shape, "x and guards", z, want, Tol::exact);
  }
  // copy_rows between row strides wider than the rows: the gaps between rows keep their values.
  struct Rows {
    int64_t rows, cols, src_stride, dst_stride;
  };
  std::vector<Rows> shapes = {{1, 1, 1, 1}, {5, 3, 7, 4}, {9, 16, 16, 20}, {4, 33, 40, 33}};
  for (uint64_t seed : kShapeSeeds) {
    Inputs in(seed_of("copy_rows shape", seed));
    const int64_t cols = in.integer(1, 70);
    shapes.push_back({in.integer(1, 30), cols, cols + in.integer(0, 9), cols + in.integer(0, 9)});
  }
  for (const Rows& r : shapes) {
    Inputs in(seed_of("copy_rows", uint64_t(r.rows * 1000 + r.cols)));
    const std::string shape = shape_str({{"rows", r.rows},
                                         {"cols", r.cols},
                                         {"src_stride", r.src_stride},
                                         {"dst_stride", r.dst_stride}});
    const std::vector<F> src = in.values<F>(size_t(r.rows * r.src_stride)),
                         around = in.values<F>(size_t(r.rows * r.dst_stride));
    std::vector<F> init = around;
    Vec want = wide(around);
    for (int64_t i = 0; i < r.rows; ++i)
      for (int64_t c = 0; c < r.cols; ++c) {
        init[size_t(i * r.dst_stride + c)] = poison<F>();
        want[size_t(i * r.dst_stride + c)] = double(src[size_t(i * r.src_stride + c)]);
      }
    Buffer<F> s = this->upload(src), d = this->upload(init);
    k.copy_rows(d.data(), r.dst_stride, s.data(), r.src_stride, r.rows, r.cols);
    this->check("copy_rows", shape, "dst and gaps", d, want, Tol::exact);
  }
}

// ---- products ---------------------------------------------------------------------------------

struct Mnk {
  int64_t M, N, K;
};

std::vector<Mnk> product_shapes(const char* op) {
  // {7, 58, 42}: M <= 32 with 48 < N < 64, where oneDNN 2.6.3's AMX bf16 kernel got products with
  // a transposed B wrong.
  std::vector<Mnk> shapes = {{1, 1, 1},    {1, 7, 5},    {5, 1, 3},  {3, 5, 1},
                             {33, 17, 65}, {64, 48, 32}, {7, 58, 42}};
  for (uint64_t seed : kShapeSeeds) {
    Inputs in(seed_of(op, seed));
    shapes.push_back({in.integer(1, 80), in.integer(1, 80), in.integer(1, 100)});
  }
  return shapes;
}

/** Dense (rows, cols) of `src`, read at (r, c) -> src[r * rs + c * cs]. */
Vec dense(const Vec& src, int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  Vec out(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[size_t(r * cols + c)] = src[size_t(r * rs + c * cs)];
  return out;
}

/** a (M,K) · b (K,N), both dense, in double. */
Vec product(const Vec& a, const Vec& b, int64_t M, int64_t N, int64_t K) {
  Vec c(size_t(M * N));
  ref::matmul(1, 1, M, N, K, {&a, {0, 0, K, 1}}, {&b, {0, 0, N, 1}}, nullptr, c, {0, 0, N, 1}, 0,
              false);
  return c;
}

// The 2-D helpers on every product shape: nt with a bias, nn, tn, and accumulating forms. With
// `mixed` they run under Bf16Operands and are held to a reference whose operands are rounded to
// bf16 (the contract: f32 operands rounded, nearest even, f32 accumulation) at the f32 bound, and
// to the unrounded reference at the bf16 product bound.
template <typename Fixture, typename F>
void two_d_products(Fixture& t, bool mixed) {
  Kernels<F>& k = t.k();
  Bf16Operands ops(t.device(), 0);
  Bf16Operands* bf16 = mixed ? &ops : nullptr;
  const std::string tag = mixed ? " Bf16Operands" : "";
  for (const Mnk& s : product_shapes("matmul")) {
    const int64_t M = s.M, N = s.N, K = s.K;
    const std::string shape = shape_str({{"M", M}, {"N", N}, {"K", K}});
    Inputs in(seed_of("matmul", uint64_t(M * 1000000 + N * 1000 + K)));
    const std::vector<F> inp = in.values<F>(size_t(M * K)), w = in.values<F>(size_t(N * K)),
                         bias = in.values<F>(size_t(N)), a = in.values<F>(size_t(M * K)),
                         b = in.values<F>(size_t(K * N)), at = in.values<F>(size_t(K * M)),
                         c0 = in.values<F>(size_t(M * N));
    const Vec wbias = wide(bias), wc0 = wide(c0);
    Buffer<F> d_inp = t.upload(inp), d_w = t.upload(w), d_bias = t.upload(bias), d_a = t.upload(a),
              d_b = t.upload(b), d_at = t.upload(at);

    // Each variant: its reference from operands (rounded or not), then the checks.
    struct Variant {
      const char* name;
      bool accumulate, has_bias;
    };
    auto expect = [&](const std::string& op, const Buffer<F>& got,
                      const std::function<Vec(bool)>& want) {
      if (!mixed) return t.check(op, shape, "C", got, want(false), Tol::arith);
      t.check(op + " (operands rounded)", shape, "C", got, want(true), Tol::arith);
      t.check(op + " (vs unrounded)", shape, "C", got, want(false), Tol::bf16_product);
    };
    auto with = [&](Vec c, bool bias_on, bool acc) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double& x = c[size_t(m * N + n)];
          x += (bias_on ? wbias[size_t(n)] : 0.0) + (acc ? wc0[size_t(m * N + n)] : 0.0);
        }
      return c;
    };
    for (const Variant& v :
         {Variant{"matmul nt +bias", false, true}, Variant{"matmul nt accumulate", true, false},
          Variant{"matmul nt +bias accumulate", true, true}}) {
      Buffer<F> out = v.accumulate ? t.upload(c0) : t.poisoned(size_t(M * N));
      matmul_nt<F>(k, out.data(), d_inp.data(), d_w.data(), v.has_bias ? d_bias.data() : nullptr, M,
                   N, K, v.accumulate, "conformance", bf16);
      expect(v.name + tag, out, [&](bool round) {
        const Vec wt = dense(round ? ref::rounded_bf16(wide(w)) : wide(w), K, N, 1, K);
        return with(product(round ? ref::rounded_bf16(wide(inp)) : wide(inp), wt, M, N, K),
                    v.has_bias, v.accumulate);
      });
    }
    for (bool acc : {false, true}) {
      Buffer<F> out = acc ? t.upload(c0) : t.poisoned(size_t(M * N));
      matmul_nn<F>(k, out.data(), d_a.data(), d_b.data(), M, N, K, acc, "conformance", bf16);
      expect(std::string(acc ? "matmul nn accumulate" : "matmul nn") + tag, out, [&](bool round) {
        return with(product(round ? ref::rounded_bf16(wide(a)) : wide(a),
                            round ? ref::rounded_bf16(wide(b)) : wide(b), M, N, K),
                    false, acc);
      });
      Buffer<F> out_tn = acc ? t.upload(c0) : t.poisoned(size_t(M * N));
      matmul_tn<F>(k, out_tn.data(), d_at.data(), d_b.data(), M, N, K, acc, "conformance", bf16);
      expect(std::string(acc ? "matmul tn accumulate" : "matmul tn") + tag, out_tn,
             [&](bool round) {
               const Vec a_mk = dense(round ? ref::rounded_bf16(wide(at)) : wide(at), M, K, 1, M);
               return with(product(a_mk, round ? ref::rounded_bf16(wide(b)) : wide(b), M, N, K),
                           false, acc);
             });
    }
  }
}

// Batched products over strided views of a fused (B,T,3C) buffer, as attention issues them:
// scores (B,NH,T,T) = q·k^T (k read transposed), out (B,T,C) = p·v written through per-head
// views of row stride C, and dv += p^T·dy accumulated into the v part of a (B,T,3C) gradient whose
// q and k parts must be left alone.
template <typename Fixture, typename F>
void batched_products(Fixture& t, bool mixed) {
  Kernels<F>& k = t.k();
  Bf16Operands ops(t.device(), 0);
  const std::string tag = mixed ? " Bf16Operands" : "";
  struct Heads {
    int B, T, NH, hs;
  };
  std::vector<Heads> shapes = {{1, 1, 1, 7}, {2, 5, 3, 12}, {1, 70, 2, 32}, {2, 9, 1, 64}};
  for (uint64_t seed : kShapeSeeds) {
    Inputs in(seed_of("matmul batched shape", seed));
    shapes.push_back({in.integer(1, 3), in.integer(1, 40), in.integer(1, 4), in.integer(1, 20)});
  }
  for (const Heads& h : shapes) {
    const int64_t B = h.B, T = h.T, NH = h.NH, hs = h.hs, C = NH * hs, C3 = 3 * C;
    const std::string shape = shape_str({{"B", B}, {"T", T}, {"NH", NH}, {"hs", hs}});
    Inputs in(seed_of("matmul batched", uint64_t(B * 1000000 + T * 1000 + NH * 100 + hs)));
    const std::vector<F> qkv = in.values<F>(size_t(B * T * C3)),
                         p = in.values<F>(size_t(B * NH * T * T)),
                         dy = in.values<F>(size_t(B * T * C)),
                         grad0 = in.values<F>(size_t(B * T * C3));
    Buffer<F> d_qkv = t.upload(qkv), d_p = t.upload(p), d_dy = t.upload(dy);
    const DType dt = dtype_of<F>();
    auto args = [&](int64_t M, int64_t N, int64_t K) {
      MatmulArgs x;
      x.b0 = B, x.b1 = NH, x.M = M, x.N = N, x.K = K;
      x.role = "conformance";
      x.bf16 = mixed ? &ops : nullptr;
      x.a.dtype = x.b.dtype = dt;
      return x;
    };
    auto prepared = [&](const std::vector<F>& v, bool round) {
      return round ? ref::rounded_bf16(wide(v)) : wide(v);
    };
    // `picked` chooses the elements held to the product's bound (all of them when empty).
    auto expect = [&](const std::string& op, const std::string& output, const Buffer<F>& got_buf,
                      const std::function<Vec(bool)>& want,
                      const std::function<Vec(const Vec&)>& picked = {}) {
      auto part = [&](const Vec& v) { return picked ? picked(v) : v; };
      const Vec got = part(wide(t.download(got_buf)));
      if (!mixed) return t.check(op, shape, output, got, part(want(false)), Tol::arith);
      t.check(op + " (operands rounded)", shape, output, got, part(want(true)), Tol::arith);
      t.check(op + " (vs unrounded)", shape, output, got, part(want(false)), Tol::bf16_product);
    };
    const std::array<int64_t, 4> head_rows{T * C3, hs, C3, 1}, head_cols{T * C3, hs, 1, C3},
        att{NH * T * T, T * T, T, 1}, att_t{NH * T * T, T * T, 1, T}, out_s{T * C, hs, C, 1};

    // scores = q · k^T
    Buffer<F> scores = t.poisoned(size_t(B * NH * T * T));
    MatmulArgs x = args(T, T, hs);
    x.a.data = d_qkv.data(), x.a.strides = head_rows;
    x.b.data = d_qkv.data() + C, x.b.strides = head_cols;
    x.c = scores.data(), x.c_strides = att;
    k.matmul(x);
    expect("matmul batched q.k^T" + tag, "scores", scores, [&](bool round) {
      const Vec q = prepared(qkv, round);
      Vec c(size_t(B * NH * T * T));
      ref::matmul(B, NH, T, T, hs, {&q, head_rows}, {&q, head_cols, C}, nullptr, c, att, 0, false);
      return c;
    });

    // out = p · v, through strided per-head views of C
    Buffer<F> out = t.poisoned(size_t(B * T * C));
    x = args(T, hs, T);
    x.a.data = d_p.data(), x.a.strides = att;
    x.b.data = d_qkv.data() + 2 * C, x.b.strides = head_rows;
    x.c = out.data(), x.c_strides = out_s;
    k.matmul(x);
    expect("matmul batched p.v" + tag, "out", out, [&](bool round) {
      const Vec pw = prepared(p, round), v = prepared(qkv, round);
      Vec c(size_t(B * T * C));
      ref::matmul(B, NH, T, hs, T, {&pw, att}, {&v, head_rows, 2 * C}, nullptr, c, out_s, 0, false);
      return c;
    });

    // dv += p^T · dy into the v part of a fused gradient
    Buffer<F> grad = t.upload(grad0);
    x = args(T, hs, T);
    x.a.data = d_p.data(), x.a.strides = att_t;
    x.b.data = d_dy.data(), x.b.strides = out_s;
    x.c = grad.data() + 2 * C, x.c_strides = head_rows;
    x.accumulate = true;
    k.matmul(x);
    // The v part (its own scale) and, exactly, the q and k parts the product must not touch.
    auto v_part = [&](bool v) {
      return [&, v](const Vec& all) {
        Vec out;
        for (size_t i = 0; i < all.size(); ++i) {
          if ((int64_t(i) % C3 >= 2 * C) == v) out.push_back(all[i]);
        }
        return out;
      };
    };
    const std::string op = "matmul batched p^T.dy accumulate" + tag;
    expect(
        op, "dqkv: dv", grad,
        [&](bool round) {
          const Vec pw = prepared(p, round), d = prepared(dy, round);
          Vec c = wide(grad0);
          ref::matmul(B, NH, T, hs, T, {&pw, att_t}, {&d, out_s}, nullptr, c, head_rows, 2 * C,
                      true);
          return c;
        },
        v_part(true));
    t.check(op + " (dq, dk untouched)", shape, "dqkv: dq, dk",
            v_part(false)(wide(t.download(grad))), v_part(false)(wide(grad0)), Tol::exact);
  }
}

TYPED_TEST(Conformance, Matmul) {
  using F = typename TestFixture::F;
  two_d_products<TestFixture, F>(*this, false);
  batched_products<TestFixture, F>(*this, false);
}

TYPED_TEST(Conformance, MatmulMixedPrecision) {
  using F = typename TestFixture::F;
  const std::string why = this->mixed_unavailable("matmul Bf16Operands");
  if (!why.empty()) GTEST_SKIP() << why;
  two_d_products<TestFixture, F>(*this, true);
  batched_products<TestFixture, F>(*this, true);

  // The rounded-operand check can tell rounding from none: on this shape the unrounded product is
  // outside the f32 bound of the rounded one.
  const int64_t M = 17, N = 9, K = 40;
  Inputs in(seed_of("matmul sensitivity", 0));
  const std::vector<F> a = in.values<F>(size_t(M * K)), b = in.values<F>(size_t(K * N));
  const Vec exact = product(wide(a), wide(b), M, N, K),
            rounded = product(ref::rounded_bf16(wide(a)), ref::rounded_bf16(wide(b)), M, N, K);
  EXPECT_GT(measure_error(exact, rounded).value, bound<F>(Tol::arith) * 100);
}

// bf16-dtype operands (bf16 tensors, f32 C and bias): the f32 table only.
TYPED_TEST(Conformance, MatmulBf16Dtype) {
  using F = typename TestFixture::F;
  if constexpr (!TestFixture::kIsF32) {
    const char* why = "bf16 operands multiply into f32 C; the f64 table takes f64 operands only";
    Report::get().skip("matmul bf16-dtype", TypeParam::kName, why);
    GTEST_SKIP() << why;
  } else {
    Kernels<F>& k = this->k();
    for (const Mnk& s : product_shapes("matmul bf16")) {
      const int64_t M = s.M, N = s.N, K = s.K;
      const std::string shape = shape_str({{"M", M}, {"N", N}, {"K", K}});
      Inputs in(seed_of("matmul bf16", uint64_t(M * 1000000 + N * 1000 + K)));
      // bf16 tensors and their exact values
      auto bf16_values = [&](size_t n, std::vector<bf16>& v, Vec& exact) {
        for (float x : in.values<float>(n)) {
          v.push_back(bf16::from_float(x));
          exact.push_back(v.back().to_float());
        }
      };
      std::vector<bf16> a, w;
      Vec wa, ww;
      bf16_values(size_t(M * K), a, wa);
      bf16_values(size_t(N * K), w, ww);
      const std::vector<F> bias = in.values<F>(size_t(N));
      Buffer<bf16> d_a = this->upload(a), d_w = this->upload(w);
      Buffer<F> d_bias = this->upload(bias), out = this->poisoned(size_t(M * N));
      MatmulArgs x;
      x.M = M, x.N = N, x.K = K;
      x.role = "conformance";
      x.a = {d_a.data(), {M * K, M * K, K, 1}, DType::bf16};
      x.b = {d_w.data(), {N * K, N * K, 1, K}, DType::bf16};  // B(k, n) = w[n, k]
      x.c = out.data(), x.c_strides = {M * N, M * N, N, 1};
      x.bias = d_bias.data();
      k.matmul(x);
      Vec want = product(wa, dense(ww, K, N, 1, K), M, N, K);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) want[size_t(m * N + n)] += double(bias[size_t(n)]);
      this->check("matmul bf16-dtype operands nt +bias", shape, "C", out, want, Tol::arith);

      // nn: the same w read as a row-major (K, N) matrix, no bias
      Buffer<F> out_nn = this->poisoned(size_t(M * N));
      x.b.strides = {N * K, N * K, N, 1};
      x.c = out_nn.data();
      x.bias = nullptr;
      k.matmul(x);
      this->check("matmul bf16-dtype operands nn", shape, "C", out_nn, product(wa, ww, M, N, K),
                  Tol::arith);
    }
  }
}

// ---- linear_gelu ------------------------------------------------------------------------------

template <typename Fixture, typename F>
void linear_gelu(Fixture& t, bool mixed) {
  Kernels<F>& k = t.k();
  Bf16Operands ops(t.device(), 0);
  const std::string op = mixed ? "linear_gelu Bf16Operands" : "linear_gelu";
  for (const Mnk& s : product_shapes("linear_gelu")) {
    const int64_t M = s.M, N = s.N, K = s.K;
    const std::string shape = shape_str({{"M", M}, {"N", N}, {"K", K}});
    Inputs in(seed_of("linear_gelu", uint64_t(M * 1000000 + N * 1000 + K)));
    // Inputs scaled so that pre spans GELU's curved part (|pre| up to ~4) at every K.
    const double scale = 2.0 / std::sqrt(double(K));
    const std::vector<F> inp = in.values<F>(size_t(M * K)),
                         w = in.values<F>(size_t(N * K), 0.1 * scale, scale),
                         bias = in.values<F>(size_t(N));
    Buffer<F> d_inp = t.upload(inp), d_w = t.upload(w), d_bias = t.upload(bias),
              out = t.poisoned(size_t(M * N)), pre = t.poisoned(size_t(M * N));
    k.linear_gelu(out.data(), pre.data(), d_inp.data(), d_w.data(), d_bias.data(), M, N, K,
                  "conformance", mixed ? &ops : nullptr);
    auto want = [&](bool round, bool activated) {
      const Vec a = round ? ref::rounded_bf16(wide(inp)) : wide(inp);
      const Vec wt = dense(round ? ref::rounded_bf16(wide(w)) : wide(w), K, N, 1, K);
      Vec c = product(a, wt, M, N, K);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double& x = c[size_t(m * N + n)];
          x += double(bias[size_t(n)]);
          if (activated) x = ref::gelu(x);
        }
      return c;
    };
    if (!mixed) {
      t.check(op, shape, "pre", pre, want(false, false), Tol::arith);
      t.check(op, shape, "out", out, want(false, true), Tol::arith);
    } else {
      t.check(op + " (operands rounded)", shape, "pre", pre, want(true, false), Tol::arith);
      t.check(op + " (operands rounded)", shape, "out", out, want(true, true), Tol::arith);
      t.check(op + " (vs unrounded)", shape, "out", out, want(false, true), Tol::bf16_product);
    }
  }
}

TYPED_TEST(Conformance, LinearGelu) {
  using F = typename TestFixture::F;
  linear_gelu<TestFixture, F>(*this, false);
}

TYPED_TEST(Conformance, LinearGeluMixedPrecision) {
  using F = typename TestFixture::F;
  const std::string why = this->mixed_unavailable("linear_gelu Bf16Operands");
  if (!why.empty()) GTEST_SKIP() << why;
  linear_gelu<TestFixture, F>(*this, true);
}

// ---- LayerNorm --------------------------------------------------------------------------------

TYPED_TEST(Conformance, LayerNorm) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  std::vector<std::pair<int, int>> shapes = {{1, 1},  {3, 1},   {4, 2},  {1, 7},
                                             {5, 64}, {70, 33}, {2, 769}};
  for (uint64_t seed : kShapeSeeds) {
    Inputs in(seed_of("layernorm shape", seed));
    shapes.emplace_back(in.integer(1, 40), in.integer(1, 130));
  }
  for (const auto& [N, C] : shapes) {
    const std::string shape = shape_str({{"N", N}, {"C", C}});
    Inputs in(seed_of("layernorm", uint64_t(N * 10000 + C)));
    // Rows off-centre (|mean| up to 4) so that the mean really is subtracted.
    std::vector<F> x = in.values<F>(size_t(N) * C);
    const std::vector<F> offset = in.values<F>(size_t(N), 0.5, 4.0);
    for (int i = 0; i < N; ++i)
      for (int c = 0; c < C; ++c) x[size_t(i * C + c)] += offset[size_t(i)];
    const std::vector<F> w = in.values<F>(size_t(C), 0.5, 1.5), b = in.values<F>(size_t(C)),
                         dy = in.values<F>(size_t(N) * C), dx0 = in.values<F>(size_t(N) * C),
                         dw0 = in.values<F>(size_t(C)), db0 = in.values<F>(size_t(C));
    Buffer<F> d_x = this->upload(x), d_w = this->upload(w), d_b = this->upload(b),
              out = this->poisoned(size_t(N) * C), mean = this->poisoned(size_t(N)),
              rstd = this->poisoned(size_t(N));
    k.layernorm_forward(out.data(), mean.data(), rstd.data(), d_x.data(), d_w.data(), d_b.data(), N,
                        C);
    Vec r_out(size_t(N) * C), r_mean(static_cast<size_t>(N)), r_rstd(static_cast<size_t>(N));
    ref::layernorm_forward(r_out, r_mean, r_rstd, wide(x), wide(w), wide(b), N, C);
    this->check("layernorm_forward", shape, "out", out, r_out, Tol::arith);
    this->check("layernorm_forward", shape, "mean", mean, r_mean, Tol::arith);
    this->check("layernorm_forward", shape, "rstd", rstd, r_rstd, Tol::arith);

    // Backward from forward's saved mean and rstd; all three gradients accumulate. Not at C = 1:
    // a row of one channel has variance 0, so dinp is an exact cancellation (w·dy - mean(w·dy))
    // scaled by rstd = 1/sqrt(eps) ~ 316, and any rounding in it (an FMA that keeps w·dy unrounded
    // leaves ~2^-24 |w·dy|) comes out 316 times larger: an input no f32 bound holds, whatever the
    // kernel does.
    if (C == 1) continue;
    Buffer<F> d_dy = this->upload(dy), dx = this->upload(dx0), dw = this->upload(dw0),
              db = this->upload(db0);
    k.layernorm_backward(dx.data(), dw.data(), db.data(), d_dy.data(), d_x.data(), d_w.data(),
                         mean.data(), rstd.data(), N, C);
    Vec r_dx = wide(dx0), r_dw = wide(dw0), r_db = wide(db0);
    ref::layernorm_backward(r_dx, r_dw, r_db, wide(dy), wide(x), wide(w), N, C);
    this->check("layernorm_backward", shape, "dinp", dx, r_dx, Tol::arith);
    this->check("layernorm_backward", shape, "dweight", dw, r_dw, Tol::arith);
    this->check("layernorm_backward", shape, "dbias", db, r_db, Tol::arith);
  }
}

// ---- RMSNorm ----------------------------------------------------------------------------------

TYPED_TEST(Conformance, RmsNorm) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  std::vector<std::pair<int, int>> shapes = {{1, 1},  {3, 1},   {4, 2},  {1, 7},
                                             {5, 64}, {70, 33}, {2, 769}};
  for (uint64_t seed : kShapeSeeds) {
    Inputs in(seed_of("rmsnorm shape", seed));
    shapes.emplace_back(in.integer(1, 40), in.integer(1, 130));
  }
  for (size_t si = 0; si < shapes.size(); ++si) {
    const auto [N, C] = shapes[si];
    const double eps = si % 2 ? 1e-6 : 1e-5;  // Llama 2's and Llama 3's
    const std::string shape =
        shape_str({{"N", N}, {"C", C}}) + " eps=" + (si % 2 ? "1e-6" : "1e-5");
    Inputs in(seed_of("rmsnorm", uint64_t(N * 10000 + C)));
    // Rows of different scales (up to 4), so that rstd differs from row to row.
    std::vector<F> x = in.values<F>(size_t(N) * C);
    const std::vector<F> row_scale = in.values<F>(size_t(N), 0.25, 4.0);
    for (int i = 0; i < N; ++i)
      for (int c = 0; c < C; ++c) x[size_t(i * C + c)] *= std::abs(row_scale[size_t(i)]);
    const std::vector<F> w = in.values<F>(size_t(C), 0.5, 1.5), dy = in.values<F>(size_t(N) * C),
                         dx0 = in.values<F>(size_t(N) * C), dw0 = in.values<F>(size_t(C));
    Buffer<F> d_x = this->upload(x), d_w = this->upload(w), out = this->poisoned(size_t(N) * C),
              rstd = this->poisoned(size_t(N));
    k.rmsnorm_forward(out.data(), rstd.data(), d_x.data(), d_w.data(), N, C, eps);
    Vec r_out(size_t(N) * C), r_rstd(static_cast<size_t>(N));
    ref::rmsnorm_forward(r_out, r_rstd, wide(x), wide(w), N, C, eps);
    this->check("rmsnorm_forward", shape, "out", out, r_out, Tol::arith);
    this->check("rmsnorm_forward", shape, "rstd", rstd, r_rstd, Tol::arith);

    // Backward from forward's saved rstd; both gradients accumulate. Not at C = 1, for the reason
    // LayerNorm's is not: dinp is rstd · w · dy · (1 - x² · rstd²) = rstd · w · dy · eps / (x² +
    // eps), a cancellation that leaves f32's rounding of x² · rstd² (~2^-24) against a result of
    // order eps / x², relative errors far beyond any f32 bound, whatever the kernel does.
    if (C == 1) continue;
    Buffer<F> d_dy = this->upload(dy), dx = this->upload(dx0), dw = this->upload(dw0);
    k.rmsnorm_backward(dx.data(), dw.data(), d_dy.data(), d_x.data(), d_w.data(), rstd.data(), N,
                       C);
    Vec r_dx = wide(dx0), r_dw = wide(dw0);
    ref::rmsnorm_backward(r_dx, r_dw, wide(dy), wide(x), wide(w), N, C, eps);
    this->check("rmsnorm_backward", shape, "dinp", dx, r_dx, Tol::arith);
    this->check("rmsnorm_backward", shape, "dweight", dw, r_dw, Tol::arith);
  }
}

// ---- rotary position embedding ----------------------------------------------------------------

// In place over qkv (B,T,W): q and k held to the rotation, v bit for bit untouched; the inverse on
// another buffer (a gradient) to the opposite rotation. Positions up to ~5000 and theta of Llama 2
// (1e4) and Llama 3 (5e5); head sizes down to 2 and past every vector width; grouped key heads.
TYPED_TEST(Conformance, Rope) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  struct Case {
    int B, T, NH, KVH, hs, pos0;
    double theta;
  };
  std::vector<Case> cases = {{1, 1, 1, 0, 2, 0, 1e4},     {2, 5, 3, 0, 12, 0, 1e4},
                             {2, 5, 4, 2, 12, 3, 1e4},    {1, 70, 4, 1, 32, 100, 5e5},
                             {2, 9, 6, 3, 64, 4090, 1e4}, {1, 3, 2, 1, 128, 0, 5e5},
                             {1, 17, 2, 2, 6, 1, 10.0}};
  const int head_sizes[] = {2, 8, 12, 16, 64};
  for (uint64_t seed : kShapeSeeds) {
    Inputs in(seed_of("rope shape", seed));
    const int KVH = in.integer(1, 3), G = in.integer(1, 3);
    cases.push_back({in.integer(1, 2), in.integer(1, 40), KVH * G, KVH,
                     head_sizes[in.integer(0, 4)], in.integer(0, 5000),
                     in.integer(0, 1) ? 5e5 : 1e4});
  }
  for (const Case& c : cases) {
    const AttentionShape s{c.B, c.T, c.NH * c.hs, c.NH, c.KVH};
    const int64_t W = s.width(), rotated = s.C + s.kv_width();  // q and k: the first columns
    const std::string shape = shape_str({{"B", c.B},
                                         {"T", c.T},
                                         {"NH", c.NH},
                                         {"KVH", s.kv_heads()},
                                         {"hs", c.hs},
                                         {"pos0", c.pos0}}) +
                              " theta=" + std::to_string(int64_t(c.theta));
    Inputs in(seed_of("rope", uint64_t(c.B * 1000000 + c.T * 1000 + c.NH * 100 + c.hs) +
                                  uint64_t(c.pos0) * 1000000000ull));
    const size_t n = size_t(c.B) * c.T * size_t(W);
    // Rows split into the rotated columns, held to the bound, and v's, held exactly.
    auto part = [&](const Vec& all, bool qk) {
      Vec out;
      for (size_t i = 0; i < all.size(); ++i)
        if ((int64_t(i) % W < rotated) == qk) out.push_back(all[i]);
      return out;
    };
    for (bool inverse : {false, true}) {
      const std::string op = inverse ? "rope (inverse)" : "rope";
      const std::vector<F> x = in.values<F>(n);
      Buffer<F> d_x = this->upload(x);
      k.rope(d_x.data(), s, c.pos0, c.theta, inverse);
      const Vec got = wide(this->download(d_x)),
                want = ref::rope(wide(x), s, c.pos0, c.theta, inverse);
      this->check(op, shape, "q, k", part(got, true), part(want, true), Tol::arith);
      this->check(op, shape, "v (untouched)", part(got, false), part(wide(x), false), Tol::exact);
    }
  }
}

// ---- attention --------------------------------------------------------------------------------

struct Heads {
  int B, T, NH, hs;
  int KVH = 0;  // key/value heads; 0: NH (multi-head)
};

std::vector<Heads> attention_shapes() {
  // T = 70 crosses the CPU's 64-row causal blocks; head sizes 7 and 12 are no vector width.
  std::vector<Heads> shapes = {{1, 1, 1, 7},   {2, 5, 3, 12}, {1, 70, 2, 32},
                               {2, 17, 1, 64}, {1, 70, 3, 7}, {2, 3, 1, 1}};
  const int head_sizes[] = {7, 12, 16, 32, 64};
  for (uint64_t seed : kShapeSeeds) {
    Inputs in(seed_of("attention shape", seed));
    shapes.push_back(
        {in.integer(1, 2), in.integer(1, 40), in.integer(1, 3), head_sizes[in.integer(0, 4)]});
  }
  // Grouped-query attention: groups of 2 to 4 query heads over one key/value head (T = 70 across
  // the causal blocks, a single key/value head, odd head sizes), then drawn ones.
  for (const Heads& h : std::vector<Heads>{{2, 5, 4, 12, 2},
                                           {1, 70, 4, 16, 1},
                                           {2, 17, 6, 7, 3},
                                           {1, 1, 2, 7, 1},
                                           {1, 70, 8, 32, 2}}) {
    shapes.push_back(h);
  }
  for (uint64_t seed : kShapeSeeds) {
    Inputs in(seed_of("attention gqa shape", seed));
    const int KVH = in.integer(1, 3), G = in.integer(2, 4);
    shapes.push_back(
        {in.integer(1, 2), in.integer(1, 40), KVH * G, head_sizes[in.integer(0, 4)], KVH});
  }
  return shapes;
}

// Forward, backward, and recompute: only the public results (out, dqkv) meet the reference;
// `saved` and `scratch` are sized by the backend and private to it, except that recompute must
// leave `saved` as forward did and backward then give the same dqkv.
template <typename Fixture, typename F>
void attention(Fixture& t, bool mixed) {
  Kernels<F>& k = t.k();
  const std::string tag = mixed ? " Bf16Operands" : "";
  const Tol tol = mixed ? Tol::bf16_attention : Tol::arith;
  for (const Heads& h : attention_shapes()) {
    const AttentionShape s{h.B, h.T, h.NH * h.hs, h.NH, h.KVH};
    const int B = s.B, T = s.T, C = s.C, NH = s.NH, KVH = s.kv_heads();
    const int64_t W = s.width(), KV = s.kv_width();
    std::string shape = shape_str({{"B", B}, {"T", T}, {"NH", NH}, {"hs", h.hs}});
    if (h.KVH) shape += " KVH=" + std::to_string(h.KVH);
    Inputs in(seed_of("attention", uint64_t(B * 1000000 + T * 1000 + NH * 100 + h.hs) +
                                       uint64_t(h.KVH) * 1000000000ull));
    // f32 and f64: |q|, |k| up to 2, scores of a few units, so the softmax is far from uniform.
    // Mixed precision: up to 1, the magnitudes the bf16 bound is derived for (kTolerances).
    const std::vector<F> qkv = in.values<F>(size_t(B) * T * size_t(W), mixed ? 0.1 : 0.2,
                                            mixed ? 1.0 : 2.0),
                         dout = in.values<F>(size_t(B) * T * C);
    Bf16Operands ops(t.device(), k.attention_bf16_elements(s));
    Bf16Operands* bf16 = mixed ? &ops : nullptr;
    const size_t saved_n = k.attention_saved_elements(s),
                 scratch_n = k.attention_scratch_elements(s);
    Buffer<F> d_qkv = t.upload(qkv), d_dout = t.upload(dout), out = t.poisoned(size_t(B) * T * C),
              saved = t.poisoned(saved_n), scratch = t.poisoned(scratch_n),
              dqkv = t.poisoned(qkv.size());
    k.attention_forward(out.data(), saved.data(), d_qkv.data(), s, bf16);
    k.attention_backward(dqkv.data(), scratch.data(), d_dout.data(), d_qkv.data(), out.data(),
                         saved.data(), s, bf16);
    Vec r_out, r_p;
    ref::attention_forward(r_out, r_p, wide(qkv), B, T, C, NH, KVH);
    t.check("attention_forward" + tag, shape, "out", out, r_out, tol);
    // dq, dk and dv are held each to its own scale (dv's is larger), as separate tensors; under
    // grouped-query attention dk and dv are sums over the query heads of a group.
    const Vec r_dqkv = ref::attention_backward(wide(dout), wide(qkv), r_p, B, T, C, NH, KVH);
    const Vec got_dqkv = wide(t.download(dqkv));
    const int64_t part_begin[] = {0, C, C + KV}, part_width[] = {C, KV, KV};
    for (int part = 0; part < 3; ++part) {
      Vec got, want;
      for (int64_t row = 0; row < int64_t(B) * T; ++row)
        for (int64_t c = 0; c < part_width[part]; ++c) {
          got.push_back(got_dqkv[size_t(row * W + part_begin[part] + c)]);
          want.push_back(r_dqkv[size_t(row * W + part_begin[part] + c)]);
        }
      t.check("attention_backward" + tag, shape, std::string("dqkv: d") + "qkv"[part], got, want,
              tol);
    }
    // Every row of the softmax gradient sums to zero, so the key bias's gradient (the sum of dk
    // over the positions) is zero but for rounding, in every precision: a mixed-precision kernel
    // whose rows do not cancel (D = rowsum(dout * out) against bf16 dP) leaves noise of order
    // bf16's roundoff there, which AdamW turns into updates of order lr (docs/parity.md, "bf16").
    double worst = 0.0;
    for (int b = 0; b < B; ++b)
      for (int64_t c = 0; c < KV; ++c) {
        double sum = 0.0, size = 0.0;
        for (int tt = 0; tt < T; ++tt) {
          const double g = got_dqkv[size_t((int64_t(b) * T + tt) * W + C + c)];
          sum += g;
          size += std::abs(g);
        }
        if (size > 0) worst = std::max(worst, std::abs(sum) / size);
      }
    t.check_error("attention_backward" + tag, shape, "key bias gradient |sum dk| / sum |dk|", worst,
                  Tol::cancellation);

    Buffer<F> saved2 = t.poisoned(saved_n), scratch2 = t.poisoned(scratch_n),
              dqkv2 = t.poisoned(qkv.size());
    k.attention_recompute(saved2.data(), d_qkv.data(), s, bf16);
    k.attention_backward(dqkv2.data(), scratch2.data(), d_dout.data(), d_qkv.data(), out.data(),
                         saved2.data(), s, bf16);
    t.check("attention_recompute" + tag, shape, "saved (vs forward's)", saved2,
            wide(t.download(saved)), Tol::exact);
    t.check("attention_backward after recompute" + tag, shape, "dqkv (vs after forward)", dqkv2,
            wide(t.download(dqkv)), Tol::exact);
  }
}

TYPED_TEST(Conformance, Attention) {
  using F = typename TestFixture::F;
  attention<TestFixture, F>(*this, false);
}

TYPED_TEST(Conformance, AttentionMixedPrecision) {
  using F = typename TestFixture::F;
  const std::string why = this->mixed_unavailable("attention Bf16Operands");
  if (!why.empty()) GTEST_SKIP() << why;
  attention<TestFixture, F>(*this, true);
}

// Generation: a cache filled over several calls with growing pos0 gives, call by call, the rows of
// full causal attention over all positions, and holds every position's key and value.
TYPED_TEST(Conformance, AttentionDecode) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  struct Decode {
    int B, NH, hs, maxT;
    std::vector<int> calls;  // new positions per call
    int KVH = 0;             // key/value heads; 0: NH
  };
  const std::vector<Decode> cases = {{1, 1, 7, 1, {1}},
                                     {2, 3, 12, 12, {4, 1, 3, 1}},
                                     {1, 2, 32, 70, {64, 5, 1}},
                                     {2, 1, 64, 8, {1, 1, 1, 1, 1, 1}},
                                     {1, 3, 7, 75, {1, 69}},
                                     {2, 4, 12, 12, {4, 1, 3, 1}, 2},
                                     {1, 4, 32, 70, {64, 5, 1}, 1},
                                     {1, 6, 7, 75, {1, 69}, 3}};
  for (const Decode& d : cases) {
    int T = 0;
    for (int n : d.calls) T += n;
    const int B = d.B, NH = d.NH, C = d.NH * d.hs, maxT = d.maxT;
    const AttentionShape whole{B, T, C, NH, d.KVH};
    const int KVH = whole.kv_heads();
    const int64_t W = whole.width(), KV = whole.kv_width();
    std::string shape = shape_str({{"B", B}, {"NH", NH}, {"hs", d.hs}, {"maxT", maxT}});
    if (d.KVH) shape += " KVH=" + std::to_string(d.KVH);
    shape += " calls";
    for (int n : d.calls) shape.append(" ").append(std::to_string(n));
    Inputs in(seed_of("attention_decode", uint64_t(B * 1000000 + T * 1000 + NH * 100 + d.hs) +
                                              uint64_t(d.KVH) * 1000000000ull));
    const std::vector<F> qkv = in.values<F>(size_t(B) * T * size_t(W), 0.2, 2.0);
    Vec r_out, r_p;
    ref::attention_forward(r_out, r_p, wide(qkv), B, T, C, NH, KVH);
    // Caches (B, maxT, KVH·hs) poisoned: positions not yet written must never be read.
    Buffer<F> kcache = this->poisoned(size_t(B) * maxT * size_t(KV)),
              vcache = this->poisoned(size_t(B) * maxT * size_t(KV)),
              scratch = this->poisoned(k.attention_decode_scratch_elements(B, NH, maxT));
    int pos0 = 0;
    for (int n : d.calls) {
      std::vector<F> part(size_t(B) * n * size_t(W));  // this call's positions of each sequence
      for (int b = 0; b < B; ++b)
        std::copy_n(qkv.begin() + (int64_t(b) * T + pos0) * W, int64_t(n) * W,
                    part.begin() + int64_t(b) * n * W);
      Buffer<F> d_part = this->upload(part), out = this->poisoned(size_t(B) * n * C);
      k.attention_decode(out.data(), d_part.data(), kcache.data(), vcache.data(), scratch.data(),
                         pos0, AttentionShape{B, n, C, NH, d.KVH}, maxT);
      Vec want(size_t(B) * n * C);
      for (int b = 0; b < B; ++b)
        std::copy_n(r_out.begin() + (int64_t(b) * T + pos0) * C, int64_t(n) * C,
                    want.begin() + int64_t(b) * n * C);
      this->check("attention_decode", shape, "out of call at pos0=" + std::to_string(pos0), out,
                  want, Tol::arith);
      pos0 += n;
    }
    // The caches' positions [0, T): (B, maxT, KVH·hs) keys and values.
    const std::vector<F> kc = this->download(kcache), vc = this->download(vcache);
    Vec got_k, got_v, want_k, want_v;
    for (int b = 0; b < B; ++b)
      for (int p = 0; p < T; ++p)
        for (int64_t c = 0; c < KV; ++c) {
          got_k.push_back(kc[size_t((int64_t(b) * maxT + p) * KV + c)]);
          got_v.push_back(vc[size_t((int64_t(b) * maxT + p) * KV + c)]);
          want_k.push_back(qkv[size_t((int64_t(b) * T + p) * W + C + c)]);
          want_v.push_back(qkv[size_t((int64_t(b) * T + p) * W + C + KV + c)]);
        }
    this->check("attention_decode", shape, "kcache", got_k, want_k, Tol::exact);
    this->check("attention_decode", shape, "vcache", got_v, want_v, Tol::exact);
  }
}

// Blockwise (ring) attention: a causal attention over T positions cut into chunks, each query
// chunk the merge of its blocks (the chunks before it whole, itself causal) in a shuffled order,
// against the whole sequence's reference. The running out starts as NaN poison under lse = -inf
// (nothing merged), which the first merge must ignore. q, k and v are read through Rows: straight
// from the fused qkv buffer (row W, batch T·W), or k and v from a packed k|v buffer per chunk
// (row 2·KVH·hs, batch its positions' rows), as a block received from another rank lies; dk and
// dv accumulate into the same layouts, pre-filled with random values, as does dq.
TYPED_TEST(Conformance, AttentionBlocks) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  struct Case {
    int B, NH, hs, KVH;  // KVH 0: NH
    std::vector<int> chunks;
  };
  // 70 and 66 cross the CPU's 64-row causal blocks; 1 is a single position.
  const std::vector<Case> cases = {{2, 3, 12, 0, {5, 7, 5, 7}},
                                   {2, 4, 7, 2, {7, 5, 3, 5}},
                                   {1, 4, 16, 1, {70, 5, 66}},
                                   {2, 6, 32, 3, {1, 9, 4, 6}},
                                   {1, 2, 64, 0, {3, 1}}};
  for (const Case& cs : cases) {
    const int B = cs.B, NH = cs.NH, C = cs.NH * cs.hs, nc = int(cs.chunks.size());
    std::vector<int> at{0};  // chunk c holds positions [at[c], at[c + 1])
    for (int n : cs.chunks) at.push_back(at.back() + n);
    const int T = at.back();
    const AttentionShape s{B, T, C, NH, cs.KVH};
    const int KVH = s.kv_heads();
    const int64_t W = s.width(), KV = s.kv_width();
    std::string shape = shape_str({{"B", B}, {"NH", NH}, {"hs", cs.hs}});
    if (cs.KVH) shape += " KVH=" + std::to_string(cs.KVH);
    shape += " chunks";
    for (int n : cs.chunks) shape.append(" ").append(std::to_string(n));
    Inputs in(seed_of("attention_block", uint64_t(B * 1000000 + T * 1000 + NH * 100 + cs.hs) +
                                             uint64_t(cs.KVH) * 1000000000ull));
    const std::vector<F> qkv = in.values<F>(size_t(B) * T * size_t(W), 0.2, 2.0),
                         dout = in.values<F>(size_t(B) * T * C);
    Vec r_out, r_p;
    ref::attention_forward(r_out, r_p, wide(qkv), B, T, C, NH, KVH);
    const Vec r_dqkv = ref::attention_backward(wide(dout), wide(qkv), r_p, B, T, C, NH, KVH);
    Vec r_delta(size_t(B) * T * NH, 0.0);
    for (size_t row = 0; row < size_t(B) * T; ++row)
      for (int h = 0; h < NH; ++h)
        for (int d = 0; d < cs.hs; ++d) {
          const size_t i = row * size_t(C) + size_t(h * cs.hs + d);
          r_delta[row * size_t(NH) + size_t(h)] += double(dout[i]) * r_out[i];
        }
    // Each query chunk's blocks (key chunks 0..c), in an order drawn per case.
    std::vector<std::vector<int>> order(cs.chunks.size());
    std::mt19937 shuffle_gen(uint32_t(seed_of("attention_block order", uint64_t(T))));
    for (int c = 0; c < nc; ++c) {
      for (int kc = 0; kc <= c; ++kc) order[size_t(c)].push_back(kc);
      std::shuffle(order[size_t(c)].begin(), order[size_t(c)].end(), shuffle_gen);
    }
    // Packed k|v (B, n, 2·KV) of each chunk, and the gradients' initial values.
    std::vector<std::vector<F>> kv_host(cs.chunks.size());
    for (int c = 0; c < nc; ++c) {
      const int n = cs.chunks[size_t(c)];
      kv_host[size_t(c)].resize(size_t(B) * n * 2 * size_t(KV));
      for (int b = 0; b < B; ++b)
        for (int t = 0; t < n; ++t)
          std::copy_n(qkv.begin() + (int64_t(b) * T + at[size_t(c)] + t) * W + C, 2 * KV,
                      kv_host[size_t(c)].begin() + (int64_t(b) * n + t) * 2 * KV);
    }
    const std::vector<F> dqkv0 = in.values<F>(qkv.size());
    Buffer<F> d_qkv = this->upload(qkv), d_dout = this->upload(dout);

    // Pass 0 reads everything from qkv, pass 1 k and v from the packed buffers, pass 2 repeats
    // pass 0, which it must match bit for bit (the kernels are deterministic).
    std::vector<F> first_out, first_lse, first_dqkv;
    for (int pass = 0; pass < 3; ++pass) {
      const bool packed = pass == 1;
      const std::string tag = packed ? " (k, v packed per chunk)" : " (q, k, v in qkv)";
      std::vector<Buffer<F>> d_kv, d_dkv;
      std::vector<std::vector<F>> dkv0(cs.chunks.size());
      for (int c = 0; c < nc; ++c) {
        d_kv.push_back(this->upload(kv_host[size_t(c)]));
        dkv0[size_t(c)] = in.values<F>(kv_host[size_t(c)].size());
        d_dkv.push_back(this->upload(dkv0[size_t(c)]));
      }
      // Rows of chunk c: of a (B,T,width) buffer at column col, or of chunk c's packed k|v.
      auto rows = [&](auto* p, int c, int64_t width, int64_t col) {
        using P = std::remove_pointer_t<decltype(p)>;
        return Rows<P>{p + int64_t(at[size_t(c)]) * width + col, width, int64_t(T) * width};
      };
      auto kv_rows = [&](auto* p, int c, int64_t col) {
        using P = std::remove_pointer_t<decltype(p)>;
        return Rows<P>{p + col, 2 * KV, int64_t(cs.chunks[size_t(c)]) * 2 * KV};
      };
      const F* q = d_qkv.data();
      auto key = [&](int c, int part) {  // part 0: k, 1: v
        return packed ? kv_rows(static_cast<const F*>(d_kv[size_t(c)].data()), c, part * KV)
                      : rows(q, c, W, C + part * KV);
      };
      Buffer<F> out = this->poisoned(size_t(B) * T * C),
                lse = this->upload(std::vector<F>(size_t(B) * T * NH, -INFINITY)),
                delta = this->poisoned(size_t(B) * T * NH), dqkv = this->upload(dqkv0);
      auto block = [&](int c, int kc) {
        return AttentionBlock{B,      cs.chunks[size_t(c)], cs.chunks[size_t(kc)], C, NH, cs.KVH,
                              kc == c};
      };
      for (int c = 0; c < nc; ++c) {
        for (int kc : order[size_t(c)]) {
          const AttentionBlock blk = block(c, kc);
          Buffer<F> scratch = this->poisoned(k.attention_block_scratch_elements(blk));
          k.attention_block_forward(rows(out.data(), c, C, 0), rows(lse.data(), c, NH, 0),
                                    rows(q, c, W, 0), key(kc, 0), key(kc, 1), blk, scratch.data());
        }
      }
      this->check("attention_block_forward", shape, "out" + tag, out, r_out, Tol::arith);
      for (int c = 0; c < nc; ++c) {
        const AttentionBlock diag = block(c, c);
        k.attention_block_delta(rows(delta.data(), c, NH, 0),
                                rows(static_cast<const F*>(d_dout.data()), c, C, 0),
                                rows(static_cast<const F*>(out.data()), c, C, 0), diag);
        for (int kc : order[size_t(c)]) {
          const AttentionBlock blk = block(c, kc);
          Buffer<F> scratch = this->poisoned(k.attention_block_scratch_elements(blk));
          F* dk = packed ? d_dkv[size_t(kc)].data() : dqkv.data();
          auto grad = [&](int64_t col) {
            return packed ? kv_rows(dk, kc, col) : rows(dk, kc, W, C + col);
          };
          k.attention_block_backward(rows(dqkv.data(), c, W, 0), grad(0), grad(KV),
                                     rows(static_cast<const F*>(d_dout.data()), c, C, 0),
                                     rows(static_cast<const F*>(delta.data()), c, NH, 0),
                                     rows(static_cast<const F*>(lse.data()), c, NH, 0),
                                     rows(q, c, W, 0), key(kc, 0), key(kc, 1), blk, scratch.data());
        }
      }
      this->check("attention_block_delta", shape, "delta" + tag, delta, r_delta, Tol::arith);
      // Each gradient's increment over its initial values, held to the reference as a tensor.
      const std::vector<F> got_dqkv = this->download(dqkv);
      std::vector<std::vector<F>> got_dkv(cs.chunks.size());
      for (int c = 0; c < nc; ++c) got_dkv[size_t(c)] = this->download(d_dkv[size_t(c)]);
      for (int part = 0; part < 3; ++part) {
        Vec got, want;
        for (int b = 0; b < B; ++b)
          for (int c = 0; c < nc; ++c)
            for (int t = at[size_t(c)]; t < at[size_t(c) + 1]; ++t) {
              const int64_t row = int64_t(b) * T + t;
              const int64_t width = part == 0 ? C : KV, col = part == 0 ? 0 : C + (part - 1) * KV;
              for (int64_t j = 0; j < width; ++j) {
                const size_t i = size_t(row * W + col + j);
                want.push_back(r_dqkv[i]);
                if (packed && part > 0) {
                  const size_t pi =
                      size_t((int64_t(b) * cs.chunks[size_t(c)] + t - at[size_t(c)]) * 2 * KV +
                             (part - 1) * KV + j);
                  got.push_back(double(got_dkv[size_t(c)][pi]) - double(dkv0[size_t(c)][pi]));
                } else {
                  got.push_back(double(got_dqkv[i]) - double(dqkv0[i]));
                }
              }
            }
        this->check("attention_block_backward", shape,
                    std::string("d") + "qkv"[part] + " increment" + tag, got, want, Tol::arith);
      }
      if (packed) {  // dk and dv went to the packed buffers: dqkv's k and v columns are untouched
        Vec got, want;
        for (int64_t row = 0; row < int64_t(B) * T; ++row)
          for (int64_t c = C; c < W; ++c) {
            got.push_back(got_dqkv[size_t(row * W + c)]);
            want.push_back(dqkv0[size_t(row * W + c)]);
          }
        this->check("attention_block_backward", shape, "dqkv k, v (untouched)" + tag, got, want,
                    Tol::exact);
      } else if (pass == 0) {
        first_out = this->download(out), first_lse = this->download(lse), first_dqkv = got_dqkv;
      } else {
        const std::string again = " (repeated: bit for bit)";
        this->check("attention_block_forward", shape, "out" + again, out, wide(first_out),
                    Tol::exact);
        this->check("attention_block_forward", shape, "lse" + again, lse, wide(first_lse),
                    Tol::exact);
        this->check("attention_block_backward", shape, "dqkv" + again, wide(got_dqkv),
                    wide(first_dqkv), Tol::exact);
      }
    }
  }
}

// ---- element-wise -----------------------------------------------------------------------------

std::vector<std::pair<int, int>> row_shapes(const char* op) {
  // OC = 70 and 129 cross the CPU bias gradient's 64-column blocks.
  std::vector<std::pair<int, int>> shapes = {{1, 1}, {3, 1}, {1, 7}, {37, 70}, {5, 129}, {64, 48}};
  for (uint64_t seed : kShapeSeeds) {
    Inputs in(seed_of(op, seed));
    shapes.emplace_back(in.integer(1, 50), in.integer(1, 200));
  }
  return shapes;
}

TYPED_TEST(Conformance, Gelu) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  for (int64_t N : {int64_t(1), int64_t(7), int64_t(1000), int64_t(40001)}) {
    const std::string shape = shape_str({{"N", N}});
    Inputs in(seed_of("gelu", uint64_t(N)));
    // |x| up to 6: both tails (GELU ~ 0 far left, ~ x far right) and the curve between.
    const std::vector<F> x = in.values<F>(size_t(N), 0.01, 6.0), dy = in.values<F>(size_t(N));
    Buffer<F> d_x = this->upload(x), out = this->poisoned(size_t(N)),
              dx = this->poisoned(size_t(N)), d_dy = this->upload(dy);
    k.gelu_forward(out.data(), d_x.data(), N);
    Vec r_out(static_cast<size_t>(N)), r_dx(static_cast<size_t>(N));
    for (size_t i = 0; i < x.size(); ++i) {
      r_out[i] = ref::gelu(x[i]);
      r_dx[i] = ref::gelu_grad(x[i]) * dy[i];
    }
    this->check("gelu_forward", shape, "out", out, r_out, Tol::arith);
    k.gelu_backward(dx.data(), d_x.data(), d_dy.data(), N);
    this->check("gelu_backward", shape, "dinp", dx, r_dx, Tol::arith);
    k.gelu_backward(d_dy.data(), d_x.data(), d_dy.data(), N);  // dinp aliasing dout
    this->check("gelu_backward", shape, "dinp (aliasing dout)", d_dy, r_dx, Tol::arith);
  }
}

TYPED_TEST(Conformance, Swiglu) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  for (int64_t N : {int64_t(1), int64_t(7), int64_t(1000), int64_t(40001)}) {
    const std::string shape = shape_str({{"N", N}});
    Inputs in(seed_of("swiglu", uint64_t(N)));
    // |gate| up to 8: both tails (silu ~ 0 far left, ~ x far right) and the curve between.
    const std::vector<F> gate = in.values<F>(size_t(N), 0.01, 8.0), up = in.values<F>(size_t(N)),
                         dy = in.values<F>(size_t(N));
    Vec r_out(static_cast<size_t>(N)), r_dgate(static_cast<size_t>(N)),
        r_dup(static_cast<size_t>(N));
    for (size_t i = 0; i < gate.size(); ++i) {
      r_out[i] = ref::silu(gate[i]) * double(up[i]);
      r_dgate[i] = ref::silu_grad(gate[i]) * double(up[i]) * double(dy[i]);
      r_dup[i] = ref::silu(gate[i]) * double(dy[i]);
    }
    Buffer<F> d_gate = this->upload(gate), d_up = this->upload(up), d_dy = this->upload(dy),
              out = this->poisoned(size_t(N));
    k.swiglu_forward(out.data(), d_gate.data(), d_up.data(), N);
    this->check("swiglu_forward", shape, "out", out, r_out, Tol::arith);
    Buffer<F> dgate = this->poisoned(size_t(N)), dup = this->poisoned(size_t(N));
    k.swiglu_backward(dgate.data(), dup.data(), d_dy.data(), d_gate.data(), d_up.data(), N);
    this->check("swiglu_backward", shape, "dgate", dgate, r_dgate, Tol::arith);
    this->check("swiglu_backward", shape, "dup", dup, r_dup, Tol::arith);
    Buffer<F> dup2 = this->poisoned(size_t(N));
    k.swiglu_backward(d_dy.data(), dup2.data(), d_dy.data(), d_gate.data(), d_up.data(), N);
    this->check("swiglu_backward", shape, "dgate (aliasing dout)", d_dy, r_dgate, Tol::arith);
    this->check("swiglu_backward", shape, "dup (dgate aliasing dout)", dup2, r_dup, Tol::arith);
  }
}

TYPED_TEST(Conformance, BiasGelu) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  for (const auto& [N, OC] : row_shapes("bias gelu")) {
    const std::string shape = shape_str({{"N", N}, {"OC", OC}});
    Inputs in(seed_of("bias gelu", uint64_t(N * 10000 + OC)));
    const std::vector<F> fch = in.values<F>(size_t(N) * OC, 0.01, 4.0),
                         bias = in.values<F>(size_t(OC)), dy = in.values<F>(size_t(N) * OC),
                         db0 = in.values<F>(size_t(OC));
    Vec r_fch(fch.size()), r_out(fch.size()), r_dx(fch.size()), r_db = wide(db0);
    for (int i = 0; i < N; ++i)
      for (int o = 0; o < OC; ++o) {
        const size_t j = size_t(i * OC + o);
        r_fch[j] = double(fch[j]) + double(bias[size_t(o)]);
        r_out[j] = ref::gelu(r_fch[j]);
      }
    // bias_gelu_forward: fch += bias in place, out = gelu(fch)
    Buffer<F> d_fch = this->upload(fch), d_bias = this->upload(bias),
              out = this->poisoned(fch.size());
    k.bias_gelu_forward(out.data(), d_fch.data(), d_bias.data(), N, OC);
    this->check("bias_gelu_forward", shape, "fch", d_fch, r_fch, Tol::arith);
    this->check("bias_gelu_forward", shape, "out", out, r_out, Tol::arith);

    // gelu_bias_backward at fch's values as the kernel left them (f32 on the f32 table)
    const std::vector<F> inp = this->download(d_fch);
    for (int i = 0; i < N; ++i)
      for (int o = 0; o < OC; ++o) {
        const size_t j = size_t(i * OC + o);
        r_dx[j] = ref::gelu_grad(inp[j]) * dy[j];
        r_db[size_t(o)] += r_dx[j];
      }
    for (bool alias : {false, true}) {
      Buffer<F> d_dy = this->upload(dy), db = this->upload(db0),
                dx = alias ? Buffer<F>() : this->poisoned(dy.size());
      F* dinp = alias ? d_dy.data() : dx.data();
      k.gelu_bias_backward(dinp, db.data(), d_fch.data(), d_dy.data(), N, OC);
      const std::string how = alias ? " (aliasing dout)" : "";
      this->check("gelu_bias_backward", shape, "dinp" + how, alias ? d_dy : dx, r_dx, Tol::arith);
      this->check("gelu_bias_backward", shape, "dbias" + how, db, r_db, Tol::arith);
    }
  }
}

TYPED_TEST(Conformance, BiasResidualAdd) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  for (const auto& [N, OC] : row_shapes("bias residual")) {
    const std::string shape = shape_str({{"N", N}, {"C", OC}});
    Inputs in(seed_of("bias residual", uint64_t(N * 10000 + OC)));
    const std::vector<F> dout = in.values<F>(size_t(N) * OC), db0 = in.values<F>(size_t(OC)),
                         out0 = in.values<F>(size_t(N) * OC), res = in.values<F>(size_t(N) * OC),
                         bias = in.values<F>(size_t(OC));
    // bias_backward: dbias (OC) += column sums of dout
    Buffer<F> d_dout = this->upload(dout), db = this->upload(db0);
    k.bias_backward(db.data(), d_dout.data(), N, OC);
    Vec r_db = wide(db0);
    for (int i = 0; i < N; ++i)
      for (int o = 0; o < OC; ++o) r_db[size_t(o)] += dout[size_t(i * OC + o)];
    this->check("bias_backward", shape, "dbias", db, r_db, Tol::arith);

    // residual_bias_add: out += residual + bias
    Buffer<F> out = this->upload(out0), d_res = this->upload(res), d_bias = this->upload(bias);
    k.residual_bias_add(out.data(), d_res.data(), d_bias.data(), N, OC);
    Vec r_out = wide(out0);
    for (int i = 0; i < N; ++i)
      for (int o = 0; o < OC; ++o) {
        const size_t j = size_t(i * OC + o);
        r_out[j] += double(res[j]) + double(bias[size_t(o)]);
      }
    this->check("residual_bias_add", shape, "out", out, r_out, Tol::arith);
  }
  // add: y += x, below and above the CPU's single-thread threshold (2^15)
  for (size_t n : {size_t(1), size_t(7), size_t(1000), size_t(40001)}) {
    Inputs in(seed_of("add", n));
    const std::vector<F> y0 = in.values<F>(n), x = in.values<F>(n);
    Buffer<F> y = this->upload(y0), d_x = this->upload(x);
    k.add(y.data(), d_x.data(), n);
    Vec want = wide(y0);
    for (size_t i = 0; i < n; ++i) want[i] += x[i];
    this->check("add", shape_str({{"n", int64_t(n)}}), "y", y, want, Tol::arith);
  }
}

// ---- mixture of experts: rows between tokens and experts ------------------------------------

TYPED_TEST(Conformance, MoeRows) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  struct Case {
    int N, k, C;
  };
  std::vector<Case> cases = {{1, 1, 1}, {5, 2, 7}, {33, 2, 64}, {17, 3, 33}, {600, 2, 96}};
  for (uint64_t seed : kShapeSeeds) {
    Inputs in(seed_of("moe rows shape", seed));
    cases.push_back({in.integer(1, 70), in.integer(1, 4), in.integer(1, 80)});
  }
  for (const Case& c : cases) {
    const int N = c.N, K = c.k, C = c.C;
    const int rows = N * K + 3;  // more rows than routes: some are padding, named by no route
    const std::string shape = shape_str({{"N", N}, {"k", K}, {"C", C}, {"rows", rows}});
    Inputs in(seed_of("moe rows", uint64_t(N * 10000 + K * 100 + C)));
    // A permutation of the routes onto rows, some routes dropped (-1).
    std::vector<int32_t> pos(size_t(N) * K), idx(size_t(rows), -1);
    std::vector<int32_t> free_rows(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r) free_rows[size_t(r)] = r;
    for (size_t i = 0; i < pos.size(); ++i) {
      const int pick = in.integer(0, int(free_rows.size()) - 1);
      pos[i] = in.integer(0, 4) == 0 ? -1 : free_rows[size_t(pick)];
      if (pos[i] >= 0) {
        idx[size_t(pos[i])] = int32_t(i / size_t(K));  // the row gathers its token
        free_rows.erase(free_rows.begin() + pick);
      }
    }
    const std::vector<F> x = in.values<F>(size_t(N) * C), expert = in.values<F>(size_t(rows) * C),
                         gate = in.values<F>(size_t(N) * K), out0 = in.values<F>(size_t(N) * C),
                         dout = in.values<F>(size_t(N) * C), din0 = in.values<F>(size_t(rows) * C);
    Buffer<int32_t> d_pos = this->upload(pos), d_idx = this->upload(idx);
    Buffer<F> d_x = this->upload(x), d_expert = this->upload(expert), d_gate = this->upload(gate);

    // gather_rows: row r = x[idx[r]], zeros for padding
    Buffer<F> gathered = this->poisoned(size_t(rows) * C);
    k.gather_rows(gathered.data(), d_x.data(), d_idx.data(), rows, C);
    Vec r_gathered(size_t(rows) * C, 0.0);
    for (int r = 0; r < rows; ++r)
      for (int ch = 0; idx[size_t(r)] >= 0 && ch < C; ++ch)
        r_gathered[size_t(r * C + ch)] = x[size_t(idx[size_t(r)] * C + ch)];
    this->check("gather_rows", shape, "out", gathered, r_gathered, Tol::exact);

    // moe_combine: out[t] += Σ_j gate · expert[pos], with gates and with gate = 1
    for (bool gated : {true, false}) {
      Buffer<F> out = this->upload(out0);
      k.moe_combine(out.data(), d_expert.data(), d_pos.data(), gated ? d_gate.data() : nullptr, N,
                    K, C);
      Vec r_out = wide(out0);
      for (int t = 0; t < N; ++t)
        for (int j = 0; j < K; ++j) {
          const int32_t p = pos[size_t(t * K + j)];
          if (p < 0) continue;
          const double g = gated ? double(gate[size_t(t * K + j)]) : 1.0;
          for (int ch = 0; ch < C; ++ch)
            r_out[size_t(t * C + ch)] += g * double(expert[size_t(p * C + ch)]);
        }
      this->check("moe_combine", shape, gated ? "out" : "out (gate 1)", out, r_out, Tol::arith);
    }

    // moe_combine_backward: din[pos] = gate · dout[t], dgate = dout[t] · expert[pos]
    Buffer<F> d_dout = this->upload(dout), din = this->upload(din0),
              dgate = this->poisoned(size_t(N) * K);
    k.moe_combine_backward(din.data(), dgate.data(), d_dout.data(), d_expert.data(), d_pos.data(),
                           d_gate.data(), N, K, C);
    Vec r_din = wide(din0), r_dgate(size_t(N) * K, 0.0);
    for (int t = 0; t < N; ++t)
      for (int j = 0; j < K; ++j) {
        const int32_t p = pos[size_t(t * K + j)];
        if (p < 0) continue;
        double dot = 0.0;
        for (int ch = 0; ch < C; ++ch) {
          r_din[size_t(p * C + ch)] =
              double(gate[size_t(t * K + j)]) * double(dout[size_t(t * C + ch)]);
          dot += double(dout[size_t(t * C + ch)]) * double(expert[size_t(p * C + ch)]);
        }
        r_dgate[size_t(t * K + j)] = dot;
      }
    this->check("moe_combine_backward", shape, "din", din, r_din, Tol::arith);
    this->check("moe_combine_backward", shape, "dgate", dgate, r_dgate, Tol::arith);
  }
}

// ---- embedding --------------------------------------------------------------------------------

TYPED_TEST(Conformance, Embedding) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  struct Emb {
    int B, T, C, V, pos0, v0, Vl;  // Vl <= 0: the whole vocabulary
    bool wpe;
  };
  std::vector<Emb> cases = {{1, 1, 1, 3, 0, 0, 0, false},   {2, 5, 7, 11, 0, 0, 0, true},
                            {2, 5, 7, 11, 3, 0, 0, true},   {3, 4, 9, 20, 0, 6, 7, true},
                            {1, 6, 16, 12, 2, 0, 5, false}, {2, 70, 33, 50, 0, 25, 25, true}};
  for (uint64_t seed : kShapeSeeds) {
    Inputs in(seed_of("embedding shape", seed));
    const int V = in.integer(2, 30), slice = in.integer(0, 1);
    const int v0 = slice ? in.integer(0, V - 1) : 0;
    cases.push_back({in.integer(1, 3), in.integer(1, 9), in.integer(1, 40), V, in.integer(0, 4), v0,
                     slice ? in.integer(1, V - v0) : 0, bool(in.integer(0, 1))});
  }
  for (const Emb& e : cases) {
    const int B = e.B, T = e.T, C = e.C, rows = e.Vl > 0 ? e.Vl : e.V, v0 = e.Vl > 0 ? e.v0 : 0;
    const std::string shape = shape_str({{"B", B},
                                         {"T", T},
                                         {"C", C},
                                         {"V", e.V},
                                         {"pos0", e.pos0},
                                         {"v0", v0},
                                         {"Vl", e.Vl},
                                         {"wpe", e.wpe}});
    Inputs in(seed_of("embedding", uint64_t(B * 1000000 + T * 10000 + C * 100 + e.V)));
    std::vector<int32_t> tokens(size_t(B) * T);
    for (int32_t& tok : tokens)
      tok = in.integer(0, e.V - 1);  // repeats and, with a slice, outside it
    const std::vector<F> wte = in.values<F>(size_t(rows) * C),
                         wpe = in.values<F>(size_t(e.pos0 + T) * C),
                         dout = in.values<F>(size_t(B) * T * C),
                         dwte0 = in.values<F>(size_t(rows) * C),
                         dwpe0 = in.values<F>(size_t(T) * C);
    auto row_of = [&](int32_t tok) {
      return e.Vl > 0 && (tok < v0 || tok >= v0 + e.Vl) ? -1 : tok - v0;
    };
    Buffer<int32_t> d_tok = this->upload(tokens);
    Buffer<F> d_wte = this->upload(wte), d_wpe = this->upload(wpe),
              out = this->poisoned(size_t(B) * T * C);
    k.embedding_forward(out.data(), d_tok.data(), d_wte.data(), e.wpe ? d_wpe.data() : nullptr, B,
                        T, C, e.pos0, v0, e.Vl);
    Vec r_out(size_t(B) * T * C), r_dwte = wide(dwte0), r_dwpe = wide(dwpe0);
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) {
        const int row = row_of(tokens[size_t(b * T + t)]);
        for (int c = 0; c < C; ++c) {
          const size_t j = size_t((int64_t(b) * T + t) * C + c);
          r_out[j] = (row >= 0 ? double(wte[size_t(row * C + c)]) : 0.0) +
                     (e.wpe ? double(wpe[size_t((e.pos0 + t) * C + c)]) : 0.0);
          if (row >= 0) r_dwte[size_t(row * C + c)] += dout[j];
          r_dwpe[size_t(t * C + c)] += dout[j];  // indexed by t: backward has no pos0
        }
      }
    this->check("embedding_forward", shape, "out", out, r_out, Tol::arith);
    Buffer<F> d_dout = this->upload(dout), dwte = this->upload(dwte0), dwpe = this->upload(dwpe0);
    k.embedding_backward(dwte.data(), dwpe.data(), d_dout.data(), d_tok.data(), B, T, C, v0, e.Vl);
    this->check("embedding_backward", shape, "dwte", dwte, r_dwte, Tol::arith);
    this->check("embedding_backward", shape, "dwpe", dwpe, r_dwpe, Tol::arith);
  }

  // add_positions: rows [first_row, first_row + rows) of a (B·T) sequence, across its sequences.
  struct Pos {
    int64_t first_row, rows;
    int T, C;
  };
  std::vector<Pos> pos_cases = {{0, 1, 1, 1}, {3, 9, 5, 7}, {0, 140, 70, 16}, {11, 4, 4, 33}};
  for (uint64_t seed : kShapeSeeds) {
    Inputs in(seed_of("add_positions shape", seed));
    pos_cases.push_back(
        {in.integer(0, 50), in.integer(1, 40), in.integer(1, 20), in.integer(1, 40)});
  }
  for (const Pos& p : pos_cases) {
    const std::string shape =
        shape_str({{"first_row", p.first_row}, {"rows", p.rows}, {"T", p.T}, {"C", p.C}});
    Inputs in(seed_of("add_positions", uint64_t(p.first_row * 1000 + p.rows)));
    const std::vector<F> out0 = in.values<F>(size_t(p.rows * p.C)),
                         wpe = in.values<F>(size_t(p.T) * p.C);
    Buffer<F> out = this->upload(out0), d_wpe = this->upload(wpe);
    k.add_positions(out.data(), d_wpe.data(), p.first_row, p.rows, p.T, p.C);
    Vec want = wide(out0);
    for (int64_t i = 0; i < p.rows; ++i)
      for (int c = 0; c < p.C; ++c)
        want[size_t(i * p.C + c)] += wpe[size_t((p.first_row + i) % p.T * p.C + c)];
    this->check("add_positions", shape, "out", out, want, Tol::arith);
  }
}

// ---- softmax + cross-entropy ------------------------------------------------------------------

struct Xent {
  int N, V, Vp;
};

// Logits ~ N(0, 2) on the real columns; the padding holds 40, far above every real logit, so a
// kernel that let padding into the softmax fails by orders of magnitude.
template <typename F>
std::vector<F> xent_logits(Inputs& in, const Xent& x) {
  std::vector<F> logits = in.normal<F>(size_t(x.N) * x.Vp, 2.0);
  for (int i = 0; i < x.N; ++i)
    for (int v = x.V; v < x.Vp; ++v) logits[size_t(i * x.Vp + v)] = F(40);
  return logits;
}

TYPED_TEST(Conformance, SoftmaxXent) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  std::vector<Xent> cases = {{1, 2, 2}, {3, 5, 8}, {7, 50, 64}, {4, 37, 37}, {16, 100, 128}};
  for (uint64_t seed : kShapeSeeds) {
    Inputs in(seed_of("softmax_xent shape", seed));
    const int V = in.integer(2, 200);
    cases.push_back({in.integer(1, 20), V, V + in.integer(0, 1) * in.integer(1, 16)});
  }
  for (const Xent& x : cases) {
    const std::string shape = shape_str({{"N", x.N}, {"V", x.V}, {"Vp", x.Vp}});
    Inputs in(seed_of("softmax_xent", uint64_t(x.N * 1000000 + x.V * 1000 + x.Vp)));
    const std::vector<F> logits = xent_logits<F>(in, x);
    std::vector<int32_t> targets(static_cast<size_t>(x.N));
    for (int32_t& y : targets) y = in.integer(0, x.V - 1);
    const F dloss = F(1.0 / 3.0);
    Vec r_losses(static_cast<size_t>(x.N)), r_grad(logits.size());
    const double r_sum =
        ref::softmax_xent(r_losses, &r_grad, wide(logits), targets, x.N, x.V, x.Vp, double(dloss));
    Buffer<int32_t> d_targets = this->upload(targets);
    for (bool backward : {false, true}) {
      const std::string op = backward ? "softmax_xent (backward)" : "softmax_xent (forward)";
      Buffer<F> d_logits = this->upload(logits), losses = this->poisoned(size_t(x.N));
      const double sum = k.softmax_xent(losses.data(), d_logits.data(), d_targets.data(), x.N, x.V,
                                        x.Vp, backward, dloss);
      this->check(op, shape, "losses", losses, r_losses, Tol::arith);
      this->check_value(op, shape, "returned sum", sum, r_sum, Tol::arith);
      if (backward) {
        this->check(op, shape, "dlogits (padding 0)", d_logits, r_grad, Tol::arith);
      } else {
        this->check(op, shape, "logits (untouched)", d_logits, wide(logits), Tol::exact);
      }
    }
  }
}

// The vocabulary-parallel loss with a group of ranks emulated exactly in one process: each rank is
// run on its column slice in turn, three times. Pass 1 records what each rank hands all_max;
// pass 2 answers all_max with the group's maximum and records what each rank hands all_sum; pass
// 3 answers both with the group's results, so every rank's outputs are what the collective would
// give (the kernel's inputs to each reduction depend only on its logits and the earlier results).
// The reductions' values are read and written through the backend's Device.
TYPED_TEST(Conformance, SoftmaxXentVocabParallel) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  struct Group {
    int N, V, ranks, Vl;
  };
  std::vector<Group> cases = {{1, 2, 2, 1},     // one column per rank
                              {5, 50, 2, 25},   // V = Vp
                              {6, 37, 3, 20},   // the last rank holds padding only
                              {4, 100, 3, 34},  // the last rank holds 2 padding columns
                              {3, 64, 2, 40}};
  for (uint64_t seed : kShapeSeeds) {
    Inputs in(seed_of("vocab parallel shape", seed));
    const int ranks = in.integer(2, 3), Vl = in.integer(1, 40);
    cases.push_back({in.integer(1, 12), std::max(2, ranks * Vl - in.integer(0, Vl)), ranks, Vl});
  }
  for (const Group& g : cases) {
    const int N = g.N, V = g.V, R = g.ranks, Vl = g.Vl, Vp = R * Vl;
    const std::string shape = shape_str({{"N", N}, {"V", V}, {"ranks", R}, {"Vl", Vl}});
    Inputs in(seed_of("vocab parallel", uint64_t(N * 1000000 + V * 1000 + R * 100 + Vl)));
    const std::vector<F> logits = xent_logits<F>(in, {N, V, Vp});
    std::vector<int32_t> targets(static_cast<size_t>(N));
    for (int32_t& y : targets) y = in.integer(0, V - 1);
    const F dloss = F(0.25);
    Vec r_losses(static_cast<size_t>(N)), r_grad(logits.size());
    const double r_sum =
        ref::softmax_xent(r_losses, &r_grad, wide(logits), targets, N, V, Vp, double(dloss));
    Buffer<int32_t> d_targets = this->upload(targets);

    for (bool backward : {false, true}) {
      const std::string op = backward ? "softmax_xent_vocab_parallel (backward)"
                                      : "softmax_xent_vocab_parallel (forward)";
      std::vector<Vec> max_in(static_cast<size_t>(R)),
          sum_in(static_cast<size_t>(R));  // each rank's contributions
      Vec group_max, group_sum;
      std::vector<std::vector<F>> grads(static_cast<size_t>(R)), losses(static_cast<size_t>(R));
      std::vector<double> sums(static_cast<size_t>(R));
      for (int pass = 0; pass < 3; ++pass) {
        for (int r = 0; r < R; ++r) {
          std::vector<F> part(size_t(N) * Vl);
          for (int i = 0; i < N; ++i)
            std::copy_n(logits.begin() + i * Vp + r * Vl, Vl, part.begin() + i * Vl);
          Buffer<F> d_part = this->upload(part), d_losses = this->poisoned(size_t(N));
          int max_calls = 0, sum_calls = 0;
          // Each reduction: read the rank's values, record them in the pass that learns them,
          // answer with the group's result once it is known.
          auto reduce = [&](F* values, int64_t n, int64_t expected, int& calls, Vec& mine,
                            const Vec& group, bool record, bool answer) {
            ++calls;
            EXPECT_EQ(n, expected) << op << " " << shape << ": reduction length";
            if (n != expected) return;
            std::vector<F> host(static_cast<size_t>(n));
            this->device().to_host(host.data(), values, host.size() * sizeof(F));
            if (record) mine = wide(host);
            if (!answer) return;
            for (size_t i = 0; i < host.size(); ++i) host[i] = F(group[i]);
            this->device().from_host(values, host.data(), host.size() * sizeof(F));
          };
          const GroupReduce<F> all_max = [&](F* values, int64_t n) {
            reduce(values, n, N, max_calls, max_in[size_t(r)], group_max, pass == 0, pass >= 1);
          };
          const GroupReduce<F> all_sum = [&](F* values, int64_t n) {
            reduce(values, n, 2 * int64_t(N), sum_calls, sum_in[size_t(r)], group_sum, pass == 1,
                   pass == 2);
          };
          sums[size_t(r)] =
              k.softmax_xent_vocab_parallel(d_losses.data(), d_part.data(), d_targets.data(), N, Vl,
                                            r * Vl, V, backward, dloss, all_max, all_sum);
          EXPECT_EQ(max_calls, 1) << op << " " << shape << ": all_max calls";
          EXPECT_EQ(sum_calls, 1) << op << " " << shape << ": all_sum calls";
          grads[size_t(r)] = this->download(d_part);
          losses[size_t(r)] = this->download(d_losses);
        }
        if (pass == 0) {
          group_max.assign(size_t(N), -INFINITY);
          for (const Vec& m : max_in)
            for (size_t i = 0; i < m.size() && i < group_max.size(); ++i)
              group_max[i] = std::max(group_max[i], m[i]);
        } else if (pass == 1) {
          group_sum.assign(size_t(2 * N), 0.0);
          for (const Vec& s : sum_in)
            for (size_t i = 0; i < s.size() && i < group_sum.size(); ++i) group_sum[i] += s[i];
        }
      }
      for (int r = 0; r < R; ++r) {
        const std::string rank = " of rank " + std::to_string(r);
        this->check(op, shape, "losses" + rank, wide(losses[size_t(r)]), r_losses, Tol::arith);
        this->check_value(op, shape, "returned sum" + rank, sums[size_t(r)], r_sum, Tol::arith);
      }
      Vec got(logits.size()), untouched(logits.size());
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < N; ++i)
          for (int v = 0; v < Vl; ++v)
            got[size_t(i * Vp + r * Vl + v)] = grads[size_t(r)][size_t(i * Vl + v)];
      if (backward) {
        this->check(op, shape, "dlogits of the ranks, concatenated", got, r_grad, Tol::arith);
      } else {
        this->check(op, shape, "logits (untouched)", got, wide(logits), Tol::exact);
      }
    }
  }
}

// ---- optimizer and reductions -----------------------------------------------------------------

TYPED_TEST(Conformance, AdamW) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  // Segments at different positions in params, grads and the state, with gaps between them that
  // no segment owns (they must keep their values).
  struct Seg {
    size_t count;
    bool decay;
  };
  const std::vector<std::vector<Seg>> layouts = {
      {{1, true}}, {{7, true}, {33, false}, {130, true}, {1, false}}, {{40001, true}, {5, false}}};
  const std::vector<AdamWStep> steps = {{0.05f, 1.0f, 0.9f, 0.999f, 1e-8f, 0.1f, 1},
                                        {0.02f, 0.7f, 0.9f, 0.95f, 1e-8f, 0.1f, 3},
                                        {0.001f, 0.25f, 0.8f, 0.99f, 1e-6f, 0.5f, 100}};
  for (size_t li = 0; li < layouts.size(); ++li) {
    for (const AdamWStep& s : steps) {
      std::vector<OwnedSegment> segments;
      size_t p = 2, g = 5, st = 1;  // leading gaps differ per buffer
      std::string shape = "segments";
      for (const Seg& sg : layouts[li]) {
        OwnedSegment o;
        o.count = sg.count, o.decay = sg.decay, o.param_pos = p, o.grad_pos = g, o.state_pos = st;
        segments.push_back(o);
        p += sg.count + 3, g += sg.count + 1, st += sg.count + 2;
        shape.append(" ").append(std::to_string(sg.count)).append(sg.decay ? "d" : "");
      }
      shape += " lr=" + std::to_string(s.lr) + " grad_scale=" + std::to_string(s.grad_scale) +
               " t=" + std::to_string(s.t);
      Inputs in(seed_of("adamw", li * 1000 + uint64_t(s.t)));
      const std::vector<F> p0 = in.values<F>(p), g0 = in.values<F>(g),
                           m0 = in.values<F>(st, 0.001, 0.1), v0 = in.values<F>(st, 1e-4, 1e-2);
      std::vector<F> v_pos = v0;
      for (F& x : v_pos) x = std::abs(x);  // second moments are non-negative
      Buffer<F> params = this->upload(p0), grads = this->upload(g0), m = this->upload(m0),
                v = this->upload(v_pos);
      k.adamw_update(params.data(), grads.data(), m.data(), v.data(), segments, s, nullptr);
      Vec rp = wide(p0), rm = wide(m0), rv = wide(v_pos);
      ref::adamw(rp, wide(g0), rm, rv, segments, s);
      this->check("adamw_update", shape, "params", params, rp, Tol::arith);
      this->check("adamw_update", shape, "m", m, rm, Tol::arith);
      this->check("adamw_update", shape, "v", v, rv, Tol::arith);
      this->check("adamw_update", shape, "grads (read-only)", grads, wide(g0), Tol::exact);
      if constexpr (TestFixture::kIsF32) {
        // With the bf16 copies: the same update, and each updated parameter's nearest-even bf16
        // at its own position; positions outside the segments are left alone.
        const bf16 untouched{0x7fc1};
        Buffer<F> params2 = this->upload(p0), m2 = this->upload(m0), v2 = this->upload(v_pos);
        Buffer<bf16> copies = this->upload(std::vector<bf16>(p, untouched));
        k.adamw_update(params2.data(), grads.data(), m2.data(), v2.data(), segments, s,
                       copies.data());
        const std::vector<F> with = this->download(params2), without = this->download(params);
        this->check("adamw_update + bf16", shape, "params", params2, wide(without), Tol::exact);
        const std::vector<bf16> got = this->download(copies);
        std::vector<bool> updated(p, false);
        for (const OwnedSegment& o : segments) {
          for (size_t i = 0; i < o.count; ++i) updated[o.param_pos + i] = true;
        }
        size_t wrong = 0;
        for (size_t i = 0; i < p; ++i) {
          const uint16_t want = updated[i] ? bf16::from_float(with[i]).bits : untouched.bits;
          wrong += got[i].bits != want;
        }
        this->check_error("adamw_update + bf16", shape,
                          "copies (elements not the bf16 of the update)", double(wrong),
                          Tol::exact);
      }
    }
  }
}

TYPED_TEST(Conformance, Reductions) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  for (int64_t n : {int64_t(1), int64_t(7), int64_t(1000), int64_t(40001)}) {
    Inputs in(seed_of("sum_squares", uint64_t(n)));
    const std::vector<F> x = in.values<F>(size_t(n), 0.01, 3.0);
    Buffer<F> d_x = this->upload(x);
    double want = 0.0;
    for (F v : x) want += double(v) * double(v);
    this->check_value("sum_squares", shape_str({{"n", n}}), "sum", k.sum_squares(d_x.data(), n),
                      want, Tol::double_sum);
  }
  // Ranges of a buffer whose gaps hold values (1e10, NaN) no range may touch.
  const std::vector<std::vector<FlatRange>> range_sets = {
      {}, {{0, 1}}, {{3, 5}, {20, 1}, {100, 77}}, {{1, 1000}, {1002, 40001}, {41010, 3}}};
  for (size_t ri = 0; ri < range_sets.size(); ++ri) {
    const auto& ranges = range_sets[ri];
    size_t end = 1;
    std::string shape = "ranges";
    for (const FlatRange& r : ranges) {
      end = std::max(end, r.offset + r.count + 2);
      shape += " [" + std::to_string(r.offset) + "," + std::to_string(r.offset + r.count) + ")";
    }
    if (ranges.empty()) shape += " (none)";
    Inputs in(seed_of("ranges", ri));
    std::vector<F> base(end, F(1e10));
    const std::vector<F> vals = in.values<F>(end, 0.01, 3.0);
    double want = 0.0;
    for (const FlatRange& r : ranges)
      for (size_t i = r.offset; i < r.offset + r.count; ++i) {
        base[i] = vals[i];
        want += double(vals[i]) * double(vals[i]);
      }
    Buffer<F> d_base = this->upload(base);
    this->check_value("sum_squares (ranges)", shape, "sum", k.sum_squares(d_base.data(), ranges),
                      want, Tol::double_sum);

    // first_nonfinite over the same ranges: none, then a NaN or an infinity placed in a gap
    // (ignored), in the middle range, in the last one, in both (the first counts).
    auto first = [&](const std::vector<std::pair<size_t, F>>& bad) {
      std::vector<F> b = base;
      for (const auto& [i, v] : bad) b[i] = v;
      Buffer<F> d = this->upload(b);
      return double(k.first_nonfinite(d.data(), ranges));
    };
    const F nan = std::numeric_limits<F>::quiet_NaN(), inf = std::numeric_limits<F>::infinity();
    const std::string op = "first_nonfinite";
    this->check_value(op, shape, "none", first({}), -1, Tol::exact);
    if (ranges.size() >= 3) {
      const size_t mid = ranges[1].offset + ranges[1].count / 2, last = ranges[2].offset;
      this->check_value(op, shape, "NaN in a gap", first({{ranges[1].offset - 1, nan}}), -1,
                        Tol::exact);
      this->check_value(op, shape, "NaN in range 1", first({{mid, nan}}), 1, Tol::exact);
      this->check_value(op, shape, "inf in range 1", first({{mid, inf}}), 1, Tol::exact);
      this->check_value(op, shape, "-inf in range 2", first({{last, -inf}}), 2, Tol::exact);
      this->check_value(op, shape, "inf in 2, NaN in 1", first({{last, inf}, {mid, nan}}), 1,
                        Tol::exact);
    }
  }
}

// ---- casts ------------------------------------------------------------------------------------

TYPED_TEST(Conformance, Casts) {
  using F = typename TestFixture::F;
  Kernels<F>& k = this->k();
  // to_bf16: values chosen for the rounding, then random ones. Ties are exact midpoints between
  // two bf16 values: 1 + 2^-8 lies between 1 (even) and 1 + 2^-7 (odd) and goes down; 1 + 3·2^-8
  // between 1 + 2^-7 (odd) and 1 + 2^-6 (even) and goes up.
  std::vector<double> special = {1.0 + 0x1p-8,
                                 1.0 + 3 * 0x1p-8,
                                 -(1.0 + 0x1p-8),
                                 -(1.0 + 3 * 0x1p-8),
                                 1.0 + 0x1p-8 + 0x1p-20,  // just above a tie: up
                                 1.0 + 0x1p-8 - 0x1p-20,  // just below: down
                                 -3.14159,
                                 65504.0,
                                 0x1p-130,         // subnormal in bf16
                                 double(FLT_MAX),  // rounds to infinity
                                 std::numeric_limits<double>::infinity(),
                                 -std::numeric_limits<double>::infinity(),
                                 std::numeric_limits<double>::quiet_NaN(),
                                 -0.0,
                                 1e-3};
  if constexpr (sizeof(F) == 8) {
    // A double just above a tie that the nearest f32 would turn into the tie itself: rounding
    // straight to bf16 goes up.
    special.push_back(1.0 + 0x1p-8 + 0x1p-40);
  }
  Inputs in(seed_of("to_bf16", 0));
  std::vector<F> src(special.begin(), special.end());
  for (F x : in.values<F>(993, 1e-3, 1e3)) src.push_back(x);
  Buffer<F> d_src = this->upload(src);
  Buffer<bf16> dst = this->upload(std::vector<bf16>(src.size(), bf16{0x7fc1}));
  k.to_bf16(dst.data(), d_src.data(), src.size());
  const std::vector<bf16> got = this->download(dst);
  Vec got_v, want_v;
  size_t bit_mismatches = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    const double want = ref::round_bf16(double(src[i]));
    got_v.push_back(got[i].to_float());
    want_v.push_back(want);
    if (!std::isnan(want) && got[i].bits != ref::bf16_bits(want)) {
      ++bit_mismatches;
      ADD_FAILURE() << "to_bf16 of " << src[i] << ": bits 0x" << std::hex << got[i].bits
                    << ", want 0x" << ref::bf16_bits(want) << std::dec;
    }
  }
  const std::string shape =
      shape_str({{"n", int64_t(src.size())}}) + " (ties, NaN, inf, -0, subnormal)";
  this->check("to_bf16", shape, "dst", got_v, want_v, Tol::exact);
  EXPECT_EQ(bit_mismatches, 0u);

  // from_bf16: every finite bf16 sign/exponent class, infinities and NaN, times a scale.
  std::vector<bf16> src16;
  for (uint32_t bits = 0; bits < 0x10000; bits += 97) src16.push_back(bf16{uint16_t(bits)});
  src16.push_back(bf16{0x7f80});
  src16.push_back(bf16{0xff80});
  src16.push_back(bf16{0x7fc0});
  Buffer<bf16> d16 = this->upload(src16);
  for (double scale : {1.0, 0.5, 1.0 / 1024, 3.0}) {
    Buffer<F> out = this->poisoned(src16.size());
    k.from_bf16(out.data(), d16.data(), src16.size(), F(scale));
    Vec want;
    for (const bf16 b : src16) want.push_back(double(F(double(b.to_float()) * scale)));
    this->check("from_bf16",
                shape_str({{"n", int64_t(src16.size())}}) + " scale=" + std::to_string(scale),
                "dst", out, want, Tol::arith);
  }
}

// ---- the checker itself -----------------------------------------------------------------------

// Every bound of the table can fail: an output perturbed by twice a bound fails it, one perturbed
// by half passes; a NaN fails everything, and exactness sees one ulp.
TEST(ConformanceChecker, EveryBoundCanFail) {
  Inputs in(seed_of("checker", 0));
  const Vec want = wide(in.values<double>(1000));
  for (const Tolerance& t : kTolerances) {
    for (double b : {t.f32, t.f64}) {
      if (std::isnan(b)) continue;
      for (size_t at : {size_t(0), size_t(500), size_t(999)}) {
        Vec got = want;
        if (b == 0) {
          got[at] = std::nextafter(got[at], INFINITY);
          EXPECT_GT(measure_error(got, want).value, b);
          continue;
        }
        got[at] = want[at] * (1 + 2 * b);
        EXPECT_GT(measure_error(got, want).value, b) << t.applies_to;
        got[at] = want[at] * (1 + 0.5 * b);
        EXPECT_LE(measure_error(got, want).value, b) << t.applies_to;
        // An element near zero is measured against the tensor's RMS: a small absolute error there
        // passes, twice the bound of the RMS fails.
        Vec near_zero = want;
        near_zero[at] = 1e-9;
        Vec moved = near_zero;
        moved[at] += 2 * b * std::sqrt(1.0 / 3.0);  // rms of |U(0.1, 1)| is ~0.58
        EXPECT_GT(measure_error(moved, near_zero).value, b);
      }
      Vec nan = want;
      nan[10] = NAN;
      EXPECT_FALSE(measure_error(nan, want).value <= b);
      Vec inf = want;
      inf[10] = INFINITY;
      EXPECT_FALSE(measure_error(inf, want).value <= b);
    }
  }
  // A NaN reference needs a NaN; an infinite one needs the same infinity.
  EXPECT_EQ(measure_error({NAN, 1.0}, {NAN, 1.0}).value, 0.0);
  EXPECT_EQ(measure_error({1.0, 1.0}, {NAN, 1.0}).value, INFINITY);
  EXPECT_EQ(measure_error({-INFINITY, 1.0}, {INFINITY, 1.0}).value, INFINITY);
  // The bf16 reference rounds ties to even, overflows to infinity, keeps subnormals.
  EXPECT_EQ(ref::round_bf16(1.0 + 0x1p-8), 1.0);
  EXPECT_EQ(ref::round_bf16(1.0 + 3 * 0x1p-8), 1.0 + 0x1p-6);
  EXPECT_EQ(ref::round_bf16(double(FLT_MAX)), INFINITY);
  EXPECT_EQ(ref::round_bf16(0x1p-133 * 1.5), 0x1p-132);
  EXPECT_EQ(ref::bf16_bits(1.0), 0x3f80);
}

// ---- the table at the end of the run ----------------------------------------------------------

class ReportEnvironment : public ::testing::Environment {
 public:
  void TearDown() override {
    const Report& report = Report::get();
    if (report.empty()) return;
    std::cout << "\n[conformance] " << report.markdown(false) << std::flush;
    const char* path = std::getenv("TETRA_CONFORMANCE_REPORT");
    if (!path || !*path) return;
    std::ofstream file(path);
    file << "# Backend conformance\n\n" << report.markdown(true);
    if (!file) std::cerr << "[conformance] could not write " << path << "\n";
  }
};

[[maybe_unused]] ::testing::Environment* const kReportEnvironment =
    ::testing::AddGlobalTestEnvironment(new ReportEnvironment);

}  // namespace
}  // namespace tetra::conformance
