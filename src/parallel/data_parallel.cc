#include "parallel/data_parallel.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>

#include "comm/flight.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"

namespace tetra::parallel {

struct DataParallel::Workspace {
  int pool = 0;
  Buffer<float> buf;
  Buffer<bf16> staging;  // reduce_bf16 under stages 2 and 3
  bool busy = false;
};

Sharding DataParallel::sharding_for(int stage, int dp_size, int dp_rank, int edp_size,
                                    int edp_rank) {
  Sharding s;
  s.shards = dp_size;
  s.index = dp_rank;
  s.expert_shards = edp_size > 0 ? edp_size : dp_size;
  s.expert_index = edp_size > 0 ? edp_rank : dp_rank;
  s.state = stage >= 1;
  s.grads = stage >= 2;
  s.params = stage >= 3;
  return s;
}

DataParallel::DataParallel(Backend& backend, comm::Communicator dp, ParamStore& store,
                           const ZeroOptions& options, MemoryLedger* ledger, ExpertGroup experts)
    : backend_(backend),
      k_(backend.f32()),
      dp_(std::move(dp)),
      store_(store),
      opt_(options),
      ledger_(ledger) {
  TETRA_CHECK(&store.device() == &backend.device(),
              "[zero] internal: the parameter store lives on another device than the backend");
  if (dp_.valid()) {
    n_ = dp_.size();
    rank_ = dp_.rank();
  }
  // A group of one communicates nothing: its reductions are local copies (and stay f32).
  Group& dense = groups_[size_t(ShardGroup::dense)];
  dense = {n_ > 1 ? dp_ : comm::Communicator(), n_, rank_, true, 1.0f / float(n_)};
  Group& expert = groups_[size_t(ShardGroup::expert)];
  if (!experts.edp.valid()) {
    TETRA_CHECK(experts.ep == 1,
                "[zero] internal: expert parallelism over {} ranks without an expert-data-parallel "
                "group",
                experts.ep);
    expert = dense;
  } else {
    const int edp = experts.edp.size();
    TETRA_CHECK(experts.ep >= 1 && edp * experts.ep == n_,
                "[zero] internal: an expert-data-parallel group of {} ranks with ep {} does not "
                "make the {} data-parallel ranks",
                edp, experts.ep, n_);
    expert.comm = edp > 1 ? experts.edp : comm::Communicator();
    expert.size = edp;
    expert.rank = experts.edp.rank();
    expert.avg = experts.ep == 1;
    expert.mean = 1.0f / float(edp * experts.ep);
  }
  const Sharding& s = store.sharding();
  TETRA_CHECK(s.shards == n_ && s.index == rank_ && s.expert_shards == expert.size &&
                  s.expert_index == expert.rank && s.state == (opt_.stage >= 1) &&
                  s.grads == (opt_.stage >= 2) && s.params == (opt_.stage >= 3),
              "[zero] internal: the store is not sharded for stage {} over {} ranks (experts over "
              "{})",
              opt_.stage, n_, expert.size);
  // Buckets never straddle a change of group: each run of units of one group is cut on its own.
  const size_t bucket = std::max<size_t>(1, size_t(opt_.bucket_mb * (1 << 20) / sizeof(float)));
  const std::vector<ParamUnit>& units = store.units();
  for (size_t u = 0, start = 0; u < units.size(); ++u) {
    if (u + 1 < units.size() && units[u + 1].group == units[u].group) continue;
    const size_t end = units[u].offset + units[u].padded;
    for (size_t b = start; b < end; b += bucket) {
      bounds_.push_back(b);
      bucket_group_.push_back(units[u].group);
    }
    start = end;
  }
  bounds_.push_back(store.flat_size());
  params_.resize(store.units().size());
  grad_ws_.assign(store.units().size(), nullptr);
  reserve_workspaces();
  if (opt_.reduce_bf16 && n_ > 1 && opt_.stage < 2) {
    flat_staging_ = Buffer<bf16>(store.flat_size(), {ledger_, MemCategory::comm}, backend.device());
  }
}

DataParallel::~DataParallel() {
  // Buffers (the store's, the workspaces) must outlive the collectives writing into them. When
  // an error unwinds mid-step, the operations already issued are still completed here; a rank
  // that cannot complete them is ended by the watchdog rather than left writing freed memory.
  try {
    drain();
  } catch (const std::exception& e) {
    log_warn("[zero] while unwinding: {}", e.what());
  }
  // Stage 3 gathers prefetched but not yet used write into workspaces too.
  for (UnitParams& p : params_) {
    try {
      if (p.state == Residency::gathering) p.gather.wait();
    } catch (const std::exception& e) {
      log_warn("[zero] while unwinding: {}", e.what());
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Collectives and the pending queue

void DataParallel::track(comm::Work w, std::function<void()> done) {
  stats_.sent_bytes += w.sent_bytes();
  ++stats_.ops;
  pending_.push_back({std::move(w), std::move(done)});
}

void DataParallel::poll() {
  while (!pending_.empty() && pending_.front().work.done()) {
    Pending p = std::move(pending_.front());
    pending_.pop_front();
    p.work.wait();  // rethrows a failure
    stats_.exec_ms += 1e3 * p.work.exec_seconds();
    if (p.on_done) p.on_done();
  }
}

void DataParallel::drain(size_t keep) {
  while (pending_.size() > keep) {
    Pending p = std::move(pending_.front());
    pending_.pop_front();
    p.work.wait();
    stats_.exec_ms += 1e3 * p.work.exec_seconds();
    if (p.on_done) p.on_done();
  }
}

bf16* DataParallel::staging(const float* f32) {
  const float* g = store_.grads().data();
  if (opt_.stage < 2) return flat_staging_.data() + (f32 - g);
  for (auto& w : pool_) {
    if (w->buf.data() == f32 && w->staging.size() > 0) return w->staging.data();
  }
  fail("[zero] internal: no bf16 staging buffer for a gradient outside the workspaces");
}

void DataParallel::scale(float* x, size_t n, float s) {
  // The kernel table has no scaling of its own: on a device whose memory the host reads, in place;
  // otherwise through a host copy. One multiply per element either way.
  auto mul = [s](float* p, size_t count) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < count; ++i) p[i] *= s;
  };
  Device& device = backend_.device();
  if (device.host_accessible()) {
    mul(x, n);
    return;
  }
  std::vector<float> host(n);
  device.to_host(host.data(), x, n * sizeof(float));
  mul(host.data(), n);
  device.from_host(x, host.data(), n * sizeof(float));
}

// The f32 reductions use the group's average where it is the mean (one division, as before
// expert units existed) and otherwise a sum and one multiply by 1 / dp. The bf16 ones sum in bf16
// and widen with that factor.
void DataParallel::all_reduce_mean(const Group& g, float* data, size_t n) {
  const comm::flight::Site site("dp.bucket");
  if (!g.comm.valid()) {
    if (!g.avg) scale(data, n, g.mean);
    return;
  }
  if (!opt_.reduce_bf16) {
    const comm::ReduceOp op = g.avg ? comm::ReduceOp::avg : comm::ReduceOp::sum;
    std::function<void()> done;
    if (!g.avg) done = [this, data, n, mean = g.mean] { scale(data, n, mean); };
    track(g.comm.all_reduce(std::span<float>(data, n), op), std::move(done));
    return;
  }
  bf16* half = staging(data);
  k_.to_bf16(half, data, n);
  track(g.comm.all_reduce(std::span<bf16>(half, n)),
        [this, half, data, n, mean = g.mean] { k_.from_bf16(data, half, n, mean); });
}

void DataParallel::reduce_scatter_mean(const Group& g, const float* in, float* out, size_t shard,
                                       std::function<void()> done) {
  const comm::flight::Site site("dp.bucket");
  if (!g.comm.valid()) {
    k_.copy(out, in, shard);
    if (!g.avg) scale(out, shard, g.mean);
    if (done) done();
    return;
  }
  const size_t total = shard * size_t(g.size);
  if (!opt_.reduce_bf16) {
    const comm::ReduceOp op = g.avg ? comm::ReduceOp::avg : comm::ReduceOp::sum;
    if (!g.avg) {
      done = [this, out, shard, mean = g.mean, done = std::move(done)] {
        scale(out, shard, mean);
        if (done) done();
      };
    }
    track(
        g.comm.reduce_scatter(std::span<const float>(in, total), std::span<float>(out, shard), op),
        std::move(done));
    return;
  }
  // In place in the staging buffer: this rank's shard of it receives the bf16 sum.
  bf16* half = staging(in);
  k_.to_bf16(half, in, total);
  bf16* mine = half + size_t(g.rank) * shard;
  track(g.comm.reduce_scatter(std::span<const bf16>(half, total), std::span<bf16>(mine, shard)),
        [this, mine, out, shard, mean = g.mean, done = std::move(done)] {
          k_.from_bf16(out, mine, shard, mean);
          if (done) done();
        });
}

comm::Work DataParallel::all_gather(const Group& g, const float* shard, float* full,
                                    size_t shard_n) {
  if (!g.comm.valid()) {
    k_.copy(full, shard, shard_n);
    return comm::Work();
  }
  return g.comm.all_gather(std::span<const float>(shard, shard_n),
                           std::span<float>(full, shard_n * size_t(g.size)));
}

namespace {

// A transformer block's unit: "h.N" (not "h.N.experts").
bool is_block(const ParamUnit& u) {
  if (u.group != ShardGroup::dense || u.name.size() <= 2 || u.name.rfind("h.", 0) != 0) {
    return false;
  }
  return std::all_of(u.name.begin() + 2, u.name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

size_t DataParallel::workspace_bound(const ZeroOptions& o, size_t units) {
  if (o.stage < 2 || units == 0) return 0;
  const size_t grads = std::min<size_t>(2, units);
  if (o.stage == 2) return grads;
  if (!o.reshard_after_forward) return units + 1;
  return std::min<size_t>(1 + size_t(o.prefetch), units) + grads;
}

void DataParallel::reserve_workspaces() {
  // The most workspaces the passes hold at once, allocated up front, so that the memory a run
  // holds is this bound, the figure `tetra plan` predicts, whatever the timing. Units come in
  // classes that share a pool:
  //  - each end unit alone (the root; on a pipeline's first or last stage the embedding, or ln_f
  //    with the head, and the tied wte): its gradient for the whole backward (stages 2, 3) and
  //    its parameters (3);
  //  - the blocks ("h.N"), and the expert units of mixture-of-experts blocks ("h.N.experts", in
  //    the expert group), each class reserved by workspace_bound. A MoE block l runs
  //      forward:  before_forward(h.l, h.l.experts) … before_forward(h.l.experts, next) experts
  //                after_forward(h.l.experts) … after_forward(h.l)
  //      backward: before_backward(h.l, h.l.experts) … before_backward(h.l.experts, h.(l-1))
  //                experts after_backward(h.l.experts) … after_backward(h.l)
  //    so within each class the passes go unit after unit as in a dense model: the block computed
  //    and the next one gathered (the experts' before_forward prefetches block l+1 while block l is
  //    resident), two gradients (before_backward keeps at most one older reduction, and a MoE
  //    block's experts reduce before it, so theirs is complete when the next block's backward
  //    starts). Blocks of a MoE model have two sizes (a MoE block has a router in place of the
  //    MLP): a class's workspaces have its largest unit's size.
  if (opt_.stage < 2) return;
  unit_pool_.assign(store_.units().size(), -1);
  std::vector<size_t> pool_size, pool_count;
  int block_pool = -1, expert_pool = -1;
  size_t blocks = 0, experts = 0;
  const size_t root_bufs = opt_.stage == 3 ? 2 : 1;
  for (size_t u = 0; u < store_.units().size(); ++u) {
    const ParamUnit& unit = store_.units()[u];
    int* shared = unit.group == ShardGroup::expert ? &expert_pool
                  : is_block(unit)                 ? &block_pool
                                                   : nullptr;
    if (!shared || *shared < 0) {
      pool_size.push_back(0);
      pool_count.push_back(root_bufs);
      if (shared) *shared = int(pool_size.size()) - 1;
    }
    const int pool = shared ? *shared : int(pool_size.size()) - 1;
    unit_pool_[u] = pool;
    pool_size[size_t(pool)] = std::max(pool_size[size_t(pool)], unit.padded);
    if (pool == block_pool) ++blocks;
    if (pool == expert_pool) ++experts;
  }
  if (block_pool >= 0) pool_count[size_t(block_pool)] = workspace_bound(opt_, blocks);
  if (expert_pool >= 0) pool_count[size_t(expert_pool)] = workspace_bound(opt_, experts);
  // bf16 staging where a class's reductions communicate.
  const bool dense_staged = groups_[size_t(ShardGroup::dense)].comm.valid();
  const bool experts_staged = groups_[size_t(ShardGroup::expert)].comm.valid();
  for (size_t p = 0; p < pool_size.size(); ++p) {
    const bool staged = opt_.reduce_bf16 && (int(p) == expert_pool ? experts_staged : dense_staged);
    for (size_t i = 0; i < pool_count[p]; ++i) {
      auto w = std::make_unique<Workspace>();
      w->pool = int(p);
      w->buf = Buffer<float>(pool_size[p], {ledger_, MemCategory::comm}, backend_.device());
      if (staged) {
        w->staging = Buffer<bf16>(pool_size[p], {ledger_, MemCategory::comm}, backend_.device());
      }
      pool_.push_back(std::move(w));
    }
  }
}

float* DataParallel::acquire(int unit, bool zero) {
  const int pool = unit_pool_[size_t(unit)];
  for (auto& w : pool_) {
    if (!w->busy && w->pool == pool) {
      w->busy = true;
      if (zero) w->buf.zero();
      return w->buf.data();
    }
  }
  fail("[zero] internal: no free workspace for unit '{}' (the bound of reserve_workspaces)",
       store_.units()[size_t(unit)].name);
}

void DataParallel::release(float* p) {
  for (auto& w : pool_) {
    if (w->buf.data() == p) {
      w->busy = false;
      return;
    }
  }
  fail("[zero] internal: releasing a workspace that is not in the pool");
}

// ---------------------------------------------------------------------------------------------
// Steps

void DataParallel::begin_step() {
  drain();
  stats_ = StepComm();
  // Stages 0 and 1 accumulate into the full gradient, 2 and 3 into the shard.
  store_.grads().zero();
  next_bucket_ = 0;
}

void DataParallel::begin_micro_batch(bool last) {
  // The previous micro-batch's reductions release their workspaces before this one needs them
  // (the root's is reduced at the very end of backward).
  drain();
  reduce_now_ = opt_.stage >= 2 || last;
}

void DataParallel::begin_backward(bool last) { reduce_now_ = opt_.stage >= 2 || last; }

void DataParallel::hold_until_finish(int unit) {
  held_.resize(store_.units().size(), false);
  held_[size_t(unit)] = true;
}

void DataParallel::issue_buckets_up_to(size_t n) {
  float* g = store_.grads().data();
  while (next_bucket_ + 1 < bounds_.size() && bounds_[next_bucket_ + 1] <= n) {
    all_reduce_mean(groups_[size_t(bucket_group_[next_bucket_])], g + bounds_[next_bucket_],
                    bounds_[next_bucket_ + 1] - bounds_[next_bucket_]);
    ++next_bucket_;
  }
}

void DataParallel::reduce_unit_grads(int unit) {
  const ParamUnit& u = store_.units()[size_t(unit)];
  const Group& group = group_of(unit);
  float* g = store_.grads().data();
  switch (opt_.stage) {
    case 0:
      issue_buckets_up_to(u.offset + u.padded);
      return;
    case 1:  // in place: this rank's slice of the unit receives the mean
      reduce_scatter_mean(group, g + u.offset, g + store_.shard_begin(unit), u.shard, {});
      return;
    default: {  // 2, 3: reduce-scatter the workspace in place, then add this rank's slice
      float* ws = std::exchange(grad_ws_[size_t(unit)], nullptr);
      store_.bind_grads(unit, nullptr);
      float* mine = ws + size_t(group.rank) * u.shard;
      float* dst = g + u.shard_offset;
      const size_t count = u.shard;
      reduce_scatter_mean(group, ws, mine, count, [this, ws, mine, dst, count] {
        k_.add(dst, mine, count);
        release(ws);
      });
      return;
    }
  }
}

void DataParallel::issue_gather(int unit) {
  const ParamUnit& u = store_.units()[size_t(unit)];
  UnitParams& p = params_[size_t(unit)];
  p.buf = acquire(unit, false);
  const comm::flight::Site site("zero3.gather");
  p.gather = all_gather(group_of(unit), store_.params().data() + u.shard_offset, p.buf, u.shard);
  stats_.sent_bytes += p.gather.sent_bytes();
  ++stats_.ops;
  p.state = Residency::gathering;
  ++in_flight_;
}

void DataParallel::prefetch_params(int unit) {
  if (opt_.stage < 3 || unit < 0 || params_[size_t(unit)].state != Residency::absent) return;
  if (in_flight_ >= opt_.prefetch) return;
  issue_gather(unit);
}

void DataParallel::ensure_params(int unit) {
  if (opt_.stage < 3) return;
  UnitParams& p = params_[size_t(unit)];
  if (p.state == Residency::resident) return;
  if (p.state == Residency::absent) issue_gather(unit);
  Stopwatch sw;
  p.gather.wait();
  stats_.gather_wait_ms += sw.elapsed_ms();
  stats_.exec_ms += 1e3 * p.gather.exec_seconds();
  p.gather = comm::Work();
  p.state = Residency::resident;
  --in_flight_;
  store_.bind_params(unit, p.buf);
}

void DataParallel::release_params(int unit) {
  if (opt_.stage < 3) return;
  UnitParams& p = params_[size_t(unit)];
  if (p.state == Residency::absent) return;
  if (p.state == Residency::gathering) {  // prefetched but not used: let it land first
    p.gather.wait();
    --in_flight_;
  }
  store_.bind_params(unit, nullptr);
  release(p.buf);
  p = UnitParams();
}

// ---------------------------------------------------------------------------------------------
// The model's passes

void DataParallel::before_forward(int unit, int next) {
  poll();
  ensure_params(unit);
  prefetch_params(next);
}

void DataParallel::after_forward(int unit) {
  if (opt_.reshard_after_forward) release_params(unit);
}

void DataParallel::before_backward(int unit, int next) {
  poll();
  ensure_params(unit);
  prefetch_params(next);
  if (opt_.stage >= 2) {
    // One unit reducing while the next is produced: overlap, with a bounded number of workspaces.
    drain(1);
    float* ws = acquire(unit, true);
    grad_ws_[size_t(unit)] = ws;
    store_.bind_grads(unit, ws);
  }
}

void DataParallel::after_backward(int unit) {
  const bool held = opt_.stage <= 1 && size_t(unit) < held_.size() && held_[size_t(unit)];
  if (reduce_now_ && (opt_.overlap || opt_.stage >= 2) && !held) reduce_unit_grads(unit);
  release_params(unit);
}

void DataParallel::end_forward_only() {
  for (int u = 0; u < int(params_.size()); ++u) release_params(u);
}

void DataParallel::finish_gradients() {
  Stopwatch sw;
  if (opt_.stage <= 1) {
    for (int u = 0; u < int(store_.units().size()); ++u) {
      if (!opt_.overlap || (size_t(u) < held_.size() && held_[size_t(u)])) reduce_unit_grads(u);
    }
  }
  if (opt_.stage == 0) issue_buckets_up_to(store_.flat_size());
  drain();
  stats_.exposed_ms += sw.elapsed_ms();
}

std::vector<FlatRange> DataParallel::owned_grad_ranges() const {
  std::vector<FlatRange> ranges;
  for (const OwnedSegment& s : store_.owned()) ranges.push_back({s.grad_pos, s.count});
  return ranges;
}

double DataParallel::norm_contribution(bool tp_root, TensorId skip) const {
  const float* g = store_.grads().data();
  const std::vector<ParamUnit>& units = store_.units();
  // Under stage 0 every rank of a unit's group holds the same reduced gradient: its first counts.
  auto counts = [&](int u) { return opt_.stage > 0 || group_of(u).rank == 0; };
  double sq = 0.0;
  if (!tp_root) {
    std::vector<FlatRange> sliced;
    for (const OwnedSegment& s : store_.owned()) {
      const ParamEntry& e = store_.tensor(s.tensor);
      if (e.spec.slice.dim >= 0 && counts(e.unit)) sliced.push_back({s.grad_pos, s.count});
    }
    sq = k_.sum_squares(g, sliced);
  } else if (opt_.stage == 1) {
    std::vector<FlatRange> shards;
    for (int u = 0; u < int(units.size()); ++u) {
      shards.push_back({store_.shard_begin(u), units[size_t(u)].shard});
    }
    sq = k_.sum_squares(g, shards);
  } else {
    // Alignment gaps and unit padding hold zero gradients, so whole units (stage 0) or the whole
    // shard buffer (stages 2, 3) can be summed; adjacent units that count make one range.
    std::vector<FlatRange> ranges;
    if (opt_.stage == 0) {
      for (int u = 0; u < int(units.size()); ++u) {
        if (!counts(u)) continue;
        const ParamUnit& unit = units[size_t(u)];
        if (!ranges.empty() && ranges.back().offset + ranges.back().count == unit.offset) {
          ranges.back().count += unit.padded;
        } else {
          ranges.push_back({unit.offset, unit.padded});
        }
      }
    } else {
      ranges.push_back({0, store_.grads().size()});
    }
    sq = k_.sum_squares(g, ranges);
  }
  if (skip >= 0 && counts(store_.tensor(skip).unit)) {
    std::vector<FlatRange> copy;
    for (const OwnedSegment& s : store_.owned()) {
      if (s.tensor == skip) copy.push_back({s.grad_pos, s.count});
    }
    sq -= k_.sum_squares(g, copy);
  }
  return sq;
}

std::string DataParallel::first_nonfinite_grad() {
  const int64_t bad = k_.first_nonfinite(store_.grads().data(), owned_grad_ranges());
  const TensorId local = bad < 0 ? -1 : store_.owned()[size_t(bad)].tensor;
  if (n_ == 1) return local < 0 ? "" : store_.tensor(local).spec.name;
  // The lowest (id, dp rank) wins: reduce INT32_MAX - (id · n + rank) with max. An expert tensor's
  // id names other experts on other ep ranks, so the winner sends the name.
  TETRA_CHECK(int64_t(store_.tensors().size()) * n_ < INT32_MAX,
              "[zero] internal: {} tensors on {} ranks overflow the non-finite vote",
              store_.tensors().size(), n_);
  int32_t code = local < 0 ? 0 : INT32_MAX - (local * n_ + rank_);
  dp_.all_reduce(std::span<int32_t>(&code, 1), comm::ReduceOp::max).wait();
  if (code == 0) return "";
  const int winner = (INT32_MAX - code) % n_;
  std::array<uint8_t, 256> name{};  // NUL-terminated (names are far shorter)
  if (rank_ == winner) {
    const std::string& mine = store_.tensor(local).spec.name;
    std::copy_n(mine.begin(), std::min(mine.size(), name.size() - 1), name.begin());
  }
  dp_.broadcast(std::span<uint8_t>(name), winner).wait();
  name.back() = 0;
  return std::string(reinterpret_cast<const char*>(name.data()));
}

void DataParallel::after_update() {
  if (opt_.stage == 0 || opt_.stage == 3) return;
  Stopwatch sw;
  const comm::flight::Site site("zero.param_gather");
  float* p = store_.params().data();
  for (int u = 0; u < int(store_.units().size()); ++u) {
    const ParamUnit& unit = store_.units()[size_t(u)];
    track(all_gather(group_of(u), p + store_.shard_begin(u), p + unit.offset, unit.shard));
  }
  drain();
  stats_.exposed_ms += sw.elapsed_ms();
}

Buffer<float> DataParallel::full_params() {
  Buffer<float> out(store_.flat_size(), {}, backend_.device());
  if (opt_.stage < 3) {
    k_.copy(out.data(), store_.params().data(), out.size());
    return out;
  }
  for (int u = 0; u < int(store_.units().size()); ++u) {
    const ParamUnit& unit = store_.units()[size_t(u)];
    all_gather(group_of(u), store_.params().data() + unit.shard_offset, out.data() + unit.offset,
               unit.shard)
        .wait();
  }
  return out;
}

}  // namespace tetra::parallel
