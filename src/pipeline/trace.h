// Timelines as Chrome trace event files (JSON), which Perfetto (ui.perfetto.dev) and
// chrome://tracing open: one track per rank, a complete event per span.
#pragma once

#include <string>
#include <vector>

#include "pipeline/simulate.h"

namespace tetra::pipeline {

/** Writes `spans` to `path` atomically; `process` names the trace's process ("simulated"). */
void write_chrome_trace(const std::string& path, const std::vector<Span>& spans,
                        const std::string& process);

}  // namespace tetra::pipeline
