// tetra plan: the seeds' arithmetic (memory, compute, communication, bubble, checkpoint, layout)
// for a model on a cluster, before anything is launched; given a `tetra train` config, for the run
// that config would launch (train/run_plan.h).
#include <fmt/format.h>

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
#include "plan/validation.h"
#include "train/run_plan.h"

namespace tetra::cli {

namespace {

// Every key `tetra plan` takes on its command line: the planner's, and a training config's.
const ConfigSchema& plan_override_schema() {
  static const ConfigSchema schema = [] {
    ConfigSchema s = plan::plan_schema();
    for (const KeySpec& k : training_plan_schema()) {
      bool known = false;
      for (const KeySpec& p : s) known = known || p.key == k.key;
      if (!known) s.push_back(k);
    }
    return s;
  }();
  return schema;
}

std::string training_config_help() {
  return "\nA `tetra train` config (one that sets a key only tetra train has: train.steps, data.*, "
         "optim.*,\n...) is planned as the run `tetra train --config` would launch, on the cpu "
         "cluster preset\nwith one device per rank (--cluster.* keys override it). Both kinds of "
         "config name a\nsetting by the same key (model.n_layer, train.seq_len, parallel.tp, "
         "zero.stage, ...).\n";
}

}  // namespace

int plan_main(const Args& args) {
  ArgParser p(
      "plan", "tetra plan",
      "usage: tetra plan --config FILE.toml [--section.key=value ...] [--json] [--top N] "
      "[--explain]\n"
      "       tetra plan --validate configs/plan/validation\n\n"
      "Memory and compute ledgers, communication per dimension, pipeline bubble, checkpoint\n"
      "interval and the best layouts for a model on a cluster (docs/plan.md). FILE.toml is a\n"
      "planner config (configs/plan/) or a `tetra train` config, planned as the run it launches.\n",
      {{{"--config", ValueKind::String, "\"\"",
         "a planner config (configs/plan/) or a `tetra train` config"},
        "FILE.toml"},
       {{"--json", ValueKind::Bool, "false", "print the report as one JSON object"}},
       {{"--top", ValueKind::Int, "5", "layouts to list", "[1, 1000]"}, "N"},
       {{"--explain", ValueKind::Bool, "false",
         "the chosen layout's step time in the audit order (data, communication, bubble, "
         "kernels, stragglers) and why each listed layout beats the next"}},
       {{"--trace", ValueKind::String, "\"\"",
         "write the chosen layout's simulated pipeline step as a Chrome/Perfetto trace"},
        "FILE.json"},
       {{"--validate", ValueKind::String, "\"\"",
         "plan every published run of DIR (configs/plan/validation) and compare the published "
         "layout's rank and utilisation, the products' efficiency fitted leave-one-out"},
        "DIR"}});
  p.allow_overrides(plan_override_schema());
  p.set_epilog(
      "keys, as --section.key=default (valid values); 0 or \"\" = from the preset or search:\n" +
      describe_keys(plan::plan_schema()) + training_config_help());
  if (!p.parse(args)) return 0;
  if (const std::string& dir = p.s("--validate"); !dir.empty()) {
    std::fputs(plan::format_validation(plan::validate(plan::load_published_runs(dir))).c_str(),
               stdout);
    return 0;
  }
  const std::string& config_path = p.s("--config");
  TETRA_CHECK(!config_path.empty() || !p.overrides().empty(),
              "[plan] no input; pass --config FILE.toml (a planner config, examples in "
              "configs/plan/, or a `tetra train` config such as configs/brown.toml) or "
              "--section.key=value overrides");
  const plan::PlanInputs inputs =
      is_training_config(config_path, p.overrides())
          ? plan_training_config(config_path, p.overrides()).inputs
          : plan::plan_inputs(Config::load(plan::plan_schema(), config_path, p.overrides()));
  const nlohmann::json report = plan::plan_report(inputs, int(p.i("--top")));
  if (const std::string& trace = p.s("--trace"); !trace.empty()) {
    const plan::LayoutEstimate e = plan::choose_layout(inputs).chosen;
    TETRA_CHECK(e.layout.pp > 1,
                "[plan] --trace shows a pipeline step, but the layout has pp=1; fix parallel.pp");
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
    std::fputs(plan::format_report(report, p.b("--explain")).c_str(), stdout);
  }
  return 0;
}

}  // namespace tetra::cli
