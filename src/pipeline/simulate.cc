#include "pipeline/simulate.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "core/error.h"

namespace tetra::pipeline {

Costs Costs::uniform(int stages, double forward, double backward, double weight) {
  Costs c;
  c.forward.assign(size_t(stages), forward);
  c.backward.assign(size_t(stages), backward);
  if (weight > 0) c.weight.assign(size_t(stages), weight);
  return c;
}

double Costs::of(Op op, int stage) const {
  const double w = weight.empty() ? 0.0 : weight[size_t(stage)];
  switch (op) {
    case Op::forward:
      return forward[size_t(stage)];
    case Op::backward:
      return backward[size_t(stage)];
    case Op::backward_input:
      return backward[size_t(stage)] - w;
    case Op::backward_weight:
      return w;
    default:
      return 0.0;
  }
}

namespace {

bool is_compute(Op op) {
  return op == Op::forward || op == Op::backward || op == Op::backward_input ||
         op == Op::backward_weight;
}

}  // namespace

double Timeline::idle_share(int r) const { return flush > 0 ? 1.0 - busy[size_t(r)] / flush : 0.0; }

double Timeline::bubble() const {
  double sum = 0;
  for (size_t r = 0; r < busy.size(); ++r) sum += idle_share(int(r));
  return busy.empty() ? 0.0 : sum / double(busy.size());
}

Timeline simulate(const Schedule& s, const Costs& c) {
  const int stages = s.p * s.v;
  TETRA_CHECK(int(c.forward.size()) == stages && int(c.backward.size()) == stages &&
                  (c.weight.empty() || int(c.weight.size()) == stages),
              "[pipeline] internal: costs for {} stages given for a schedule of {}",
              c.forward.size(), stages);
  Timeline t;
  const size_t P = size_t(s.p);
  t.busy.assign(P, 0.0);
  t.last_backward.assign(P, 0.0);
  t.peak_inflight.assign(P, 0);
  std::vector<size_t> pc(P, 0);
  std::vector<double> clock(P, 0.0);
  std::vector<int> inflight(P, 0);
  // (is gradient, destination stage, micro-batch) -> arrival time
  std::map<std::tuple<bool, int, int>, double> arrived;
  size_t done = 0;
  while (done < P) {
    bool progress = false;
    done = 0;
    for (size_t r = 0; r < P; ++r) {
      const std::vector<Instr>& prog = s.ranks[r];
      while (pc[r] < prog.size()) {
        const Instr& in = prog[pc[r]];
        const int stage = s.stage(int(r), in.chunk);
        double& now = clock[r];
        if (in.op == Op::recv_act || in.op == Op::recv_grad) {
          auto it = arrived.find({in.op == Op::recv_grad, stage, in.mb});
          if (it == arrived.end()) break;
          if (it->second > now) {
            t.spans.push_back({int(r), std::string("wait ") + to_string(in.op), in.mb, in.chunk,
                               now, it->second});
            now = it->second;
          }
          arrived.erase(it);
        } else if (in.op == Op::send_act || in.op == Op::send_grad) {
          const double latency = in.peer == int(r) ? 0.0 : c.transfer;
          arrived[{in.op == Op::send_grad, in.op == Op::send_grad ? stage - 1 : stage + 1, in.mb}] =
              now + latency;
        } else {
          double cost = is_compute(in.op) ? c.of(in.op, stage) : 0.0;
          if (in.op == Op::reduce_grads) cost = c.reduce;
          if (in.op == Op::optimizer_step) cost = c.step;
          t.spans.push_back({int(r), to_string(in.op), in.mb, in.chunk, now, now + cost});
          now += cost;
          if (is_compute(in.op)) t.busy[r] += cost;
          if (in.op == Op::forward) {
            t.peak_inflight[r] = std::max(t.peak_inflight[r], ++inflight[r]);
          }
          if (in.op == Op::backward || in.op == Op::backward_weight) --inflight[r];
          if (is_compute(in.op) && in.op != Op::forward) t.last_backward[r] = now;
        }
        ++pc[r];
        progress = true;
      }
      if (pc[r] == prog.size()) ++done;
    }
    if (!progress && done < P) {
      std::string stuck;
      for (size_t r = 0; r < P; ++r) {
        if (pc[r] == s.ranks[r].size()) continue;
        const Instr& in = s.ranks[r][pc[r]];
        stuck += fmt::format("; rank {} at instruction {} ({} mb {} chunk {})", r, pc[r],
                             to_string(in.op), in.mb, in.chunk);
      }
      fail("[pipeline] the {} schedule (p={}, m={}, v={}) deadlocks{}", to_string(s.kind), s.p, s.m,
           s.v, stuck);
    }
  }
  for (size_t r = 0; r < P; ++r) {
    t.flush = std::max(t.flush, t.last_backward[r]);
    t.makespan = std::max(t.makespan, clock[r]);
  }
  return t;
}

}  // namespace tetra::pipeline
