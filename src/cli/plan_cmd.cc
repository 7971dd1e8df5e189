// tetra plan: the seeds' arithmetic (memory, compute, communication, bubble, checkpoint, layout)
// for a model on a cluster, before anything is launched.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/config.h"
#include "core/error.h"
#include "plan/plan_config.h"
#include "plan/report.h"

namespace tetra::cli {

namespace {

void plan_usage() {
  std::printf(
      "usage: tetra plan --config FILE.toml [--section.key=value ...] [--json] [--top N]\n\n"
      "Memory and compute ledgers, communication per dimension, pipeline bubble, checkpoint\n"
      "interval and the best layouts for a model on a cluster. Keys (0 or \"\" = "
      "preset/search):\n");
  for (const auto& k : plan::plan_schema()) {
    std::printf("  --%-28s %s (default %s)\n", k.key.c_str(), k.help.c_str(),
                k.default_value.c_str());
  }
}

int parse_top(const std::string& text) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  TETRA_CHECK(!text.empty() && end && *end == 0 && v >= 1 && v <= 1000,
              "[plan] --top expects a number of layouts between 1 and 1000, got '{}'", text);
  return int(v);
}

}  // namespace

int plan_main(const Args& args) {
  std::string config_path;
  std::vector<std::string> overrides;
  bool json = false;
  int top = 5;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](const std::string& flag) -> std::string {
      if (a.size() > flag.size() && a.compare(0, flag.size() + 1, flag + "=") == 0) {
        return a.substr(flag.size() + 1);
      }
      TETRA_CHECK(i + 1 < args.size(), "[plan] {} needs a value", flag);
      return args[++i];
    };
    if (a == "--help" || a == "-h") {
      plan_usage();
      return 0;
    } else if (a == "--json") {
      json = true;
    } else if (a == "--config" || a.rfind("--config=", 0) == 0) {
      config_path = value("--config");
    } else if (a == "--top" || a.rfind("--top=", 0) == 0) {
      top = parse_top(value("--top"));
    } else if (a.rfind("--", 0) == 0 && a.find('=') != std::string::npos) {
      overrides.push_back(a);
    } else {
      fail(
          "[plan] unexpected argument '{}'; use --config FILE, --json, --top N or "
          "--section.key=value (see tetra plan --help)",
          a);
    }
  }
  TETRA_CHECK(!config_path.empty() || !overrides.empty(),
              "[plan] no input; pass --config FILE.toml (examples in configs/plan/) or "
              "--section.key=value overrides");
  const Config config = Config::load(plan::plan_schema(), config_path, overrides);
  const plan::PlanInputs inputs = plan::plan_inputs(config);
  const nlohmann::json report = plan::plan_report(inputs, top);
  if (json) {
    std::printf("%s\n", report.dump(2).c_str());
  } else {
    std::fputs(plan::format_report(report).c_str(), stdout);
  }
  return 0;
}

}  // namespace tetra::cli
