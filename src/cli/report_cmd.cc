// tetra report RUN_DIR: one self-contained HTML page of a training run (docs/report.md). The
// binary checks the run directory and runs the page's maker, scripts/tetra_report.py (matplotlib),
// under Debian's python3.
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"

namespace tetra::cli {

namespace {

namespace fs = std::filesystem;

// Every line of RUN_DIR/metrics.jsonl must be a step record: a damaged file is named here, with
// its line, rather than half a page drawn from it.
void check_run_dir(const fs::path& run) {
  std::error_code ec;
  TETRA_CHECK(fs::is_directory(run, ec),
              "[report] {} is not a directory; give the run.dir of a tetra train run (the "
              "directory that holds its metrics.jsonl)",
              run.string());
  const fs::path metrics = run / "metrics.jsonl";
  std::ifstream in(metrics);
  TETRA_CHECK(in.good(),
              "[report] {} has no metrics.jsonl; give the run.dir of a tetra train run (the "
              "directory its config's run.dir names)",
              run.string());
  size_t steps = 0, n = 0;
  for (std::string line; std::getline(in, line);) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json rec = nlohmann::json::parse(line, nullptr, false);
    TETRA_CHECK(!rec.is_discarded(),
                "[report] {} line {} is not JSON; the file is damaged: rerun the training or cut "
                "the file back to its last complete line",
                metrics.string(), n);
    TETRA_CHECK(rec.is_object() && rec.contains("step") && rec["step"].is_number_integer(),
                "[report] {} line {} is not a step record (a JSON object with an integer "
                "\"step\"); is {} a tetra run directory?",
                metrics.string(), n, run.string());
    ++steps;
  }
  TETRA_CHECK(steps > 0,
              "[report] {} holds no step: the run stopped before its first step finished; "
              "report a run that trained at least one step",
              metrics.string());
}

// The page's maker: $TETRA_REPORT_SCRIPT, else the source tree's scripts/tetra_report.py (its
// path is built in).
std::string report_script() {
  if (const char* s = std::getenv("TETRA_REPORT_SCRIPT"); s && *s) {
    TETRA_CHECK(fs::is_regular_file(s),
                "[report] TETRA_REPORT_SCRIPT={} is not a file; point it at "
                "scripts/tetra_report.py or unset it",
                s);
    return s;
  }
  const std::string built_in = std::string(TETRA_SOURCE_DIR) + "/scripts/tetra_report.py";
  TETRA_CHECK(fs::is_regular_file(built_in),
              "[report] {} is missing (tetra was built from {}); set TETRA_REPORT_SCRIPT to "
              "scripts/tetra_report.py of a tetra source tree",
              built_in, TETRA_SOURCE_DIR);
  return built_in;
}

// Debian's python3, where python3-matplotlib installs, unless $TETRA_PYTHON names another.
std::string python() {
  if (const char* p = std::getenv("TETRA_PYTHON"); p && *p) return p;
  return access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
}

int run_script(const std::vector<std::string>& argv) {
  std::vector<char*> c;
  for (const std::string& a : argv) c.push_back(const_cast<char*>(a.c_str()));
  c.push_back(nullptr);
  const pid_t pid = fork();
  TETRA_CHECK(pid >= 0, "[report] cannot start {}: {}", argv[0], std::strerror(errno));
  if (pid == 0) {
    execvp(c[0], c.data());
    std::fprintf(stderr,
                 "error: [report] cannot run %s: %s; install python3 (apt-get install "
                 "python3 python3-matplotlib) or set TETRA_PYTHON\n",
                 c[0], std::strerror(errno));
    _exit(127);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

int report_main(const Args& args) {
  ArgParser p("report", "tetra report",
              "usage: tetra report RUN_DIR [--out DIR]\n\n"
              "A self-contained HTML page of a training run (docs/report.md): loss and\n"
              "validation loss, learning rate, throughput and MFU, where a step goes, memory by\n"
              "category, the MFU audit, per-rank step times, the pipeline bubble measured vs\n"
              "simulated and links to the pipeline trace, each chart where the run wrote its\n"
              "data. RUN_DIR is a run's run.dir. Needs python3 with matplotlib\n"
              "(python3-matplotlib; TETRA_PYTHON overrides the interpreter).\n",
              {{{"--out", ValueKind::String, "\"\"",
                 "the directory of index.html and the charts' PNGs (default RUN_DIR/report)"},
                "DIR"}});
  // RUN_DIR is the one argument that is neither a flag nor --out's value.
  Args flags;
  std::vector<std::string> dirs;
  for (size_t i = 0; i < args.size(); ++i) {
    const bool flag = args[i].rfind("-", 0) == 0;
    if (!flag) {
      dirs.push_back(args[i]);
      continue;
    }
    flags.push_back(args[i]);
    if (args[i] == "--out" && i + 1 < args.size()) flags.push_back(args[++i]);
  }
  if (!p.parse(flags)) return 0;
  TETRA_CHECK(dirs.size() == 1,
              "[report] usage: tetra report RUN_DIR [--out DIR]: give one run directory{}",
              dirs.empty() ? "" : fmt::format(", not {}", dirs.size()));
  const fs::path run = dirs[0];
  check_run_dir(run);
  const std::string out = p.s("--out").empty() ? (run / "report").string() : p.s("--out");
  const std::vector<std::string> argv = {python(), report_script(), run.string(), out};
  const int code = run_script(argv);
  TETRA_CHECK(code == 0, "[report] {} {} failed (exit status {}); its message is above", argv[0],
              argv[1], code);
  std::fprintf(stderr, "[report] open %s in a browser\n",
               fs::absolute(fs::path(out) / "index.html").string().c_str());
  return 0;
}

}  // namespace tetra::cli
