#include "core/paths.h"

#include <algorithm>
#include <system_error>

namespace tetra {

namespace fs = std::filesystem;

fs::path resolved_path(const fs::path& p) {
  std::error_code ec;
  fs::path c = fs::weakly_canonical(fs::absolute(p), ec);
  if (ec) c = fs::absolute(p).lexically_normal();
  if (c.has_relative_path() && c.filename().empty()) c = c.parent_path();
  return c;
}

bool is_within(const fs::path& inner, const fs::path& outer) {
  const fs::path a = resolved_path(inner), b = resolved_path(outer);
  return std::mismatch(b.begin(), b.end(), a.begin(), a.end()).first == b.end();
}

}  // namespace tetra
