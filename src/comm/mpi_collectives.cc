// What a group's operations execute on its progress lane (the engine thread or a helping waiter,
// mpi_m_ held): deterministic ring reductions in f32 and bf16, gathers, all-to-all, splits, the
// collective-sequence hash, and device buffers handed to their link (mpi_engine.h).
#include <mpi.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "comm/mpi_engine.h"

namespace tetra::comm::detail::mpi {

void MpiGroup::hash_step(const Op& op) {
  HashDesc d{};
  d.seq = op.seq;
  d.op = uint32_t(op.kind);
  // all_to_allv legitimately moves different byte counts on different ranks.
  d.bytes = op.kind == OpKind::all_to_allv ? 0 : op.work->bytes;
  d.world_rank = engine_->world_rank();
  uint64_t mixed[3] = {d.seq, d.bytes, uint64_t(d.op) << 32 | uint64_t(id_.key & 0xffffffffu)};
  hash_ = XXH3_64bits_withSeed(mixed, sizeof(mixed), hash_);
  d.hash = hash_;
  ++hashed_;
  const CommOptions& o = engine_->options();
  if (!o.debug_hash || size_ == 1) return;
  if (op.kind != OpKind::barrier && hashed_ % uint64_t(o.debug_hash_every) != 0) return;
  std::vector<HashDesc> all(size_t(size_), HashDesc{});
  check_mpi(MPI_Allgather(&d, sizeof(d), MPI_BYTE, all.data(), sizeof(d), MPI_BYTE, comm_),
            "MPI_Allgather (debug hash)");
  // The majority hash is the reference; every rank that differs is named.
  size_t best = 0, best_votes = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    size_t votes = size_t(std::count_if(all.begin(), all.end(),
                                        [&](const HashDesc& x) { return x.hash == all[i].hash; }));
    if (votes > best_votes) best = i, best_votes = votes;
  }
  if (best_votes == all.size()) return;
  std::vector<int> odd;
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].hash != all[best].hash) odd.push_back(int(i));
  }
  std::string report = fmt::format(
      "[comm] debug hash: the collective sequence on group '{}' diverged at its #{} operation "
      "(checked on world rank {}). First differing group rank: {} (world rank {}); differing: {}\n",
      id_.name, op.seq, engine_->world_rank(), odd[0], id_.world_ranks[size_t(odd[0])],
      fmt::join(odd, ", "));
  for (size_t i = 0; i < all.size(); ++i) {
    report += fmt::format(
        "[comm]   group rank {:>3} (world {:>3}): {:<14} #{:<6} {:>12} bytes  "
        "hash {:016x}{}\n",
        i, all[i].world_rank, op_name(OpKind(all[i].op)), all[i].seq, all[i].bytes, all[i].hash,
        all[i].hash == all[best].hash ? "" : "  <- differs");
  }
  report +=
      "[comm]   ranks issued different collectives (a rank-dependent branch?); the first "
      "differing rank's code path is the one to inspect\n";
  engine_->watchdog().abort_job(report, kExitCollectiveDesync);
}

void MpiGroup::exec(Op& op) {
  if (op.kind != OpKind::send && op.kind != OpKind::recv) hash_step(op);
  if (op.device) {
    device_->execute(*op.device, op.in, op.out, [&] { exec_host(op); });
    return;
  }
  exec_host(op);
}

std::string MpiGroup::finish_device(Op& op) {
  if (!op.device) return {};
  try {
    device_->finish_p2p(*op.device);
  } catch (const std::exception& e) {
    return fmt::format("[comm] {} #{} on group '{}' failed on world rank {}: {}", op_name(op.kind),
                       op.seq, id_.name, engine_->world_rank(), e.what());
  }
  return {};
}

void MpiGroup::exec_host(Op& op) {
  switch (op.kind) {
    case OpKind::all_reduce:
      exec_all_reduce(op);
      break;
    case OpKind::reduce_scatter:
      exec_reduce_scatter(op);
      break;
    case OpKind::all_gather:
      exec_all_gather(op);
      break;
    case OpKind::all_to_all:
      exec_all_to_all(op, false);
      break;
    case OpKind::all_to_allv:
      exec_all_to_all(op, true);
      break;
    case OpKind::broadcast: {
      char* p = static_cast<char*>(op.in.data);
      size_t n = op.in.bytes();
      for (size_t off = 0; off < n; off += size_t(1) << 30) {
        size_t c = std::min(n - off, size_t(1) << 30);
        check_mpi(MPI_Bcast(p + off, int(c), MPI_BYTE, op.peer, comm_), "MPI_Bcast");
      }
      break;
    }
    case OpKind::barrier:
      check_mpi(MPI_Barrier(comm_), "MPI_Barrier");
      break;
    case OpKind::send:
    case OpKind::recv: {
      PendingP2P p;
      int count = to_int(op.kind == OpKind::send ? op.in.bytes() : op.out.bytes(), "message bytes");
      if (op.kind == OpKind::send) {
        check_mpi(
            MPI_Isend(nonnull(op.in.data), count, MPI_BYTE, op.peer, op.tag, comm_, &p.request),
            "MPI_Isend");
      } else {
        check_mpi(
            MPI_Irecv(nonnull(op.out.data), count, MPI_BYTE, op.peer, op.tag, comm_, &p.request),
            "MPI_Irecv");
      }
      p.op = std::move(op);
      lane_->add_p2p(std::move(p));
      break;
    }
    case OpKind::split:
      exec_split(op);
      break;
  }
}

// bf16 reductions combine in f32 and round each partial result to bf16 (nearest even), as a
// bf16 collective does on a GPU; both operations are commutative, so every algorithm MPI picks
// gives every rank the same bits.
template <bool kMax>
void bf16_combine(void* in, void* inout, int* len, MPI_Datatype*) {
  const bf16* a = static_cast<const bf16*>(in);
  bf16* b = static_cast<bf16*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = a[i].to_float(), y = b[i].to_float();
    b[i] = bf16::from_float(kMax ? std::max(x, y) : x + y);
  }
}

MPI_Op mpi_op(ElemType type, ReduceOp op) {
  if (type != ElemType::bf16) return op == ReduceOp::max ? MPI_MAX : MPI_SUM;
  static const MPI_Op sum = [] {
    MPI_Op o;
    check_mpi(MPI_Op_create(&bf16_combine<false>, 1, &o), "MPI_Op_create");
    return o;
  }();
  static const MPI_Op max = [] {
    MPI_Op o;
    check_mpi(MPI_Op_create(&bf16_combine<true>, 1, &o), "MPI_Op_create");
    return o;
  }();
  return op == ReduceOp::max ? max : sum;
}

void MpiGroup::exec_all_reduce(Op& op) {
  if (op.in.count == 0) return;
  const MPI_Op mop = mpi_op(op.in.type, op.rop);
  size_t esz = elem_size(op.in.type);
  char* p = static_cast<char*>(op.in.data);
  constexpr size_t kChunk = size_t(1) << 30;
  for (size_t off = 0; off < op.in.count; off += kChunk) {
    size_t c = std::min(op.in.count - off, kChunk);
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, p + off * esz, int(c), mpi_type(op.in.type), mop, comm_),
              "MPI_Allreduce");
  }
  if (op.rop == ReduceOp::avg) {  // f32 only (Communicator refuses avg of the other types)
    float* f = static_cast<float*>(op.in.data);
    const float n = float(size_);
    for (size_t i = 0; i < op.in.count; ++i) f[i] /= n;
  }
}

void MpiGroup::exec_reduce_scatter(Op& op) {
  if (op.in.type == ElemType::bf16) {
    ring_reduce_scatter<bf16>(op);
  } else {
    ring_reduce_scatter<float>(op);
  }
}

// Ring reduce-scatter over MPI_Sendrecv. Chunk c is summed in the fixed order
// x[c+1] + x[c+2] + ... + x[c] (ranks mod n) and ends on rank c only, so the result does not depend
// on timing and is the same on every run. It moves (n-1)/n of the buffer per rank, half of what an
// all-reduce moves; OpenMPI's MPI_Reduce_scatter_block is slower than a whole all-reduce here.
template <typename T>
void MpiGroup::ring_reduce_scatter(Op& op) {
  const T* in = static_cast<const T*>(op.in.data);
  T* out = static_cast<T*>(op.out.data);
  const size_t total = op.in.count;
  const int n = size_, r = rank_;
  if (n == 1) {
    if (total && out != in) std::memcpy(out, in, total * sizeof(T));
    return;
  }
  if (total == 0) return;
  auto chunk = [&](int c) { return even_split(total, n, ((c % n) + n) % n); };
  size_t max_chunk = chunk(0).count;
  const size_t scratch_floats = (2 * max_chunk * sizeof(T) + sizeof(float) - 1) / sizeof(float);
  if (scratch_.size() < scratch_floats) scratch_.resize(scratch_floats);
  T* bufs[2] = {reinterpret_cast<T*>(scratch_.data()),
                reinterpret_cast<T*>(scratch_.data()) + max_chunk};
  const MPI_Datatype type = mpi_type(op.in.type);
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  const bool is_max = op.rop == ReduceOp::max;
  const T* send = nullptr;
  for (int s = 0; s < n - 1; ++s) {
    Range cs = chunk(r - s - 1), cr = chunk(r - s - 2);
    if (s == 0) send = in + cs.offset;
    T* recv = bufs[s % 2];
    check_mpi(MPI_Sendrecv(nonnull(const_cast<T*>(send)), to_int(cs.count, "shard size"), type,
                           right, 0, nonnull(recv), to_int(cr.count, "shard size"), type, left, 0,
                           comm_, MPI_STATUS_IGNORE),
              "MPI_Sendrecv (reduce_scatter)");
    // The last step writes `out` only after receiving, so `out` may alias this rank's shard of in.
    T* dst = (s == n - 2) ? out : recv;
    const T* own = in + cr.offset;
    if constexpr (std::is_same_v<T, bf16>) {
      for (size_t i = 0; i < cr.count; ++i) {
        const float x = recv[i].to_float(), y = own[i].to_float();
        dst[i] = bf16::from_float(is_max ? std::max(x, y) : x + y);
      }
    } else if (is_max) {
      for (size_t i = 0; i < cr.count; ++i) dst[i] = std::max(recv[i], own[i]);
    } else {
      for (size_t i = 0; i < cr.count; ++i) dst[i] = recv[i] + own[i];
    }
    send = recv;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (op.rop == ReduceOp::avg) {
      const float nf = float(n);
      for (size_t i = 0; i < op.out.count; ++i) out[i] /= nf;
    }
  }
}

void MpiGroup::exec_all_gather(Op& op) {
  const size_t esz = elem_size(op.out.type);
  const size_t total = op.out.count;
  if (total == 0) return;
  char* out = static_cast<char*>(op.out.data);
  Range mine = even_split(total, size_, rank_);
  const void* send = op.in.data == out + mine.offset * esz ? MPI_IN_PLACE : nonnull(op.in.data);
  if (total % size_t(size_) == 0) {
    int c = to_int(mine.count * esz, "all_gather bytes per rank");
    check_mpi(MPI_Allgather(send, c, MPI_BYTE, out, c, MPI_BYTE, comm_), "MPI_Allgather");
    return;
  }
  std::vector<int> counts(static_cast<size_t>(size_)), displs(static_cast<size_t>(size_));
  for (int j = 0; j < size_; ++j) {
    Range rj = even_split(total, size_, j);
    counts[size_t(j)] = to_int(rj.count * esz, "all_gather bytes per rank");
    displs[size_t(j)] = to_int(rj.offset * esz, "all_gather byte offset");
  }
  check_mpi(MPI_Allgatherv(send, counts[size_t(rank_)], MPI_BYTE, out, counts.data(), displs.data(),
                           MPI_BYTE, comm_),
            "MPI_Allgatherv");
}

void MpiGroup::exec_all_to_all(Op& op, bool variable) {
  const size_t esz = elem_size(op.in.type);
  void* in = nonnull(op.in.data);
  void* out = nonnull(op.out.data);
  if (!variable) {
    if (op.in.count == 0) return;
    int c = to_int(op.in.count / size_t(size_) * esz, "all_to_all bytes per block");
    check_mpi(MPI_Alltoall(in, c, MPI_BYTE, out, c, MPI_BYTE, comm_), "MPI_Alltoall");
    return;
  }
  size_t n = size_t(size_);
  std::vector<int> sc(n), sd(n), rc(n), rd(n);
  size_t so = 0, ro = 0;
  for (size_t j = 0; j < n; ++j) {
    sc[j] = to_int(op.send_counts[j] * esz, "all_to_allv send bytes");
    sd[j] = to_int(so * esz, "all_to_allv send offset");
    rc[j] = to_int(op.recv_counts[j] * esz, "all_to_allv recv bytes");
    rd[j] = to_int(ro * esz, "all_to_allv recv offset");
    so += op.send_counts[j];
    ro += op.recv_counts[j];
  }
  check_mpi(
      MPI_Alltoallv(in, sc.data(), sd.data(), MPI_BYTE, out, rc.data(), rd.data(), MPI_BYTE, comm_),
      "MPI_Alltoallv");
}

void MpiGroup::exec_split(Op& op) {
  MPI_Comm sub = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(comm_, op.color, op.key, &sub), "MPI_Comm_split");
  int n = 0;
  MPI_Comm_size(sub, &n);
  int me = engine_->world_rank();
  std::vector<int> ranks(size_t(n), 0);
  check_mpi(MPI_Allgather(&me, 1, MPI_INT, ranks.data(), 1, MPI_INT, sub), "MPI_Allgather (split)");
  const std::vector<std::string>& world_hosts = engine_->hosts();
  std::vector<std::string> hosts;
  for (int w : ranks) hosts.push_back(world_hosts[size_t(w)]);
  // Made before the group: a group must never die on a lane thread (see Engine::finish).
  std::unique_ptr<DeviceLink> link;
  if (device_) {
    try {
      link = device_->split(sub, op.color, op.key, op.split_name);
    } catch (...) {
      MPI_Comm_free(&sub);
      throw;
    }
  }
  *op.split_result = std::make_shared<MpiGroup>(engine_, engine_->lane_for_group(), sub,
                                                op.split_name, std::move(ranks), std::move(hosts));
  (*op.split_result)->set_device(std::move(link));
}

}  // namespace tetra::comm::detail::mpi
