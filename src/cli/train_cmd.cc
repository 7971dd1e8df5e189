// tetra train --config FILE.toml [--section.key=value ...]
#include <cstdio>
#include <cstdlib>

#include "cli/commands.h"
#include "core/error.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace tetra::cli {

namespace {

void print_keys() {
  std::printf("tetra train --config FILE.toml [--section.key=value ...]\n\nkeys (default):\n");
  for (const auto& k : train_config_schema()) {
    std::printf("  %-22s %-16s %s\n", k.key.c_str(), k.default_value.c_str(), k.help.c_str());
  }
}

// True when a launcher (mpirun, srun with PMIx) started this process as one of several ranks.
bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"}) {
    if (std::getenv(v)) return true;
  }
  return false;
}

}  // namespace

int train_main(const Args& args) {
  std::string config_path;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h" || a == "--help-config") {
      print_keys();
      return 0;
    } else if (a == "--config") {
      TETRA_CHECK(i + 1 < args.size(), "[train] --config needs a file: --config FILE.toml");
      config_path = args[++i];
    } else if (a.rfind("--config=", 0) == 0) {
      config_path = a.substr(9);
    } else {
      TETRA_CHECK(a.rfind("--", 0) == 0 && a.find('=') != std::string::npos,
                  "[train] unexpected argument '{}'; overrides look like --section.key=value", a);
      overrides.push_back(a);
    }
  }
  Config config = Config::load(train_config_schema(), config_path, overrides);
  TrainOptions options = TrainOptions::from(config);
  comm::Communicator world;
  if (launched_by_mpi()) world = comm::init_world(options.comm);
  Trainer trainer(options, config.to_toml(), world);
  trainer.run();
  return 0;
}

}  // namespace tetra::cli
