#include "pipeline/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"

namespace tetra::pipeline {

void write_chrome_trace(const std::string& path, const std::vector<Span>& spans,
                        const std::string& process) {
  using json = nlohmann::json;
  json events = json::array();
  events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", 0}, {"args", {{"name", process}}}});
  int ranks = 0;
  for (const Span& s : spans) ranks = std::max(ranks, s.rank + 1);
  for (int r = 0; r < ranks; ++r) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", r},
                      {"args", {{"name", fmt::format("pipeline rank {}", r)}}}});
  }
  for (const Span& s : spans) {
    std::string name = s.name;
    if (s.mb >= 0) name += fmt::format(" mb{} c{}", s.mb, s.chunk);
    const std::string cat = s.name.rfind("wait", 0) == 0 ? "idle" : "compute";
    // Microseconds, as the format wants.
    events.push_back({{"name", name},
                      {"cat", cat},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", s.rank},
                      {"ts", s.start * 1e6},
                      {"dur", (s.end - s.start) * 1e6},
                      {"args", {{"mb", s.mb}, {"chunk", s.chunk}}}});
  }
  const std::string text = json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
  write_file_atomically(path, {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}},
                        "pipeline");
}

}  // namespace tetra::pipeline
