// Every matmul library against the f64 reference loop in every layout the model uses (plain,
// transposed A, transposed B, both, strided batches as attention takes them, bias, accumulation),
// at 1, 2 and 3 threads (the split libraries cut the output by rows or by columns);
// and the per-machine choice: measured once, read back from the cache, a damaged cache measured
// again with a warning, another machine's replaced.
#include "kernels/cpu/matmul_choice.h"

#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "tests/kernels/random_floats.h"

namespace tetra::cpu {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using testing::random_floats;
using testing::Threads;

struct Layout {
  std::string name;
  int64_t b0, b1, M, N, K;
  bool at, bt;  // A stored transposed (K, M); B stored transposed (N, K)
  int64_t pad;  // extra elements per stored row (leading dimension beyond the row)
  bool bias, accumulate;
};

// The operands of `l` in f32 and f64 (same values, same strides), the product run through `lib`
// in f32 and through the reference loop in f64; returns the largest error relative to the
// reference's scale.
double relative_error(const Layout& l, MatmulLib lib) {
  const int64_t ra = l.at ? l.K : l.M, ca = l.at ? l.M : l.K;  // stored rows, cols of A
  const int64_t rb = l.bt ? l.N : l.K, cb = l.bt ? l.K : l.N;
  const int64_t lda = ca + l.pad, ldb = cb + l.pad, ldc = l.N + l.pad;
  const int64_t sa = ra * lda, sb = rb * ldb, sc = l.M * ldc, batch = l.b0 * l.b1;
  const auto a = random_floats(size_t(batch * sa), 1), b = random_floats(size_t(batch * sb), 2);
  const auto bias = random_floats(size_t(l.N), 3), c0 = random_floats(size_t(batch * sc), 4);
  MatmulArgs x;
  x.b0 = l.b0, x.b1 = l.b1, x.M = l.M, x.N = l.N, x.K = l.K;
  x.a.strides = {l.b1 * sa, sa, l.at ? 1 : lda, l.at ? lda : 1};
  x.b.strides = {l.b1 * sb, sb, l.bt ? 1 : ldb, l.bt ? ldb : 1};
  x.c_strides = {l.b1 * sc, sc, ldc, 1};
  x.accumulate = l.accumulate;
  x.role = "test";

  std::vector<float> c = c0;
  x.a.data = a.data(), x.b.data = b.data(), x.c = c.data();
  x.bias = l.bias ? bias.data() : nullptr;
  matmul_with(lib, x);

  const std::vector<double> a64(a.begin(), a.end()), b64(b.begin(), b.end());
  const std::vector<double> bias64(bias.begin(), bias.end());
  std::vector<double> c64(c0.begin(), c0.end());
  MatmulArgs r = x;
  r.a = {a64.data(), x.a.strides, DType::f64};
  r.b = {b64.data(), x.b.strides, DType::f64};
  r.c = c64.data();
  r.bias = l.bias ? bias64.data() : nullptr;
  matmul_reference(r);

  double err = 0.0;
  for (int64_t i = 0; i < batch; ++i)
    for (int64_t m = 0; m < l.M; ++m)
      for (int64_t n = 0; n < l.N; ++n) {
        const size_t at = size_t(i * sc + m * ldc + n);
        err = std::max(err, std::abs(double(c[at]) - c64[at]));
      }
  return err / std::sqrt(double(l.K));  // operands in [-1, 1]: the sum's scale is sqrt(K)
}

const std::vector<Layout>& layouts() {
  static const std::vector<Layout> l = {
      {"nn", 1, 1, 33, 17, 65, false, false, 0, false, false},
      {"nt + bias (forward)", 1, 1, 33, 17, 65, false, true, 0, true, false},
      {"nt + bias + accumulate (residual)", 1, 1, 40, 24, 72, false, true, 0, true, true},
      {"tn + accumulate (weight gradient)", 1, 1, 17, 33, 65, true, false, 0, false, true},
      {"tt", 1, 1, 9, 31, 20, true, true, 0, false, false},
      {"nn, rows longer than the matrix", 1, 1, 12, 10, 14, false, false, 5, false, false},
      {"batched nt, strided (q.k^T)", 2, 3, 7, 7, 4, false, true, 3, false, false},
      {"batched tn + accumulate (dv)", 2, 3, 7, 4, 7, true, false, 2, false, true},
      {"batched nn (att.v)", 2, 3, 7, 4, 7, false, false, 0, false, false},
      {"nt + bias, wide (column slabs)", 1, 1, 20, 70, 33, false, true, 3, true, false},
      {"tt + accumulate, wide", 1, 1, 6, 50, 9, true, true, 0, false, true},
  };
  return l;
}

TEST(MatmulLibraries, EveryLibraryMatchesTheF64ReferenceInEveryLayout) {
  for (int threads : {1, 2, 3}) {
    const Threads scope(threads);
    for (const Layout& l : layouts()) {
      int ran = 0;
      for (MatmulLib lib : kMatmulLibs) {
        MatmulArgs x;
        x.b0 = l.b0, x.b1 = l.b1, x.M = l.M, x.N = l.N, x.K = l.K;
        const int64_t lda = (l.at ? l.M : l.K) + l.pad, ldb = (l.bt ? l.K : l.N) + l.pad;
        x.a.strides = {0, 0, l.at ? 1 : lda, l.at ? lda : 1};
        x.b.strides = {0, 0, l.bt ? 1 : ldb, l.bt ? ldb : 1};
        x.c_strides = {0, 0, l.N + l.pad, 1};
        const bool batched = l.b0 * l.b1 > 1;
        // Which library runs which layout is part of the contract: no silent skips. A split
        // needs threads to split between and more than one 16-row (or column) slab.
        const bool splits = threads > 1 && !batched && std::max(l.M, l.N) > 16;
        bool expected = true;
        if (lib == MatmulLib::onednn_copy) expected = !batched && (l.at || l.bt);
        if (lib == MatmulLib::onednn_split || lib == MatmulLib::openblas_split) expected = splits;
        // The widened libraries run products with a bf16 operand, never two f32 ones.
        if (lib == MatmulLib::widened || lib == MatmulLib::widened_split) expected = false;
        ASSERT_EQ(matmul_lib_supports(lib, x), expected)
            << l.name << " " << matmul_lib_name(lib) << " at " << threads << " threads";
        if (!expected) continue;
        ++ran;
        EXPECT_LT(relative_error(l, lib), 1e-6)
            << l.name << " on " << matmul_lib_name(lib) << " at " << threads << " threads";
      }
      EXPECT_GE(ran, 2) << l.name;
    }
  }
}

// Products of bf16 operands: oneDNN's bf16 primitive whole and split where it is native (and takes
// B as it is), and everywhere the operands widened to f32, whole and split. All compute the f64
// product of the same (bf16-exact) values; nothing else runs them.
TEST(MatmulLibraries, Bf16OperandsRunOnTheBf16PrimitiveOrWidened) {
  std::cout << "[ bf16     ] " << bf16_matmul_path().describe() << std::endl;
  const Threads scope(2);
  for (const Layout& l : layouts()) {
    if (l.b0 * l.b1 > 1 || l.pad > 0) continue;
    const int64_t ra = l.at ? l.K : l.M, ca = l.at ? l.M : l.K;
    const int64_t rb = l.bt ? l.N : l.K, cb = l.bt ? l.K : l.N;
    std::vector<bf16> a(size_t(ra * ca)), b(size_t(rb * cb));
    const auto fa = random_floats(a.size(), 5), fb = random_floats(b.size(), 6);
    for (size_t i = 0; i < a.size(); ++i) a[i] = bf16::from_float(fa[i]);
    for (size_t i = 0; i < b.size(); ++i) b[i] = bf16::from_float(fb[i]);
    MatmulArgs x;
    x.M = l.M, x.N = l.N, x.K = l.K;
    x.a = {a.data(), {0, 0, l.at ? 1 : ca, l.at ? ca : 1}, DType::bf16};
    x.b = {b.data(), {0, 0, l.bt ? 1 : cb, l.bt ? cb : 1}, DType::bf16};
    x.c_strides = {0, 0, l.N, 1};
    const auto bias = random_floats(size_t(l.N), 7);
    x.bias = l.bias ? bias.data() : nullptr;
    x.accumulate = l.accumulate;
    const auto c0 = random_floats(size_t(l.M * l.N), 8);

    std::vector<double> a64(a.size()), b64(b.size()), c64(c0.begin(), c0.end());
    for (size_t i = 0; i < a.size(); ++i) a64[i] = a[i].to_float();
    for (size_t i = 0; i < b.size(); ++i) b64[i] = b[i].to_float();
    const std::vector<double> bias64(bias.begin(), bias.end());
    MatmulArgs r = x;
    r.a = {a64.data(), x.a.strides, DType::f64};
    r.b = {b64.data(), x.b.strides, DType::f64};
    r.c = c64.data();
    r.bias = l.bias ? bias64.data() : nullptr;
    matmul_reference(r);

    // A transposed B is copied row-major first when M <= 32 (oneDNN's AMX kernels get it wrong,
    // matmul.cc): such a product goes to neither bf16 library as it is.
    const bool primitive = bf16_matmul_path().native && !(l.bt && l.M <= 32);
    const bool splits = std::max(l.M, l.N) > 16;
    for (MatmulLib lib : kMatmulLibs) {
      const bool expected =
          (primitive && (lib == MatmulLib::onednn || (lib == MatmulLib::onednn_split && splits))) ||
          lib == MatmulLib::widened || (lib == MatmulLib::widened_split && splits);
      ASSERT_EQ(matmul_lib_supports(lib, x), expected) << l.name << " " << matmul_lib_name(lib);
      if (!expected) continue;
      std::vector<float> c(c0);
      x.c = c.data();
      matmul_with(lib, x);
      double err = 0.0;
      for (size_t i = 0; i < c.size(); ++i) err = std::max(err, std::abs(double(c[i]) - c64[i]));
      EXPECT_LT(err / std::sqrt(double(l.K)), 1e-6) << l.name << " on " << matmul_lib_name(lib);
    }
  }
}

TEST(MatmulLibraries, SplitsAreNotOfferedInsideAParallelRegion) {
  const Threads scope(2);
  MatmulArgs x;
  x.M = 64, x.N = 64, x.K = 8;
  x.a.strides = {0, 0, 8, 1};
  x.b.strides = {0, 0, 64, 1};
  x.c_strides = {0, 0, 64, 1};
  EXPECT_TRUE(matmul_lib_supports(MatmulLib::onednn_split, x));
  bool inside = true;
#pragma omp parallel num_threads(2)
  {
#pragma omp critical
    inside = inside && !matmul_lib_supports(MatmulLib::onednn_split, x);
  }
  EXPECT_TRUE(inside);
}

TEST(MatmulLibraries, OpenBlasRefusesWhatItCannotRead) {
  MatmulArgs x;
  x.M = 4, x.N = 4, x.K = 4;
  x.a.strides = {16, 16, 4, 1};
  x.b.strides = {32, 32, 8, 2};  // neither unit row nor unit column stride
  x.c_strides = {16, 16, 4, 1};
  EXPECT_FALSE(matmul_lib_supports(MatmulLib::openblas, x));
  EXPECT_TRUE(matmul_lib_supports(MatmulLib::onednn, x));
  try {
    matmul_with(MatmulLib::openblas, x);
    FAIL() << "expected a refusal";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[matmul] openblas cannot run a 4x4x4 product"),
              std::string::npos)
        << e.what();
  }
}

// The choice over a cache file in a private directory and a stand-in machine whose rates are set
// per library.
class MatmulChoice : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tetra_matmul_choice_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    cache_ = dir_ / "tetra" / "matmul.json";
    x_.M = 64, x_.N = 32, x_.K = 16;
    x_.a.strides = {0, 0, 1, 64};  // A transposed: every library can run it
    x_.b.strides = {0, 0, 32, 1};
    x_.c_strides = {0, 0, 32, 1};
    x_.role = "mlp.c_fc weight grad";
    threads_before_ = omp_get_max_threads();
    omp_set_num_threads(1);  // the split libraries are offered from 2 threads (their own test)
  }
  void TearDown() override {
    omp_set_num_threads(threads_before_);
    fs::remove_all(dir_);
  }

  MatmulChoiceSource source(std::map<MatmulLib, double> rates, const std::string& machine) {
    return {[this, rates](MatmulLib lib, const MatmulArgs&) {
              ++measurements_;
              return rates.at(lib);
            },
            machine};
  }
  json cache() const {
    std::ifstream in(cache_);
    return json::parse(in);
  }
  void write(const std::string& text) const {
    fs::create_directories(cache_.parent_path());
    std::ofstream(cache_) << text;
  }

  fs::path dir_, cache_;
  MatmulArgs x_;
  int measurements_ = 0;
  int threads_before_ = 1;
  const std::map<MatmulLib, double> blas_wins_ = {
      {MatmulLib::onednn, 30.0}, {MatmulLib::openblas, 75.0}, {MatmulLib::onednn_copy, 50.0}};
};

TEST_F(MatmulChoice, MeasuredOnceThenReadBackFromTheCache) {
  const std::string key = matmul_choice_key(x_, 2);
  EXPECT_EQ(key, "64x16x32 b1 tn t2");
  {
    MatmulChooser chooser(cache_, source(blas_wins_, "Test CPU"));
    EXPECT_EQ(chooser.choose(x_), MatmulLib::openblas);
    EXPECT_EQ(chooser.choose(x_), MatmulLib::openblas);
    EXPECT_EQ(chooser.measured(), 1);
    EXPECT_EQ(measurements_, 6);  // each library in each of two rounds
  }
  const json j = cache();
  EXPECT_EQ(j["schema"], 3);
  EXPECT_EQ(j["machine"], "Test CPU");
  const std::string k = matmul_choice_key(x_, omp_get_max_threads());
  ASSERT_TRUE(j["products"].contains(k)) << j.dump(1);
  EXPECT_EQ(j["products"][k]["library"], "openblas");
  EXPECT_EQ(j["products"][k]["role"], "mlp.c_fc weight grad");
  EXPECT_EQ(j["products"][k]["gflops"]["onednn-copy"], 50.0);

  // A new process (here: chooser) reads the choice instead of measuring, even if the machine's
  // rates would now say otherwise.
  measurements_ = 0;
  MatmulChooser again(
      cache_,
      source({{MatmulLib::onednn, 99.0}, {MatmulLib::openblas, 1.0}, {MatmulLib::onednn_copy, 1.0}},
             "Test CPU"));
  EXPECT_EQ(again.choose(x_), MatmulLib::openblas);
  EXPECT_EQ(again.measured(), 0);
  EXPECT_EQ(measurements_, 0);

  // Another shape is measured and added beside the first.
  MatmulArgs y = x_;
  y.a.strides = {0, 0, 16, 1};
  EXPECT_EQ(again.choose(y), MatmulLib::onednn);  // this chooser's machine now favours oneDNN
  EXPECT_EQ(again.measured(), 1);
  EXPECT_EQ(measurements_, 4);  // oneDNN and OpenBLAS twice: no transposed operand to copy
  EXPECT_EQ(cache()["products"].size(), 2u);
}

TEST_F(MatmulChoice, WithTwoThreadsTheSplitLibrariesAreMeasuredToo) {
  omp_set_num_threads(2);
  MatmulChooser chooser(cache_, source({{MatmulLib::onednn, 30.0},
                                        {MatmulLib::openblas, 75.0},
                                        {MatmulLib::onednn_copy, 50.0},
                                        {MatmulLib::onednn_split, 90.0},
                                        {MatmulLib::openblas_split, 80.0}},
                                       "Test CPU"));
  EXPECT_EQ(chooser.choose(x_), MatmulLib::onednn_split);
  EXPECT_EQ(measurements_, 10);  // five libraries, two rounds
  const json e = cache()["products"][matmul_choice_key(x_, 2)];
  EXPECT_EQ(e["library"], "onednn-split");
  EXPECT_EQ(e["gflops"]["openblas-split"], 80.0);
}

// A product of bf16 operands has its own key and its own libraries: the bf16 primitive whole and
// split where it is native, the widened pair everywhere; a CPU whose bf16 instructions are slow
// picks widened.
TEST_F(MatmulChoice, Bf16ProductsAreKeptApartAndMeasuredOnTheirOwnLibraries) {
  const bool native = bf16_matmul_path().native;
  std::cout << "[ bf16     ] " << bf16_matmul_path().describe() << std::endl;
  omp_set_num_threads(2);
  std::vector<bf16> a(size_t(x_.M * x_.K)), b(size_t(x_.K * x_.N));
  MatmulArgs y = x_;
  y.a = {a.data(), x_.a.strides, DType::bf16};
  y.b = {b.data(), x_.b.strides, DType::bf16};
  EXPECT_EQ(matmul_choice_key(y, 2), "64x16x32 b1 tn bf16 t2");
  const std::map<MatmulLib, double> rates = {{MatmulLib::onednn, 30.0},
                                             {MatmulLib::onednn_split, 45.0},
                                             {MatmulLib::widened, 50.0},
                                             {MatmulLib::widened_split, 40.0}};
  MatmulChooser chooser(cache_, source(rates, "Test CPU"));
  EXPECT_EQ(chooser.choose(y), MatmulLib::widened);
  // Two rounds over the libraries that run it; none of the f32-only ones.
  EXPECT_EQ(measurements_, native ? 8 : 4);
  const json entry = cache()["products"][matmul_choice_key(y, 2)];
  EXPECT_EQ(entry["gflops"].size(), native ? 4u : 2u) << entry;
  EXPECT_FALSE(cache()["products"].contains(matmul_choice_key(x_, 2))) << "the f32 product";
}

TEST_F(MatmulChoice, AnOlderSchemaIsMeasuredAgain) {
  const std::string k = matmul_choice_key(x_, omp_get_max_threads());
  write(R"({"schema": 1, "machine": "Test CPU", "products": {")" + k +
        R"(": {"library": "onednn", "gflops": {"onednn": 1}}}})");
  MatmulChooser chooser(cache_, source(blas_wins_, "Test CPU"));
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(chooser.choose(x_), MatmulLib::openblas);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("has schema 1, not 3"), std::string::npos) << err;
  EXPECT_EQ(chooser.measured(), 1);
  EXPECT_EQ(cache()["schema"], 3);
}

TEST_F(MatmulChoice, DamagedCacheIsMeasuredAgainWithAWarning) {
  const std::string k = matmul_choice_key(x_, omp_get_max_threads());
  const std::vector<std::pair<std::string, std::string>> damaged = {
      {"{\"schema\": 1, \"machine\"", "is not valid JSON"},
      {"[1, 2]", "is not a JSON object"},
      {R"({"schema": 3, "machine": "Test CPU", "products": 7})", "has no \"products\" object"},
      {R"({"schema": 3, "machine": "Test CPU", "products": {")" + k +
           R"(": {"library": "magic", "gflops": {}}}})",
       "has a malformed entry for \"" + k + "\""},
  };
  for (const auto& [text, problem] : damaged) {
    write(text);
    measurements_ = 0;
    MatmulChooser chooser(cache_, source(blas_wins_, "Test CPU"));
    ::testing::internal::CaptureStderr();
    EXPECT_EQ(chooser.choose(x_), MatmulLib::openblas) << text;
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("[matmul] " + cache_.string() + " " + problem), std::string::npos)
        << text << "\n"
        << err;
    EXPECT_NE(err.find("; measuring the libraries of each product again and rewriting it"),
              std::string::npos)
        << err;
    EXPECT_EQ(chooser.measured(), 1) << text;
    EXPECT_EQ(cache()["products"][k]["library"], "openblas") << text;
  }
}

TEST_F(MatmulChoice, AnEntryNamingALibraryThatCannotRunTheProductIsMeasuredAgain) {
  MatmulArgs nn = x_;
  nn.a.strides = {0, 0, 16, 1};  // no transposed operand: the copy path cannot run it
  const std::string k = matmul_choice_key(nn, omp_get_max_threads());
  write(R"({"schema": 3, "machine": "Test CPU", "products": {")" + k +
        R"(": {"library": "onednn-copy", "gflops": {}}}})");
  MatmulChooser chooser(cache_, source(blas_wins_, "Test CPU"));
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(chooser.choose(nn), MatmulLib::openblas);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("names onednn-copy, which cannot run it; measuring again"), std::string::npos)
      << err;
  EXPECT_EQ(chooser.measured(), 1);
}

TEST_F(MatmulChoice, AnotherMachinesCacheIsReplaced) {
  const std::string k = matmul_choice_key(x_, omp_get_max_threads());
  write(R"({"schema": 3, "machine": "Other CPU", "products": {")" + k +
        R"(": {"library": "onednn", "gflops": {"onednn": 1}}}})");
  MatmulChooser chooser(cache_, source(blas_wins_, "Test CPU"));
  EXPECT_EQ(chooser.choose(x_), MatmulLib::openblas);
  EXPECT_EQ(chooser.measured(), 1);
  EXPECT_EQ(cache()["machine"], "Test CPU");
}

TEST_F(MatmulChoice, TheThreadCountIsPartOfTheKey) {
  EXPECT_NE(matmul_choice_key(x_, 1), matmul_choice_key(x_, 2));
  MatmulArgs batched = x_;
  batched.b0 = 4;
  EXPECT_EQ(matmul_choice_key(batched, 1), "64x16x32 b4 tn t1");
}

// A fixed policy runs every product on its library (bit for bit what that library gives) without
// asking the chooser; openblas leaves to oneDNN what OpenBLAS cannot read.
TEST(MatmulPolicy, AFixedLibraryRunsEveryProductWithoutMeasuring) {
  const int64_t n = 48;
  const auto a = random_floats(size_t(n * n), 7), b = random_floats(size_t(n * n), 8);
  MatmulArgs x;
  x.M = x.N = x.K = n;
  x.a = {a.data(), {n * n, n * n, 1, n}};  // transposed A
  x.b = {b.data(), {n * n, n * n, n, 1}};
  x.c_strides = {n * n, n * n, n, 1};
  x.role = "test";
  auto run = [&](auto&& product) {
    std::vector<float> c(size_t(n * n));
    MatmulArgs y = x;
    y.c = c.data();
    product(y);
    return c;
  };
  const MatmulPolicy before = matmul_policy();
  const int measured = matmul_chooser().measured();
  for (MatmulLib lib : {MatmulLib::onednn, MatmulLib::openblas}) {
    set_matmul_policy(lib == MatmulLib::onednn ? MatmulPolicy::onednn : MatmulPolicy::openblas,
                      "test");
    EXPECT_EQ(run([](const MatmulArgs& y) { matmul(y); }),
              run([&](const MatmulArgs& y) { matmul_with(lib, y); }))
        << matmul_lib_name(lib);
  }
  // A batch whose rows are neither contiguous nor unit-strided in either direction: oneDNN's.
  x.a.strides = {n * n, n * n, 2, 2 * n};
  x.M = x.K = n / 2;
  ASSERT_FALSE(matmul_lib_supports(MatmulLib::openblas, x));
  EXPECT_EQ(run([](const MatmulArgs& y) { matmul(y); }),
            run([](const MatmulArgs& y) { matmul_with(MatmulLib::onednn, y); }));
  EXPECT_EQ(matmul_chooser().measured(), measured) << "a fixed policy asked the chooser";
  EXPECT_EQ(matmul_policy_describe(), "openblas for every product it runs (test)");
  set_matmul_policy(before, "test");
}

TEST(MatmulPolicy, UnknownPoliciesAreRefusedWithTheValuesThatWork) {
  EXPECT_EQ(parse_matmul_policy("auto", "k"), MatmulPolicy::choose);
  EXPECT_EQ(parse_matmul_policy("onednn", "k"), MatmulPolicy::onednn);
  EXPECT_EQ(parse_matmul_policy("openblas", "k"), MatmulPolicy::openblas);
  try {
    parse_matmul_policy("OneDNN", "kernels.matmul");
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("kernels.matmul=\"OneDNN\" is not a matmul library "
                                         "policy; use auto"),
              std::string::npos)
        << e.what();
  }
}

// The real machine: each library measured on a real product gives a positive rate, and the
// process's chooser picks one that runs the product.
TEST(MatmulChoiceMachine, MeasuresThisCpu) {
  const int64_t n = 96;
  const auto a = random_floats(size_t(n * n), 5), b = random_floats(size_t(n * n), 6);
  std::vector<float> c(size_t(n * n));
  MatmulArgs x;
  x.M = x.N = x.K = n;
  x.a = {a.data(), {n * n, n * n, 1, n}};
  x.b = {b.data(), {n * n, n * n, n, 1}};
  x.c = c.data();
  x.c_strides = {n * n, n * n, n, 1};
  const MatmulChoiceSource machine = machine_matmul_source();
  const Threads scope(2);  // every library of f32 operands, the split ones too
  for (MatmulLib lib : kMatmulLibs) {
    if (lib == MatmulLib::widened || lib == MatmulLib::widened_split) continue;  // bf16 operands
    const double g = machine.measure(lib, x);
    EXPECT_GT(g, 0.0) << matmul_lib_name(lib);
    std::cout << "[ matmul   ] " << machine.machine << " " << matmul_choice_key(x, 0) << " "
              << matmul_lib_name(lib) << ": " << g << " GFLOP/s" << std::endl;
  }
  EXPECT_TRUE(std::all_of(c.begin(), c.end(), [](float v) { return v == 0.0f; }))
      << "measuring wrote into the caller's C";
  EXPECT_TRUE(matmul_lib_supports(matmul_chooser().choose(x), x));
}

}  // namespace
}  // namespace tetra::cpu
