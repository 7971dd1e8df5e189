#include "core/profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>

#include "core/timer.h"

namespace tetra {

namespace {

std::atomic<Profile*>& active_profile() {
  static std::atomic<Profile*> p{nullptr};
  return p;
}

}  // namespace

const char* prof_kind_name(ProfKind kind) {
  static constexpr const char* names[kProfKinds] = {
      "matmul",       "attention", "layernorm", "gelu",      "bias_grad",
      "softmax_loss", "embedding", "residual",  "bf16_cast", "moe",
      "adamw",        "grad_norm", "data_wait", "comm",      "other"};
  return names[size_t(kind)];
}

Profile::Profile(std::function<double()> clock) : clock_(clock ? std::move(clock) : now_s) {}

Profile* Profile::active() { return active_profile().load(std::memory_order_relaxed); }

void Profile::add(ProfKind kind, const std::string& label, double ms, double flops) {
  Entry& e = step_[{kind, label}];
  e.ms += ms;
  e.flops += flops;
  ++e.calls;
}

void Profile::end_step(int64_t step, double step_ms, int64_t first_counted) {
  std::array<double, kProfKinds + 1> kinds{};
  double covered = 0.0;
  for (const auto& [key, e] : step_) {
    kinds[size_t(key.first)] += e.ms;
    covered += e.ms;
  }
  const double other = std::max(0.0, step_ms - covered);
  if (other > 0.0) add(ProfKind::other, "outside the profiled kernels", other);
  kinds[size_t(ProfKind::other)] += other;
  kinds[kProfKinds] = step_ms;
  per_step_.emplace_back(step, kinds);
  if (step >= first_counted) {
    if (counted_ == 0) first_counted_ = step;
    ++counted_;
    counted_ms_ += step_ms;
    for (const auto& [key, e] : step_) {
      Entry& t = total_[key];
      t.ms += e.ms;
      t.flops += e.flops;
      t.calls += e.calls;
    }
  }
  step_.clear();
}

std::string Profile::table() const {
  if (counted_ == 0) return "[profile] no step was profiled";
  const double n = double(counted_), step_ms = counted_ms_ / n;
  std::array<double, kProfKinds> kinds{};
  for (const auto& [key, e] : total_) kinds[size_t(key.first)] += e.ms / n;
  std::string out = fmt::format(
      "[profile] steps {}..{} ({} counted{}): {:.2f} ms per step\n"
      "[profile] {:<14} {:>10} {:>7}\n",
      first_counted_, first_counted_ + counted_ - 1, counted_,
      per_step_.size() > size_t(counted_) ? "; the warm-up before them is left out" : "", step_ms,
      "kind", "ms/step", "share");
  for (size_t k = 0; k < kProfKinds; ++k) {
    if (kinds[k] == 0.0) continue;
    out += fmt::format("[profile]   {:<12} {:>10.3f} {:>6.1f}%\n", prof_kind_name(ProfKind(k)),
                       kinds[k], 100.0 * kinds[k] / step_ms);
  }
  // Entries by time, largest first.
  std::vector<std::pair<const Key*, const Entry*>> rows;
  for (const auto& [key, e] : total_) rows.emplace_back(&key, &e);
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second->ms > b.second->ms; });
  out += fmt::format("[profile] {:<12} {:<44} {:>9} {:>10} {:>8} {:>7}\n", "kind", "entry", "calls",
                     "ms/step", "GFLOP/s", "share");
  for (const auto& [key, e] : rows) {
    const std::string rate = e->flops > 0.0 ? fmt::format("{:.1f}", e->flops / e->ms * 1e-6) : "";
    out += fmt::format("[profile]   {:<10} {:<44} {:>9.4g} {:>10.3f} {:>8} {:>6.1f}%\n",
                       prof_kind_name(key->first), key->second, double(e->calls) / n, e->ms / n,
                       rate, 100.0 * e->ms / counted_ms_);
  }
  out.pop_back();
  return out;
}

nlohmann::json Profile::to_json() const {
  nlohmann::json j;
  const double n = std::max<double>(1.0, double(counted_));
  j["steps_counted"] = counted_;
  j["first_step"] = first_counted_;
  j["step_ms"] = counted_ms_ / n;
  std::array<double, kProfKinds> kinds{};
  for (const auto& [key, e] : total_) kinds[size_t(key.first)] += e.ms / n;
  j["kinds"] = nlohmann::json::object();
  for (size_t k = 0; k < kProfKinds; ++k) {
    j["kinds"][prof_kind_name(ProfKind(k))] = {
        {"ms_per_step", kinds[k]}, {"share", counted_ms_ > 0.0 ? kinds[k] * n / counted_ms_ : 0.0}};
  }
  j["entries"] = nlohmann::json::array();
  for (const auto& [key, e] : total_) {
    nlohmann::json row = {{"kind", prof_kind_name(key.first)},
                          {"label", key.second},
                          {"calls_per_step", double(e.calls) / n},
                          {"ms_per_step", e.ms / n},
                          {"flops_per_step", e.flops / n},
                          {"share", counted_ms_ > 0.0 ? e.ms / counted_ms_ : 0.0}};
    if (e.flops > 0.0 && e.ms > 0.0) row["gflops"] = e.flops / e.ms * 1e-6;
    j["entries"].push_back(std::move(row));
  }
  j["per_step"] = nlohmann::json::array();
  for (const auto& [step, ms] : per_step_) {
    nlohmann::json row = {{"step", step}, {"step_ms", ms[kProfKinds]}};
    for (size_t k = 0; k < kProfKinds; ++k) row[prof_kind_name(ProfKind(k))] = ms[k];
    j["per_step"].push_back(std::move(row));
  }
  return j;
}

ProfileActivation::ProfileActivation(Profile* p) : previous_(active_profile().exchange(p)) {}

ProfileActivation::~ProfileActivation() { active_profile().store(previous_); }

void ProfileScope::open(ProfKind kind, const char* label) {
  kind_ = kind;
  label_ = label;
  outer_child_ms_ = std::exchange(p_->child_ms_, 0.0);
  start_ = p_->now();
}

void ProfileScope::open_matmul(const char* label, int64_t b, int64_t M, int64_t K, int64_t N) {
  flops_ = 2.0 * double(b) * double(M) * double(K) * double(N);
  open(ProfKind::matmul, label);
  label_ += fmt::format(" {}x{}x{}", M, K, N);
  if (b > 1) label_ += fmt::format(" [b={}]", b);
}

void ProfileScope::open_group(const char* label, int64_t n, double flops) {
  flops_ = flops;
  open(ProfKind::matmul, label);
  label_ += fmt::format(" [group of {}]", n);
}

void ProfileScope::close() {
  const double ms = (p_->now() - start_) * 1e3;
  p_->add(kind_, label_, std::max(0.0, ms - p_->child_ms_), flops_);
  p_->child_ms_ = outer_child_ms_ + ms;
}

}  // namespace tetra
