#include "cli/commands.h"
#include "core/error.h"

namespace tetra::cli {

int train_main(const Args&) { fail("[train] under construction"); }

}  // namespace tetra::cli
