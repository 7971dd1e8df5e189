// MPI backend. Each process group runs its operations on a progress lane of its own: a FIFO queue
// in issue order and a thread that executes it with *blocking* MPI calls (in OpenMPI these are
// faster than the non-blocking ones and progress by themselves), so a bucket all-reduce runs while
// the compute thread keeps computing, and one group's collectives never wait behind another's: a
// tensor-parallel all-reduce passes the data-parallel buckets issued before it. Every rank issues
// a group's collectives in the same order, so every communicator sees them in the same order, which
// is all MPI asks; lanes of different groups never wait on each other, so no cycle can form. MPI is
// initialised with MPI_THREAD_MULTIPLE. With dist.progress=process (or an MPI without thread
// support) one lane serves every group, under MPI_THREAD_SERIALIZED. A thread that waits on a Work
// may run its lane's queue itself when the lane is free ("helping"), so a collective waited on at
// once costs the same as the raw MPI call. See docs/comm.md.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "comm/flight.h"
#include "comm/mpi_engine.h"

namespace tetra::comm::detail {

namespace mpi {
// ---------------------------------------------------------------------------------------------
// Engine

Engine::Engine(const CommOptions& options, int* argc, char*** argv) : options_(options) {
  lane_per_group_ = options_.progress == "group";
  const int wanted = lane_per_group_ ? MPI_THREAD_MULTIPLE : MPI_THREAD_SERIALIZED;
  int initialised = 0;
  MPI_Initialized(&initialised);
  int provided = 0;
  if (!initialised) {
    MPI_Init_thread(argc, argv, wanted, &provided);
    we_initialised_ = true;
  } else {
    MPI_Query_thread(&provided);
  }
  TETRA_CHECK(provided >= MPI_THREAD_SERIALIZED,
              "[comm] MPI provides thread level {} but tetra needs MPI_THREAD_SERIALIZED ({}): "
              "initialise MPI with MPI_Init_thread(..., MPI_THREAD_SERIALIZED, ...) or let "
              "comm::init_world do it",
              provided, int(MPI_THREAD_SERIALIZED));
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  if (lane_per_group_ && provided < MPI_THREAD_MULTIPLE) {
    lane_per_group_ = false;
    if (world_rank_ == 0) {
      std::fprintf(stderr,
                   "[comm] warning: MPI provides thread level %d, not MPI_THREAD_MULTIPLE (%d): "
                   "every group's collectives share one progress thread, as with "
                   "dist.progress=process, so tensor-parallel collectives queue behind "
                   "data-parallel buckets; use an MPI built with thread support to avoid it\n",
                   provided, int(MPI_THREAD_MULTIPLE));
    }
  }
}

void Engine::start(const std::vector<std::string>& hosts, uint64_t token) {
  int world_size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  hosts_ = hosts;
  watchdog_ = std::make_unique<Watchdog>(options_, world_rank_, world_size, hosts, token);
  // Where every rank answers probes; gathering them also waits until every local rank has
  // mapped the arrival board.
  constexpr int kAddress = 256;
  char mine[kAddress] = {};
  const std::string& address = watchdog_->probe_address();
  std::memcpy(mine, address.data(), std::min(address.size(), size_t(kAddress - 1)));
  std::vector<char> all(size_t(world_size) * kAddress);
  MPI_Allgather(mine, kAddress, MPI_CHAR, all.data(), kAddress, MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> addresses;
  for (int i = 0; i < world_size; ++i) addresses.emplace_back(all.data() + size_t(i) * kAddress);
  watchdog_->set_peer_addresses(std::move(addresses));
  watchdog_->start();
}

Engine::~Engine() {
  process_lane_.reset();  // joins its thread before MPI goes away
  watchdog_.reset();
  int finalised = 0;
  MPI_Finalized(&finalised);
  if (we_initialised_ && !finalised) MPI_Finalize();
}

std::shared_ptr<Lane> Engine::lane_for_group() {
  std::lock_guard<std::mutex> lock(issue_m_);
  if (!lane_per_group_) {
    if (!process_lane_) {
      process_lane_ = std::make_shared<Lane>(*this);
      lanes_.push_back(process_lane_);
    }
    return process_lane_;
  }
  auto lane = std::make_shared<Lane>(*this);
  std::erase_if(lanes_, [](const std::weak_ptr<Lane>& l) { return l.expired(); });
  lanes_.push_back(lane);
  return lane;
}

std::shared_ptr<WorkState> Engine::submit(Op op, size_t bytes, const std::shared_ptr<Lane>& lane) {
  auto ws = std::make_shared<WorkState>();
  ws->op = op.kind;
  ws->group = op.group->name();
  ws->bytes = bytes;
  ws->sent_bytes = ring_sent_bytes(op.kind, bytes, op.group->size(),
                                   op.kind == OpKind::broadcast && op.peer == op.group->rank());
  ws->timeout_s = options_.timeout_s;
  ws->helper = lane;
  ws->issue_s = now_s();
  op.work = ws;
  OpRecord rec;
  rec.op = op.kind;
  rec.group = op.group->name();
  rec.group_key = op.group->id().key;
  rec.bytes = bytes;
  rec.elem = op.in.count > 0 || op.out.count == 0 ? op.in.type : op.out.type;
  rec.peer = op.peer;
  rec.site = flight::current_site();
  rec.issue_s = ws->issue_s;
  std::lock_guard<std::mutex> lock(issue_m_);
  op.id = next_id_++;
  op.seq = op.group->next_seq(op.kind);
  ws->seq = op.seq;
  rec.id = op.id;
  rec.seq = op.seq;
  // Recorded before any lane can see the operation, so history order is issue order.
  watchdog_->on_issue(rec, op.group->id());
  outstanding_.fetch_add(1);
  lane->push(std::move(op));
  return ws;
}

void Engine::synchronize() {
  while (outstanding_.load() > 0) {
    std::vector<std::shared_ptr<Lane>> lanes;
    {
      std::lock_guard<std::mutex> lock(issue_m_);
      for (const auto& l : lanes_) {
        if (auto p = l.lock()) lanes.push_back(std::move(p));
      }
    }
    for (auto& l : lanes) l->help_all();
    if (outstanding_.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void Engine::finish(Op& op, std::string error) {
  // A split's new group must never die on a lane thread: its destructor waits for every pending
  // operation, the lane's own included. Dropping the lane's reference before the issuer wakes up
  // leaves the last one to the issuer.
  op.split_result.reset();
  op.work->end_s = now_s();
  watchdog_->on_end(op.id, op.group->id(), op.seq, error.empty());
  op.work->complete(std::move(error));
  outstanding_.fetch_sub(1);
}

void Engine::abort_job(const std::string& message, int exit_code) {
  std::string line = fmt::format("error: [rank {}] {}\n", world_rank_, message);
  if (exit_code == kExitError) flight::dump("error: " + message);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
  std::fflush(stdout);
  // MPI_Abort asks the launcher to kill every rank. It is called while a lane may sit in a
  // collective that will never complete; should the abort itself hang there, the process still
  // ends (the launcher then sees a rank exit without finalising and stops the others).
  std::thread([exit_code] {
    std::this_thread::sleep_for(std::chrono::seconds(5));
    _exit(exit_code);
  }).detach();
  if (before_abort_) before_abort_();
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  _exit(exit_code);
}

// ---------------------------------------------------------------------------------------------
// Lane

Lane::~Lane() {
  {
    std::lock_guard<std::mutex> lock(queue_m_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Lane::push(Op op) {
  {
    std::lock_guard<std::mutex> lock(queue_m_);
    TETRA_CHECK(!stop_, "[comm] {} issued on group '{}' after its progress lane stopped",
                op_name(op.kind), op.group->name());
    queue_.push_back(std::move(op));
    // Started lazily: groups that never communicate (size 1, unused dimensions) cost no thread.
    if (!thread_.joinable()) thread_ = std::thread([this] { thread_main(); });
  }
  queue_cv_.notify_one();
}

void Lane::help(const WorkState& target) {
  std::unique_lock<std::mutex> lock(mpi_m_, std::try_to_lock);
  if (!lock.owns_lock()) return;
  drain(&target);
}

void Lane::help_all() {
  std::unique_lock<std::mutex> lock(mpi_m_, std::try_to_lock);
  if (lock.owns_lock()) drain(nullptr);
}

void Lane::release_comm(MPI_Comm comm) {
  std::lock_guard<std::mutex> lock(mpi_m_);
  MPI_Comm_free(&comm);
}

void Lane::thread_main() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(queue_m_);
      while (queue_.empty() && !stop_) {
        if (p2p_count_.load() == 0) {
          queue_cv_.wait(lock);
          continue;
        }
        lock.unlock();
        {
          std::lock_guard<std::mutex> mpi(mpi_m_);
          poll_p2p();
        }
        lock.lock();
        if (queue_.empty() && !stop_ && p2p_count_.load() > 0) {
          queue_cv_.wait_for(lock, std::chrono::microseconds(50));
        }
      }
      if (stop_ && queue_.empty() && p2p_count_.load() == 0) return;
    }
    std::lock_guard<std::mutex> mpi(mpi_m_);
    drain(nullptr);
  }
}

void Lane::drain(const WorkState* target) {
  for (;;) {
    if (target && target->done.load(std::memory_order_acquire)) break;
    Op op;
    {
      std::lock_guard<std::mutex> lock(queue_m_);
      if (queue_.empty()) break;
      op = std::move(queue_.front());
      queue_.pop_front();
    }
    execute(op);
  }
  if (!p2p_.empty()) poll_p2p();
}

void Lane::execute(Op& op) {
  const OpKind kind = op.kind;
  const int world_rank = engine_.world_rank();
  op.work->start_s = now_s();
  engine_.watchdog().on_start(op.id, op.group->id(), op.seq, op.kind);
  try {
    op.group->exec(op);
  } catch (const MpiFailure& f) {
    engine_.finish(op, fmt::format("[comm] {} #{} on group '{}' failed on world rank {}: {}",
                                   op_name(op.kind), op.seq, op.group->name(), world_rank, f.what));
    return;
  } catch (const std::exception& e) {
    engine_.finish(
        op, fmt::format("[comm] {} #{} on group '{}' failed on world rank {}: {}", op_name(op.kind),
                        op.seq, op.group->name(), world_rank, e.what()));
    return;
  }
  if (kind == OpKind::send || kind == OpKind::recv) return;  // completes in poll_p2p
  engine_.finish(op, {});
}

void Lane::poll_p2p() {
  if (p2p_.empty()) return;
  std::vector<MPI_Request> reqs;
  reqs.reserve(p2p_.size());
  for (const auto& p : p2p_) reqs.push_back(p.request);
  std::vector<int> idx(reqs.size());
  int n_done = 0;
  int rc = MPI_Testsome(int(reqs.size()), reqs.data(), &n_done, idx.data(), MPI_STATUSES_IGNORE);
  if (rc != MPI_SUCCESS) {
    std::string err = fmt::format("[comm] MPI_Testsome failed: {}", mpi_error_text(rc));
    for (auto& p : p2p_) engine_.finish(p.op, err);
    p2p_count_.fetch_sub(int64_t(p2p_.size()));
    p2p_.clear();
    return;
  }
  if (n_done <= 0) return;
  std::vector<bool> completed(reqs.size(), false);
  for (int i = 0; i < n_done; ++i) completed[size_t(idx[size_t(i)])] = true;
  std::vector<PendingP2P> still;
  for (size_t i = 0; i < p2p_.size(); ++i) {
    if (completed[i]) {
      engine_.finish(p2p_[i].op, p2p_[i].op.group->finish_device(p2p_[i].op));
      p2p_count_.fetch_sub(1);
    } else {
      still.push_back(std::move(p2p_[i]));
    }
  }
  p2p_ = std::move(still);
}

/** The world group, without its device side. */
std::shared_ptr<MpiGroup> make_world(const CommOptions& options, int* argc, char*** argv) {
  auto engine = std::make_shared<Engine>(options, argc, argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  constexpr int kHost = 64;
  char mine[kHost] = {};
  std::memcpy(mine, name, size_t(std::min(len, kHost - 1)));
  std::vector<char> all(size_t(size) * kHost);
  MPI_Allgather(mine, kHost, MPI_CHAR, all.data(), kHost, MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> hosts;
  for (int i = 0; i < size; ++i) hosts.emplace_back(all.data() + size_t(i) * kHost);

  uint64_t token = 0;
  if (rank == 0) {
    std::random_device rd;
    token = (uint64_t(rd()) << 32) ^ uint64_t(rd()) ^ uint64_t(getpid());
  }
  MPI_Bcast(&token, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);

  MPI_Comm world = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &world);
  MPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN);
  engine->start(hosts, token);
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) ranks[size_t(i)] = i;
  return std::make_shared<MpiGroup>(engine, engine->lane_for_group(), world, "world",
                                    std::move(ranks), std::move(hosts));
}

}  // namespace mpi

using mpi::make_world;
using mpi::MpiGroup;

std::shared_ptr<GroupImpl> make_mpi_world(const CommOptions& options, int* argc, char*** argv) {
  std::shared_ptr<MpiGroup> world = make_world(options, argc, argv);
  world->set_device(make_staging_link());
  return world;
}

std::shared_ptr<GroupImpl> make_mpi_world_with(const CommOptions& options, int* argc, char*** argv,
                                               const DeviceWorldFactory& factory) {
  std::shared_ptr<MpiGroup> world = make_world(options, argc, argv);
  DeviceWorld device = factory(*world, world->comm());
  world->set_device(std::move(device.link));
  if (device.before_abort) world->engine().set_before_abort(std::move(device.before_abort));
  return world;
}

}  // namespace tetra::comm::detail
