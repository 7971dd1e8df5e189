// In-memory checkpoints (ckpt.memory_every; docs/checkpoints.md, "In memory"). Every N steps each
// rank copies its shards (what it writes to a disk checkpoint) into its host's memory store
// (ckpt/memory_store.h) and, on a thread of its own, sends them to its buddy — the rank k places
// along the world ring, k the smallest shift that puts every rank's buddy on another host — which
// keeps the copy in its host's store. A restart takes the newest step whose every shard survives
// on some host (both copies of a shard gone, or a newer checkpoint on disk: the disk's), brings the
// shards each host's ranks read from the hosts that hold them, and loads it as a checkpoint of any
// layout.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/memory_store.h"
#include "ckpt/shard.h"
#include "comm/communicator.h"
#include "train/options.h"

namespace tetra {

/** What became of one memory save, on this rank. */
struct MemorySaveReport {
  int64_t step = 0;
  double block_s = 0;     // the step loop's stall: the copy into the host's memory
  double copy_s = 0;      // the rest, on the save's thread: the buddies' copies, the clean-up
  uint64_t kept = 0;      // bytes this rank put into its host's store (its shard and its copy)
  uint64_t sent = 0;      // bytes it sent to its buddy
  int64_t complete = -1;  // the newest step every rank holds in memory (after this save)
  std::string error;      // empty on success
};

class MemoryCheckpoint {
 public:
  /** Collective over `world` (invalid: one process). The store of `options.dir`'s run under
   *  options.memory_dir on this host. `error_step`: the test seam debug.save_error_step of this
   *  rank (0: none), whose memory save fails as in a full file system. */
  MemoryCheckpoint(const CkptOptions& options, const comm::Communicator& world, Device& device,
                   int64_t error_step = 0);
  ~MemoryCheckpoint();  // waits for the save in flight
  MemoryCheckpoint(const MemoryCheckpoint&) = delete;
  MemoryCheckpoint& operator=(const MemoryCheckpoint&) = delete;

  /** Collective. The newest step held in memory whose every shard survives on some host, when it
   *  is not older than `disk_step` (the newest on disk): with the shards this host's ranks read
   *  (files_needed for `store`, `stage` as ckpt::load takes it) brought from the hosts holding
   *  them, and its manifest, whose directory is this host's copy of the step. Nothing otherwise,
   *  the log saying why. */
  std::optional<ckpt::Manifest> restore_point(int64_t disk_step, ParamStore& store, bool stage);
  /** Collective, once the run knows where it starts (after step `start_step`): every host keeps
   *  only the step the run resumed from memory (`resumed`; -1: none), so that shards of another
   *  history never mix with this run's; then each rank makes the files of its first saves of
   *  `sources` and of its copies. */
  void begin(int64_t resumed, const std::vector<ckpt::Source>& sources, int64_t start_step);

  /** After 1-based step `step`: a memory save is due (not on the run's last step, which goes to
   *  disk). */
  bool due(int64_t step, bool last) const;
  /** Copies this rank's `sources` into its host's memory and hands the rest to the save's thread;
   *  waits for the previous save first. Returns the seconds the loop was blocked. */
  double save(int64_t step, const std::vector<ckpt::Source>& sources, const nlohmann::json& header,
              const nlohmann::json& rank_state);
  std::vector<MemorySaveReport> take_reports();
  /** The newest step every rank of the job holds in memory, as known after the last save (-1:
   *  none). */
  int64_t complete_step() const { return complete_.load(); }
  /** At the end of the run (collective): waits for the save in flight, then removes the store on
   *  every host. */
  void finish();

  /** The buddy shift: rank r keeps its copy on rank (r + k) mod world; 0: every rank on one
   *  host, no copy. Exposed for the tests. */
  static int buddy_shift(const std::vector<std::string>& hosts);

 private:
  struct Job;
  void run();
  void exchange(Job& job, MemorySaveReport& report);
  // A shard of `size` bytes for writer `writer` from `pool` (one taken back from an older step),
  // else made now.
  ckpt::MemoryStore::Shard take(std::vector<ckpt::MemoryStore::Shard>& pool, int writer,
                                uint64_t size);

  CkptOptions opt_;
  comm::Communicator world_, copies_;  // copies_: the buddies' own group, for the save's thread
  Device& device_;
  ckpt::MemoryStore store_;
  int64_t error_step_ = 0;
  int rank_ = 0, world_size_ = 1, shift_ = 0;
  bool host_leader_ = true;  // the lowest world rank of its host: cleans the host's store
  std::string buddy_host_;

  ckpt::ShardLayout layout_;  // of the last save
  // Shard files ready to be written: this rank's own and its buddy's copies. Made before the first
  // step (first touching a page of a memory file costs ten times more while training runs: 4.4 s
  // instead of 0.4 s for 747 MB on a 2-core virtual machine), then taken back from the steps no
  // longer needed, so that no page is freed and taken again.
  std::vector<ckpt::MemoryStore::Shard> own_free_, copy_free_;
  // The shards this rank wrote (its own and the copies it keeps), still mapped: when their step is
  // no longer needed, the next save's and the next copy's files.
  struct Written {
    int64_t step;
    int writer;
    ckpt::MemoryStore::Shard shard;
  };
  std::vector<Written> written_;
  int64_t dropped_below_ = -1;  // the host leader dropped the steps before this one
  int64_t done_ = -1;           // the newest step of this rank's completed saves
  std::atomic<int64_t> complete_{-1};

  std::unique_ptr<Job> pending_;
  bool busy_ = false, stop_ = false;
  std::vector<MemorySaveReport> reports_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread thread_;
};

}  // namespace tetra
