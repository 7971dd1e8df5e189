#include "pipeline/schedule.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <optional>

#include "core/error.h"

namespace tetra::pipeline {

Kind parse_kind(const std::string& text) {
  if (text == "gpipe") return Kind::gpipe;
  if (text == "1f1b") return Kind::one_f_one_b;
  if (text == "interleaved") return Kind::interleaved;
  if (text == "zb_h1") return Kind::zb_h1;
  if (text == "zb_v") return Kind::zb_v;
  fail("[pipeline] unknown schedule '{}'; use gpipe, 1f1b, interleaved, zb_h1 or zb_v", text);
}

const char* to_string(Kind k) {
  switch (k) {
    case Kind::gpipe:
      return "gpipe";
    case Kind::one_f_one_b:
      return "1f1b";
    case Kind::interleaved:
      return "interleaved";
    case Kind::zb_h1:
      return "zb_h1";
    case Kind::zb_v:
      return "zb_v";
  }
  return "?";
}

const char* to_string(Op op) {
  switch (op) {
    case Op::recv_act:
      return "recv_act";
    case Op::forward:
      return "forward";
    case Op::send_act:
      return "send_act";
    case Op::recv_grad:
      return "recv_grad";
    case Op::backward:
      return "backward";
    case Op::send_grad:
      return "send_grad";
    case Op::backward_input:
      return "backward_input";
    case Op::backward_weight:
      return "backward_weight";
    case Op::reduce_grads:
      return "reduce_grads";
    case Op::optimizer_step:
      return "optimizer_step";
  }
  return "?";
}

namespace {

// Appends a forward or backward of (mb, chunk) on `rank` with the transfers around it.
struct Emitter {
  const Schedule& s;
  std::vector<Instr>& out;
  int rank;

  // The ranks of the stages before and after `chunk`'s.
  int prev(int chunk) const { return s.rank_of(s.stage(rank, chunk) - 1); }
  int next(int chunk) const { return s.rank_of(s.stage(rank, chunk) + 1); }
  bool first(int chunk) const { return s.stage(rank, chunk) == 0; }
  bool last(int chunk) const { return s.stage(rank, chunk) == s.p * s.v - 1; }

  void forward(int mb, int chunk) {
    if (!first(chunk)) out.push_back({Op::recv_act, mb, chunk, prev(chunk)});
    out.push_back({Op::forward, mb, chunk, -1});
    if (!last(chunk)) out.push_back({Op::send_act, mb, chunk, next(chunk)});
  }
  // The whole backward, or (split) its B: the previous stage's gradient is sent after either.
  void backward(int mb, int chunk, Op op = Op::backward) {
    if (!last(chunk)) out.push_back({Op::recv_grad, mb, chunk, next(chunk)});
    out.push_back({op, mb, chunk, -1});
    if (!first(chunk)) out.push_back({Op::send_grad, mb, chunk, prev(chunk)});
  }
  void weight(int mb, int chunk) { out.push_back({Op::backward_weight, mb, chunk, -1}); }
};

// The zero-bubble programs (make_schedule's comment): list scheduling at unit costs.
struct Task {
  Op op;
  int mb, chunk;
};

// How a free rank chooses among what is ready: the oldest W when more than w_cap[r] are pending,
// then a forward before a B if `forward_first` (else a B before a forward), and the oldest W when
// nothing else is.
struct Policy {
  std::vector<int> w_cap;
  bool forward_first = false;
};

struct ListSchedule {
  std::vector<std::vector<Task>> order;  // each rank's F, B and W in the order it ran them
  int makespan = 0;                      // unit steps
};

ListSchedule list_schedule(const Schedule& s, const Policy& policy) {
  const int p = s.p, m = s.m, v = s.v, stages = p * v;
  const size_t P = size_t(p);
  ListSchedule out;
  out.order.resize(P);
  constexpr int kNever = std::numeric_limits<int>::max();
  // When (mb, stage)'s input activation and output gradient are there (unit steps).
  std::vector<std::vector<int>> act(size_t(stages), std::vector<int>(size_t(m), kNever));
  std::vector<std::vector<int>> grad = act;
  for (int i = 0; i < m; ++i) act[0][size_t(i)] = 0;
  std::vector<std::vector<int>> next_f(P, std::vector<int>(size_t(v), 0)), next_b = next_f;
  std::vector<std::deque<std::pair<int, int>>> pending_w(P);  // (mb, chunk) after B
  // Activations held (forwarded, W not done) and, of them, not yet through B.
  std::vector<int> held(P, 0), before_b(P, 0), clock(P, 0);
  auto may_forward = [&](int r) {
    if (s.kind == Kind::zb_v) return held[size_t(r)] < 2 * p;
    return held[size_t(r)] < p && before_b[size_t(r)] < p - r;
  };
  const int total = 3 * m * v;  // tasks per rank
  // Unit steps: a task started at t ends, and its output arrives, at t + 1.
  for (int t = 0;; ++t) {
    bool all_done = true, busy = false;
    for (int r = 0; r < p; ++r) {
      std::vector<Task>& order = out.order[size_t(r)];
      if (int(order.size()) == total) continue;
      all_done = false;
      if (clock[size_t(r)] > t) {
        busy = true;
        continue;
      }
      // The chunk nearer the loss first (it is also the earlier in backward order).
      std::optional<Task> b, f, w;
      for (int c = v - 1; c >= 0 && !b; --c) {
        const int mb = next_b[size_t(r)][size_t(c)], st = s.stage(r, c);
        if (mb < next_f[size_t(r)][size_t(c)] && grad[size_t(st)][size_t(mb)] <= t) {
          b = Task{Op::backward_input, mb, c};
        }
      }
      for (int c = v - 1; c >= 0 && !f && may_forward(r); --c) {
        const int mb = next_f[size_t(r)][size_t(c)], st = s.stage(r, c);
        if (mb < m && act[size_t(st)][size_t(mb)] <= t) f = Task{Op::forward, mb, c};
      }
      if (!pending_w[size_t(r)].empty()) {
        const auto [mb, c] = pending_w[size_t(r)].front();
        w = Task{Op::backward_weight, mb, c};
      }
      const bool must_w = int(pending_w[size_t(r)].size()) > policy.w_cap[size_t(r)];
      std::optional<Task> pick = w;
      if (!must_w) {
        const std::optional<Task>& first = policy.forward_first ? f : b;
        const std::optional<Task>& second = policy.forward_first ? b : f;
        pick = first ? first : second ? second : w;
      }
      if (!pick) continue;
      const Task k = *pick;
      const int st = s.stage(r, k.chunk), end = t + 1;
      if (k.op == Op::forward) {
        ++next_f[size_t(r)][size_t(k.chunk)];
        ++held[size_t(r)];
        ++before_b[size_t(r)];
        if (st + 1 < stages) {
          act[size_t(st) + 1][size_t(k.mb)] = end;
        } else {
          grad[size_t(st)][size_t(k.mb)] = end;  // the loss: backward may start
        }
      } else if (k.op == Op::backward_input) {
        ++next_b[size_t(r)][size_t(k.chunk)];
        pending_w[size_t(r)].push_back({k.mb, k.chunk});
        --before_b[size_t(r)];
        if (st > 0) grad[size_t(st) - 1][size_t(k.mb)] = end;
      } else {
        pending_w[size_t(r)].pop_front();
        --held[size_t(r)];
      }
      order.push_back(k);
      clock[size_t(r)] = end;
      out.makespan = std::max(out.makespan, end);
      busy = true;
    }
    if (all_done) break;
    // Nothing running and nothing started: no message is on its way, so nothing ever will be.
    TETRA_CHECK(busy, "[pipeline] internal: the {} list scheduler (p={}, m={}) is stuck at step {}",
                to_string(s.kind), p, m, t);
  }
  return out;
}

// Writes the programs of the policy whose unit-cost run is shortest, the first of equals: rank
// r deferring up to r W's with forwards before B's (the paper's ZB-H1: 1F1B's order, whose idle
// at the end the deferred W's fill), or up to r + 1, r + 2 or 2r; or every W deferred while the
// rank has anything else to run, B's first. Simulated at unit costs, the first meets zb_h1's
// bound at every m >= p; zb_v needs the others (docs/pipeline.md).
void zero_bubble(Schedule& s) {
  const int p = s.p;
  std::vector<Policy> policies;
  for (const auto& [per_rank, extra] : {std::pair{1, 0}, {1, 1}, {1, 2}, {2, 0}}) {
    Policy deferring{std::vector<int>(size_t(p)), true};
    for (int r = 0; r < p; ++r) deferring.w_cap[size_t(r)] = per_rank * r + extra;
    policies.push_back(deferring);
  }
  policies.push_back({std::vector<int>(size_t(p), std::numeric_limits<int>::max()), false});
  std::optional<ListSchedule> best;
  for (const Policy& policy : policies) {
    ListSchedule run = list_schedule(s, policy);
    if (!best || run.makespan < best->makespan) best = std::move(run);
  }
  for (int r = 0; r < p; ++r) {
    Emitter e{s, s.ranks[size_t(r)], r};
    for (const Task& k : best->order[size_t(r)]) {
      if (k.op == Op::forward) e.forward(k.mb, k.chunk);
      if (k.op == Op::backward_input) e.backward(k.mb, k.chunk, Op::backward_input);
      if (k.op == Op::backward_weight) e.weight(k.mb, k.chunk);
    }
  }
}

}  // namespace

Schedule make_schedule(Kind kind, int p, int m, int v) {
  TETRA_CHECK(p >= 1 && m >= 1,
              "[pipeline] {} needs at least one stage and one micro-batch (got "
              "p={}, m={})",
              to_string(kind), p, m);
  if (kind == Kind::zb_v) {
    TETRA_CHECK(v == 2,
                "[pipeline] the zb_v schedule runs two chunks per rank in a V (got v={}); set v=2",
                v);
  } else if (kind == Kind::interleaved) {
    TETRA_CHECK(p >= 2 && v >= 2,
                "[pipeline] the interleaved schedule needs pp>=2 and at least 2 chunks per rank "
                "(got pp={}, v={}); set v=2, or use 1f1b",
                p, v);
    TETRA_CHECK(m % p == 0,
                "[pipeline] the interleaved schedule sends micro-batches round the ranks in groups "
                "of pp, so the micro-batch count must be a multiple of pp={} (got m={}); use m={} "
                "or {}, or 1f1b",
                p, m, std::max(p, m / p * p), (m / p + 1) * p);
  } else {
    TETRA_CHECK(v == 1,
                "[pipeline] {} runs one chunk per rank (got v={}); set v=1, or use the "
                "interleaved or zb_v schedule",
                to_string(kind), v);
  }
  Schedule s;
  s.kind = kind;
  s.p = p;
  s.m = m;
  s.v = v;
  s.ranks.resize(size_t(p));
  if (s.split_backward()) zero_bubble(s);
  for (int r = 0; r < p; ++r) {
    std::vector<Instr>& out = s.ranks[size_t(r)];
    Emitter e{s, out, r};
    switch (kind) {
      case Kind::gpipe:
        for (int i = 0; i < m; ++i) e.forward(i, 0);
        for (int i = 0; i < m; ++i) e.backward(i, 0);
        break;
      case Kind::one_f_one_b: {
        // Warm-up forwards fill the pipe below this rank; then one forward, one backward.
        const int warm = std::min(p - r - 1, m);
        for (int i = 0; i < warm; ++i) e.forward(i, 0);
        for (int i = 0; i < m - warm; ++i) {
          e.forward(warm + i, 0);
          e.backward(i, 0);
        }
        for (int i = m - warm; i < m; ++i) e.backward(i, 0);
        break;
      }
      case Kind::interleaved: {
        // Megatron-LM's order: micro-batches go round in groups of p, each group through chunk
        // 0, 1, ..., v-1 (forward) or v-1, ..., 0 (backward).
        const int total = m * v, group = p * v;
        auto mb_of = [&](int k) { return k / group * p + k % p; };
        auto fwd_chunk = [&](int k) { return k % group / p; };
        auto bwd_chunk = [&](int k) { return v - 1 - k % group / p; };
        const int warm = m == p ? total : std::min(total, (p - r - 1) * 2 + (v - 1) * p);
        for (int k = 0; k < warm; ++k) e.forward(mb_of(k), fwd_chunk(k));
        for (int k = 0; k < total - warm; ++k) {
          e.forward(mb_of(warm + k), fwd_chunk(warm + k));
          e.backward(mb_of(k), bwd_chunk(k));
        }
        for (int k = total - warm; k < total; ++k) e.backward(mb_of(k), bwd_chunk(k));
        break;
      }
      case Kind::zb_h1:
      case Kind::zb_v:
        break;  // zero_bubble wrote the passes
    }
    out.push_back({Op::reduce_grads, -1, 0, -1});
    out.push_back({Op::optimizer_step, -1, 0, -1});
  }
  return s;
}

Schedule make_forward_schedule(int p, int m, int v, Kind placement) {
  TETRA_CHECK(p >= 1 && m >= 1 && v >= 1,
              "[pipeline] a forward pass needs at least one stage, micro-batch and chunk (got "
              "p={}, m={}, v={})",
              p, m, v);
  Schedule s;
  s.kind = placement == Kind::zb_v ? Kind::zb_v : v > 1 ? Kind::interleaved : Kind::gpipe;
  s.p = p;
  s.m = m;
  s.v = v;
  s.ranks.resize(size_t(p));
  for (int r = 0; r < p; ++r) {
    Emitter e{s, s.ranks[size_t(r)], r};
    for (int i = 0; i < m; ++i) {
      for (int c = 0; c < v; ++c) e.forward(i, c);
    }
  }
  return s;
}

Split balance_split(int layers, int stages, double embedding_cost, double head_cost) {
  TETRA_CHECK(stages >= 1 && layers >= stages,
              "[pipeline] {} layers cannot fill {} stages: each stage needs at least one layer; "
              "use at most {} stages",
              layers, stages, layers);
  const double inf = std::numeric_limits<double>::infinity();
  auto cost = [&](int k, int a, int b) {  // stage k holding layers [a, b)
    return double(b - a) + (k == 0 ? embedding_cost : 0.0) + (k == stages - 1 ? head_cost : 0.0);
  };
  // best[k][j]: over splits of layers [0, j) into stages 0..k-1, the least maximum stage cost,
  // then the least sum of squared costs (the most even among them); cut[k][j] its last cut.
  using Score = std::pair<double, double>;
  std::vector<std::vector<Score>> best(size_t(stages) + 1,
                                       std::vector<Score>(size_t(layers) + 1, {inf, inf}));
  std::vector<std::vector<int>> cut(size_t(stages) + 1, std::vector<int>(size_t(layers) + 1, 0));
  best[0][0] = {0, 0};
  for (int k = 1; k <= stages; ++k) {
    for (int j = k; j <= layers - (stages - k); ++j) {
      // The latest cut among equals keeps later stages no heavier than earlier ones.
      for (int a = k - 1; a < j; ++a) {
        const Score& prev = best[size_t(k) - 1][size_t(a)];
        const double c = cost(k - 1, a, j);
        const Score score{std::max(prev.first, c), prev.second + c * c};
        if (score <= best[size_t(k)][size_t(j)]) {
          best[size_t(k)][size_t(j)] = score;
          cut[size_t(k)][size_t(j)] = a;
        }
      }
    }
  }
  Split split(static_cast<size_t>(stages));
  for (int k = stages, j = layers; k > 0; --k) {
    const int a = cut[size_t(k)][size_t(j)];
    split[size_t(k) - 1] = j - a;
    j = a;
  }
  return split;
}

std::vector<int> peak_inflight_per_chunk(const Schedule& s, int rank) {
  std::vector<int> now(size_t(s.v), 0), peak(size_t(s.v), 0);
  for (const Instr& in : s.ranks[size_t(rank)]) {
    int& n = now[size_t(in.chunk)];
    if (in.op == Op::forward) peak[size_t(in.chunk)] = std::max(peak[size_t(in.chunk)], ++n);
    if (in.op == Op::backward || in.op == Op::backward_input) --n;
  }
  return peak;
}

std::vector<std::vector<int>> pending_weight_grads(const Schedule& s, int rank) {
  std::vector<std::vector<int>> states;
  std::vector<int> now(size_t(s.v), 0);
  for (const Instr& in : s.ranks[size_t(rank)]) {
    if (in.op == Op::backward_input) {
      ++now[size_t(in.chunk)];
      states.push_back(now);
    }
    if (in.op == Op::backward_weight) --now[size_t(in.chunk)];
  }
  return states;
}

Split parse_split(const std::string& text, int layers, int stages, double embedding_cost,
                  double head_cost, const std::string& key) {
  TETRA_CHECK(stages >= 1 && layers >= stages,
              "[pipeline] {} pipeline stages for {} layers: each stage needs at least one layer; "
              "use at most {} stages (pp x v)",
              stages, layers, layers);
  if (text == "auto") return balance_split(layers, stages, embedding_cost, head_cost);
  if (text.empty()) {
    TETRA_CHECK(layers % stages == 0,
                "[pipeline] {} layers do not split evenly over {} stages; give {} an explicit "
                "split such as \"{}\" or auto",
                layers, stages, key, [&] {
                  std::string out;
                  for (int v : balance_split(layers, stages, 0, 0)) {
                    if (!out.empty()) out += ',';
                    out += std::to_string(v);
                  }
                  return out;
                }());
    return Split(size_t(stages), layers / stages);
  }
  Split split;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(start, end - start);
    TETRA_CHECK(!item.empty() && item.size() <= 6 &&
                    item.find_first_not_of("0123456789") == std::string::npos &&
                    std::stoi(item) >= 1,
                "[pipeline] {}=\"{}\": '{}' is not a layer count; give one positive count per "
                "stage, e.g. \"5,6,6,5\", or auto",
                key, text, item);
    split.push_back(std::stoi(item));
    start = end + 1;
  }
  int sum = 0;
  for (int n : split) sum += n;
  TETRA_CHECK(int(split.size()) == stages && sum == layers,
              "[pipeline] {}=\"{}\" gives {} stage(s) holding {} layers, but the model has {} "
              "layers on {} stages (pp x v): give {} counts that sum to {}",
              key, text, split.size(), sum, layers, stages, stages, layers);
  return split;
}

}  // namespace tetra::pipeline
