#include "plan/units.h"

#include <fmt/format.h>

#include <cmath>

namespace tetra::plan {

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  int u = 0;
  while (std::fabs(bytes) >= 1000.0 && u < 5) bytes /= 1000.0, ++u;
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.3g} {}", bytes, units[u]);
}

std::string human_seconds(double s) {
  if (s < 1e-3) return fmt::format("{:.1f} us", s * 1e6);
  if (s < 1.0) return fmt::format("{:.1f} ms", s * 1e3);
  if (s < 120.0) return fmt::format("{:.2f} s", s);
  if (s < 2 * 3600.0) return fmt::format("{:.1f} min", s / 60);
  if (s < 3 * 86400.0) return fmt::format("{:.1f} h", s / 3600);
  if (s < 3 * 365.25 * 86400) return fmt::format("{:.1f} days", s / 86400);
  return fmt::format("{:.1f} years", s / (365.25 * 86400));
}

}  // namespace tetra::plan
