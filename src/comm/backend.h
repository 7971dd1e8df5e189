// The seam between Communicator and a backend (MPI, NCCL). Internal to comm/.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace tetra::comm::detail {

/** Lets a thread waiting on a Work drive its progress lane itself instead of sleeping (see
 *  docs/comm.md, "progress lanes"). */
class ProgressHelper {
 public:
  virtual ~ProgressHelper() = default;
  /** Runs queued operations on the calling thread if the lane is free; never blocks on it. */
  virtual void help(const WorkState& target) = 0;
};

struct WorkState {
  std::atomic<bool> done{false};
  std::mutex m;
  std::condition_variable cv;
  std::string error;  // non-empty: the operation failed

  OpKind op = OpKind::barrier;
  std::string group;
  uint64_t seq = 0;
  size_t bytes = 0;
  double sent_bytes = 0;  // ring-model bytes this rank sends
  double issue_s = 0, start_s = 0, end_s = 0;
  double timeout_s = 0;
  std::weak_ptr<ProgressHelper> helper;  // weak: only user threads may end a lane

  void complete(std::string err = {}) {
    {
      std::lock_guard<std::mutex> lock(m);
      error = std::move(err);
      done.store(true, std::memory_order_release);
    }
    cv.notify_all();
  }
};

class GroupImpl {
 public:
  virtual ~GroupImpl() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;
  virtual const std::vector<int>& world_ranks() const = 0;
  virtual const std::string& host(int r) const = 0;
  virtual const CommOptions& options() const = 0;

  virtual Work all_reduce(View data, ReduceOp op) = 0;
  virtual Work reduce_scatter(View in, View out, ReduceOp op) = 0;
  virtual Work all_gather(View in, View out) = 0;
  virtual Work all_to_all(View in, View out) = 0;
  virtual Work all_to_allv(View in, const std::vector<size_t>& send_counts, View out,
                           const std::vector<size_t>& recv_counts) = 0;
  virtual Work broadcast(View data, int root) = 0;
  virtual Work send(View data, int dst, int tag) = 0;
  virtual Work recv(View data, int src, int tag) = 0;
  virtual Work barrier() = 0;
  virtual std::shared_ptr<GroupImpl> split(int color, int key, const std::string& name) = 0;
  virtual void synchronize() = 0;
  [[noreturn]] virtual void abort_job(const std::string& message, int exit_code) = 0;
  virtual void set_deadline(double seconds, const std::string& why) = 0;
};

std::shared_ptr<GroupImpl> make_mpi_world(const CommOptions& options, int* argc, char*** argv);
std::shared_ptr<GroupImpl> make_nccl_world(const CommOptions& options, int* argc, char*** argv);

}  // namespace tetra::comm::detail
