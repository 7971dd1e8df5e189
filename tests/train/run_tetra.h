// Running the tetra binary (alone or under mpirun) from the train tests.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

#include "core/timer.h"

namespace tetra::testing {

struct Ran {
  int code = -1;
  std::string output;  // stdout and (unless asked otherwise) stderr
  double seconds = 0;
};

/** Runs `cmd` through the shell, capturing both output streams (or stdout alone). */
inline Ran run_command(const std::string& cmd, bool with_stderr = true) {
  Ran r;
  Stopwatch clock;
  FILE* p = popen((cmd + (with_stderr ? " 2>&1" : "")).c_str(), "r");
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) r.output.append(buf, n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.seconds = clock.elapsed_s();
  return r;
}

/** `tetra <args>` on one process, or under mpirun on `ranks` ranks. */
inline std::string tetra_command(int ranks, const std::string& args) {
  if (ranks <= 1) return std::string(TETRA_BINARY) + " " + args;
  return std::string(TETRA_MPIEXEC) +
         " --oversubscribe --allow-run-as-root --bind-to none --mca btl self,vader -np " +
         std::to_string(ranks) + " " + TETRA_BINARY + " " + args;
}

}  // namespace tetra::testing
