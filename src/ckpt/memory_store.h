// Checkpoints held in a host's memory: the shards of the newest steps in the checkpoint format, in
// a memory-backed file system (/dev/shm, tmpfs), so that they outlive the processes that wrote
// them — a restarted job finds them — but not the host. One store per run (keyed by its ckpt.dir)
// per host; it holds the shards of the host's own ranks and the copies its ranks keep for their
// buddies on other hosts (train/memory_checkpoint.h moves them; docs/checkpoints.md, "In memory").
//
//   <root>/step-000000120/header.json              the manifest besides ranks and tensors
//   <root>/step-000000120/rank-00003.safetensors   writer rank 3's shard, as a rank file on disk
//   <root>/step-000000120/rank-00003.json          its fragment: written once the shard is whole
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tetra::ckpt {

class MemoryStore {
 public:
  explicit MemoryStore(std::filesystem::path root);

  /** The store of the run whose checkpoints go to `ckpt_dir`, under `memory_dir`: its directory
   *  tetra-<xxh3 of ckpt_dir's absolute path>, the same on every host that shares ckpt_dir. */
  static std::filesystem::path root_for(const std::filesystem::path& memory_dir,
                                        const std::filesystem::path& ckpt_dir);
  const std::filesystem::path& root() const { return root_; }
  std::filesystem::path step_dir(int64_t step) const;

  /** What the store holds of one step: its header, and the whole shards by writer rank (their
   *  file sizes). */
  struct Step {
    int64_t step = 0;
    bool header = false;
    std::map<int, uint64_t> shards;
  };
  /** Every step the store holds, newest first. Names it does not write are passed over. */
  std::vector<Step> inventory() const;

  /** A shard being written: a file of `size` bytes mapped into memory (its pages taken from the
   *  file system now, so that a full one is an error here and never a SIGBUS later), published
   *  as a step's shard with its fragment by commit() and mapped until destroyed. Destroyed
   *  uncommitted, it is removed. */
  class Shard {
   public:
    Shard() = default;
    Shard(Shard&& o) noexcept;
    Shard& operator=(Shard&& o) noexcept;
    ~Shard();
    std::byte* data() const { return data_; }
    size_t size() const { return size_; }
    bool committed() const { return committed_; }
    /** Publishes it as writer rank `rank`'s shard of step `step` (the step's directory made if
     *  need be), with its fragment. */
    void commit(int64_t step, const nlohmann::json& fragment);
    /** A committed shard taken back to be written again (its pages and its mapping kept:
     *  nothing freed, zeroed or mapped anew), as a shard of writer rank `rank`; its fragment goes
     *  first, so that its step no longer counts it. False (and it is removed) when it cannot. */
    bool recycle(int rank);

   private:
    friend class MemoryStore;
    void release();
    const MemoryStore* store_ = nullptr;
    std::filesystem::path tmp_;
    int64_t step_ = -1;  // committed as a shard of this step
    int rank_ = 0;
    bool committed_ = false;
    std::byte* data_ = nullptr;
    size_t size_ = 0;
    int fd_ = -1;
  };
  /** Starts a shard of writer rank `rank` (a file beside the steps until committed), its pages
   *  taken and mapped now. Throws naming the store and what to change when the file system has no
   *  room. */
  Shard create(int rank, uint64_t size) const;
  /** Removes writer rank `rank`'s shard of step `step`. */
  void drop_shard(int64_t step, int rank) const;

  /** A committed shard mapped read-only. */
  class Mapped {
   public:
    Mapped() = default;
    Mapped(Mapped&& o) noexcept;
    Mapped& operator=(Mapped&& o) noexcept;
    ~Mapped();
    const std::byte* data() const { return data_; }
    size_t size() const { return size_; }

   private:
    friend class MemoryStore;
    const std::byte* data_ = nullptr;
    size_t size_ = 0;
  };
  Mapped map(int64_t step, int rank) const;
  nlohmann::json fragment(int64_t step, int rank) const;

  /** The step's header (written by every rank of the host; the same bytes). */
  void put_header(int64_t step, const nlohmann::json& header) const;
  nlohmann::json header(int64_t step) const;

  /** Removes the steps before `step`. */
  void drop_before(int64_t step) const;
  /** Every step but `keep` (-1: every step) goes: its shards, and the shards an earlier process
   *  left unfinished, become spares (files whose pages are taken already), the rest is removed.
   *  A restarted job makes its files from them (claim) rather than take new pages. */
  void drop_all_but(int64_t keep) const;
  /** A spare of exactly `size` bytes taken as a shard of writer rank `rank` (mapped, its pages
   *  already there); empty when none is left. Several processes may claim at once: each spare
   *  goes to one. */
  Shard claim(int rank, uint64_t size) const;
  /** Removes the spares nobody claimed. */
  void drop_spares() const;
  /** Removes the store. */
  void remove() const;
  /** Bytes the file system holding the store can still give. */
  uint64_t free_bytes() const;

 private:
  std::filesystem::path root_;
};

}  // namespace tetra::ckpt
