// Comparing paths the user gives with the files a command reads and writes: made absolute, with
// the symlinks of the part that exists resolved, so `out/../in`, `./in/` and a link to `in` are
// all `in`.
#pragma once

#include <filesystem>

namespace tetra {

/** `p` absolute, symlinks of its existing part resolved, `..` removed, no trailing separator. */
std::filesystem::path resolved_path(const std::filesystem::path& p);

/** True when `inner` is `outer` or lies under it (both resolved first). */
bool is_within(const std::filesystem::path& inner, const std::filesystem::path& outer);

}  // namespace tetra
