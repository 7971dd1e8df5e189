// Helpers shared by the test suites.
#pragma once

#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
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

/** Sets (or, with nullptr, unsets) an environment variable for one scope; restores it after. */
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      old_ = old;
      had_ = true;
    }
    set(value);
  }
  ~ScopedEnv() { set(had_ ? old_.c_str() : nullptr); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  void set(const char* value) {
    if (value) {
      setenv(name_.c_str(), value, 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  std::string name_, old_;
  bool had_ = false;
};

struct Ran {
  int code = -1;       // exit status; -1 when it did not exit normally
  std::string output;  // stdout and (unless asked otherwise) stderr
  double seconds = 0;  // wall time
};

/** Runs `command` through the shell, capturing both output streams (or stdout alone). */
inline Ran run_command(const std::string& command, bool with_stderr = true) {
  Ran r;
  const auto start = std::chrono::steady_clock::now();
  FILE* p = popen((command + (with_stderr ? " 2>&1" : "")).c_str(), "r");
  if (!p) return r;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) r.output.append(buf, n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

}  // namespace tetra::testing
