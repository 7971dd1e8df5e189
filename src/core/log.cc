#include "core/log.h"

namespace tetra {

LogState& log_state() {
  static LogState state;
  return state;
}

}  // namespace tetra
