// The parameter store: every trainable tensor of a rank, registered by its global (Hugging Face)
// name and global shape, with the part this rank holds, and the flat buffers over those parts.
// Models register tensors and read them back by id; optimizers run over the store's owned
// segments; parallel layers decide which parts of the flat buffers are resident. Nothing here
// knows which model it holds.
//
// Layout: tensors are grouped into units (a transformer block, the embedding...). Units are laid
// out in registration order, which is the order backward finishes them, so "every unit up to u is
// final" is a prefix of the flat gradient. Each unit is padded to a multiple of 16·N elements, N
// the size of the group it is sharded over, so that a ZeRO shard of a unit is an equal, 64-byte
// aligned slice on every rank of that group: the rank of index r owns elements [r·S, (r+1)·S) of
// the unit (S = padded / N), and a shard buffer is the concatenation of a rank's slices of every
// unit. Dense units are sharded over the data-parallel group; expert units (mixture of experts,
// held only by the ranks that hold those experts) over the expert-data-parallel group, whose
// members hold the same experts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/device.h"
#include "core/memory.h"
#include "core/tensor.h"

namespace tetra {

/** How a tensor is initialised. Values are keyed by (seed, global name, global element index),
 * so every sharding of a model starts with exactly the serial values. */
struct ParamInit {
  enum class Kind : uint8_t { zeros, ones, normal };
  Kind kind = Kind::zeros;
  float std = 0.0f;
  int64_t rows = -1;  // normal: rows >= `rows` stay zero (a padded vocabulary); -1 = all rows
};

/** How a tensor is stored in Hugging Face files. */
struct FileLayout {
  bool transposed = false;  // Conv1D weights: (in, out) in files, (out, in) here
  int64_t rows = -1;        // rows present in files (a padded vocabulary has fewer); -1 = all
};

/** The part of a global tensor a rank holds: [offset, offset + extent) along `dim`; dim -1 is the
 * whole tensor. With `parts` > 1 the dimension is `parts` equal blocks (c_attn's q, k and v) and
 * the rank holds [offset, offset + extent) of each, concatenated. Tensor and expert parallelism
 * slice; data parallelism (ZeRO) does not. */
struct Slice {
  int dim = -1;
  int64_t offset = 0, extent = 0;
  int64_t parts = 1;
};

struct ParamSpec {
  std::string name;  // global name, e.g. "transformer.h.0.attn.c_attn.weight"
  Shape shape;       // global shape in tetra's layout (Linear weights are (out, in))
  bool decay = false;
  ParamInit init;
  FileLayout file;
  Slice slice;
};

using TensorId = int;

/** The group a unit is sharded (and its gradient reduced) over: the data-parallel group, or for
 *  experts the expert-data-parallel group (the dp ranks that hold the same experts). */
enum class ShardGroup : uint8_t { dense, expert };

/** A registered tensor: its spec plus where its local part lives in the flat layout. */
struct ParamEntry {
  ParamSpec spec;
  Shape local_shape;
  int unit = 0;
  size_t offset = 0;  // elements from the start of the flat (unsharded) layout
  int64_t numel() const { return shape_numel(local_shape); }
  /** Global element index of local element i (row-major in both). */
  int64_t global_index(int64_t i) const;
};

struct ParamUnit {
  std::string name;
  ShardGroup group = ShardGroup::dense;
  TensorId first = 0, end = 0;  // tensors [first, end)
  size_t offset = 0;            // flat offset
  size_t size = 0;              // elements covered by its tensors (with alignment gaps)
  size_t padded = 0;            // size rounded up to a multiple of its group's shards * 16
  size_t shard = 0;             // padded / its group's shards
  size_t shard_offset = 0;      // where this unit's slice starts in a shard buffer
};

/** Which of the flat buffers hold only this rank's shard (ZeRO stages 3, 2+ and 1+), over how
 *  many ranks: dense units over `shards` (this rank is `index`), expert units over
 *  `expert_shards` (this rank is `expert_index`). */
struct Sharding {
  int shards = 1, index = 0;
  bool params = false, grads = false, state = false;
  int expert_shards = 1, expert_index = 0;

  int shards_of(ShardGroup g) const { return g == ShardGroup::expert ? expert_shards : shards; }
  int index_of(ShardGroup g) const { return g == ShardGroup::expert ? expert_index : index; }
};

/** A run of one tensor's elements that this rank updates, with positions in each buffer. */
struct OwnedSegment {
  TensorId tensor = 0;
  size_t element = 0;  // first element within the local tensor
  size_t count = 0;
  size_t param_pos = 0, grad_pos = 0, state_pos = 0;  // in params(), grads() and the state
  bool decay = false;
};

/** What the model tells the layer that manages parameter and gradient residency (ZeRO) as it
 * runs; `next` is the unit the same pass visits next (-1 at the end), for prefetching. */
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_forward(int unit, int next) = 0;
  virtual void after_forward(int unit) = 0;
  virtual void before_backward(int unit, int next) = 0;
  /** Every gradient of `unit` for this micro-batch is final. */
  virtual void after_backward(int unit) = 0;
  /** A forward-only pass (evaluation) ended: release what it gathered. */
  virtual void end_forward_only() = 0;
};

template <typename F>
class ParamStoreT {
 public:
  /** A store whose buffers live on `device` (the backend's; the host by default). */
  explicit ParamStoreT(Device& device = host_device()) : device_(&device) {}

  /** Starts a unit sharded over `group`; tensors added until end_unit() belong to it. */
  int begin_unit(const std::string& name, ShardGroup group = ShardGroup::dense);
  TensorId add(ParamSpec spec);
  void end_unit();

  /** Fixes the layout and allocates params and grads as `sharding` says (charged to `ledger`). */
  void finalize(const Sharding& sharding, MemoryLedger* ledger = nullptr);

  /** The local tensor's values. With sharded params, its unit must be bound (gathered). */
  F* param(TensorId id) { return resolve(id, param_base_); }
  const F* param(TensorId id) const { return const_cast<ParamStoreT*>(this)->param(id); }
  /** The local tensor's gradient. With sharded grads, its unit's workspace must be bound. */
  F* grad(TensorId id) { return resolve(id, grad_base_); }
  /** Points a unit's tensors at `base` (unit-sized, nullptr unbinds): gathered params, or a
   *  gradient workspace. Only meaningful for the sharded buffers. */
  void bind_params(int unit, F* base) { param_base_[size_t(unit)] = base; }
  void bind_grads(int unit, F* base) { grad_base_[size_t(unit)] = base; }
  bool params_bound(int unit) const { return param_base_[size_t(unit)] != nullptr; }

  /** Full flat buffer (unsharded) or this rank's shard buffer, as the sharding says. */
  Buffer<F>& params() { return params_; }
  Buffer<F>& grads() { return grads_; }
  /** Elements the optimizer state holds: the flat size, or one shard. */
  size_t state_size() const { return sharding_.state ? shard_size() : flat_size(); }
  const std::vector<OwnedSegment>& owned() const { return owned_; }

  /** The elements of tensor `id` this rank holds persistently: all of its local part, or (ZeRO-3)
   *  the run inside this rank's shard. Local elements [first, first + count) live at data (device
   *  memory). */
  struct HeldRun {
    int64_t first = 0, count = 0;
    F* data = nullptr;
  };
  HeldRun held(TensorId id);

  /** Initialises every element this rank holds from (seed, name, global index). */
  void init(uint64_t seed);
  /** Copies what this rank holds of tensor `id` out of the whole global tensor `global` (host
   *  memory; tetra layout, global shape). */
  void load_global(TensorId id, const F* global);

  /** The device every buffer of the store lives on. */
  Device& device() const { return *device_; }

  const std::vector<ParamEntry>& tensors() const { return tensors_; }
  const ParamEntry& tensor(TensorId id) const { return tensors_[size_t(id)]; }
  /** The id of a tensor by global name; -1 when absent. */
  TensorId find(const std::string& name) const;
  const std::vector<ParamUnit>& units() const { return units_; }
  const Sharding& sharding() const { return sharding_; }
  size_t flat_size() const { return flat_size_; }
  /** Elements of a shard buffer: the sum of the units' shards. */
  size_t shard_size() const { return shard_size_; }
  /** Flat position of this rank's shard within unit u (its index in the unit's group). */
  size_t shard_begin(int u) const {
    const ParamUnit& unit = units_[size_t(u)];
    return unit.offset + size_t(sharding_.index_of(unit.group)) * unit.shard;
  }

 private:
  F* resolve(TensorId id, std::vector<F*>& bases);
  void build_owned();

  Device* device_;
  std::vector<ParamEntry> tensors_;
  std::vector<ParamUnit> units_;
  bool in_unit_ = false, finalized_ = false;
  Sharding sharding_;
  size_t flat_size_ = 0, shard_size_ = 0;
  Buffer<F> params_, grads_;
  std::vector<F*> param_base_, grad_base_;  // per unit: where its tensors live now
  std::vector<OwnedSegment> owned_;
};

using ParamStore = ParamStoreT<float>;

}  // namespace tetra
