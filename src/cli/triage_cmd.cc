// tetra triage RUN_DIR...: what a hung or crashed job's ranks were doing, from the flight records
// (comm/flight.h) they wrote to RUN_DIR/flight, in a few lines (comm/triage.h;
// docs/operability.md).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "comm/triage.h"
#include "core/error.h"
#include "core/read_file.h"

namespace tetra::cli {

namespace {

namespace fs = std::filesystem;

constexpr uintmax_t kMaxRecordBytes = uintmax_t(1) << 28;  // 2,000 operations take ~1 MB

// The rank-N.json files of `dir`: its flight/ directory, or `dir` itself when it holds them.
std::vector<fs::path> record_files(const fs::path& dir) {
  std::error_code ec;
  TETRA_CHECK(fs::is_directory(dir, ec),
              "[triage] {} is not a directory; give a run's run.dir (or its flight/ directory)",
              dir.string());
  const fs::path flight = fs::is_directory(dir / "flight", ec) ? dir / "flight" : dir;
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(flight, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("rank-", 0) == 0 && e.path().extension() == ".json") out.push_back(e.path());
  }
  return out;
}

}  // namespace

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

  std::map<int, nlohmann::json> newest;  // world rank -> its newest record
  std::vector<std::string> skipped;
  size_t files = 0;
  for (const std::string& dir : dirs) {
    for (const fs::path& path : record_files(dir)) {
      ++files;
      const nlohmann::json rec = nlohmann::json::parse(
          read_small_file(path.string(), kMaxRecordBytes, "triage", "a flight record", ""), nullptr,
          false);
      if (rec.is_discarded() || !rec.is_object() || !rec.contains("rank") ||
          !rec["rank"].is_number_integer() || !rec.contains("reason")) {
        skipped.push_back(path.string());
        continue;
      }
      const int rank = rec["rank"].get<int>();
      auto it = newest.find(rank);
      if (it == newest.end() ||
          rec.value("written_unix", 0.0) > it->second.value("written_unix", 0.0)) {
        newest[rank] = rec;
      }
    }
  }
  for (const std::string& s : skipped) {
    std::fprintf(stderr, "[triage] skipped %s: not a flight record (JSON with rank and reason)\n",
                 s.c_str());
  }
  TETRA_CHECK(!newest.empty(),
              "[triage] no flight record under {}{}: ranks write RUN_DIR/flight/rank-N.json on a "
              "watchdog timeout, a fatal signal, an error exit or SIGUSR1 (`kill -USR1 PID` of a "
              "running rank writes one now); give the run.dir of the job that hung",
              fmt::join(dirs, ", "),
              files ? fmt::format(" ({} file(s) that are not records)", files) : "");
  std::vector<nlohmann::json> records;
  for (auto& [rank, rec] : newest) records.push_back(std::move(rec));
  const comm::Diagnosis d = comm::triage(records);
  if (p.b("--json")) {
    std::printf("%s\n", nlohmann::json{{"cause", d.cause}, {"lines", d.lines}}.dump().c_str());
  } else {
    for (const std::string& line : d.lines) std::printf("[triage] %s\n", line.c_str());
  }
  return 0;
}

}  // namespace tetra::cli
