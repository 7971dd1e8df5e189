// Reading a small file whole (a manifest, a tokenizer.json) with a bound on its size, so that a
// wrong path never makes tetra allocate what a huge or special file claims.
#pragma once

#include <cstdint>
#include <string>

namespace tetra {

/** The bytes of the regular file `path`, refused when missing, not a regular file or larger than
 *  `max_bytes`. Errors read "[module] path: what happened; hint"; `kind` names what the file
 *  should be ("a manifest"). */
std::string read_small_file(const std::string& path, uintmax_t max_bytes, const std::string& module,
                            const std::string& kind, const std::string& hint);

}  // namespace tetra
