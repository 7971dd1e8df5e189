// Publishing a file so that a crash leaves either the old file or the new one, never a torn one:
// write beside the target, fsync, rename over it, fsync the directory.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace tetra {

/** Writes the concatenation of `parts` to `path` atomically. Errors name the path and `module`
 * ("[module] path: ...") and say what to check; the temporary file is removed on failure. */
void write_file_atomically(const std::string& path,
                           const std::vector<std::span<const uint8_t>>& parts,
                           const std::string& module);

}  // namespace tetra
