#include "core/read_file.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace tetra {

std::string read_small_file(const std::string& path, uintmax_t max_bytes, const std::string& module,
                            const std::string& kind, const std::string& hint) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  TETRA_CHECK(fs::exists(st), "[{}] {}: cannot open it (no such file); {}", module, path, hint);
  TETRA_CHECK(fs::is_regular_file(st), "[{}] {}: not a regular file; {}", module, path, hint);
  const uintmax_t size = fs::file_size(path, ec);
  TETRA_CHECK(!ec && size <= max_bytes, "[{}] {}: {} bytes, more than the {} MB {} may have; {}",
              module, path, size, max_bytes >> 20, kind, hint);
  std::ifstream in(path, std::ios::binary);
  TETRA_CHECK(in, "[{}] {}: cannot open it; check its permissions", module, path);
  std::stringstream buf;
  buf << in.rdbuf();
  TETRA_CHECK(!in.bad(), "[{}] {}: reading it failed", module, path);
  return buf.str();
}

}  // namespace tetra
