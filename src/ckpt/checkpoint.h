// Sharded checkpoints of a parameter store and its AdamW moments.
//
// On disk (docs/checkpoints.md):
//   <dir>/latest                     the newest published checkpoint's name, written last
//   <dir>/step-000000120/manifest.json   per global tensor: shape and the chunks of each kind
//                                     (param, adam_m, adam_v), each with its file, byte offset,
//                                     the writer's slice, its element range and its xxh3; plus the
//                                     trainer state, the layout, the config and per-rank state
//   <dir>/step-000000120/rank-00003.safetensors   what rank 3 owns, one 1-D F32 tensor per chunk
// A save goes into "<name>.tmp-<nonce>"; rank 0 publishes it (manifest, fsync, rename, then
// `latest`) once every rank has left its fragment there, so a crash at any moment leaves the
// previous checkpoint intact. Each rank reads back only the chunks that overlap what it holds,
// whatever layout wrote them, and checks every chunk it reads against its checksum.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/arena.h"
#include "core/param_store.h"

namespace tetra::ckpt {

namespace fs = std::filesystem;

/** The largest step a checkpoint can hold: its name carries at most 18 digits (train.steps stops
 * at 10^12). */
inline constexpr int64_t kMaxStep = 999'999'999'999'999'999;

/** The three kinds of per-element state a checkpoint holds. */
inline constexpr const char* kKinds[] = {"param", "adam_m", "adam_v"};

/** A contiguous run of one tensor's elements in a rank file. */
struct Chunk {
  std::string file;              // rank file, relative to the checkpoint directory
  uint64_t offset = 0;           // byte offset of its data in the file
  Slice slice;                   // the writer's part of the global tensor (dim -1: all of it)
  int64_t first = 0, count = 0;  // elements [first, first + count) of that part, row-major
  uint64_t xxh3 = 0;             // of the count * 4 data bytes
};

struct TensorRecord {
  Shape shape;                                       // global, tetra layout
  std::map<std::string, std::vector<Chunk>> chunks;  // by kind
};

struct Manifest {
  fs::path dir;
  int64_t step = 0;
  nlohmann::json trainer;  // the trainer's own state (step, counters, sampler)
  nlohmann::json layout;   // world, dp, tp, pp, ep, zero of the writer
  nlohmann::json ranks;    // per-rank state, one object per rank
  std::string config_toml, model, tetra_version;
  // The writer's model.* shape: vocab_size, n_layer, n_head, d_model, max_seq (null in
  // checkpoints written before it was recorded; `model` describes the shape there).
  nlohmann::json model_shape;
  std::map<std::string, TensorRecord> tensors;
  uint64_t bytes = 0;  // data bytes over every chunk

  /** Reads and checks dir/manifest.json: every field, every file present and long enough, and
   * each (tensor, kind) covered exactly once. Errors name the checkpoint and what is wrong. */
  static Manifest read(const fs::path& dir);
  /** The same checks of a manifest's `text` for the checkpoint in `dir`, whose files' sizes
   * `size` tells (nothing: the file is missing), wherever they are. */
  static Manifest parse(const std::string& text, const fs::path& dir,
                        const std::function<std::optional<uintmax_t>(const std::string&)>& size);
};

/** A manifest's integer field `field` of object `j`, refused (naming `where`, the field and its
 * value) unless it is an integer in [lo, hi]: a float, a string or a huge value never reaches a
 * cast. */
int64_t integer_field(const nlohmann::json& j, const char* field, int64_t lo, int64_t hi,
                      const std::string& where);

/** The name of step `step`'s checkpoint directory: "step-" and the step in at least 9 digits. */
std::string checkpoint_name(int64_t step);

/** The step a checkpoint directory's name stands for, or nothing unless the name is exactly what
 * checkpoint_name writes for a step in [0, 10^18) (so no sign, no extra leading zero, no suffix,
 * and never a number that does not fit). The one parser of step names: listing, pruning, resume,
 * the writer's clean-up and `tetra ckpt` all go through it. */
std::optional<int64_t> parse_checkpoint_name(std::string_view name);

/** What a ckpt.dir holds, read off its entries' names. Nothing in it is ever fatal: a name that
 * is not one of tetra's is left alone, and one that looks like a checkpoint but is not gets a
 * note in `ignored`. */
struct DirScan {
  struct Published {
    int64_t step;
    fs::path path;
  };
  struct Unfinished {
    fs::path path;      // "<checkpoint name>.tmp-<nonce>" or ".old-<nonce>"
    std::string nonce;  // of the job that wrote it
  };
  std::vector<Published> published;    // with a manifest.json, newest first
  std::vector<Unfinished> unfinished;  // saves that were not (or not yet) published
  std::vector<std::string> ignored;    // "<path>: why it is not a checkpoint"
};
DirScan scan_checkpoint_dir(const fs::path& dir);

/** Logs scan.ignored, one note each. */
void log_ignored(const DirScan& scan);

/** The published checkpoints under `dir`, newest first (scan_checkpoint_dir's). */
std::vector<fs::path> list_checkpoints(const fs::path& dir);

/** The checkpoints a user's path names, newest first: a checkpoint directory (one holding
 * manifest.json) or that manifest.json itself (one), or a ckpt.dir (its published ones, maybe
 * none; its stray names are noted in the log). Refuses, naming `what` ("ckpt.resume=PATH"), a path
 * that does not exist or is a file other than a manifest.json. */
std::vector<fs::path> locate_checkpoints(const fs::path& path, const std::string& what);

/** Reads every chunk of the checkpoint and checks its checksum; returns the problems found
 * (empty: it verifies). */
std::vector<std::string> verify(const Manifest& m);

/** A part of this rank's state to save: `count` elements of a tensor (from local element
 * `first`) at `data` (device memory). */
struct Source {
  std::string kind;
  const ParamEntry* tensor = nullptr;
  int64_t first = 0, count = 0;
  const float* data = nullptr;
};

/** What this rank writes of `store` and its moments m and v (indexed like the store's optimizer
 * state): the parameters and moments of every segment it updates, each element written by
 * exactly one rank. `dp_replica`: another data-parallel rank holds the same state (unsharded
 * optimizer state, dp rank > 0), so this rank writes nothing. `slice_replica`: this rank is not
 * the first of its tensor-parallel group, whose members all hold the tensors that are not sliced,
 * so it writes only its slices. */
std::vector<Source> sources(ParamStore& store, const float* m, const float* v, bool dp_replica,
                            bool slice_replica);

/** Fills what this rank holds of parameters (store.held) and moments (store.owned, into m and v,
 * on the store's device) from checkpoint `m`, reading only the chunks that overlap it; each chunk
 * read is checked against its checksum. Throws tetra::Error naming the checkpoint, file and tensor.
 * `stage`: the store holds one pipeline stage's tensors, so the checkpoint's others are not
 * refused. */
void load(const Manifest& manifest, ParamStore& store, float* m, float* v, bool stage = false);

/** The rank files of checkpoint `manifest` that load() reads for this rank: those with a chunk
 * overlapping what it holds of `store` and updates. */
std::set<std::string> files_needed(const Manifest& manifest, ParamStore& store, bool stage = false);

/** Assembles the whole global tensor `name` of kind `kind` (all chunks). */
std::vector<float> read_global(const Manifest& manifest, const std::string& name,
                               const std::string& kind);

struct WriterOptions {
  fs::path dir;
  int keep = 3;       // published checkpoints kept (the newest); 0 keeps all
  bool async = true;  // write on a background thread
  int rank = 0, world = 1;
  std::string nonce;  // the same on every rank of one run: names the temporary directory
  double publish_timeout_s = 600;  // rank 0 waits this long for every rank's files
  // Test seams (debug.*): on `fault_rank`, die by SIGKILL halfway through writing step
  // `kill_in_save_step`'s file, or fail that write as a full disk would at `error_step`.
  int fault_rank = -1;
  int64_t kill_in_save_step = 0, error_step = 0;
};

/** What became of one save. */
struct SaveReport {
  int64_t step = 0;
  double block_s = 0;  // the step loop's stall: the snapshot (plus the whole write if sync)
  double write_s = 0;  // this rank's write (and on rank 0 the publish)
  uint64_t bytes =
      0;  // data bytes: this rank's, or on rank 0 once published the whole checkpoint's
  bool published = false;  // rank 0: the checkpoint is in place
  std::string error;       // empty on success
};

/** Saves checkpoints: save() snapshots this rank's sources (on `device`) into host memory — the
 * host staging every save writes from, charged to the ledger as temporaries — and hands them to a
 * background thread (or writes at once when !async); the next save() waits for the previous
 * write. Rank 0 publishes each checkpoint and prunes old ones. */
class Writer {
 public:
  Writer(WriterOptions options, MemoryLedger* ledger, Device& device = host_device());
  ~Writer();  // waits for the write in flight
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  /** `header` is the manifest's content besides tensors and ranks (step, trainer, layout,
   * config, model), used by rank 0; `rank_state` is this rank's entry. Returns the seconds the
   * caller was blocked. */
  double save(int64_t step, const std::vector<Source>& sources, nlohmann::json header,
              nlohmann::json rank_state);
  /** Allocates (and touches) the host snapshot for `sources` now, so that the first save's
   * stall is a copy like every other one rather than also the allocation. */
  void reserve(const std::vector<Source>& sources);
  /** Reports of the saves finished since the last call. */
  std::vector<SaveReport> take_reports();
  /** Waits until the write in flight (if any) is done. */
  void wait();
  /** The step of the last checkpoint this writer published (rank 0), else 0. */
  int64_t last_published() const;

 private:
  struct Job;
  void run();
  SaveReport write(Job& job);
  void publish(Job& job, SaveReport& report);
  // Removes published checkpoints beyond opt_.keep (the newest kept, and always `published`).
  void prune(int64_t published);

  WriterOptions opt_;
  MemTag tag_;
  Device& device_;
  Buffer<float> snapshot_;  // this rank's data, in file order, reused by every save
  std::unique_ptr<Job> pending_;
  bool busy_ = false, stop_ = false;
  std::vector<SaveReport> reports_;
  int64_t last_published_ = 0;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::thread thread_;
};

}  // namespace tetra::ckpt
