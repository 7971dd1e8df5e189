#include "model/moe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <utility>

#include "core/error.h"
#include "core/profile.h"

namespace tetra {

namespace {

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

}  // namespace

MoeShape MoeShape::of(const GptConfig& c, int B, int T, bool capacity) {
  MoeShape s;
  if (c.moe.experts == 0) return s;  // a dense model: no MoE buffers
  s.N = int64_t(B) * T;
  s.k = c.moe.top_k;
  s.E = c.moe.experts;
  s.ep = c.ep;
  s.El = c.local_experts();
  s.C = c.d_model;
  s.H = c.ffn;
  s.swiglu = mlp_activation(c) == Activation::swiglu;
  // One expert takes each token at most once, and with a capacity at most `cap` routes of each
  // of the ep·B sequences that meet at it; this rank's experts take at most every route of the
  // group.
  const int64_t per_rank = capacity && c.moe.capacity_factor > 0.0
                               ? std::min(moe_capacity(c.moe.capacity_factor, T, s.k, s.E) * B, s.N)
                               : s.N;
  const int64_t routed = std::min(int64_t(s.El) * per_rank * s.ep, s.N * s.k * s.ep);
  s.expert_rows = routed + int64_t(s.El) * (kMoeRowAlign - 1);
  if (s.ep > 1) {
    s.send_rows = s.N * s.k;
    s.recv_rows = routed;
  }
  return s;
}

template <typename F>
size_t MoeActs<F>::elements(const MoeShape& s) {
  return size_t(s.N * s.E + s.N * s.k + s.expert_rows * (2 * s.C + (s.swiglu ? 3 : 2) * s.H) +
                s.send_rows * s.C);
}

template <typename F>
MoeActs<F> MoeActs<F>::carve(F* p, const MoeShape& s) {
  auto take = [&](int64_t n) { return std::exchange(p, p + n); };
  MoeActs a;
  a.logits = take(s.N * s.E);
  a.gate = take(s.N * s.k);
  a.x = take(s.expert_rows * s.C);
  a.pre = take(s.expert_rows * s.H);
  if (s.swiglu) a.up = take(s.expert_rows * s.H);
  a.h = take(s.expert_rows * s.H);
  a.y = take(s.expert_rows * s.C);
  if (s.send_rows > 0) a.back = take(s.send_rows * s.C);
  return a;
}

MoeRoute::MoeRoute(const MoeShape& s, Device& device, MemTag tag)
    : index(size_t(s.N * s.k + s.expert_rows + s.recv_rows + s.send_rows), tag, device) {
  int32_t* p = index.data();
  auto take = [&](int64_t n) { return std::exchange(p, p + n); };
  pos = take(s.N * s.k);
  x_src = take(s.expert_rows);
  back = take(s.recv_rows);
  send_token = take(s.send_rows);
}

template <typename F>
size_t MoeScratch<F>::elements(const MoeShape& s) {
  return size_t(s.N * s.E + s.N * s.k + (s.recv_rows + s.send_rows + s.expert_rows) * s.C +
                s.expert_rows * s.H * (s.swiglu ? 2 : 1));
}

template <typename F>
MoeScratch<F> MoeScratch<F>::carve(F* p, const MoeShape& s) {
  auto take = [&](int64_t n) { return std::exchange(p, p + n); };
  MoeScratch m;
  m.dlogits = take(s.N * s.E);
  m.dgate = take(s.N * s.k);
  m.recv = take(s.recv_rows * s.C);
  m.send = take(s.send_rows * s.C);
  m.dy = take(s.expert_rows * s.C);
  m.dh = take(s.expert_rows * s.H);
  if (s.swiglu) m.dup = take(s.expert_rows * s.H);
  return m;
}

template <typename F>
std::vector<typename MoeMlp<F>::ExpertIds> MoeMlp<F>::register_experts(const GptConfig& c,
                                                                       const MoeSpec& spec,
                                                                       ParamStoreT<F>& store,
                                                                       int ep_rank) {
  const MlpSpec& m = spec.expert;
  const int64_t C = c.d_model, H = m.hidden;
  const int El = c.local_experts();
  std::vector<ExpertIds> ids;
  for (int le = 0; le < El; ++le) {
    const std::string base = spec.experts + "." + std::to_string(ep_rank * El + le) + ".";
    auto linear = [&](const LinearSpec& l, int64_t out, int64_t in) {
      LinearSpec named = l;
      named.name = base + l.name;
      return add_linear(store, named, out, in, m.conv1d);
    };
    ExpertIds e;
    std::tie(e.downw, e.downb) = linear(m.down, C, H);
    if (m.act == Activation::swiglu) e.upw = linear(m.up, H, C).first;
    std::tie(e.inw, e.inb) = linear(m.in, H, C);
    ids.push_back(e);
  }
  return ids;
}

template <typename F>
TensorId MoeMlp<F>::register_router(const GptConfig& c, const MoeSpec& spec,
                                    ParamStoreT<F>& store) {
  return store.add(weight_spec({spec.router, false, 0.02f}, c.moe.experts, c.d_model, false));
}

template <typename F>
MoeMlp<F>::MoeMlp(const GptConfig& c, const MoeSpec& spec, const parallel::LayerEnv<F>& env,
                  parallel::ExpertParallel& ep, TensorId router, std::vector<ExpertIds> experts)
    : c_(c),
      act_(spec.expert.act),
      router_role_(profile_role(spec.router)),
      in_role_(profile_role(spec.experts + ".0." + spec.expert.in.name)),
      up_role_(profile_role(spec.experts + ".0." + spec.expert.up.name)),
      down_role_(profile_role(spec.experts + ".0." + spec.expert.down.name)),
      env_(env),
      ep_(ep),
      router_(router),
      experts_(std::move(experts)) {
  TETRA_CHECK(ep.size() == c.ep && int(experts_.size()) == c.local_experts(),
              "[model] internal: a MoE block shaped for ep={} ({} experts each) on a group of {} "
              "holding {}",
              c.ep, c.local_experts(), ep.size(), experts_.size());
  reset_stats();
}

template <typename F>
void MoeMlp<F>::reset_stats() {
  stats_ = MoeStats();
  stats_.load.assign(size_t(c_.moe.experts), 0);
}

namespace {

// `r`'s decisions and, per token, the logit gap between its k-th choice and the best expert left.
MoeRouteRecord route_record(const MoeRouting& r) {
  MoeRouteRecord rec{r.S, r.T, r.k, r.expert, r.kept, {}};
  const int64_t N = r.tokens();
  rec.margin.resize(size_t(N));
  for (int64_t n = 0; n < N; ++n) {
    const double* p = r.prob.data() + n * r.E;
    const int32_t* chosen = r.expert.data() + n * r.k;
    double next = 0.0;
    for (int e = 0; e < r.E; ++e) {
      if (std::find(chosen, chosen + r.k, e) == chosen + r.k) next = std::max(next, p[e]);
    }
    rec.margin[size_t(n)] = next > 0.0 ? float(std::log(p[chosen[r.k - 1]] / next))
                                       : std::numeric_limits<float>::infinity();
  }
  return rec;
}

}  // namespace

template <typename F>
void MoeMlp<F>::plan(MoeRoute& route, const F* logits, int B, int T, Pass pass) {
  const ProfileScope profile(ProfKind::moe, "routing");
  const int E = c_.moe.experts, k = c_.moe.top_k, El = c_.local_experts(), ep = ep_.size();
  const int64_t N = int64_t(B) * T;
  std::vector<F> host(size_t(N * E));
  env_.store.device().to_host(host.data(), logits, host.size() * sizeof(F));
  const double cf = pass == Pass::decode ? 0.0 : c_.moe.capacity_factor;
  route.routing = route_tokens(host.data(), B, T, E, k, cf);
  const MoeRouting& r = route.routing;
  last_ = {r.aux, r.z, r.dropped};
  if (pass == Pass::train) {
    ++stats_.micro_batches;
    stats_.routes += r.routes();
    stats_.dropped += r.dropped;
    stats_.aux += r.aux;
    stats_.z += r.z;
    for (int e = 0; e < E; ++e) stats_.load[size_t(e)] += r.load[size_t(e)];
    if (record_) stats_.records.push_back(route_record(r));
  }
  // Host images of the index vectors, laid out as route.index.
  const MoeShape shape = MoeShape::of(c_, B, T, pass != Pass::decode);
  std::vector<int32_t> index(route.index.size(), -1);
  int32_t* pos = index.data();
  int32_t* x_src = pos + N * k;
  int32_t* back = x_src + shape.expert_rows;
  int32_t* send_token = back + shape.recv_rows;
  route.expert_rows.assign(size_t(El), 0);
  route.send_rows.assign(size_t(ep), 0);
  route.recv_rows.assign(size_t(ep), 0);
  if (ep == 1) {
    // The experts' rows directly: expert e's kept routes in token order, padded.
    std::vector<int64_t> start(static_cast<size_t>(E));
    int64_t rows = 0;
    for (int e = 0; e < E; ++e) {
      start[size_t(e)] = rows;
      route.expert_rows[size_t(e)] = round_up(r.load[size_t(e)], kMoeRowAlign);
      rows += route.expert_rows[size_t(e)];
    }
    route.x_rows = rows;
    for (int64_t route_i = 0; route_i < N * k; ++route_i) {
      if (!r.kept[size_t(route_i)]) continue;
      const int64_t row = start[size_t(r.expert[size_t(route_i)])]++;
      pos[route_i] = int32_t(row);
      x_src[row] = int32_t(route_i / k);
    }
  } else {
    // Sent rows in global expert order, which is destination-rank order; each rank learns how
    // many rows of each of its experts every rank sends, and gathers them expert by expert.
    std::vector<int64_t> start(static_cast<size_t>(E));
    std::vector<int32_t> counts(static_cast<size_t>(E));
    int64_t rows = 0;
    for (int e = 0; e < E; ++e) {
      start[size_t(e)] = rows;
      counts[size_t(e)] = int32_t(r.load[size_t(e)]);
      rows += r.load[size_t(e)];
      route.send_rows[size_t(e / El)] += r.load[size_t(e)];
    }
    route.send_total = rows;
    for (int64_t route_i = 0; route_i < N * k; ++route_i) {
      if (!r.kept[size_t(route_i)]) continue;
      const int64_t row = start[size_t(r.expert[size_t(route_i)])]++;
      pos[route_i] = int32_t(row);
      send_token[row] = int32_t(route_i / k);
    }
    const std::vector<int32_t> recv = ep_.exchange_counts(counts, El);  // [source][local expert]
    std::vector<int64_t> xstart(static_cast<size_t>(El));
    int64_t xrows = 0;
    for (int le = 0; le < El; ++le) {
      int64_t n = 0;
      for (int src = 0; src < ep; ++src) n += recv[size_t(src * El + le)];
      xstart[size_t(le)] = xrows;
      route.expert_rows[size_t(le)] = round_up(n, kMoeRowAlign);
      xrows += route.expert_rows[size_t(le)];
    }
    route.x_rows = xrows;
    int64_t received = 0;
    for (int src = 0; src < ep; ++src) {
      for (int le = 0; le < El; ++le) {
        const int32_t n = recv[size_t(src * El + le)];
        route.recv_rows[size_t(src)] += n;
        for (int32_t i = 0; i < n; ++i, ++received) {
          const int64_t row = xstart[size_t(le)]++;
          x_src[row] = int32_t(received);
          back[received] = int32_t(row);
        }
      }
    }
    route.recv_total = received;
  }
  TETRA_CHECK(route.x_rows <= shape.expert_rows && route.recv_total <= shape.recv_rows &&
                  route.send_total <= shape.send_rows,
              "[moe] internal: {} expert rows, {} received and {} sent over the bounds {}, {}, {}",
              route.x_rows, route.recv_total, route.send_total, shape.expert_rows, shape.recv_rows,
              shape.send_rows);
  env_.store.device().from_host(route.index.data(), index.data(), index.size() * sizeof(int32_t));
}

template <typename F>
void MoeMlp<F>::run(std::span<const MatmulArgs> products) {
  Kernels<F>& k = env_.kernels();
  if (c_.grouped_experts) {
    k.matmul_group(products);
  } else {
    for (const MatmulArgs& p : products) k.matmul(p);
  }
}

template <typename F>
void MoeMlp<F>::experts_forward(const MoeActs<F>& a, const MoeRoute& route) {
  Kernels<F>& k = env_.kernels();
  ParamStoreT<F>& st = env_.store;
  const int64_t C = c_.d_model, H = c_.ffn;
  const bool swiglu = act_ == Activation::swiglu;
  auto bias = [&](TensorId id) { return id >= 0 ? st.param(id) : static_cast<const F*>(nullptr); };
  // Every expert's input products (SwiGLU: gate and up), the activation, the output products.
  std::vector<MatmulArgs> in, out;
  int64_t off = 0;
  for (size_t le = 0; le < experts_.size(); ++le) {
    const int64_t m = route.expert_rows[le];
    if (m == 0) continue;
    const ExpertIds& e = experts_[le];
    const F* x = a.x + off * C;
    in.push_back(nt_args(a.pre + off * H, x, st.param(e.inw), static_cast<const F*>(nullptr), m, H,
                         C, false, in_role_.fwd.c_str(), env_.bf16));
    if (swiglu) {
      in.push_back(nt_args(a.up + off * H, x, st.param(e.upw), static_cast<const F*>(nullptr), m, H,
                           C, false, up_role_.fwd.c_str(), env_.bf16));
    }
    out.push_back(nt_args(a.y + off * C, a.h + off * H, st.param(e.downw), bias(e.downb), m, C, H,
                          false, down_role_.fwd.c_str(), env_.bf16));
    off += m;
  }
  run(in);
  if (swiglu) {
    k.swiglu_forward(a.h, a.pre, a.up, off * H);
  } else {
    off = 0;
    for (size_t le = 0; le < experts_.size(); ++le) {
      const int64_t m = route.expert_rows[le];
      if (m > 0)
        k.bias_gelu_forward(a.h + off * H, a.pre + off * H, bias(experts_[le].inb), m, int(H));
      off += m;
    }
  }
  run(out);
}

template <typename F>
void MoeMlp<F>::forward(F* out, const F* x, const MoeActs<F>& a, MoeRoute& route,
                        const MoeScratch<F>& s, int B, int T, Pass pass) {
  Kernels<F>& k = env_.kernels();
  const int E = c_.moe.experts, K = c_.moe.top_k, C = c_.d_model;
  const int64_t N = int64_t(B) * T;
  // The router stays in f32 (its products are small, and the decisions should not move with
  // bf16 rounding).
  matmul_nt(k, a.logits, x, env_.store.param(router_), static_cast<const F*>(nullptr), N, E, C,
            false, router_role_.fwd.c_str());
  plan(route, a.logits, B, T, pass);
  std::vector<F> gate(route.routing.gate.begin(), route.routing.gate.end());
  env_.store.device().from_host(a.gate, gate.data(), gate.size() * sizeof(F));
  if (ep_.size() == 1) {
    k.gather_rows(a.x, x, route.x_src, route.x_rows, C);
    experts_forward(a, route);
    k.moe_combine(out, a.y, route.pos, a.gate, N, K, C);
    return;
  }
  k.gather_rows(s.send, x, route.send_token, route.send_total, C);
  ep_.exchange_rows(s.send, route.send_rows, s.recv, route.recv_rows, C);
  k.gather_rows(a.x, s.recv, route.x_src, route.x_rows, C);
  experts_forward(a, route);
  k.gather_rows(s.recv, a.y, route.back, route.recv_total, C);
  ep_.exchange_rows(s.recv, route.recv_rows, a.back, route.send_rows, C);
  k.moe_combine(out, a.back, route.pos, a.gate, N, K, C);
}

template <typename F>
void MoeMlp<F>::experts_backward(const MoeActs<F>& a, const MoeRoute& route,
                                 const MoeScratch<F>& s) {
  Kernels<F>& k = env_.kernels();
  ParamStoreT<F>& st = env_.store;
  const int64_t C = c_.d_model, H = c_.ffn;
  const bool swiglu = act_ == Activation::swiglu;
  // y = h · W_downᵀ + b: the hidden gradient and the down weights' gradient, every expert's
  // (weight products apart: a zero-bubble schedule keeps them for W).
  std::vector<MatmulArgs> down, down_w, in, in_w, in_up;
  int64_t off = 0;
  for (size_t le = 0; le < experts_.size(); ++le) {
    const int64_t m = route.expert_rows[le];
    if (m == 0) continue;
    const ExpertIds& e = experts_[le];
    const F* dy = s.dy + off * C;
    down.push_back(nn_args(s.dh + off * H, dy, st.param(e.downw), m, H, C, false,
                           down_role_.igrad.c_str(), env_.bf16));
    down_w.push_back(tn_args(st.grad(e.downw), dy, a.h + off * H, C, H, m, true,
                             down_role_.wgrad.c_str(), env_.bf16));
    // The input products' gradients (SwiGLU: the gate's, then the up product's added), into dy,
    // which is spent.
    const F* x = a.x + off * C;
    in_w.push_back(tn_args(st.grad(e.inw), s.dh + off * H, x, H, C, m, true, in_role_.wgrad.c_str(),
                           env_.bf16));
    in.push_back(nn_args(s.dy + off * C, s.dh + off * H, st.param(e.inw), m, C, H, false,
                         in_role_.igrad.c_str(), env_.bf16));
    if (swiglu) {
      in_w.push_back(tn_args(st.grad(e.upw), s.dup + off * H, x, H, C, m, true,
                             up_role_.wgrad.c_str(), env_.bf16));
      in_up.push_back(nn_args(s.dy + off * C, s.dup + off * H, st.param(e.upw), m, C, H, true,
                              up_role_.igrad.c_str(), env_.bf16));
    }
    off += m;
  }
  run(down);
  env_.weight_products(down_w, c_.grouped_experts);
  if (swiglu) {
    // h = silu(x · W_inᵀ) ⊙ (x · W_upᵀ); dh becomes the gate's gradient.
    k.swiglu_backward(s.dh, s.dup, s.dh, a.pre, a.up, off * H);
  }
  off = 0;
  for (size_t le = 0; le < experts_.size(); ++le) {
    const int64_t m = route.expert_rows[le];
    const ExpertIds& e = experts_[le];
    if (m > 0 && e.downb >= 0) k.bias_backward(st.grad(e.downb), s.dy + off * C, m, int(C));
    // h = gelu(x · W_inᵀ + b)
    if (m > 0 && !swiglu) {
      k.gelu_bias_backward(s.dh + off * H, st.grad(e.inb), a.pre + off * H, s.dh + off * H, m,
                           int(H));
    }
    off += m;
  }
  env_.weight_products(in_w, c_.grouped_experts);
  run(in);
  run(in_up);
}

template <typename F>
void MoeMlp<F>::backward(F* dx, const F* dout, const F* x, const MoeActs<F>& a,
                         const MoeRoute& route, const MoeScratch<F>& s, int B, int T,
                         float loss_scale) {
  Kernels<F>& k = env_.kernels();
  const int E = c_.moe.experts, K = c_.moe.top_k, C = c_.d_model;
  const int64_t N = int64_t(B) * T;
  // The combine: the gates' gradients, and the rows' gradients back to the experts.
  if (ep_.size() == 1) {
    k.zero(s.dy, size_t(route.x_rows) * size_t(C));  // padding rows stay zero
    k.moe_combine_backward(s.dy, s.dgate, dout, a.y, route.pos, a.gate, N, K, C);
  } else {
    k.moe_combine_backward(s.send, s.dgate, dout, a.back, route.pos, a.gate, N, K, C);
    ep_.exchange_rows(s.send, route.send_rows, s.recv, route.recv_rows, C);
    k.gather_rows(s.dy, s.recv, route.x_src, route.x_rows, C);
  }
  experts_backward(a, route, s);
  // The dispatch: each route's input gradient back to its token.
  if (ep_.size() == 1) {
    k.moe_combine(dx, s.dy, route.pos, static_cast<const F*>(nullptr), N, K, C);
  } else {
    k.gather_rows(s.recv, s.dy, route.back, route.recv_total, C);
    ep_.exchange_rows(s.recv, route.recv_rows, s.send, route.send_rows, C);
    k.moe_combine(dx, s.send, route.pos, static_cast<const F*>(nullptr), N, K, C);
  }
  // The router: the gates' and the losses' gradients through the softmax, on the host.
  const MoeRouting& r = route.routing;
  std::vector<F> dgate_f(size_t(N * K));
  Device& device = env_.store.device();
  device.to_host(dgate_f.data(), s.dgate, dgate_f.size() * sizeof(F));
  std::vector<double> dgate(dgate_f.begin(), dgate_f.end());
  std::vector<double> dl;
  {
    const ProfileScope profile(ProfKind::moe, "routing backward");
    dl = route_backward(r, dgate.data(), c_.moe.aux_loss_coeff * loss_scale,
                        c_.moe.z_loss_coeff * loss_scale);
  }
  const std::vector<F> dlogits(dl.begin(), dl.end());
  device.from_host(s.dlogits, dlogits.data(), dlogits.size() * sizeof(F));
  ParamStoreT<F>& st = env_.store;
  env_.weight_product(
      tn_args(st.grad(router_), s.dlogits, x, E, C, N, true, router_role_.wgrad.c_str()));
  matmul_nn(k, dx, s.dlogits, st.param(router_), N, C, E, true, router_role_.igrad.c_str());
}

template struct MoeActs<float>;
template struct MoeActs<double>;
template struct MoeScratch<float>;
template struct MoeScratch<double>;
template class MoeMlp<float>;
template class MoeMlp<double>;

}  // namespace tetra
