// tetra plan: the seeds' arithmetic (memory, compute, communication, bubble, checkpoint, layout)
// for a model on a cluster, before anything is launched.
#include <cstdio>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/config.h"
#include "core/error.h"
#include "pipeline/trace.h"
#include "plan/plan_config.h"
#include "plan/report.h"

namespace tetra::cli {

int plan_main(const Args& args) {
  ArgParser p(
      "plan", "tetra plan",
      "usage: tetra plan --config FILE.toml [--section.key=value ...] [--json] [--top N]\n\n"
      "Memory and compute ledgers, communication per dimension, pipeline bubble, checkpoint\n"
      "interval and the best layouts for a model on a cluster (docs/plan.md).\n",
      {{{"--config", ValueKind::String, "\"\"", "the plan's TOML config (configs/plan/)"},
        "FILE.toml"},
       {{"--json", ValueKind::Bool, "false", "print the report as one JSON object"}},
       {{"--top", ValueKind::Int, "5", "layouts to list", "[1, 1000]"}, "N"},
       {{"--trace", ValueKind::String, "\"\"",
         "write the chosen layout's simulated pipeline step as a Chrome/Perfetto trace"},
        "FILE.json"}});
  p.allow_overrides(plan::plan_schema());
  p.set_epilog(
      "keys, as --section.key=default (valid values); 0 or \"\" = from the preset or search:\n" +
      describe_keys(plan::plan_schema()));
  if (!p.parse(args)) return 0;
  const std::string& config_path = p.s("--config");
  TETRA_CHECK(!config_path.empty() || !p.overrides().empty(),
              "[plan] no input; pass --config FILE.toml (examples in configs/plan/) or "
              "--section.key=value overrides");
  const Config config = Config::load(plan::plan_schema(), config_path, p.overrides());
  const plan::PlanInputs inputs = plan::plan_inputs(config);
  const nlohmann::json report = plan::plan_report(inputs, int(p.i("--top")));
  if (const std::string& trace = p.s("--trace"); !trace.empty()) {
    const plan::LayoutEstimate e = plan::choose_layout(inputs).chosen;
    TETRA_CHECK(e.layout.pp > 1,
                "[plan] --trace shows a pipeline step, but the layout has pp=1; fix layout.pp");
    pipeline::write_chrome_trace(trace,
                                 plan::simulate_pipeline(inputs.model, inputs.training, e).spans,
                                 "tetra plan: " + plan::describe(e.layout));
    std::fprintf(stderr,
                 "[plan] wrote the simulated pipeline step to %s (open in ui.perfetto.dev)\n",
                 trace.c_str());
  }
  if (p.b("--json")) {
    std::printf("%s\n", report.dump(2).c_str());
  } else {
    std::fputs(plan::format_report(report).c_str(), stdout);
  }
  return 0;
}

}  // namespace tetra::cli
