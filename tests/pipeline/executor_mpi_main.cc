// The pipeline executor across ranks on a small chain of tanh layers: for GPipe, 1F1B,
// interleaved and the zero-bubble schedules (ZB-H1, and ZB-V with its V-shaped placement and the
// hop to itself at the turn; the chain's backward split into input and weight gradients), even
// and uneven stage splits and several micro-batch counts, every rank's parameter gradients and
// the loss equal, bit for bit, those of the whole chain computed serially with gradient
// accumulation; the update runs once, after the reduction, after every backward. Exit 1 on any
// mismatch.
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <vector>

#include "comm/communicator.h"
#include "pipeline/executor.h"

using namespace tetra;

namespace {

constexpr int kWidth = 8, kBatch = 3;  // activation width, samples per micro-batch

// y = tanh(W x + b) per layer; loss = 0.5 * sum((y_L - target)^2) over every micro-batch.
struct Chain {
  int layers;
  std::vector<std::vector<float>> w, b, gw, gb;
  explicit Chain(int l) : layers(l), w(l), b(l), gw(l), gb(l) {
    for (int i = 0; i < l; ++i) {
      w[i].resize(kWidth * kWidth);
      b[i].resize(kWidth);
      for (int j = 0; j < kWidth * kWidth; ++j) w[i][j] = 0.4f * std::sin(float(1 + i * 131 + j));
      for (int j = 0; j < kWidth; ++j) b[i][j] = 0.1f * std::cos(float(7 + i * 17 + j));
      gw[i].assign(w[i].size(), 0.0f);
      gb[i].assign(b[i].size(), 0.0f);
    }
  }
  static std::vector<float> input(int mb) {
    std::vector<float> x(kBatch * kWidth);
    for (size_t j = 0; j < x.size(); ++j) x[j] = std::sin(float(mb * 1000 + j) * 0.37f);
    return x;
  }
  static float target(int mb, size_t j) { return std::cos(float(mb * 77 + j) * 0.11f); }

  // Forward of layers [lo, hi) from x; `acts` gets each layer's output.
  void forward(int lo, int hi, const float* x, std::vector<std::vector<float>>& acts) const {
    acts.assign(size_t(hi - lo), std::vector<float>(kBatch * kWidth));
    for (int l = lo; l < hi; ++l) {
      const float* in = l == lo ? x : acts[size_t(l - lo - 1)].data();
      float* out = acts[size_t(l - lo)].data();
      for (int s = 0; s < kBatch; ++s) {
        for (int o = 0; o < kWidth; ++o) {
          float z = b[l][o];
          for (int i = 0; i < kWidth; ++i) z += w[l][o * kWidth + i] * in[s * kWidth + i];
          out[s * kWidth + o] = std::tanh(z);
        }
      }
    }
  }
  // Backward of layers [lo, hi): dy is the gradient of layer hi-1's output; writes the
  // gradient of x into dx (if not null); accumulates gw, gb.
  void backward(int lo, int hi, const float* x, const std::vector<std::vector<float>>& acts,
                std::vector<float> dy, float* dx) {
    std::vector<std::vector<float>> dz;
    backward_input(lo, hi, acts, std::move(dy), dx, dz);
    backward_weight(lo, hi, x, acts, dz);
  }
  // The input-gradient half: dx as backward's, and each layer's dz for the weight half.
  void backward_input(int lo, int hi, const std::vector<std::vector<float>>& acts,
                      std::vector<float> dy, float* dx, std::vector<std::vector<float>>& dz) const {
    dz.assign(size_t(hi - lo), {});
    for (int l = hi - 1; l >= lo; --l) {
      const std::vector<float>& y = acts[size_t(l - lo)];
      std::vector<float>& d = dz[size_t(l - lo)];
      std::vector<float> din(dy.size(), 0.0f);
      d.resize(dy.size());
      for (size_t j = 0; j < dy.size(); ++j) d[j] = dy[j] * (1.0f - y[j] * y[j]);
      for (int s = 0; s < kBatch; ++s) {
        for (int o = 0; o < kWidth; ++o) {
          for (int i = 0; i < kWidth; ++i) {
            din[s * kWidth + i] += w[l][o * kWidth + i] * d[s * kWidth + o];
          }
        }
      }
      dy = std::move(din);
    }
    if (dx) std::memcpy(dx, dy.data(), dy.size() * sizeof(float));
  }
  // The weight half: gw and gb accumulate from each layer's input and dz.
  void backward_weight(int lo, int hi, const float* x, const std::vector<std::vector<float>>& acts,
                       const std::vector<std::vector<float>>& dz) {
    for (int l = hi - 1; l >= lo; --l) {
      const float* in = l == lo ? x : acts[size_t(l - lo - 1)].data();
      for (int s = 0; s < kBatch; ++s) {
        for (int o = 0; o < kWidth; ++o) {
          const float g = dz[size_t(l - lo)][s * kWidth + o];
          gb[l][o] += g;
          for (int i = 0; i < kWidth; ++i) gw[l][o * kWidth + i] += g * in[s * kWidth + i];
        }
      }
    }
  }
};

// The executor's view of this rank's chunks of a Chain.
class ChainStages : public pipeline::SplitStageModel {
 public:
  ChainStages(Chain& chain, const pipeline::Schedule& s, const std::vector<int>& split, int rank)
      : chain_(chain), s_(s), rank_(rank) {
    int first = 0;
    for (int stage = 0; stage < int(split.size()); ++stage) {
      bounds_.push_back({first, first + split[size_t(stage)]});
      first += split[size_t(stage)];
    }
  }
  size_t boundary_size() const override { return kBatch * kWidth; }
  void forward(int mb, int chunk, const float* input, float* output) override {
    const int stage = s_.stage(rank_, chunk);
    Saved& sv = saved_[{mb, chunk}];
    sv.x = input ? std::vector<float>(input, input + boundary_size()) : Chain::input(mb);
    chain_.forward(bounds_[size_t(stage)].first, bounds_[size_t(stage)].second, sv.x.data(),
                   sv.acts);
    if (output) std::memcpy(output, sv.acts.back().data(), boundary_size() * sizeof(float));
    if (!output) {
      for (size_t j = 0; j < boundary_size(); ++j) {
        const float d = sv.acts.back()[j] - Chain::target(mb, j);
        loss += 0.5 * double(d) * double(d);
      }
    }
  }
  void backward(int mb, int chunk, const float* grad_output, float* grad_input) override {
    const int stage = s_.stage(rank_, chunk);
    auto it = saved_.find({mb, chunk});
    std::vector<float> dy(boundary_size());
    for (size_t j = 0; j < dy.size(); ++j) {
      dy[j] = grad_output ? grad_output[j] : it->second.acts.back()[j] - Chain::target(mb, j);
    }
    chain_.backward(bounds_[size_t(stage)].first, bounds_[size_t(stage)].second,
                    it->second.x.data(), it->second.acts, dy, grad_input);
    saved_.erase(it);
  }
  void backward_input(int mb, int chunk, const float* grad_output, float* grad_input) override {
    const int stage = s_.stage(rank_, chunk);
    Saved& sv = saved_.at({mb, chunk});
    std::vector<float> dy(boundary_size());
    for (size_t j = 0; j < dy.size(); ++j) {
      dy[j] = grad_output ? grad_output[j] : sv.acts.back()[j] - Chain::target(mb, j);
    }
    chain_.backward_input(bounds_[size_t(stage)].first, bounds_[size_t(stage)].second, sv.acts, dy,
                          grad_input, sv.dz);
  }
  void backward_weight(int mb, int chunk) override {
    const int stage = s_.stage(rank_, chunk);
    auto it = saved_.find({mb, chunk});
    chain_.backward_weight(bounds_[size_t(stage)].first, bounds_[size_t(stage)].second,
                           it->second.x.data(), it->second.acts, it->second.dz);
    saved_.erase(it);
  }
  size_t held() const { return saved_.size(); }
  void forget() { saved_.clear(); }
  double loss = 0;

 private:
  struct Saved {
    std::vector<float> x;
    std::vector<std::vector<float>> acts;
    std::vector<std::vector<float>> dz;  // after backward_input, for backward_weight
  };
  Chain& chain_;
  const pipeline::Schedule& s_;
  int rank_;
  std::vector<std::pair<int, int>> bounds_;  // layers of each virtual stage
  std::map<std::pair<int, int>, Saved> saved_;
};

}  // namespace

int main(int argc, char** argv) {
  comm::CommOptions opts;
  opts.timeout_s = 60;
  int failures = 0, cases = 0;
  {
    comm::Communicator world = comm::init_world(opts, &argc, &argv);
    const int p = world.size(), r = world.rank();
    auto expect = [&](bool ok, const std::string& what) {
      if (!ok) ++failures, std::fprintf(stderr, "rank %d: %s\n", r, what.c_str());
    };
    const int layers = 4 * p;
    struct Case {
      pipeline::Kind kind;
      int v, m;
      bool uneven;
    };
    std::vector<Case> all;
    for (int m : {p, 2 * p + 1}) {
      for (bool uneven : {false, true}) {
        all.push_back({pipeline::Kind::gpipe, 1, m, uneven});
        all.push_back({pipeline::Kind::one_f_one_b, 1, m, uneven});
        if (m % p == 0) all.push_back({pipeline::Kind::interleaved, 2, m, uneven});
        all.push_back({pipeline::Kind::zb_h1, 1, m, uneven});
        all.push_back({pipeline::Kind::zb_v, 2, m, uneven});
      }
    }
    for (const Case& c : all) {
      ++cases;
      const std::string name = fmt::format("{} v={} m={}{}", pipeline::to_string(c.kind), c.v, c.m,
                                           c.uneven ? " uneven" : "");
      const int stages = p * c.v;
      std::vector<int> split(size_t(stages), layers / stages);
      if (c.uneven) split.front() += 1, split.back() -= 1;  // e.g. 3,2,...,1 layers
      // Serial reference: the whole chain, micro-batches accumulated in order.
      Chain serial(layers);
      double serial_loss = 0;
      for (int mb = 0; mb < c.m; ++mb) {
        std::vector<std::vector<float>> acts;
        const std::vector<float> x = Chain::input(mb);
        serial.forward(0, layers, x.data(), acts);
        std::vector<float> dy(kBatch * kWidth);
        for (size_t j = 0; j < dy.size(); ++j) {
          dy[j] = acts.back()[j] - Chain::target(mb, j);
          serial_loss += 0.5 * double(dy[j]) * double(dy[j]);
        }
        serial.backward(0, layers, x.data(), acts, dy, nullptr);
      }
      // The pipeline.
      Chain part(layers);
      const pipeline::Schedule sched = pipeline::make_schedule(c.kind, p, c.m, c.v);
      ChainStages model(part, sched, split, r);
      pipeline::Executor exec(sched, world, host_device());
      int reduced = 0, stepped = 0;
      const pipeline::StepStats st = exec.run(
          model, [&] { ++reduced; },
          [&] { expect(reduced == 1, name + ": step before reduce"), ++stepped; });
      expect(reduced == 1 && stepped == 1, name + ": reduce and step once");
      expect(model.held() == 0, name + ": every activation released");
      // This rank's layers: its chunks' ranges.
      int first = 0;
      for (int stage = 0; stage < stages; ++stage) {
        const int n = split[size_t(stage)];
        if (sched.rank_of(stage) == r) {
          for (int l = first; l < first + n; ++l) {
            expect(part.gw[l] == serial.gw[l] && part.gb[l] == serial.gb[l],
                   fmt::format("{}: gradient of layer {} differs", name, l));
          }
        }
        first += n;
      }
      std::vector<float> loss{float(model.loss)};
      world.all_reduce(std::span<float>(loss)).wait();
      expect(loss[0] == float(serial_loss),
             fmt::format("{}: loss {} vs serial {}", name, loss[0], serial_loss));
      // Validation: the forward-only program over the same stages gives the same loss.
      model.loss = 0;
      const pipeline::StepStats fwd = exec.run_forward(model, c.m);
      std::vector<float> eval_loss{float(model.loss)};
      world.all_reduce(std::span<float>(eval_loss)).wait();
      expect(eval_loss[0] == float(serial_loss),
             fmt::format("{}: forward-only loss {} vs serial {}", name, eval_loss[0], serial_loss));
      size_t forwards = 0, backwards = 0;
      for (const auto& sp : fwd.timeline.spans) {
        forwards += sp.name == "forward";
        backwards += sp.name == "backward";
      }
      expect(forwards == size_t(c.m * c.v) && backwards == 0, name + ": forward-only spans");
      model.forget();
      // The measured timeline has every computation of this rank.
      size_t computed = 0;
      for (const auto& sp : st.timeline.spans) {
        computed += sp.name == "forward" || sp.name == "backward" || sp.name == "backward_input" ||
                    sp.name == "backward_weight";
      }
      const size_t passes = sched.split_backward() ? 3 : 2;
      expect(computed == passes * size_t(c.m * c.v), name + ": timeline spans");
      expect(st.timeline.peak_inflight[size_t(r)] ==
                 pipeline::simulate(sched, pipeline::Costs::uniform(stages, 1, 2))
                     .peak_inflight[size_t(r)],
             name + ": in-flight activations as simulated");
      if (r == 0) {
        std::printf("%-28s rank 0: idle %.0f%%, p2p wait %.2f ms, %.0f bytes sent\n", name.c_str(),
                    100 * st.timeline.idle_share(0), 1e3 * st.p2p_wait_s, st.sent_bytes);
      }
    }
    std::vector<int32_t> f{failures};
    world.all_reduce(std::span<int32_t>(f)).wait();
    failures = f[0];
    if (r == 0) std::printf("%d pipeline case(s) on %d ranks, %d failure(s)\n", cases, p, failures);
  }
  return failures ? 1 : 0;
}
