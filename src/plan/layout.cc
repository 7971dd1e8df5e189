#include "plan/layout.h"

#include <fmt/format.h>

#include "core/error.h"

namespace tetra::plan {

Schedule parse_schedule(const std::string& text) {
  if (text == "gpipe") return Schedule::GPipe;
  if (text == "1f1b") return Schedule::OneFOneB;
  if (text == "interleaved") return Schedule::Interleaved;
  fail("[plan] unknown layout.schedule '{}'; use gpipe, 1f1b or interleaved", text);
}

const char* to_string(Schedule s) {
  switch (s) {
    case Schedule::GPipe:
      return "gpipe";
    case Schedule::OneFOneB:
      return "1f1b";
    case Schedule::Interleaved:
      return "interleaved";
  }
  return "?";
}

std::string describe(const Layout& l) {
  std::string s = fmt::format("TP {} x PP {} x DP {}", l.tp, l.pp, l.dp);
  if (l.ep > 1) s += fmt::format(" (EP {})", l.ep);
  s += l.zero ? fmt::format(", ZeRO-{}", l.zero) : std::string(", no ZeRO");
  if (l.pp > 1) {
    s += fmt::format(", {}", to_string(l.schedule));
    if (l.schedule == Schedule::Interleaved) s += fmt::format(" v={}", l.v);
  }
  s += fmt::format(", mbs={} m={}", l.micro_batch, l.microbatches);
  return s;
}

}  // namespace tetra::plan
