// Subcommands of the `tetra` binary. Each takes the arguments after its own name.
#pragma once

#include <string>
#include <vector>

#include "core/config.h"
#include "model/gpt_io.h"

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
int report_main(const Args& args);
int triage_main(const Args& args);

/** The model.* config of `tetra generate` and `tetra export` (model_source.cc): `--config FILE`
 * when given, else the shape MODEL/config.json gives when `model_arg` is a model directory, else
 * the shape the weights' tensors give; `overrides` (the command line's) win over the inferred
 * keys. A bare weights file needs model.n_head; a bare Llama file's n_kv_head then follows from
 * k_proj's rows, and the keys no tensor holds (max_seq, rope_theta, norm_eps) are named in a
 * warning when left at their defaults. */
Config model_config_for(const std::string& module, const std::string& config_path,
                        const std::string& model_arg, const WeightsShape& weights,
                        std::vector<std::string> overrides);

/** True when a launcher (mpirun, srun with PMIx) started this process as one of several ranks. */
bool launched_by_mpi();

}  // namespace tetra::cli
