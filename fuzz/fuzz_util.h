// Shared by the fuzz targets: expected refusals (tetra::Error) are the parser working; anything
// else that escapes (another exception type, a sanitizer report, a broken property) is a crash.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "core/log.h"

namespace tetra::fuzz {

/** Quiet logging: warnings about odd but valid inputs would flood the fuzzer's output. */
inline void quiet_logs() { log_state().level = LogLevel::error; }

/** Aborts (a crash for libFuzzer) when a property of a successfully parsed input fails. */
inline void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "[fuzz] property failed: %s\n", what);
    std::abort();
  }
}

}  // namespace tetra::fuzz
