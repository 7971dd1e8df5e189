#include "plan/bubble.h"

#include <algorithm>

namespace tetra::plan {

namespace {
// The divisor of the idle time: interleaving's v chunks, zero bubble's three passes of which
// one (W) fills the idle time.
int64_t chunks(Schedule s, int64_t v) {
  if (s == Schedule::zb_h1) return 3;
  if (s == Schedule::zb_v) return 6;  // two chunks of three passes; the start-up's idle only
  return s == Schedule::interleaved ? std::max<int64_t>(v, 1) : 1;
}
}  // namespace

double bubble_fraction(Schedule s, int64_t p, int64_t m, int64_t v) {
  const double idle = double(p - 1);
  return idle / (double(chunks(s, v) * m) + idle);
}

double bubble_ratio(Schedule s, int64_t p, int64_t m, int64_t v) {
  return double(p - 1) / double(chunks(s, v) * m);
}

double inflight_microbatches(Schedule s, int64_t p, int64_t m, int64_t v) {
  if (s == Schedule::gpipe) return double(m);
  const double warm = double(std::min(m, p));
  if (s == Schedule::one_f_one_b || s == Schedule::zb_h1 || s == Schedule::zb_v) return warm;
  return warm * (1.0 + double(p - 1) / double(p * chunks(s, v)));
}

}  // namespace tetra::plan
