#include "parallel/data_parallel.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>

#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"

namespace tetra::parallel {

struct DataParallel::Workspace {
  Buffer<float> buf;
  Buffer<bf16> staging;  // reduce_bf16 under stages 2 and 3
  bool busy = false;
};

Sharding DataParallel::sharding_for(int stage, int dp_size, int dp_rank) {
  Sharding s;
  s.shards = dp_size;
  s.index = dp_rank;
  s.state = stage >= 1;
  s.grads = stage >= 2;
  s.params = stage >= 3;
  return s;
}

DataParallel::DataParallel(Backend& backend, comm::Communicator dp, ParamStore& store,
                           const ZeroOptions& options, MemoryLedger* ledger)
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
  const Sharding& s = store.sharding();
  TETRA_CHECK(s.shards == n_ && s.index == rank_ && s.state == (opt_.stage >= 1) &&
                  s.grads == (opt_.stage >= 2) && s.params == (opt_.stage >= 3),
              "[zero] internal: the store is not sharded for stage {} over {} ranks", opt_.stage,
              n_);
  const size_t bucket = std::max<size_t>(1, size_t(opt_.bucket_mb * (1 << 20) / sizeof(float)));
  for (size_t b = 0; b < store.flat_size(); b += bucket) bounds_.push_back(b);
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
    if (w->buf.data() == f32) return w->staging.data();
  }
  fail("[zero] internal: no bf16 staging buffer for a gradient outside the workspaces");
}

void DataParallel::widen_mean(const bf16* in, float* out, size_t n) {
  k_.from_bf16(out, in, n, 1.0f / float(n_));
}

void DataParallel::all_reduce_avg(float* data, size_t n) {
  if (n_ == 1) return;
  if (!opt_.reduce_bf16) {
    track(dp_.all_reduce(std::span<float>(data, n), comm::ReduceOp::avg));
    return;
  }
  bf16* half = staging(data);
  k_.to_bf16(half, data, n);
  track(dp_.all_reduce(std::span<bf16>(half, n)),
        [this, half, data, n] { widen_mean(half, data, n); });
}

void DataParallel::reduce_scatter_avg(const float* in, float* out, size_t shard,
                                      std::function<void()> done) {
  if (!dp_.valid()) {
    k_.copy(out, in, shard);
    if (done) done();
    return;
  }
  const size_t total = shard * size_t(n_);
  if (!opt_.reduce_bf16) {
    track(dp_.reduce_scatter(std::span<const float>(in, total), std::span<float>(out, shard),
                             comm::ReduceOp::avg),
          std::move(done));
    return;
  }
  // In place in the staging buffer: this rank's shard of it receives the bf16 sum.
  bf16* half = staging(in);
  k_.to_bf16(half, in, total);
  bf16* mine = half + size_t(rank_) * shard;
  track(dp_.reduce_scatter(std::span<const bf16>(half, total), std::span<bf16>(mine, shard)),
        [this, mine, out, shard, done = std::move(done)] {
          widen_mean(mine, out, shard);
          if (done) done();
        });
}

comm::Work DataParallel::all_gather(const float* shard, float* full, size_t shard_n) {
  if (!dp_.valid()) {
    k_.copy(full, shard, shard_n);
    return comm::Work();
  }
  return dp_.all_gather(std::span<const float>(shard, shard_n),
                        std::span<float>(full, shard_n * size_t(n_)));
}

void DataParallel::reserve_workspaces() {
  // The most workspaces the passes hold at once. Gradients (stages 2, 3): the root's for the whole
  // backward, and two blocks' (one produced while the previous one reduces; before_backward waits
  // for older reductions). Parameters (stage 3): the root's, and the block being computed plus
  // zero.prefetch gathers ahead — or, kept between forward and backward, every block (the one
  // whose gradient is produced is among them). They are allocated up front, so the memory a run
  // holds is this bound, the figure `tetra plan` predicts, whatever the timing. A pipeline stage
  // holds blocks ("h.N" units, all one size) and, on the first or the last stage, units in place
  // of the root (the embedding, or ln_f with the head, and the tied wte), each reserved as the
  // root is.
  if (opt_.stage < 2) return;
  std::vector<size_t> ends;
  size_t blocks = 0, block_size = 0;
  for (const ParamUnit& u : store_.units()) {
    if (u.name.rfind("h.", 0) == 0) {
      ++blocks;
      block_size = u.padded;
    } else {
      ends.push_back(u.padded);
    }
  }
  size_t block_bufs = std::min<size_t>(2, blocks), root_bufs = 1;
  if (opt_.stage == 3) {
    root_bufs = 2;
    block_bufs = opt_.reshard_after_forward
                     ? std::min<size_t>(1 + size_t(opt_.prefetch), blocks) + block_bufs
                     : blocks + 1;
  }
  auto add = [&](size_t n) {
    auto w = std::make_unique<Workspace>();
    w->buf = Buffer<float>(n, {ledger_, MemCategory::comm}, backend_.device());
    if (opt_.reduce_bf16 && n_ > 1) {
      w->staging = Buffer<bf16>(n, {ledger_, MemCategory::comm}, backend_.device());
    }
    pool_.push_back(std::move(w));
  };
  for (size_t n : ends) {
    for (size_t i = 0; i < root_bufs; ++i) add(n);
  }
  for (size_t i = 0; blocks > 0 && i < block_bufs; ++i) add(block_size);
}

float* DataParallel::acquire(size_t n, bool zero) {
  for (auto& w : pool_) {
    if (!w->busy && w->buf.size() == n) {
      w->busy = true;
      if (zero) w->buf.zero();
      return w->buf.data();
    }
  }
  fail("[zero] internal: no free workspace of {} elements (the bound of reserve_workspaces)", n);
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

void DataParallel::issue_buckets_up_to(size_t n) {
  float* g = store_.grads().data();
  while (next_bucket_ + 1 < bounds_.size() && bounds_[next_bucket_ + 1] <= n) {
    all_reduce_avg(g + bounds_[next_bucket_], bounds_[next_bucket_ + 1] - bounds_[next_bucket_]);
    ++next_bucket_;
  }
}

void DataParallel::reduce_unit_grads(int unit) {
  const ParamUnit& u = store_.units()[size_t(unit)];
  float* g = store_.grads().data();
  switch (opt_.stage) {
    case 0:
      issue_buckets_up_to(u.offset + u.padded);
      return;
    case 1:  // in place: this rank's slice of the unit receives the mean
      reduce_scatter_avg(g + u.offset, g + store_.shard_begin(unit), u.shard, {});
      return;
    default: {  // 2, 3: reduce-scatter the workspace in place, then add this rank's slice
      float* ws = std::exchange(grad_ws_[size_t(unit)], nullptr);
      store_.bind_grads(unit, nullptr);
      float* mine = ws + size_t(rank_) * u.shard;
      float* dst = g + u.shard_offset;
      const size_t count = u.shard;
      reduce_scatter_avg(ws, mine, count, [this, ws, mine, dst, count] {
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
  p.buf = acquire(u.padded, false);
  p.gather = all_gather(store_.params().data() + u.shard_offset, p.buf, u.shard);
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
    float* ws = acquire(store_.units()[size_t(unit)].padded, true);
    grad_ws_[size_t(unit)] = ws;
    store_.bind_grads(unit, ws);
  }
}

void DataParallel::after_backward(int unit) {
  if (reduce_now_ && (opt_.overlap || opt_.stage >= 2)) reduce_unit_grads(unit);
  release_params(unit);
}

void DataParallel::end_forward_only() {
  for (int u = 0; u < int(params_.size()); ++u) release_params(u);
}

void DataParallel::finish_gradients() {
  Stopwatch sw;
  if (!opt_.overlap && opt_.stage <= 1) {
    for (int u = 0; u < int(store_.units().size()); ++u) reduce_unit_grads(u);
  }
  if (opt_.stage == 0) issue_buckets_up_to(store_.flat_size());
  drain();
  stats_.exposed_ms += sw.elapsed_ms();
}

std::vector<FlatRange> DataParallel::owned_grad_ranges(bool sliced_only) const {
  std::vector<FlatRange> ranges;
  for (const OwnedSegment& s : store_.owned()) {
    if (sliced_only && store_.tensor(s.tensor).spec.slice.dim < 0) continue;
    ranges.push_back({s.grad_pos, s.count});
  }
  return ranges;
}

double DataParallel::local_grad_sum_squares(bool replicated) const {
  const float* g = store_.grads().data();
  if (!replicated) return k_.sum_squares(g, owned_grad_ranges(true));
  // Alignment gaps and unit padding hold zero gradients, so whole ranges can be summed.
  if (opt_.stage != 1) return k_.sum_squares(g, int64_t(store_.grads().size()));
  std::vector<FlatRange> shards;
  for (int u = 0; u < int(store_.units().size()); ++u) {
    shards.push_back({store_.shard_begin(u), store_.units()[size_t(u)].shard});
  }
  return k_.sum_squares(g, shards);
}

TensorId DataParallel::first_nonfinite_grad() {
  const int64_t bad = k_.first_nonfinite(store_.grads().data(), owned_grad_ranges(false));
  const TensorId local = bad < 0 ? -1 : store_.owned()[size_t(bad)].tensor;
  if (n_ == 1) return local;
  // The lowest id wins: reduce INT_MAX - id with max.
  int32_t code = local < 0 ? 0 : INT32_MAX - local;
  dp_.all_reduce(std::span<int32_t>(&code, 1), comm::ReduceOp::max).wait();
  return code == 0 ? -1 : INT32_MAX - code;
}

void DataParallel::after_update() {
  if (opt_.stage == 0 || opt_.stage == 3) return;
  Stopwatch sw;
  float* p = store_.params().data();
  for (int u = 0; u < int(store_.units().size()); ++u) {
    const ParamUnit& unit = store_.units()[size_t(u)];
    track(all_gather(p + store_.shard_begin(u), p + unit.offset, unit.shard));
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
    all_gather(store_.params().data() + unit.shard_offset, out.data() + unit.offset, unit.shard)
        .wait();
  }
  return out;
}

}  // namespace tetra::parallel
