#include "cli/commands.h"
#include "core/error.h"

namespace tetra::cli {

int plan_main(const Args&) { fail("[plan] tetra plan is being built in issue 5"); }

}  // namespace tetra::cli
