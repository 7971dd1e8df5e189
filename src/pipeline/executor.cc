#include "pipeline/executor.h"

#include <algorithm>
#include <map>
#include <memory>
#include <tuple>

#include "comm/flight.h"
#include "core/arena.h"
#include "core/error.h"
#include "core/timer.h"

namespace tetra::pipeline {

namespace {

// What the flight recorder says a rank does while it runs `op`.
comm::flight::Phase flight_phase(Op op) {
  using comm::flight::Phase;
  switch (op) {
    case Op::recv_act:
      return Phase::recv_activations;
    case Op::forward:
      return Phase::forward;
    case Op::recv_grad:
      return Phase::recv_gradients;
    case Op::backward:
    case Op::backward_input:
    case Op::backward_weight:
      return Phase::backward;
    case Op::send_act:
    case Op::send_grad:
      return Phase::send;
    case Op::reduce_grads:
      return Phase::reduce_gradients;
    case Op::optimizer_step:
      return Phase::optimizer;
  }
  return Phase::between_steps;
}

// Activations and gradients travel on their own tags: with two ranks both flow between the same
// pair. Within a tag, messages between a pair arrive in the order sent, and every schedule sends
// and receives them in the same (micro-batch, chunk) order.
constexpr int kActTag = 1, kGradTag = 2;

bool is_recv(Op op) { return op == Op::recv_act || op == Op::recv_grad; }

// Whether an instruction is about a gradient (travelling back) rather than an activation.
bool is_grad(Op op) {
  return op == Op::recv_grad || op == Op::backward || op == Op::backward_input ||
         op == Op::send_grad;
}

}  // namespace

Executor::Executor(Schedule schedule, comm::Communicator group, Device& device)
    : schedule_(std::move(schedule)), group_(std::move(group)), device_(device) {
  if (schedule_.p > 1) {
    TETRA_CHECK(group_.valid() && group_.size() == schedule_.p,
                "[pipeline] internal: a schedule of {} ranks needs a pipeline group of that size "
                "(got {})",
                schedule_.p, group_.valid() ? group_.size() : 0);
    rank_ = group_.rank();
  }
}

StepStats Executor::run(StageModel& model, const std::function<void()>& reduce_grads,
                        const std::function<void()>& optimizer_step) {
  return execute(schedule_, model, reduce_grads, optimizer_step);
}

StepStats Executor::run_forward(StageModel& model, int micro_batches) {
  return execute(make_forward_schedule(schedule_.p, micro_batches, schedule_.v, schedule_.kind),
                 model, {}, {});
}

StepStats Executor::execute(const Schedule& program, StageModel& model,
                            const std::function<void()>& reduce_grads,
                            const std::function<void()>& optimizer_step) {
  using Buffer = tetra::Buffer<float>;
  using Key = std::tuple<bool, int, int>;  // (gradient, micro-batch, chunk)
  const std::vector<Instr>& prog = program.ranks[size_t(rank_)];
  const size_t n = model.boundary_size();
  // A zero-bubble program's B and W; forward-only programs run any stage model.
  SplitStageModel* split = nullptr;
  for (const Instr& in : prog) {
    if (in.op != Op::backward_input && in.op != Op::backward_weight) continue;
    split = dynamic_cast<SplitStageModel*>(&model);
    TETRA_CHECK(split,
                "[pipeline] internal: the {} schedule needs a stage model with a split backward",
                to_string(program.kind));
    break;
  }
  StepStats stats;
  Timeline& tl = stats.timeline;
  tl.busy.assign(size_t(program.p), 0.0);
  tl.last_backward.assign(size_t(program.p), 0.0);
  tl.peak_inflight.assign(size_t(program.p), 0);
  const double start = now_s();
  auto since = [&] { return now_s() - start; };

  std::vector<std::unique_ptr<Buffer>> pool;
  auto take = [&] {
    if (pool.empty()) return std::make_unique<Buffer>(n, MemTag{}, device_);
    std::unique_ptr<Buffer> b = std::move(pool.back());
    pool.pop_back();
    return b;
  };
  // Posted receives and arrived data, by what they carry; outputs waiting to be sent; sends in
  // flight with the buffer each reads.
  std::map<Key, std::pair<comm::Work, std::unique_ptr<Buffer>>> posted;
  std::map<Key, std::unique_ptr<Buffer>> outputs;
  std::vector<std::pair<comm::Work, std::unique_ptr<Buffer>>> sending;
  size_t next_recv[2] = {0, 0};  // per kind: the program position of the next receive to post

  // Posts the first receive of `grad`'s kind at or after position `from`.
  auto post_next = [&](bool grad, size_t from) {
    for (size_t k = from; k < prog.size(); ++k) {
      const Instr& in = prog[k];
      // A transfer to itself (zb_v's turn) is handed over by its send.
      if (!is_recv(in.op) || (in.op == Op::recv_grad) != grad || in.peer == rank_) continue;
      std::unique_ptr<Buffer> b = take();
      const comm::flight::Site site(grad ? "pp.recv_grad" : "pp.recv_act");
      comm::Work w =
          group_.recv(std::span<float>(b->data(), b->size()), in.peer, grad ? kGradTag : kActTag);
      posted[{grad, in.mb, in.chunk}] = {w, std::move(b)};
      next_recv[grad] = k + 1;
      return;
    }
    next_recv[grad] = prog.size();
  };
  auto reap = [&](bool all) {
    for (size_t i = 0; i < sending.size();) {
      if (all || sending[i].first.done()) {
        const double t = now_s();
        sending[i].first.wait();
        stats.p2p_wait_s += now_s() - t;
        stats.sent_bytes += sending[i].first.sent_bytes();
        pool.push_back(std::move(sending[i].second));
        sending.erase(sending.begin() + long(i));
      } else {
        ++i;
      }
    }
  };
  if (program.p > 1) {
    post_next(false, 0);
    post_next(true, 0);
  }

  int inflight = 0;
  std::map<Key, std::unique_ptr<Buffer>> received;
  for (size_t k = 0; k < prog.size(); ++k) {
    const Instr& in = prog[k];
    reap(false);
    const Key key{is_grad(in.op), in.mb, in.chunk};
    const double t0 = since();
    comm::flight::enter(flight_phase(in.op), in.mb, program.stage(rank_, in.chunk));
    switch (in.op) {
      case Op::recv_act:
      case Op::recv_grad: {
        const bool grad = in.op == Op::recv_grad;
        if (in.peer == rank_) {
          TETRA_CHECK(received.count(key),
                      "[pipeline] internal: rank {} receives {} mb {} chunk {} from itself "
                      "before sending it",
                      rank_, to_string(in.op), in.mb, in.chunk);
          break;
        }
        auto it = posted.find(key);
        TETRA_CHECK(it != posted.end(),
                    "[pipeline] internal: rank {} receives {} mb {} chunk {} "
                    "that was never posted",
                    rank_, to_string(in.op), in.mb, in.chunk);
        it->second.first.wait();
        received[key] = std::move(it->second.second);
        posted.erase(it);
        const double waited = since() - t0;
        stats.p2p_wait_s += waited;
        if (waited > 0)
          tl.spans.push_back(
              {rank_, std::string("wait ") + to_string(in.op), in.mb, in.chunk, t0, t0 + waited});
        if (next_recv[grad] < prog.size()) post_next(grad, next_recv[grad]);
        break;
      }
      case Op::forward:
      case Op::backward:
      case Op::backward_input: {
        const bool fwd = in.op == Op::forward;
        const Key incoming{!fwd, in.mb, in.chunk};
        auto got = received.find(incoming);
        const float* input = got == received.end() ? nullptr : got->second->data();
        const int stage = program.stage(rank_, in.chunk);
        const bool edge = fwd ? stage == program.p * program.v - 1 : stage == 0;
        std::unique_ptr<Buffer> out = edge ? nullptr : take();
        if (fwd) {
          model.forward(in.mb, in.chunk, input, out ? out->data() : nullptr);
          tl.peak_inflight[size_t(rank_)] = std::max(tl.peak_inflight[size_t(rank_)], ++inflight);
        } else if (in.op == Op::backward) {
          model.backward(in.mb, in.chunk, input, out ? out->data() : nullptr);
          --inflight;
        } else {
          split->backward_input(in.mb, in.chunk, input, out ? out->data() : nullptr);
        }
        if (got != received.end()) {
          pool.push_back(std::move(got->second));
          received.erase(got);
        }
        if (out) outputs[key] = std::move(out);
        const double t1 = since();
        tl.spans.push_back({rank_, to_string(in.op), in.mb, in.chunk, t0, t1});
        tl.busy[size_t(rank_)] += t1 - t0;
        if (!fwd) tl.last_backward[size_t(rank_)] = t1;
        break;
      }
      case Op::backward_weight: {
        split->backward_weight(in.mb, in.chunk);
        --inflight;
        const double t1 = since();
        tl.spans.push_back({rank_, to_string(in.op), in.mb, in.chunk, t0, t1});
        tl.busy[size_t(rank_)] += t1 - t0;
        tl.last_backward[size_t(rank_)] = t1;
        break;
      }
      case Op::send_act:
      case Op::send_grad: {
        auto it = outputs.find(key);
        TETRA_CHECK(it != outputs.end(),
                    "[pipeline] internal: rank {} sends {} mb {} chunk {} "
                    "before computing it",
                    rank_, to_string(in.op), in.mb, in.chunk);
        if (in.peer == rank_) {
          // zb_v's turn: the next (or, for a gradient, the previous) stage is this rank's other
          // chunk.
          const bool grad = in.op == Op::send_grad;
          const int to = program.chunk_of(program.stage(rank_, in.chunk) + (grad ? -1 : 1));
          received[{grad, in.mb, to}] = std::move(it->second);
          outputs.erase(it);
          break;
        }
        const Buffer& out = *it->second;
        const comm::flight::Site site(in.op == Op::send_grad ? "pp.send_grad" : "pp.send_act");
        comm::Work w = group_.send(std::span<const float>(out.data(), out.size()), in.peer,
                                   in.op == Op::send_grad ? kGradTag : kActTag);
        sending.emplace_back(w, std::move(it->second));
        outputs.erase(it);
        break;
      }
      case Op::reduce_grads:
      case Op::optimizer_step: {
        (in.op == Op::reduce_grads ? reduce_grads : optimizer_step)();
        tl.spans.push_back({rank_, to_string(in.op), -1, 0, t0, since()});
        break;
      }
    }
  }
  reap(true);
  tl.flush = tl.last_backward[size_t(rank_)];
  tl.makespan = since();
  return stats;
}

BubbleStats measure_bubble(const Schedule& sched, const StepStats& stats,
                           const comm::Communicator& group) {
  const Timeline& tl = stats.timeline;
  const int rank = group.rank();
  // Per rank: busy, last backward, then per chunk the mean forward, backward (B and W) and W.
  const size_t v = size_t(sched.v), n = 2 + 3 * v;
  std::vector<float> mine(n, 0.0f), all(n * size_t(sched.p));
  mine[0] = float(tl.busy[size_t(rank)]);
  mine[1] = float(tl.last_backward[size_t(rank)]);
  for (const Span& span : tl.spans) {
    const float share = float((span.end - span.start) / sched.m);
    const size_t c = size_t(span.chunk);
    if (span.name == "forward") mine[2 + c] += share;
    if (span.name == "backward" || span.name == "backward_input") mine[2 + v + c] += share;
    if (span.name == "backward_weight") {
      mine[2 + v + c] += share;
      mine[2 + 2 * v + c] += share;
    }
  }
  group.all_gather(std::span<const float>(mine), std::span<float>(all)).wait();
  const int stages = sched.p * sched.v;
  Costs costs = Costs::uniform(stages, 0.0, 0.0);
  costs.weight.assign(size_t(stages), 0.0);
  double flush = 0.0, busy = 0.0, f = 0.0, bw = 0.0, w = 0.0;
  for (int r = 0; r < sched.p; ++r) {
    const float* a = all.data() + size_t(r) * n;
    busy += a[0];
    flush = std::max(flush, double(a[1]));
    for (int c = 0; c < sched.v; ++c) {
      const size_t st = size_t(sched.stage(r, c));
      costs.forward[st] = a[2 + c];
      costs.backward[st] = a[2 + v + size_t(c)];
      costs.weight[st] = a[2 + 2 * v + size_t(c)];
      f += costs.forward[st] / stages;
      bw += costs.backward[st] / stages;
      w += costs.weight[st] / stages;
    }
  }
  BubbleStats b;
  b.measured = flush > 0 ? 1.0 - busy / sched.p / flush : 0.0;
  b.simulated = simulate(sched, costs).bubble();
  b.formula = bubble_formula(sched, f, bw, w);
  return b;
}

double bubble_formula(const Schedule& s, double forward, double backward, double weight) {
  const double p = s.p, m = s.m;
  if (!s.split_backward()) return (p - 1) / (double(s.v) * m + p - 1);
  const double b = backward - weight, work = m * double(s.v) * (forward + backward);
  const double idle =
      (p - 1) * (s.kind == Kind::zb_h1 ? std::max(forward, forward + b - weight) : forward);
  return idle / (work + idle);
}

}  // namespace tetra::pipeline
