// Helpers shared by the test suites.
#pragma once

#include <functional>
#include <string>

#include "core/error.h"

namespace tetra::testing {

/** The message of the tetra::Error that f throws, or "<no error>" when it returns normally. */
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace tetra::testing
