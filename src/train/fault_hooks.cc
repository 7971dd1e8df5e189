#include "train/fault_hooks.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/log.h"

namespace tetra {

FaultInjection::FaultInjection(const FaultOptions& faults, int zero_stage, int grad_accum, int rank,
                               UnitHooks& inner, ParamStore& store)
    : faults_(faults),
      zero_stage_(zero_stage),
      rank_(rank),
      inner_(inner),
      store_(store),
      calls_(zero_stage, grad_accum, store.units().size()) {}

namespace {

// x (n elements, device memory) *= s, through the host: a fault injection, not a kernel.
void scale(Device& device, float* x, size_t n, float s) {
  std::vector<float> h(n);
  device.to_host(h.data(), x, n * sizeof(float));
  for (float& v : h) v *= s;
  device.from_host(x, h.data(), n * sizeof(float));
}

}  // namespace

void FaultInjection::begin_step(int64_t step) {
  nan_ = step == faults_.nan_grad_step && rank_ == faults_.nan_grad_rank;
  fail_ = step == faults_.fail_step && rank_ == faults_.fail_rank;
  corrupt_ =
      step == faults_.corrupt_step && rank_ == faults_.fault_rank && faults_.corrupt_grad != 0.0;
  calls_.begin_step();
  // A straggler: this rank computes slower than its peers by a fixed delay every step.
  if (faults_.slow_ms > 0 && rank_ == faults_.fault_rank) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(faults_.slow_ms));
  }
}

void FaultInjection::after_backward(int unit) {
  // The first unit backward finishes; its first tensor is the first gradient produced.
  const TensorId first = store_.units()[size_t(unit)].first;
  if (nan_ && unit == 0) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    store_.device().from_host(store_.grad(first), &nan, sizeof nan);
    nan_ = false;
  }
  const ParamUnit& u = store_.units()[size_t(unit)];
  if (calls_.reduces(unit) && corrupt_ && zero_stage_ > 0 && u.group == ShardGroup::dense) {
    // This rank's contribution, as the reduction is about to receive it.
    float* g = store_.grad(u.first) - (store_.tensor(u.first).offset - u.offset);
    scale(store_.device(), g, u.size, float(1.0 + faults_.corrupt_grad));
  }
  inner_.after_backward(unit);
  if (fail_ && unit == 0) {
    fail_ = false;
    fail("[train] debug.fail_step: failing in the middle of backward, after '{}' was reduced",
         store_.units()[size_t(unit)].name);
  }
}

void FaultInjection::after_reduction() {
  if (!corrupt_ || zero_stage_ > 0) return;
  log_warn("[train] debug.corrupt_grad: rank {} scales its copy of the reduced gradient by {}",
           rank_, 1.0 + faults_.corrupt_grad);
  scale(store_.device(), store_.grads().data(), store_.grads().size(),
        float(1.0 + faults_.corrupt_grad));
}

void FaultInjection::in_evaluation() const {
  if (faults_.slow_eval_ms > 0 && rank_ == faults_.fault_rank) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(faults_.slow_eval_ms));
  }
}

void FaultInjection::end_step(int64_t step) {
  if (rank_ != faults_.fault_rank) return;
  if (step == faults_.kill_step) {
    log_warn("[train] debug.kill_step={}: rank {} dies by SIGKILL", step, rank_);
    ::raise(SIGKILL);
  }
  if (step == faults_.hang_step) {
    log_warn("[train] debug.hang_step={}: rank {} stops making progress", step, rank_);
    for (;;) ::pause();
  }
}

Heartbeat::Heartbeat(int rank) {
  const char* dir = std::getenv("TETRA_HEARTBEAT_DIR");
  if (!dir || !*dir) return;
  dir_ = dir;
  const std::string path = fmt::format("{}/rank-{}", dir, rank);
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TETRA_CHECK(fd_ >= 0, "[train] TETRA_HEARTBEAT_DIR: cannot create {} ({})", path,
              std::strerror(errno));
}

Heartbeat::~Heartbeat() {
  if (fd_ >= 0) ::close(fd_);
}

void Heartbeat::beat(int64_t step, int64_t newest_checkpoint, BeatPhase phase,
                     double median_step_s) {
  if (fd_ < 0) return;
  // Fixed width, so each beat overwrites the last in place.
  const std::string beat = fmt::format("{:>20} {:>20} {} {:>16.6f}\n", step, newest_checkpoint,
                                       int(phase), std::min(median_step_s, 1e9));
  (void)!::pwrite(fd_, beat.data(), beat.size(), 0);
}

std::optional<std::string> Heartbeat::stop_requested() const {
  if (dir_.empty()) return std::nullopt;
  std::ifstream in(dir_ + "/" + kStopFile);
  if (!in) return std::nullopt;
  std::string why;
  std::getline(in, why);
  return why;
}

}  // namespace tetra
