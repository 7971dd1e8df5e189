// Wall-clock timing helpers.
#pragma once

#include <chrono>

namespace tetra {

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Stopwatch {
 public:
  Stopwatch() : start_(now_s()) {}
  double elapsed_s() const { return now_s() - start_; }
  double elapsed_ms() const { return 1e3 * elapsed_s(); }
  void reset() { start_ = now_s(); }

 private:
  double start_;
};

}  // namespace tetra
