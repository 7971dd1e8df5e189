// tetra: thin dispatcher over the subcommands. Errors become one clear line and exit code 2.
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/daemon_link.h"
#include "core/config.h"
#include "core/error.h"

namespace {

struct Command {
  const char* name;
  int (*run)(const tetra::cli::Args&);
  const char* help;  // nullptr: not listed (run by tetra itself)
};

const Command kCommands[] = {
    {"train", tetra::cli::train_main,
     "train a GPT model: tetra train --config FILE.toml [--s.k=v]"},
    {"plan", tetra::cli::plan_main, "memory/compute/communication plan: tetra plan --config FILE"},
    {"data", tetra::cli::data_main, "text to token shards: tetra data prepare --input P --out D"},
    {"launch", tetra::cli::launch_main,
     "run a command on N local ranks: tetra launch -n N -- train ..."},
    {"generate", tetra::cli::generate_main,
     "sample text from a model: tetra generate --model F --prompt T"},
    {"export", tetra::cli::export_main,
     "a Hugging Face model directory: tetra export --hf DIR --model F"},
    {"ckpt", tetra::cli::ckpt_main,
     "look inside checkpoints: tetra ckpt inspect|verify|export DIR"},
    {"report", tetra::cli::report_main,
     "an HTML page of a run's charts: tetra report RUN_DIR [--out DIR]"},
    {"triage", tetra::cli::triage_main,
     "why a job hung or died, from its flight records: tetra triage RUN_DIR..."},
    {"verify-resume", tetra::cli::verify_resume_main,
     "kill a run, resume it, compare bitwise: tetra verify-resume --config F"},
    {"launch-link", tetra::cli::launch_link_main, nullptr},
};

void usage() {
  std::fprintf(stderr, "usage: tetra <command> [args]\n\ncommands:\n");
  for (const auto& c : kCommands) {
    if (c.help) std::fprintf(stderr, "  %-10s %s\n", c.name, c.help);
  }
}

// libgomp reads its wait policy once, when it is loaded, and by default a waiting thread spins
// for ~300k iterations at every barrier. With another process on the same cores (a second rank, a
// build, a shared host) the spinning thread steals the core from the one it waits for, and a step
// of hundreds of parallel regions took 10x longer. Unless the user chose a policy, tetra
// re-executes itself once with a short spin before sleeping (measured in docs/training.md).
void set_thread_wait_policy(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
  setenv("GOMP_SPINCOUNT", "10000", 1);
  execv("/proc/self/exe", argv);  // returns only on failure: then run with the default policy
}

}  // namespace

int main(int argc, char** argv) {
  set_thread_wait_policy(argv);
  // Past a file-size limit (ulimit -f) a write then fails with EFBIG, which tetra reports with
  // the path, instead of the process dying silently of SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  // A write to a peer that is gone (a socket whose other end died) fails with EPIPE, which the
  // communicator reports, instead of the process dying of SIGPIPE without a word (under srun a
  // survivor sending to a killed rank did).
  std::signal(SIGPIPE, SIG_IGN);
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  std::vector<std::string> args(argv + 2, argv + argc);
  for (const auto& c : kCommands) {
    if (std::strcmp(argv[1], c.name) != 0) continue;
    try {
      return c.run(args);
    } catch (const tetra::Error& e) {
      std::fprintf(stderr, "error: %s\n", e.what());
      return 2;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: unexpected: %s\n", e.what());
      return 3;
    }
  }
  std::vector<std::string> names;
  for (const auto& c : kCommands) {
    if (c.help) names.emplace_back(c.name);
  }
  std::fprintf(stderr, "error: [tetra] unknown command '%s'.%s\n\n", argv[1],
               tetra::closest_suggestion(names, argv[1]).c_str());
  usage();
  return 2;
}
