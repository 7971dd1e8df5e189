#include "core/param_store.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "core/philox.h"

namespace tetra {

namespace {

constexpr size_t kAlign = 16;  // elements: 64 bytes of f32

size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

}  // namespace

int64_t ParamEntry::global_index(int64_t i) const {
  const Slice& s = spec.slice;
  if (s.dim < 0) return i;
  int64_t inner = 1;
  for (size_t d = size_t(s.dim) + 1; d < local_shape.size(); ++d) inner *= local_shape[d];
  const int64_t local = s.parts * s.extent, block = spec.shape[size_t(s.dim)] / s.parts;
  const int64_t mid = i / inner % local, outer = i / (inner * local);
  const int64_t g = mid / s.extent * block + s.offset + mid % s.extent;
  return (outer * spec.shape[size_t(s.dim)] + g) * inner + i % inner;
}

template <typename F>
int ParamStoreT<F>::begin_unit(const std::string& name, ShardGroup group) {
  TETRA_CHECK(!finalized_ && !in_unit_, "[params] internal: begin_unit('{}') out of order", name);
  in_unit_ = true;
  ParamUnit u;
  u.name = name;
  u.group = group;
  u.first = u.end = TensorId(tensors_.size());
  units_.push_back(u);
  return int(units_.size()) - 1;
}

template <typename F>
TensorId ParamStoreT<F>::add(ParamSpec spec) {
  TETRA_CHECK(in_unit_, "[params] internal: tensor '{}' added outside a unit", spec.name);
  TETRA_CHECK(find(spec.name) < 0, "[params] internal: tensor '{}' registered twice", spec.name);
  ParamEntry e;
  e.local_shape = spec.shape;
  if (spec.slice.dim >= 0) {
    const Slice& s = spec.slice;
    TETRA_CHECK(size_t(s.dim) < spec.shape.size() && s.parts >= 1 &&
                    spec.shape[size_t(s.dim)] % s.parts == 0 && s.offset >= 0 && s.extent > 0 &&
                    s.offset + s.extent <= spec.shape[size_t(s.dim)] / s.parts,
                "[params] internal: slice [{}, {}) of each of {} parts of dim {} outside '{}' {}",
                s.offset, s.offset + s.extent, s.parts, s.dim, spec.name, shape_str(spec.shape));
    e.local_shape[size_t(s.dim)] = s.parts * s.extent;
  }
  e.spec = std::move(spec);
  e.unit = int(units_.size()) - 1;
  tensors_.push_back(std::move(e));
  units_.back().end = TensorId(tensors_.size());
  return TensorId(tensors_.size()) - 1;
}

template <typename F>
void ParamStoreT<F>::end_unit() {
  TETRA_CHECK(in_unit_, "[params] internal: end_unit without begin_unit");
  in_unit_ = false;
}

template <typename F>
void ParamStoreT<F>::finalize(const Sharding& sharding, MemoryLedger* ledger) {
  TETRA_CHECK(!finalized_ && !in_unit_,
              "[params] internal: finalize called twice or inside a unit");
  TETRA_CHECK(sharding.shards >= 1 && sharding.index >= 0 && sharding.index < sharding.shards,
              "[params] internal: shard {} of {}", sharding.index, sharding.shards);
  TETRA_CHECK(sharding.expert_shards >= 1 && sharding.expert_index >= 0 &&
                  sharding.expert_index < sharding.expert_shards,
              "[params] internal: expert shard {} of {}", sharding.expert_index,
              sharding.expert_shards);
  sharding_ = sharding;
  size_t offset = 0, shard_offset = 0;
  for (ParamUnit& u : units_) {
    u.offset = offset;
    for (TensorId t = u.first; t < u.end; ++t) {
      tensors_[size_t(t)].offset = offset;
      offset = round_up(offset + size_t(tensors_[size_t(t)].numel()), kAlign);
    }
    u.size = offset - u.offset;
    const size_t shards = size_t(sharding.shards_of(u.group));
    u.padded = round_up(std::max<size_t>(u.size, 1), kAlign * shards);
    u.shard = u.padded / shards;
    u.shard_offset = shard_offset;
    shard_offset += u.shard;
    offset = u.offset + u.padded;
  }
  flat_size_ = offset;
  shard_size_ = shard_offset;
  finalized_ = true;
  params_ = Buffer<F>(sharding.params ? shard_size() : flat_size_, {ledger, MemCategory::params},
                      *device_);
  grads_ =
      Buffer<F>(sharding.grads ? shard_size() : flat_size_, {ledger, MemCategory::grads}, *device_);
  param_base_.assign(units_.size(), nullptr);
  grad_base_.assign(units_.size(), nullptr);
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!sharding.params) param_base_[u] = params_.data() + units_[u].offset;
    if (!sharding.grads) grad_base_[u] = grads_.data() + units_[u].offset;
  }
  build_owned();
}

template <typename F>
void ParamStoreT<F>::build_owned() {
  const bool sharded = sharding_.params || sharding_.grads || sharding_.state;
  owned_.clear();
  for (size_t u = 0; u < units_.size(); ++u) {
    const ParamUnit& unit = units_[u];
    const size_t begin = sharded ? shard_begin(int(u)) : unit.offset;
    const size_t end = sharded ? begin + unit.shard : unit.offset + unit.padded;
    auto pos = [&](bool in_shard, size_t flat) {
      return in_shard ? unit.shard_offset + (flat - begin) : flat;
    };
    for (TensorId t = unit.first; t < unit.end; ++t) {
      const ParamEntry& e = tensors_[size_t(t)];
      const size_t lo = std::max(begin, e.offset), hi = std::min(end, e.offset + size_t(e.numel()));
      if (lo >= hi) continue;
      OwnedSegment s;
      s.tensor = t;
      s.element = lo - e.offset;
      s.count = hi - lo;
      s.param_pos = pos(sharding_.params, lo);
      s.grad_pos = pos(sharding_.grads, lo);
      s.state_pos = pos(sharding_.state, lo);
      s.decay = e.spec.decay;
      owned_.push_back(s);
    }
  }
}

template <typename F>
F* ParamStoreT<F>::resolve(TensorId id, std::vector<F*>& bases) {
  const ParamEntry& e = tensors_[size_t(id)];
  F* base = bases[size_t(e.unit)];
  TETRA_CHECK(base, "[params] internal: tensor '{}' used while its unit '{}' is not resident",
              e.spec.name, units_[size_t(e.unit)].name);
  return base + (e.offset - units_[size_t(e.unit)].offset);
}

template <typename F>
TensorId ParamStoreT<F>::find(const std::string& name) const {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].spec.name == name) return TensorId(i);
  }
  return -1;
}

template <typename F>
typename ParamStoreT<F>::HeldRun ParamStoreT<F>::held(TensorId id) {
  const ParamEntry& e = tensors_[size_t(id)];
  HeldRun r;
  if (!sharding_.params) {
    r.count = e.numel();
    r.data = params_.data() + e.offset;
    return r;
  }
  const ParamUnit& u = units_[size_t(e.unit)];
  const size_t begin = shard_begin(e.unit), end = begin + u.shard;
  const size_t lo = std::max(begin, e.offset), hi = std::min(end, e.offset + size_t(e.numel()));
  if (lo >= hi) return r;
  r.first = int64_t(lo - e.offset);
  r.count = int64_t(hi - lo);
  r.data = params_.data() + u.shard_offset + (lo - begin);
  return r;
}

// Both fill what this rank holds on the host and copy it to the device: one tensor at a time, so
// the host copy is at most one tensor long.
template <typename F>
void ParamStoreT<F>::init(uint64_t seed) {
  std::vector<F> host;
  for (TensorId id = 0; id < TensorId(tensors_.size()); ++id) {
    const ParamEntry& e = tensors_[size_t(id)];
    const ParamInit& in = e.spec.init;
    const HeldRun run = held(id);
    host.resize(size_t(run.count));
    if (in.kind != ParamInit::Kind::normal) {
      std::fill(host.begin(), host.end(), F(in.kind == ParamInit::Kind::ones ? 1 : 0));
    } else {
      const Philox rng(seed, e.spec.name);
      int64_t row = 1;
      for (size_t d = 1; d < e.spec.shape.size(); ++d) row *= e.spec.shape[d];
      const int64_t drawn = in.rows < 0 ? shape_numel(e.spec.shape) : in.rows * row;
#pragma omp parallel for schedule(static)
      for (int64_t k = 0; k < run.count; ++k) {
        const int64_t g = e.global_index(run.first + k);
        host[size_t(k)] = g < drawn ? F(in.std * rng.normal(uint64_t(g))) : F(0);
      }
    }
    device_->from_host(run.data, host.data(), host.size() * sizeof(F));
  }
}

template <typename F>
void ParamStoreT<F>::load_global(TensorId id, const F* global) {
  const ParamEntry& e = tensors_[size_t(id)];
  const HeldRun run = held(id);
  std::vector<F> host(size_t(run.count));
  for (int64_t k = 0; k < run.count; ++k) host[size_t(k)] = global[e.global_index(run.first + k)];
  device_->from_host(run.data, host.data(), host.size() * sizeof(F));
}

template class ParamStoreT<float>;
template class ParamStoreT<double>;

}  // namespace tetra
