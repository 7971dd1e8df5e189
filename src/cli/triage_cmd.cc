// tetra triage RUN_DIR...: what a hung or crashed job's ranks were doing, from the flight records
// (comm/flight.h) they wrote to RUN_DIR/flight, in a few lines (comm/triage.h;
// docs/comm.md, "Watchdog").
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "comm/triage.h"
#include "core/error.h"

namespace tetra::cli {

int triage_main(const Args& args) {
  ArgParser p("triage", "tetra triage",
              "usage: tetra triage RUN_DIR [RUN_DIR...] [--json]\n\n"
              "Why a job hung or died, from the flight records its ranks wrote to\n"
              "RUN_DIR/flight/rank-N.json (on a watchdog timeout, a fatal signal, an error exit,\n"
              "the launcher's SIGTERM, or `kill -USR1` of a running rank): which collective each\n"
              "group is stuck in, which ranks never entered it and what they did instead, and\n"
              "the likely cause. Give every host's copy of the run directory when they are not\n"
              "on a shared file system; the newest record of each rank is used.\n",
              {{{"--json", ValueKind::Bool, "false", "print the diagnosis as one JSON object"}}});
  Args flags;
  std::vector<std::string> dirs;
  for (const std::string& a : args) (a.rfind("-", 0) == 0 ? flags : dirs).push_back(a);
  if (!p.parse(flags)) return 0;
  TETRA_CHECK(!dirs.empty(),
              "[triage] usage: tetra triage RUN_DIR [RUN_DIR...]: give the run "
              "directory of the job (its run.dir)");

  const comm::FlightRecords found = comm::read_flight_records(dirs);
  for (const std::string& s : found.skipped) {
    std::fprintf(stderr, "[triage] skipped %s: not a flight record (JSON with rank and reason)\n",
                 s.c_str());
  }
  TETRA_CHECK(!found.newest.empty(),
              "[triage] no flight record under {}{}: ranks write RUN_DIR/flight/rank-N.json on a "
              "watchdog timeout, a fatal signal, an error exit or SIGUSR1 (`kill -USR1 PID` of a "
              "running rank writes one now); give the run.dir of the job that hung",
              fmt::join(dirs, ", "),
              found.files ? fmt::format(" ({} file(s) that are not records)", found.files) : "");
  const comm::Diagnosis d = comm::triage(found.newest);
  if (p.b("--json")) {
    std::printf("%s\n", nlohmann::json{{"cause", d.cause}, {"lines", d.lines}}.dump().c_str());
  } else {
    for (const std::string& line : d.lines) std::printf("[triage] %s\n", line.c_str());
  }
  return 0;
}

}  // namespace tetra::cli
