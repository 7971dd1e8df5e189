// tetra train --config FILE.toml [--section.key=value ...]
#include <cstdio>
#include <cstdlib>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace tetra::cli {

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"}) {
    if (std::getenv(v)) return true;
  }
  return false;
}

int train_main(const Args& args) {
  ArgParser p("train", "tetra train",
              "usage: tetra train --config FILE.toml [--section.key=value ...]\n\n"
              "Trains a GPT model as the config says; any key can be overridden on the command\n"
              "line as --section.key=value (or --section.key value). See docs/training.md.\n",
              {{{"--config", ValueKind::String, "\"\"",
                 "the run's TOML config; without it every key has its default"},
                "FILE.toml"}});
  p.allow_overrides(train_config_schema());
  p.set_epilog("keys, as --section.key=default (valid values):\n" +
               describe_keys(train_config_schema()));
  if (!p.parse(args)) return 0;
  const std::string& config_path = p.s("--config");
  const std::vector<std::string>& overrides = p.overrides();
  Config config = Config::load(train_config_schema(), config_path, overrides);
  TrainOptions options = TrainOptions::from(config);
  comm::Communicator world;
  if (launched_by_mpi()) world = comm::init_world(options.parallel.comm);
  Trainer trainer(options, config.to_toml(), world);
  trainer.run();
  return 0;
}

}  // namespace tetra::cli
