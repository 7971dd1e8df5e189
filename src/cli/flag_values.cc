#include "cli/flag_values.h"

#include <stdexcept>

#include "core/error.h"

namespace tetra::cli {

int64_t flag_int(const std::string& module, const std::string& flag, const std::string& value,
                 int64_t min_value) {
  try {
    size_t used = 0;
    const long long n = std::stoll(value, &used);
    if (used == value.size() && n >= min_value) return n;
  } catch (const std::exception&) {
  }
  if (min_value == 0) fail("[{}] {} {}: expected a non-negative integer", module, flag, value);
  fail("[{}] {} {}: expected an integer", module, flag, value);
}

double flag_double(const std::string& module, const std::string& flag, const std::string& value,
                   const std::string& example) {
  try {
    size_t used = 0;
    const double d = std::stod(value, &used);
    if (used == value.size()) return d;
  } catch (const std::exception&) {
  }
  fail("[{}] {} {}: expected a number, e.g. {}", module, flag, value, example);
}

}  // namespace tetra::cli
