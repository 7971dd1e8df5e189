// The trainer's MFU denominator comes from the one peak cache the planner shares
// (kernels/cpu/peak.h); this name is kept for the trainer's call.
#pragma once

#include "kernels/cpu/peak.h"

namespace tetra {

using cpu::fp32_peak_gflops;

}  // namespace tetra
