// Subcommands of the `tetra` binary. Each takes the arguments after its own name.
#pragma once

#include <string>
#include <vector>

namespace tetra::cli {

using Args = std::vector<std::string>;

int train_main(const Args& args);
int plan_main(const Args& args);
int data_main(const Args& args);
int launch_main(const Args& args);
int generate_main(const Args& args);
int export_main(const Args& args);
int ckpt_main(const Args& args);
int verify_resume_main(const Args& args);

/** True when a launcher (mpirun, srun with PMIx) started this process as one of several ranks. */
bool launched_by_mpi();

}  // namespace tetra::cli
