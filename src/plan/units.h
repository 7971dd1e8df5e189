// Human-readable bytes and durations for plan reports (decimal units, as the seeds use).
#pragma once

#include <string>

namespace tetra::plan {

/** 1.12e12 -> "1.12 TB" */
std::string human_bytes(double bytes);
/** 3120 -> "52.0 min" */
std::string human_seconds(double seconds);

}  // namespace tetra::plan
