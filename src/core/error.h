// Errors that carry context. Every message starts with a [module] prefix and says what to change.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace tetra {

/** The one exception type of tetra; what() is a complete, user-facing message. */
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace tetra

// TETRA_CHECK(cond, "[module] what happened; what to do {}", args...) throws tetra::Error.
#define TETRA_CHECK(cond, ...)    \
  do {                            \
    if (!(cond)) {                \
      ::tetra::fail(__VA_ARGS__); \
    }                             \
  } while (0)
