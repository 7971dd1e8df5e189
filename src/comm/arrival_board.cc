#include "comm/arrival_board.h"

#include <fmt/format.h>

#include <bit>
#include <cstdlib>
#include <sstream>

namespace tetra::comm {

uint64_t SlotView::entered_on(uint64_t key) const {
  for (const auto& [k, seq] : entered) {
    if (k == key) return seq;
  }
  return 0;
}

std::string SlotView::serialize() const {
  std::string out =
      fmt::format("board {} {} {} {} {:.6f} {} {} {} {} {:.6f}", cur_key, cur_seq, cur_op,
                  running ? 1 : 0, age_s, phase, phase_step, phase_micro, phase_stage, phase_age_s);
  for (const auto& [k, seq] : entered) {
    if (k != 0) out += fmt::format(" {}:{}", k, seq);
  }
  return out;
}

bool SlotView::parse(const std::string& text, SlotView* out) {
  std::istringstream in(text);
  std::string tag;
  int running = 0;
  SlotView v;
  if (!(in >> tag >> v.cur_key >> v.cur_seq >> v.cur_op >> running >> v.age_s >> v.phase >>
        v.phase_step >> v.phase_micro >> v.phase_stage >> v.phase_age_s) ||
      tag != "board") {
    return false;
  }
  v.running = running != 0;
  size_t i = 0;
  for (std::string pair; in >> pair && i < v.entered.size(); ++i) {
    const size_t colon = pair.find(':');
    if (colon == std::string::npos) return false;
    char* end = nullptr;
    const uint64_t key = std::strtoull(pair.c_str(), &end, 10);
    if (end != pair.c_str() + colon) return false;
    v.entered[i] = {key, std::strtoull(pair.c_str() + colon + 1, nullptr, 10)};
  }
  *out = v;
  return true;
}

SlotView view_of(const BoardSlot& b, double now) {
  SlotView v;
  v.cur_key = b.cur_key.load();
  v.cur_seq = b.cur_seq.load();
  v.cur_op = b.cur_op.load();
  v.running = b.running.load() != 0;
  const uint64_t since = b.since.load();
  v.age_s = since == 0 ? -1 : now - std::bit_cast<double>(since);
  v.phase = b.phase.load();
  v.phase_micro = b.phase_micro.load();
  v.phase_stage = b.phase_stage.load();
  v.phase_step = b.phase_step.load();
  const uint64_t phase_since = b.phase_since.load();
  v.phase_age_s = phase_since == 0 ? -1 : now - std::bit_cast<double>(phase_since);
  for (int g = 0; g < kBoardGroups; ++g) {
    v.entered[size_t(g)] = {b.groups[g].key.load(), b.groups[g].entered.load()};
  }
  return v;
}

}  // namespace tetra::comm
