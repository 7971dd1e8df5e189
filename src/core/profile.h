// The per-kernel profile of training steps (run.profile = true). Kernels open a ProfileScope at
// entry; while a Profile is active each scope adds its exclusive time (its own, less that of the
// scopes opened inside it) to an entry named by kind and label, so that the entries of a step sum
// to the time spent in kernels and nothing is counted twice. Matmul scopes carry their shape and
// FLOPs, giving a rate per product. The trainer adds what no kernel sees (data wait, exposed
// communication) and closes each step with its wall time; the rest of the step is "other".
//
// When no profile is active (the default) a scope costs one relaxed atomic load and a branch.
// The active profile is one per process (kernels are called from the training thread only; their
// OpenMP workers open no scopes).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tetra {

enum class ProfKind : uint8_t {
  matmul,
  attention,
  layernorm,
  gelu,
  bias_grad,
  softmax_loss,
  embedding,
  residual,   // residual adds outside a matmul (sequence-parallel row-parallel outputs)
  bf16_cast,  // mixed precision: f32 operands rounded to bf16 for a product
  moe,        // routing and moving token rows between tokens and experts
  adamw,
  grad_norm,
  data_wait,
  comm,
  other,
};
constexpr size_t kProfKinds = size_t(ProfKind::other) + 1;
const char* prof_kind_name(ProfKind kind);

class Profile {
 public:
  /** `clock` returns seconds; tests substitute a fake one. */
  explicit Profile(std::function<double()> clock = {});

  /** The profile scopes record into, or null when profiling is off. */
  static Profile* active();

  /** Adds `ms` (and `flops`, for a rate) to the entry (kind, label) of the current step. */
  void add(ProfKind kind, const std::string& label, double ms, double flops = 0.0);
  /** Closes step `step` (1-based) of wall time `step_ms`; the time no entry took is "other".
   *  Steps before `first_counted` (warm-up: oneDNN builds its primitives and the matmul libraries
   *  are measured in a run's first step) are kept in the per-step record but left out of the
   *  totals. */
  void end_step(int64_t step, double step_ms, int64_t first_counted);

  /** Text table: time per kind and per entry (calls, ms per step, GFLOP/s, share). */
  std::string table() const;
  /** {"steps_counted", "first_step", "step_ms", "kinds": {kind: {"ms_per_step", "share"}},
   *   "entries": [{"kind", "label", "calls_per_step", "ms_per_step", "gflops", "share"}],
   *   "per_step": [{"step", "step_ms", kind: ms...}]} */
  nlohmann::json to_json() const;

  double now() const { return clock_(); }

 private:
  friend class ProfileScope;
  struct Entry {
    double ms = 0.0, flops = 0.0;
    int64_t calls = 0;
  };
  using Key = std::pair<ProfKind, std::string>;

  std::function<double()> clock_;
  std::map<Key, Entry> step_, total_;  // the current step; the counted steps
  std::vector<std::pair<int64_t, std::array<double, kProfKinds + 1>>> per_step_;  // + step ms
  int64_t counted_ = 0, first_counted_ = 0;
  double counted_ms_ = 0.0;
  double child_ms_ = 0.0;  // time of the scopes closed inside the innermost open scope
};

/** Makes `p` (possibly null) the active profile for this object's lifetime. */
class ProfileActivation {
 public:
  explicit ProfileActivation(Profile* p);
  ~ProfileActivation();
  ProfileActivation(const ProfileActivation&) = delete;
  ProfileActivation& operator=(const ProfileActivation&) = delete;

 private:
  Profile* previous_;
};

/** Times the enclosing block into the active profile, if any. */
class ProfileScope {
 public:
  ProfileScope(ProfKind kind, const char* label) : p_(Profile::active()) {
    if (p_) [[unlikely]]
      open(kind, label);
  }
  /** A matrix product (M, K) x (K, N), b of them, named "<label> MxKxN" (+ " [b=<b>]" if b > 1). */
  ProfileScope(const char* label, int64_t b, int64_t M, int64_t K, int64_t N)
      : p_(Profile::active()) {
    if (p_) [[unlikely]]
      open_matmul(label, b, M, K, N);
  }
  /** A group of `n` matrix products of `flops` in all run together (a mixture of experts'
   *  experts), named "<label> [group of <n>]". */
  ProfileScope(const char* label, int64_t n, double flops) : p_(Profile::active()) {
    if (p_) [[unlikely]]
      open_group(label, n, flops);
  }
  ~ProfileScope() {
    if (p_) [[unlikely]]
      close();
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  void open(ProfKind kind, const char* label);
  void open_matmul(const char* label, int64_t b, int64_t M, int64_t K, int64_t N);
  void open_group(const char* label, int64_t n, double flops);
  void close();

  Profile* p_;
  ProfKind kind_ = ProfKind::other;
  std::string label_;
  double start_ = 0.0, outer_child_ms_ = 0.0, flops_ = 0.0;
};

}  // namespace tetra
