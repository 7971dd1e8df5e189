#include "plan/elastic.h"

#include <fmt/format.h>

#include <algorithm>

namespace tetra::plan {

namespace {

std::string change(const char* what, int64_t from, int64_t to) {
  return from == to ? fmt::format("{} {} kept", what, from)
                    : fmt::format("{} {} -> {}", what, from, to);
}

}  // namespace

Resize resize(const Layout& from, int64_t available, int64_t min_ranks) {
  Resize r;
  const int64_t model_parallel = from.tp * from.cp * from.pp;
  const int64_t global = from.dp * from.micro_batch * from.microbatches;
  const bool interleaved = from.schedule == Schedule::interleaved;
  for (int64_t dp = available / model_parallel; dp >= 1; --dp) {
    if (dp * model_parallel < min_ranks) break;
    if (dp % from.ep != 0 || global % dp != 0) continue;
    const int64_t per_replica = global / dp;
    for (int64_t mbs = std::min(from.micro_batch, per_replica); mbs >= 1; --mbs) {
      if (per_replica % mbs != 0) continue;
      const int64_t m = per_replica / mbs;
      if (interleaved && m % from.pp != 0) continue;
      r.fits = true;
      r.layout = from;
      r.layout.dp = dp;
      r.layout.micro_batch = mbs;
      r.layout.microbatches = m;
      r.ranks = dp * model_parallel;
      return r;
    }
  }
  const std::string split = fmt::format("tp {} x cp {} x pp {}", from.tp, from.cp, from.pp);
  if (available < model_parallel) {
    r.why = fmt::format(
        "{} rank(s) cannot hold one replica of the model split {} ({} ranks); add hosts, or "
        "restart from the checkpoint with a smaller split",
        available, split, model_parallel);
  } else if (available / model_parallel * model_parallel < min_ranks) {
    const int64_t usable = available / model_parallel * model_parallel;
    r.why = fmt::format(
        "{} rank(s){} are fewer than --min-ranks {}; lower it to go on with them", available,
        usable < available ? fmt::format(" ({} in whole replicas of {})", usable, split) : "",
        min_ranks);
  } else {
    r.why = fmt::format(
        "no dp from {} to {} divides the global batch of {} sequences{}{} with {}; lower "
        "--min-ranks, or change the global batch",
        std::max<int64_t>(1, (min_ranks + model_parallel - 1) / model_parallel),
        available / model_parallel, global,
        from.ep > 1 ? fmt::format(" as a multiple of ep {}", from.ep) : "",
        interleaved ? fmt::format(" into micro-batches a multiple of pp {} (interleaved)", from.pp)
                    : "",
        split);
  }
  return r;
}

std::string describe_resize(const Layout& from, const Layout& to) {
  return fmt::format("{}, {}, {}; global batch {} sequences kept", change("dp", from.dp, to.dp),
                     change("micro_batch", from.micro_batch, to.micro_batch),
                     change("grad_accum", from.microbatches, to.microbatches),
                     to.dp * to.micro_batch * to.microbatches);
}

}  // namespace tetra::plan
