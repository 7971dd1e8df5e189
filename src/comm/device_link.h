// The device side of a process group: how the MPI engine's progress lanes (mpi_backend.cc) run
// operations whose buffers live in GPU memory. Internal to comm/; the links themselves are the
// CUDA build's (comm/nccl/), and without CUDA no group has one (make_staging_link returns null).
//
// Every MpiGroup of a CUDA build carries a DeviceLink. The operation is described to it on the
// issuing thread (prepare: classify the buffers, record an event on the compute stream), and the
// lane hands it the operation to run (execute) in its place in the group's issue order:
//   * StagingLink (host_staging.cc), dist.backend=mpi: device buffers are copied to host memory,
//     the unchanged MPI algorithm runs on the copies, the results are copied back.
//   * NcclLink (nccl_backend.cc), dist.backend=nccl: collectives run as NCCL calls on the group's
//     stream, host buffers bounce through device memory; send/recv, barrier, split and the debug
//     hash stay on MPI.
// This header needs no CUDA headers, so the MPI backend includes it in every build.
#pragma once

#include <mpi.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace tetra::comm::detail {

class GroupImpl;

/** An operation as issued; pointers are valid only during prepare(). */
struct OpDesc {
  OpKind kind = OpKind::barrier;
  View in, out;
  ReduceOp rop = ReduceOp::sum;
  int peer = -1;  // send/recv: the peer; broadcast: the root
  int rank = 0, size = 1;
  const std::vector<size_t>* send_counts = nullptr;  // all_to_allv only
  const std::vector<size_t>* recv_counts = nullptr;
};

/** Per-operation device state, made on the issuing thread and owned by the lane's Op. */
class DeviceOp {
 public:
  virtual ~DeviceOp() = default;
};

class DeviceLink {
 public:
  virtual ~DeviceLink() = default;
  /** Issuing thread. Null: the operation runs as plain MPI on host memory, untouched. */
  virtual std::unique_ptr<DeviceOp> prepare(const OpDesc& desc) = 0;
  /** Lane (its mutex held), in issue order. Runs the operation; `host_algorithm()` runs the MPI
   *  backend's own algorithm on `in`/`out`, which execute may first point at host copies. For
   *  send and recv it only posts the request: finish_p2p completes them. */
  virtual void execute(DeviceOp& op, View& in, View& out,
                       const std::function<void()>& host_algorithm) = 0;
  /** Lane: the posted send/recv of `op` completed in MPI; a staged recv copies to the device. */
  virtual void finish_p2p(DeviceOp& op) = 0;
  /** Lane of the parent group, inside its split, after MPI_Comm_split made `sub`: the link of the
   *  new group `name` (collective over the parent, like the split). */
  virtual std::unique_ptr<DeviceLink> split(MPI_Comm sub, int color, int key,
                                            const std::string& name) = 0;
};

/** dist.backend=mpi: device buffers staged through host memory (CUDA builds); null without CUDA,
 *  where every buffer is host memory. */
std::unique_ptr<DeviceLink> make_staging_link();

/** What a backend adds to the MPI world group. */
struct DeviceWorld {
  std::unique_ptr<DeviceLink> link;
  /** Runs before the process ends on a watchdog timeout, a debug-hash mismatch or abort_job
   *  (may be empty): the NCCL backend aborts its communicators there. */
  std::function<void()> before_abort;
};
/** Called once MPI and the watchdog are up, on the initialising thread, with the world group and
 *  its MPI communicator; throws tetra::Error to refuse. */
using DeviceWorldFactory = std::function<DeviceWorld(GroupImpl& world, MPI_Comm comm)>;

/** The MPI world group (make_mpi_world) with the device side `factory` builds. */
std::shared_ptr<GroupImpl> make_mpi_world_with(const CommOptions& options, int* argc, char*** argv,
                                               const DeviceWorldFactory& factory);

}  // namespace tetra::comm::detail
