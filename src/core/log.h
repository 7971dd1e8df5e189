// Minimal leveled logging to stderr; rank-aware so multi-rank runs print once unless asked.
#pragma once

#include <fmt/format.h>

#include <cstdio>

namespace tetra {

enum class LogLevel { debug, info, warn, error };

struct LogState {
  LogLevel level = LogLevel::info;
  int rank = 0;
  bool all_ranks = false;
};
LogState& log_state();

template <typename... Args>
void log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  const LogState& st = log_state();
  if (level < st.level) return;
  if (st.rank != 0 && !st.all_ranks && level < LogLevel::warn) return;
  std::string line = fmt::format(format, std::forward<Args>(args)...);
  std::fprintf(stderr, "%s\n", line.c_str());
}

template <typename... Args>
void log_info(fmt::format_string<Args...> f, Args&&... a) {
  log(LogLevel::info, f, std::forward<Args>(a)...);
}
template <typename... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... a) {
  log(LogLevel::warn, f, std::forward<Args>(a)...);
}

}  // namespace tetra
