// The expert-parallel group of a mixture-of-experts model (seed 004, "エキスパート並列"): each of
// its ep ranks holds E/ep of every MoE block's experts, and the tokens routed to an expert travel
// to its rank and back by all-to-all(v) over the mesh's ep group — twice forward (dispatch,
// combine) and twice backward. Counters say what moved and how long the compute thread waited
// for it (every exchange is exposed: the experts cannot start before their rows arrive).
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "kernels/backend.h"

namespace tetra::parallel {

struct EpCounters {
  double row_bytes = 0.0;  // bytes of the rows this rank put into its all-to-alls, its own included
  double sent_bytes = 0.0;  // of the rows' exchanges, the ring model's (comm::Work::sent_bytes)
  double wait_ms = 0.0;     // time the compute thread waited for them, count exchanges included
};

class ExpertParallel {
 public:
  /** One rank on `backend`: nothing moves. */
  explicit ExpertParallel(Backend& backend) : backend_(&backend) {}
  /** Over `group` (the mesh's ep group; invalid means one rank), on `backend`'s device buffers. */
  ExpertParallel(Backend& backend, comm::Communicator group);

  Backend& backend() const { return *backend_; }
  int size() const { return size_; }
  int rank() const { return rank_; }

  /** send (size()·n): block j goes to rank j; returns (size()·n) whose block j came from rank j.
   *  Collective; host memory. */
  std::vector<int32_t> exchange_counts(const std::vector<int32_t>& send, int n);
  /** Rows of C elements: send_rows[j] consecutive rows of `in` go to rank j (in rank order), and
   *  recv_rows[j] rows from rank j land in `out` in rank order. Device buffers; collective. */
  template <typename F>
  void exchange_rows(const F* in, const std::vector<int64_t>& send_rows, F* out,
                     const std::vector<int64_t>& recv_rows, int C);

  const EpCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = EpCounters(); }

 private:
  Backend* backend_;
  comm::Communicator group_;
  int size_ = 1, rank_ = 0;
  EpCounters counters_;
};

}  // namespace tetra::parallel
