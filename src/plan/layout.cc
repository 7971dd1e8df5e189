#include "plan/layout.h"

#include <fmt/format.h>

#include <algorithm>

namespace tetra::plan {

int64_t chunks_per_rank(const Layout& l) {
  return l.schedule == Schedule::interleaved || l.schedule == Schedule::zb_v ? l.v : 1;
}

int64_t stage_of(const Layout& l, int64_t rank, int64_t chunk) {
  return l.schedule == Schedule::zb_v && chunk == 1 ? 2 * l.pp - 1 - rank : chunk * l.pp + rank;
}

int64_t rank_layers(const Layout& l, int64_t layers, int64_t rank) {
  if (l.split.empty()) return layers / l.pp;
  int64_t n = 0;
  for (int64_t c = 0; c < chunks_per_rank(l); ++c) n += l.split[size_t(stage_of(l, rank, c))];
  return n;
}

int64_t stage_layers(const Layout& l, int64_t layers, int64_t stage) {
  return l.split.empty() ? layers / (l.pp * chunks_per_rank(l)) : int64_t(l.split[size_t(stage)]);
}

int64_t stage_first_layer(const Layout& l, int64_t layers, int64_t stage) {
  int64_t first = 0;
  for (int64_t k = 0; k < stage; ++k) first += stage_layers(l, layers, k);
  return first;
}

int64_t max_rank_layers(const Layout& l, int64_t layers) {
  int64_t most = 0;
  for (int64_t r = 0; r < l.pp; ++r) most = std::max(most, rank_layers(l, layers, r));
  return most;
}

std::string describe(const Layout& l) {
  std::string s =
      l.cp > 1 ? fmt::format("TP {} x CP {} ({}) x PP {} x DP {}", l.tp, l.cp,
                             cp_attention_label(l.cp_attention, int(l.cp), int(l.cp_ulysses)), l.pp,
                             l.dp)
               : fmt::format("TP {} x PP {} x DP {}", l.tp, l.pp, l.dp);
  if (l.ep > 1) s += fmt::format(" (EP {})", l.ep);
  s += l.zero ? fmt::format(", ZeRO-{}", l.zero) : std::string(", no ZeRO");
  if (l.pp > 1) {
    s += fmt::format(", {}", to_string(l.schedule));
    if (l.schedule == Schedule::interleaved) s += fmt::format(" v={}", l.v);
    if (!l.split.empty()) {
      s += ", layers ";
      for (size_t i = 0; i < l.split.size(); ++i)
        s += fmt::format("{}{}", i ? "," : "", l.split[i]);
    }
  }
  s += fmt::format(", mbs={} m={}, recompute {}", l.micro_batch, l.microbatches,
                   recompute_name(l.recompute));
  return s;
}

}  // namespace tetra::plan
