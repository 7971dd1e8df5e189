// The machinery of the backend conformance suite (conformance_test.cc): the tolerance table, the
// error measure, the run's table of worst errors, reproducible inputs, and f64 reference
// implementations of the operations of kernels/kernels.h written here from their contracts as
// plain loops. The references never call a backend (its f64 table is itself under test).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/param_store.h"
#include "kernels/kernels.h"

namespace tetra::conformance {

using Vec = std::vector<double>;

// ---- tolerances -------------------------------------------------------------------------------

/** The classes of bound an output is held to (kTolerances below). */
enum class Tol : uint8_t { exact, arith, double_sum, bf16_product, bf16_attention, cancellation };

/** bf16's unit roundoff: 8 significant bits, so a rounding moves a value by at most 2^-8 of it. */
inline constexpr double kBf16Unit = 0x1p-8;

struct Tolerance {
  Tol tol;
  double f32, f64;  // the bound on measure_error() below, per precision of the table under test
  const char* applies_to;
  const char* why;
};

// The one table of bounds. The error measure is measure_error(): the larger of the norm-wise
// relative error and the worst element's relative error (against max(|ref|, rms(ref))).
inline constexpr Tolerance kTolerances[] = {
    {Tol::exact, 0.0, 0.0,
     "copy, zero, copy_rows, gather_rows, to_bf16, first_nonfinite, the decode caches; memory an "
     "op must leave "
     "alone (guards, gaps, read-only inputs, v under rope); recompute and backward after it vs "
     "forward's",
     "data movement and casts have one right answer; `saved` after recompute is forward's"},
    {Tol::arith, 1e-5, 1e-12,
     "every other operation; bf16-dtype operands; Bf16Operands products against a reference "
     "that rounds their operands to bf16 as the contract says",
     "f32: 1e-5 is ~170 unit roundoffs (2^-24); the sums here are at most ~800 long (C = 769), "
     "whose rounding grows like sqrt(n), plus the CPU's exp_approx (2e-7 relative). f64: 1e-12 "
     "is ~9000 units of 2^-53, the same with headroom"},
    {Tol::double_sum, 1e-12, 1e-12, "sum_squares",
     "the contract sums in double: every f32 element squares exactly in double"},
    {Tol::bf16_product, 4 * kBf16Unit, NAN,
     "Bf16Operands products (matmul, linear_gelu) against the unrounded reference",
     "rounding moves each operand by <= u relative (~0.45u rms), each term a_k b_k by <= 2u; over "
     "random signs the sum's error is ~0.64u rms(ref), and 4u (~6 sigma) covers the largest of "
     "~10^4 elements of a shape"},
    {Tol::bf16_attention, 8 * kBf16Unit, NAN,
     "attention under Bf16Operands against the unrounded reference, inputs of magnitude <= 1",
     "forward chains two bf16 products through the softmax (q.k^T, p.v), backward two or three "
     "(dy.v^T, then dpre.k, dpre^T.q; p^T.dy): twice a product's 4u, dq, dk, dv each at its own "
     "scale. Which of attention's products round is the backend's choice (the CPU keeps dq and dk "
     "in f32), so the reference rounds nothing"},
    {Tol::cancellation, 1e-4, 1e-10,
     "a sum that is zero in exact arithmetic, as |sum| / sum of |terms|: the key bias's gradient "
     "(every row of attention's softmax gradient sums to zero), in every precision",
     "f32 rounding leaves ~1e-6 of the terms' size; a kernel whose rows do not cancel (bf16 noise "
     "of order u = 4e-3 in them) leaves 1e-3 and more"},
};

inline const char* tol_name(Tol t) {
  switch (t) {
    case Tol::exact:
      return "exact";
    case Tol::arith:
      return "arith";
    case Tol::double_sum:
      return "double_sum";
    case Tol::bf16_product:
      return "bf16_product";
    case Tol::bf16_attention:
      return "bf16_attention";
    case Tol::cancellation:
      return "cancellation";
  }
  return "?";
}

inline const Tolerance& tolerance(Tol t) {
  for (const Tolerance& row : kTolerances) {
    if (row.tol == t) return row;
  }
  return kTolerances[0];
}

template <typename F>
double bound(Tol t) {
  return sizeof(F) == 8 ? tolerance(t).f64 : tolerance(t).f32;
}

// ---- the error measure ------------------------------------------------------------------------

struct Error {
  double value = 0.0;  // infinity for a NaN, an infinity or a NaN where none belongs
  size_t index = 0;    // the worst element
};

/** The error of `got` against the reference `want`: the larger of the norm-wise relative error
 *  ||got - want|| / ||want|| and the worst element's |got - want| / max(|want|, rms(want)). The
 *  floor at the tensor's RMS measures elements near zero (a sum that cancels, a GELU far left)
 *  against the tensor's scale, since their f32 error is absolute, not relative. A NaN or infinity
 *  where the reference is finite is an infinite error (NaN never passes); where the reference is a
 *  NaN (a cast of one) `got` must be a NaN, and an infinite reference must be met exactly. */
inline Error measure_error(const Vec& got, const Vec& want) {
  Error e;
  auto worse = [&](double v, size_t i) {
    if (!(v <= e.value)) e = {std::isnan(v) ? INFINITY : v, i};
  };
  if (got.size() != want.size()) return {INFINITY, 0};
  double ref2 = 0.0;
  size_t finite = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) {
      if (!std::isnan(got[i])) worse(INFINITY, i);
    } else if (std::isinf(want[i])) {
      if (got[i] != want[i]) worse(INFINITY, i);
    } else {
      ref2 += want[i] * want[i];
      ++finite;
    }
  }
  const double floor = std::max(std::sqrt(ref2 / double(std::max<size_t>(finite, 1))), DBL_MIN);
  double diff2 = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(want[i])) continue;
    if (!std::isfinite(got[i])) {
      worse(INFINITY, i);
      continue;
    }
    const double d = got[i] - want[i];
    diff2 += d * d;
    worse(std::abs(d) / std::max(std::abs(want[i]), floor), i);
  }
  const double norm = std::sqrt(diff2) / std::max(std::sqrt(ref2), DBL_MIN);
  if (norm > e.value) e.value = norm;
  return e;
}

// ---- the run's table --------------------------------------------------------------------------

/** Every checked output of the run, kept as the worst error/bound per (op, target), printed at
 *  the end as "op x backend: worst error / bound". */
class Report {
 public:
  static Report& get() {
    static Report report;
    return report;
  }

  void record(const std::string& op, const std::string& target, const std::string& shape,
              const std::string& output, double error, double bound) {
    const std::lock_guard lock(mu_);
    Cell& c = cell(op, target);
    ++c.cases;
    const bool fails = !(error <= bound);
    c.failed = c.failed || fails;
    if (c.cases == 1 || ratio(error, bound) > ratio(c.worst, c.bound)) {
      c.worst = error, c.bound = bound, c.shape = shape + " (" + output + ")";
    }
  }
  /** Ops not run on `target`, and why: those whose name holds every word of `pattern` (all of
   *  them when it is empty). */
  void skip(const std::string& pattern, const std::string& target, const std::string& reason) {
    const std::lock_guard lock(mu_);
    if (pattern.empty()) {
      target_skips_[target] = reason;
    } else {
      skips_.push_back({pattern, target, reason});
    }
  }
  void describe(const std::string& target, const std::string& what) {
    const std::lock_guard lock(mu_);
    descriptions_[target] = what;
  }
  bool empty() const { return ops_.empty() && target_skips_.empty() && skips_.empty(); }

  /** The table as Markdown; `details` adds the worst case's shape per op and backend. */
  std::string markdown(bool details) const {
    const std::lock_guard lock(mu_);
    std::vector<std::string> targets;
    // A column per backend run; one not run at all is a line above the table instead.
    for (const char* t : kTargets) {
      bool seen = descriptions_.count(t) > 0;
      for (const auto& [key, c] : cells_) seen = seen || key.second == t;
      if (seen && !target_skips_.count(t)) targets.emplace_back(t);
    }
    std::string s =
        "Worst error / bound per operation and backend (error: measure_error in "
        "tests/kernels/conformance.h; cases in parentheses).\n\n";
    for (const auto& [t, what] : descriptions_) s += "- " + t + ": " + what + "\n";
    for (const auto& [t, why] : target_skips_) s += "- " + t + ": not tested: " + why + "\n";
    s += "\n| op |";
    for (const auto& t : targets) s += " " + t + " |";
    s += "\n|---|";
    for (size_t i = 0; i < targets.size(); ++i) s += "---|";
    s += "\n";
    std::map<std::string, int> notes;  // skip reason -> footnote number
    auto note = [&](const std::string& why) {
      auto [it, added] = notes.emplace(why, int(notes.size()) + 1);
      return "skipped [" + std::to_string(it->second) + "]";
    };
    // The checked ops, then each skip pattern that names none of them (a table with none of an
    // op's cases run still lists it).
    std::vector<std::string> rows = ops_;
    for (const Skip& k : skips_) {
      bool named = false;
      for (const auto& op : ops_) named = named || matches(op, k.pattern);
      if (!named && std::find(rows.begin(), rows.end(), k.pattern) == rows.end()) {
        rows.push_back(k.pattern);
      }
    }
    for (const auto& op : rows) {
      s += "| " + op + " |";
      for (const auto& t : targets) {
        const auto it = cells_.find({op, t});
        std::string text = "-";
        for (const Skip& k : skips_) {
          if (k.target == t && matches(op, k.pattern)) text = note(k.reason);
        }
        if (it == cells_.end() || it->second.cases == 0) {
          // "-" or the skip found above
        } else {
          const Cell& c = it->second;
          text = num(c.worst) + " / " + num(c.bound) + " (" + std::to_string(c.cases) + ")";
          if (c.failed) text = "**FAIL** " + text;
        }
        s += " " + text + " |";
      }
      s += "\n";
    }
    std::vector<std::pair<int, std::string>> ordered;
    for (const auto& [why, n] : notes) ordered.emplace_back(n, why);
    std::sort(ordered.begin(), ordered.end());
    if (!ordered.empty()) s += "\n";
    for (const auto& [n, why] : ordered) s += "[" + std::to_string(n) + "] " + why + "\n";
    if (details) {
      s += "\nBounds (kTolerances in tests/kernels/conformance.h; u = 2^-8, bf16's unit "
           "roundoff):\n\n| bound | f32 | f64 | applies to |\n|---|---|---|---|\n";
      for (const Tolerance& t : kTolerances) {
        s += "| " + std::string(tol_name(t.tol)) + " | " + num(t.f32) + " | " +
             (std::isnan(t.f64) ? std::string("-") : num(t.f64)) + " | " + t.applies_to + " |\n";
      }
      s += "\nWorst case of each op and backend:\n\n| op | backend | worst case (output) |\n"
           "|---|---|---|\n";
      for (const auto& op : ops_) {
        for (const auto& t : targets) {
          const auto it = cells_.find({op, t});
          if (it == cells_.end() || it->second.cases == 0) continue;
          s += "| " + op + " | " + t + " | " + it->second.shape + " |\n";
        }
      }
    }
    return s;
  }

  static constexpr const char* kTargets[] = {"cpu f32", "cpu f64", "cuda f32"};

 private:
  struct Cell {
    int cases = 0;
    double worst = 0.0, bound = 0.0;
    std::string shape;
    bool failed = false;
  };
  struct Skip {
    std::string pattern, target, reason;
  };
  /** Whether `op` holds every space-separated word of `pattern`. */
  static bool matches(const std::string& op, const std::string& pattern) {
    size_t begin = 0;
    while (begin < pattern.size()) {
      size_t end = pattern.find(' ', begin);
      if (end == std::string::npos) end = pattern.size();
      if (end > begin && op.find(pattern.substr(begin, end - begin)) == std::string::npos) {
        return false;
      }
      begin = end + 1;
    }
    return true;
  }
  Cell& cell(const std::string& op, const std::string& target) {
    if (std::find(ops_.begin(), ops_.end(), op) == ops_.end()) ops_.push_back(op);
    return cells_[{op, target}];
  }
  static double ratio(double error, double bound) {
    if (std::isnan(error)) return INFINITY;
    if (bound > 0) return error / bound;
    return error > 0 ? INFINITY : 0.0;
  }
  static std::string num(double x) {
    if (x == 0) return "0";
    if (std::isinf(x)) return "inf";
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1e", x);
    return buf;
  }

  mutable std::mutex mu_;
  std::vector<std::string> ops_;  // in the order first checked
  std::map<std::pair<std::string, std::string>, Cell> cells_;
  std::vector<Skip> skips_;
  std::map<std::string, std::string> target_skips_, descriptions_;
};

// ---- inputs -----------------------------------------------------------------------------------

/** FNV-1a of a name and an index: the seed of one case, stable across platforms and builds. */
inline uint64_t seed_of(std::string_view name, uint64_t index) {
  uint64_t h = 1469598103934665603ull;
  for (char c : name) h = (h ^ uint8_t(c)) * 1099511628211ull;
  return (h ^ index) * 1099511628211ull;
}

/** Reproducible random inputs. Values are never zero: a zero input can make a kernel's untouched
 *  or zeroed output match the reference by accident. */
class Inputs {
 public:
  explicit Inputs(uint64_t seed) : gen_(seed) {}

  /** n values of magnitude in [lo, hi) with random signs, rounded to F. */
  template <typename F>
  std::vector<F> values(size_t n, double lo = 0.1, double hi = 1.0) {
    std::uniform_real_distribution<double> mag(lo, hi);
    std::vector<F> v(n);
    for (F& x : v) x = F((gen_() & 1 ? 1.0 : -1.0) * mag(gen_));
    return v;
  }
  /** An integer in [lo, hi]. */
  int integer(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen_); }
  /** Normal values (mean 0, standard deviation sigma) rounded to F, never zero. */
  template <typename F>
  std::vector<F> normal(size_t n, double sigma) {
    std::normal_distribution<double> d(0.0, sigma);
    std::vector<F> v(n);
    for (F& x : v) {
      do {
        x = F(d(gen_));
      } while (x == F(0));
    }
    return v;
  }

 private:
  std::mt19937_64 gen_;
};

/** An output's poison: a NaN with a payload, so an element the kernel should write and did not
 *  fails every comparison. */
template <typename F>
F poison() {
  if constexpr (sizeof(F) == 8) {
    return std::bit_cast<double>(uint64_t(0x7ff8deaddeaddeadull));
  } else {
    return std::bit_cast<float>(uint32_t(0x7fc0deadu));
  }
}

template <typename T>
Vec wide(const std::vector<T>& v) {
  return Vec(v.begin(), v.end());
}

// ---- f64 references, from the contracts of kernels/kernels.h ----------------------------------

namespace ref {

/** x rounded to the nearest bf16, ties to even; past the largest bf16 to infinity; NaN and
 *  infinities kept. Computed from the value (scaled by the bf16 quantum of x's binade and rounded
 *  by nearbyint, which ties to even in the default rounding mode), not from the bit pattern as the
 *  kernels do. */
inline double round_bf16(double x) {
  if (!std::isfinite(x) || x == 0) return x;
  int e = 0;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  // 8 significant bits: the quantum is 2^(e-8); subnormal bf16 (below 2^-126) step by 2^-133.
  const double q = std::ldexp(1.0, std::max(e - 8, -133));
  const double r = std::nearbyint(x / q) * q;
  return std::abs(r) >= 0x1p128 ? std::copysign(INFINITY, x) : r;
}

/** The bits of a bf16 value (round_bf16's results are exact in f32). */
inline uint16_t bf16_bits(double rounded) {
  if (std::isnan(rounded)) return 0x7fc0;
  return uint16_t(std::bit_cast<uint32_t>(float(rounded)) >> 16);
}

inline Vec rounded_bf16(Vec v) {
  for (double& x : v) x = round_bf16(x);
  return v;
}

inline constexpr double kGeluScale = 0.79788456080286535588;  // sqrt(2/pi)

/** GPT-2's gelu_new: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
inline double gelu(double x) {
  return 0.5 * x * (1.0 + std::tanh(kGeluScale * (x + 0.044715 * x * x * x)));
}
inline double gelu_grad(double x) {
  const double th = std::tanh(kGeluScale * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * kGeluScale * (1.0 + 3.0 * 0.044715 * x * x);
}

/** A (rows, cols) matrix of a flat buffer at `offset` with element strides (b0, b1, row, col). */
struct View {
  const Vec* data;
  std::array<int64_t, 4> strides;
  int64_t offset = 0;
  double at(int64_t i0, int64_t i1, int64_t r, int64_t c) const {
    return (*data)[size_t(offset + i0 * strides[0] + i1 * strides[1] + r * strides[2] +
                          c * strides[3])];
  }
};

/** C = A·B (+ bias) (+ C) over the batch dims, as MatmulArgs describes it. */
inline void matmul(int64_t b0, int64_t b1, int64_t M, int64_t N, int64_t K, const View& a,
                   const View& b, const Vec* bias, Vec& c, const std::array<int64_t, 4>& cs,
                   int64_t c_offset, bool accumulate) {
  for (int64_t i0 = 0; i0 < b0; ++i0)
    for (int64_t i1 = 0; i1 < b1; ++i1)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double acc = bias ? (*bias)[size_t(n)] : 0.0;
          for (int64_t k = 0; k < K; ++k) acc += a.at(i0, i1, m, k) * b.at(i0, i1, k, n);
          double& out = c[size_t(c_offset + i0 * cs[0] + i1 * cs[1] + m * cs[2] + n * cs[3])];
          out = accumulate ? out + acc : acc;
        }
}

/** out (N,C), mean, rstd (N): biased variance, eps kLayerNormEps. */
inline void layernorm_forward(Vec& out, Vec& mean, Vec& rstd, const Vec& x, const Vec& w,
                              const Vec& b, int64_t N, int C) {
  for (int64_t i = 0; i < N; ++i) {
    const double* row = x.data() + i * C;
    double m = 0.0, v = 0.0;
    for (int c = 0; c < C; ++c) m += row[c];
    m /= C;
    for (int c = 0; c < C; ++c) v += (row[c] - m) * (row[c] - m);
    v /= C;
    const double r = 1.0 / std::sqrt(v + kLayerNormEps);
    for (int c = 0; c < C; ++c)
      out[size_t(i * C + c)] = (row[c] - m) * r * w[size_t(c)] + b[size_t(c)];
    mean[size_t(i)] = m;
    rstd[size_t(i)] = r;
  }
}

/** dx (N,C), dw, db (C) accumulate the gradient of LayerNorm for dy, from x itself. */
inline void layernorm_backward(Vec& dx, Vec& dw, Vec& db, const Vec& dy, const Vec& x, const Vec& w,
                               int64_t N, int C) {
  Vec out(x.size()), mean(static_cast<size_t>(N)), rstd(static_cast<size_t>(N));
  layernorm_forward(out, mean, rstd, x, w, Vec(size_t(C), 0.0), N, C);
  for (int64_t i = 0; i < N; ++i) {
    const double r = rstd[size_t(i)];
    double g_mean = 0.0, gn_mean = 0.0;  // mean of dnorm and of dnorm * norm over the row
    for (int c = 0; c < C; ++c) {
      const size_t j = size_t(i * C + c);
      const double norm = (x[j] - mean[size_t(i)]) * r, g = w[size_t(c)] * dy[j];
      g_mean += g / C;
      gn_mean += g * norm / C;
    }
    for (int c = 0; c < C; ++c) {
      const size_t j = size_t(i * C + c);
      const double norm = (x[j] - mean[size_t(i)]) * r, g = w[size_t(c)] * dy[j];
      dx[j] += r * (g - g_mean - norm * gn_mean);
      dw[size_t(c)] += norm * dy[j];
      db[size_t(c)] += dy[j];
    }
  }
}

/** out (N,C) = x · rstd · w with rstd (N) = 1/sqrt(mean(x²) + eps). */
inline void rmsnorm_forward(Vec& out, Vec& rstd, const Vec& x, const Vec& w, int64_t N, int C,
                            double eps) {
  for (int64_t i = 0; i < N; ++i) {
    const double* row = x.data() + i * C;
    double ms = 0.0;
    for (int c = 0; c < C; ++c) ms += row[c] * row[c];
    const double r = 1.0 / std::sqrt(ms / C + eps);
    for (int c = 0; c < C; ++c) out[size_t(i * C + c)] = row[c] * r * w[size_t(c)];
    rstd[size_t(i)] = r;
  }
}

/** dx (N,C), dw (C) accumulate the gradient of RMSNorm for dy, from x itself: with n = x · rstd,
 *  dx = rstd · (w·dy - n · mean(w·dy·n)), dw = Σ_rows n · dy. */
inline void rmsnorm_backward(Vec& dx, Vec& dw, const Vec& dy, const Vec& x, const Vec& w, int64_t N,
                             int C, double eps) {
  Vec out(x.size()), rstd(static_cast<size_t>(N));
  rmsnorm_forward(out, rstd, x, w, N, C, eps);
  for (int64_t i = 0; i < N; ++i) {
    const double r = rstd[size_t(i)];
    double gn_mean = 0.0;
    for (int c = 0; c < C; ++c) {
      const size_t j = size_t(i * C + c);
      gn_mean += w[size_t(c)] * dy[j] * x[j] * r / C;
    }
    for (int c = 0; c < C; ++c) {
      const size_t j = size_t(i * C + c);
      const double n = x[j] * r;
      dx[j] += r * (w[size_t(c)] * dy[j] - n * gn_mean);
      dw[size_t(c)] += n * dy[j];
    }
  }
}

/** qkv (B,T,W) with the q and k heads rotated (Hugging Face's rotate_half): the pair (i, i + hs/2)
 *  of a head at position pos0 + t by (pos0 + t) · theta^(-2i/hs), or by minus that (`inverse`). */
inline Vec rope(const Vec& qkv, const AttentionShape& s, int pos0, double theta, bool inverse) {
  const int hs = s.head_size(), half = hs / 2;
  const int64_t W = s.width();
  Vec y = qkv;
  for (int64_t r = 0; r < int64_t(s.B) * s.T; ++r) {
    const double pos = double(pos0 + int(r % s.T));
    for (int h = 0; h < s.NH + s.kv_heads(); ++h)
      for (int i = 0; i < half; ++i) {
        const double angle = (inverse ? -pos : pos) * std::pow(theta, -2.0 * i / hs);
        const size_t a = size_t(r * W + h * hs + i), b = a + size_t(half);
        y[a] = qkv[a] * std::cos(angle) - qkv[b] * std::sin(angle);
        y[b] = qkv[b] * std::cos(angle) + qkv[a] * std::sin(angle);
      }
  }
  return y;
}

/** silu(x) = x · sigmoid(x) and its derivative. */
inline double silu(double x) { return x / (1.0 + std::exp(-x)); }
inline double silu_grad(double x) {
  const double s = 1.0 / (1.0 + std::exp(-x));
  return s * (1.0 + x * (1.0 - s));
}

/** Where element (b, t, part, head, d) of attention's qkv (B,T,W) lives: part 0 is q's head h,
 *  parts 1 and 2 the key and value head that query head h reads, h / (NH/KVH) (KVH = 0: NH). */
struct QkvIndex {
  int T, C, NH, KVH, hs;
  size_t operator()(int b, int t, int part, int h, int d) const {
    const int64_t kv = int64_t(KVH) * hs, W = C + 2 * kv;
    const int64_t col = part == 0 ? int64_t(h) * hs : C + (part - 1) * kv + (h / (NH / KVH)) * hs;
    return size_t((int64_t(b) * T + t) * W + col + d);
  }
};

/** Causal attention over qkv (B,T,W) = [q | k | v], q heads (NH, hs), k and v heads (KVH, hs),
 *  query head h reading key/value head h / (NH/KVH) (KVH = 0: NH): out (B,T,C), probabilities p
 *  (B,NH,T,T) (zero above the diagonal). */
inline void attention_forward(Vec& out, Vec& p, const Vec& qkv, int B, int T, int C, int NH,
                              int KVH = 0) {
  const int hs = C / NH;
  const QkvIndex idx{T, C, NH, KVH > 0 ? KVH : NH, hs};
  const double scale = 1.0 / std::sqrt(double(hs));
  auto at = [&](int b, int t, int part, int h, int d) { return qkv[idx(b, t, part, h, d)]; };
  p.assign(size_t(B) * NH * T * T, 0.0);
  out.assign(size_t(B) * T * C, 0.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < T; ++t) {
        double* row = p.data() + ((int64_t(b) * NH + h) * T + t) * T;
        double mx = -INFINITY;
        for (int j = 0; j <= t; ++j) {
          double s = 0.0;
          for (int d = 0; d < hs; ++d) s += at(b, t, 0, h, d) * at(b, j, 1, h, d);
          row[j] = s * scale;
          mx = std::max(mx, row[j]);
        }
        double sum = 0.0;
        for (int j = 0; j <= t; ++j) sum += (row[j] = std::exp(row[j] - mx));
        for (int j = 0; j <= t; ++j) row[j] /= sum;
        for (int d = 0; d < hs; ++d) {
          double acc = 0.0;
          for (int j = 0; j <= t; ++j) acc += row[j] * at(b, j, 2, h, d);
          out[size_t((int64_t(b) * T + t) * C + h * hs + d)] = acc;
        }
      }
}

/** dqkv (B,T,W) of attention for dout (B,T,C), given forward's probabilities p: the gradients of
 *  a key/value head sum over the query heads that read it. */
inline Vec attention_backward(const Vec& dout, const Vec& qkv, const Vec& p, int B, int T, int C,
                              int NH, int KVH = 0) {
  const int hs = C / NH;
  const QkvIndex idx{T, C, NH, KVH > 0 ? KVH : NH, hs};
  const double scale = 1.0 / std::sqrt(double(hs));
  Vec dqkv(qkv.size(), 0.0);
  Vec dp(static_cast<size_t>(T));
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < T; ++t) {
        const double* row = p.data() + ((int64_t(b) * NH + h) * T + t) * T;
        const double* dy = dout.data() + (int64_t(b) * T + t) * C + h * hs;
        double dot = 0.0;
        for (int j = 0; j <= t; ++j) {
          double g = 0.0;
          for (int d = 0; d < hs; ++d) {
            g += dy[d] * qkv[idx(b, j, 2, h, d)];
            dqkv[idx(b, j, 2, h, d)] += row[j] * dy[d];  // dv
          }
          dp[size_t(j)] = g;
          dot += row[j] * g;
        }
        for (int j = 0; j <= t; ++j) {
          const double ds = row[j] * (dp[size_t(j)] - dot) * scale;  // through the softmax
          for (int d = 0; d < hs; ++d) {
            dqkv[idx(b, t, 0, h, d)] += ds * qkv[idx(b, j, 1, h, d)];
            dqkv[idx(b, j, 1, h, d)] += ds * qkv[idx(b, t, 0, h, d)];
          }
        }
      }
  return dqkv;
}

/** Loss of each row (N) over the first V of Vp columns; with dlogits, its gradient (N,Vp):
 *  dloss * (softmax - onehot) on the real columns, 0 on the padding. Returns the sum. */
inline double softmax_xent(Vec& losses, Vec* dlogits, const Vec& logits,
                           const std::vector<int32_t>& targets, int64_t N, int V, int Vp,
                           double dloss) {
  double total = 0.0;
  for (int64_t i = 0; i < N; ++i) {
    const double* x = logits.data() + i * Vp;
    double mx = -INFINITY, sum = 0.0;
    for (int v = 0; v < V; ++v) mx = std::max(mx, x[v]);
    for (int v = 0; v < V; ++v) sum += std::exp(x[v] - mx);
    const double lse = mx + std::log(sum);
    const int y = targets[size_t(i)];
    losses[size_t(i)] = lse - x[y];
    total += losses[size_t(i)];
    if (!dlogits) continue;
    for (int v = 0; v < Vp; ++v) {
      (*dlogits)[size_t(i * Vp + v)] =
          v < V ? dloss * (std::exp(x[v] - lse) - (v == y ? 1.0 : 0.0)) : 0.0;
    }
  }
  return total;
}

/** torch.optim.AdamW on every segment, in double from the step's (float) hyperparameters. */
inline void adamw(Vec& p, const Vec& g, Vec& m, Vec& v, const std::vector<OwnedSegment>& segments,
                  const AdamWStep& s) {
  const double b1 = s.beta1, b2 = s.beta2, lr = s.lr;
  const double bc1 = 1.0 - std::pow(b1, double(s.t)), bc2 = 1.0 - std::pow(b2, double(s.t));
  for (const OwnedSegment& seg : segments) {
    for (size_t i = 0; i < seg.count; ++i) {
      double& pi = p[seg.param_pos + i];
      double& mi = m[seg.state_pos + i];
      double& vi = v[seg.state_pos + i];
      const double gi = g[seg.grad_pos + i] * double(s.grad_scale);
      if (seg.decay) pi *= 1.0 - lr * double(s.weight_decay);
      mi = b1 * mi + (1.0 - b1) * gi;
      vi = b2 * vi + (1.0 - b2) * gi * gi;
      pi -= lr * (mi / bc1) / (std::sqrt(vi / bc2) + double(s.eps));
    }
  }
}

}  // namespace ref
}  // namespace tetra::conformance
