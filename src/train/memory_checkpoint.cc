#include "train/memory_checkpoint.h"

#include <sys/statfs.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <span>

#include "comm/flight.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"

namespace tetra {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Shards move in pieces of at most this many bytes: each piece one operation with the watchdog's
// deadline, and a bounded buffer for a piece that has nowhere to go.
constexpr size_t kPiece = size_t(32) << 20;
constexpr int kTag = 7301;
constexpr long kTmpfsMagic = 0x01021994;

// Every rank's `j`, in rank order (collective; one process: its own).
std::vector<json> all_gather_json(const comm::Communicator& world, const json& j) {
  if (!world.valid() || world.size() == 1) return {j};
  const std::string text = j.dump();
  const int n = world.size();
  uint64_t mine = text.size();
  std::vector<uint64_t> sizes(static_cast<size_t>(n));
  world
      .all_gather(std::span<const std::byte>(reinterpret_cast<const std::byte*>(&mine), 8),
                  std::span<std::byte>(reinterpret_cast<std::byte*>(sizes.data()), 8 * size_t(n)))
      .wait();
  const size_t width = std::max<size_t>(1, *std::max_element(sizes.begin(), sizes.end()));
  std::vector<std::byte> in(width), out(width * size_t(n));
  std::transform(text.begin(), text.end(), in.begin(), [](char c) { return std::byte(c); });
  world.all_gather(std::span<const std::byte>(in), std::span<std::byte>(out)).wait();
  std::vector<json> all;
  for (int r = 0; r < n; ++r) {
    all.push_back(json::parse(std::string(reinterpret_cast<const char*>(out.data()) + width * r,
                                          size_t(sizes[size_t(r)]))));
  }
  return all;
}

std::span<const std::byte> bytes_of(const void* p, size_t n) {
  return {static_cast<const std::byte*>(p), n};
}

// The writer rank of a rank file's name, "rank-00003.safetensors".
int writer_of(const std::string& file) { return std::stoi(file.substr(5, file.find('.') - 5)); }

}  // namespace

struct MemoryCheckpoint::Job {
  int64_t step = 0;
  ckpt::MemoryStore::Shard shard;  // empty: nothing to keep this time (it could not be made)
  json header, rank_state;
  std::string error;
  double block_s = 0;
};

int MemoryCheckpoint::buddy_shift(const std::vector<std::string>& hosts) {
  const int n = int(hosts.size());
  for (int k = 1; k < n; ++k) {
    bool apart = true;
    for (int r = 0; r < n && apart; ++r) apart = hosts[size_t(r)] != hosts[size_t((r + k) % n)];
    if (apart) return k;
  }
  return 0;
}

MemoryCheckpoint::MemoryCheckpoint(const CkptOptions& options, const comm::Communicator& world,
                                   Device& device, int64_t error_step)
    : opt_(options),
      world_(world),
      device_(device),
      store_(ckpt::MemoryStore::root_for(options.memory_dir, options.dir)),
      error_step_(error_step) {
  std::error_code ec;
  TETRA_CHECK(fs::is_directory(opt_.memory_dir, ec),
              "[ckpt] ckpt.memory_dir={} is not a directory; give a directory of a memory-backed "
              "file system (a tmpfs such as /dev/shm) on every host",
              opt_.memory_dir);
  std::vector<std::string> hosts = {"this host"};
  if (world_.valid() && world_.size() > 1) {
    rank_ = world_.rank();
    world_size_ = world_.size();
    hosts.clear();
    for (int r = 0; r < world_size_; ++r) hosts.push_back(world_.host(r));
    shift_ = buddy_shift(hosts);
    for (int r = 0; r < rank_; ++r)
      host_leader_ = host_leader_ && hosts[size_t(r)] != hosts[size_t(rank_)];
    copies_ = world_.split(0, rank_, "ckpt.memory");
  }
  if (rank_ == 0) {
    struct statfs fsinfo {};
    if (::statfs(opt_.memory_dir.c_str(), &fsinfo) == 0 && long(fsinfo.f_type) != kTmpfsMagic) {
      log_warn(
          "[ckpt] ckpt.memory_dir={} is not a memory-backed file system: its copies survive a "
          "restart, but every memory save writes to that device",
          opt_.memory_dir);
    }
    log_info("[ckpt] in memory every {} step(s): each rank's shards in {} on its host{}",
             opt_.memory_every, store_.root().string(),
             shift_ > 0 ? fmt::format(", a copy {} rank(s) along the ring on another host (rank 0 "
                                      "on {} keeps its copy on {})",
                                      shift_, hosts[0], hosts[size_t(shift_)])
             : world_size_ > 1
                 ? fmt::format("; all {} ranks are on {}, so no copy goes elsewhere: they survive "
                               "a rank's failure, not the host's (disk checkpoints do)",
                               world_size_, hosts[0])
                 : "");
  }
  thread_ = std::thread([this] { run(); });
}

MemoryCheckpoint::~MemoryCheckpoint() {
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::optional<ckpt::Manifest> MemoryCheckpoint::restore_point(int64_t disk_step, ParamStore& store,
                                                              bool stage) {
  Stopwatch clock;
  const bool multi = world_.valid() && world_.size() > 1;
  // What this host holds, as every rank of it sees it.
  json held = json::array();
  for (const ckpt::MemoryStore::Step& s : store_.inventory()) {
    int64_t writers = -1;
    if (s.header) {
      try {
        writers = store_.header(s.step).at("layout").at("world").get<int64_t>();
      } catch (const std::exception&) {
        writers = -1;  // a damaged header: as if it were not there
      }
    }
    json shards = json::object();
    for (const auto& [w, size] : s.shards) shards[std::to_string(w)] = size;
    held.push_back({{"step", s.step}, {"writers", writers}, {"shards", shards}});
  }
  const std::vector<json> all = all_gather_json(world_, held);

  // Per step: its writers' count, who holds its header and each writer's shard (and its size).
  struct Seen {
    int64_t writers = -1;
    int header = -1;               // lowest world rank whose host holds the header
    std::map<int, int> holder;     // writer -> lowest world rank whose host holds its shard
    std::map<int, uint64_t> size;  // writer -> its file's size
    std::map<int, std::set<std::string>> hosts;  // writer -> hosts holding it
  };
  std::map<int64_t, Seen, std::greater<>> seen;
  auto host_of = [&](int r) { return multi ? world_.host(r) : std::string("this host"); };
  for (int r = 0; r < int(all.size()); ++r) {
    for (const json& s : all[size_t(r)]) {
      Seen& x = seen[s.at("step").get<int64_t>()];
      if (s.at("writers").get<int64_t>() > 0 && x.header < 0) {
        x.header = r;
        x.writers = s.at("writers").get<int64_t>();
      }
      for (const auto& [w, size] : s.at("shards").items()) {
        const int writer = std::stoi(w);
        if (!x.holder.count(writer)) x.holder[writer] = r;
        x.size[writer] = size.get<uint64_t>();
        x.hosts[writer].insert(host_of(r));
      }
    }
  }
  int64_t step = -1;
  std::vector<std::string> passed;
  for (const auto& [s, x] : seen) {
    if (s < disk_step) {
      passed.push_back(fmt::format("step {} (disk holds step {})", s, disk_step));
      continue;
    }
    std::vector<int> gone;
    for (int w = 0; w < x.writers; ++w) {
      if (!x.holder.count(w)) gone.push_back(w);
    }
    if (x.writers > 0 && gone.empty()) {
      step = s;
      break;
    }
    passed.push_back(x.writers <= 0
                         ? fmt::format("step {} (no host holds its header)", s)
                         : fmt::format("step {} (both copies of rank(s) {}'s shards are gone)", s,
                                       fmt::join(gone, ", ")));
  }
  if (step < 0) {
    if (rank_ == 0) {
      log_info("[ckpt] in memory: {}; reading from disk",
               seen.empty() ? std::string("no step held on any host")
                            : "no step to resume: " + fmt::format("{}", fmt::join(passed, "; ")));
    }
    return std::nullopt;
  }
  const Seen& x = seen.at(step);
  const int writers = int(x.writers);

  // The header and every writer's fragment, each from the lowest rank holding it.
  json mine = {{"header", nullptr}, {"fragments", json::object()}};
  try {
    if (x.header == rank_) mine["header"] = store_.header(step);
    for (const auto& [w, holder] : x.holder) {
      if (holder == rank_ && w < writers)
        mine["fragments"][std::to_string(w)] = store_.fragment(step, w);
    }
  } catch (const Error& e) {
    log_warn("{}", e.what());  // the others see the part missing
  }
  const std::vector<json> parts = all_gather_json(world_, mine);
  std::vector<json> fragments;
  const json& header = parts[size_t(x.header)].at("header");
  std::optional<ckpt::Manifest> manifest;
  std::string why;
  try {
    TETRA_CHECK(!header.is_null(), "[ckpt] the header of step {} could not be read", step);
    for (int w = 0; w < writers; ++w) {
      const json& f = parts[size_t(x.holder.at(w))].at("fragments");
      TETRA_CHECK(f.contains(std::to_string(w)),
                  "[ckpt] rank {}'s fragment of step {} could not "
                  "be read",
                  w, step);
      fragments.push_back(f.at(std::to_string(w)));
    }
    const json text = ckpt::merge_fragments(header, step, fragments, nullptr);
    manifest = ckpt::Manifest::parse(text.dump(), store_.step_dir(step),
                                     [&](const std::string& file) -> std::optional<uintmax_t> {
                                       const int w = writer_of(file);
                                       if (!x.size.count(w)) return std::nullopt;
                                       return x.size.at(w);
                                     });
  } catch (const std::exception& e) {
    why = e.what();  // the same on every rank: all of them decide alike
  }
  if (!manifest) {
    if (rank_ == 0)
      log_warn("[ckpt] in memory: step {} cannot be used ({}); reading from disk", step, why);
    return std::nullopt;
  }

  // The shards each host's ranks read, and what their hosts lack.
  json needs = json::array();
  std::string refused;
  try {
    for (const std::string& f : ckpt::files_needed(*manifest, store, stage))
      needs.push_back(writer_of(f));
  } catch (const Error& e) {
    refused = e.what();
  }
  const uint64_t room = store_.free_bytes();
  const std::vector<json> asked =
      all_gather_json(world_, {{"needs", needs}, {"refused", refused}, {"room", room}});
  struct Move {
    int writer, from, to;
  };
  std::vector<Move> moves;
  std::map<std::string, uint64_t> incoming;  // bytes per receiving host
  std::map<std::pair<int, std::string>, bool> planned;
  for (int q = 0; q < int(asked.size()); ++q) {
    if (!asked[size_t(q)].at("refused").get<std::string>().empty()) {
      if (rank_ == 0) {
        log_warn("[ckpt] in memory: step {} does not fit rank {} ({}); reading from disk", step, q,
                 asked[size_t(q)].at("refused").get<std::string>());
      }
      return std::nullopt;
    }
    const std::string host = host_of(q);
    for (const json& w : asked[size_t(q)].at("needs")) {
      const int writer = w.get<int>();
      if (x.hosts.at(writer).count(host) || planned[{writer, host}]) continue;
      planned[{writer, host}] = true;
      moves.push_back({writer, x.holder.at(writer), q});
      incoming[host] += x.size.at(writer);
    }
  }
  for (int q = 0; q < int(asked.size()); ++q) {
    const uint64_t want = incoming[host_of(q)];
    if (want > asked[size_t(q)].at("room").get<uint64_t>()) {
      if (rank_ == 0) {
        log_warn(
            "[ckpt] in memory: step {} needs {:.1f} MB more on host {}, which has {:.1f} MB "
            "free in ckpt.memory_dir; reading from disk",
            step, double(want) / 1e6, host_of(q), asked[size_t(q)].at("room").get<double>() / 1e6);
      }
      return std::nullopt;
    }
  }

  // The moves: every piece of a shard as one send and one receive, in the same order on both ends.
  uint64_t moved = 0;
  comm::run_or_abort(world_, [&] {
    const comm::flight::Site site("ckpt.memory_restore");
    std::vector<ckpt::MemoryStore::Mapped> out;
    std::vector<std::pair<ckpt::MemoryStore::Shard, int>> in;
    std::vector<comm::Work> works;
    for (const Move& m : moves) {
      const uint64_t size = x.size.at(m.writer);
      if (m.from == rank_) {
        out.push_back(store_.map(step, m.writer));
        for (size_t at = 0; at < size; at += kPiece) {
          works.push_back(world_.send(
              bytes_of(out.back().data() + at, std::min<size_t>(kPiece, size - at)), m.to, kTag));
        }
      }
      if (m.to == rank_) {
        in.emplace_back(store_.create(m.writer, size), m.writer);
        for (size_t at = 0; at < size; at += kPiece) {
          works.push_back(world_.recv(std::span<std::byte>(in.back().first.data() + at,
                                                           std::min<size_t>(kPiece, size - at)),
                                      m.from, kTag));
        }
        moved += size;
      }
    }
    for (const comm::Work& w : works) w.wait();
    for (auto& [shard, writer] : in) shard.commit(step, fragments[size_t(writer)]);
    if (multi) world_.barrier().wait();  // every host's shards in place for all its ranks
  });
  uint64_t total_moved = moved;
  if (multi) {
    std::vector<json> each = all_gather_json(world_, moved);
    total_moved = 0;
    for (const json& m : each) total_moved += m.get<uint64_t>();
  }
  if (rank_ == 0) {
    log_info(
        "[ckpt] in memory: step {} is whole ({} rank(s)' shards); {} shard(s), {:.1f} MB, brought "
        "from other hosts in {:.2f} s",
        step, writers, moves.size(), double(total_moved) / 1e6, clock.elapsed_s());
  }
  return manifest;
}

void MemoryCheckpoint::begin(int64_t resumed, const std::vector<ckpt::Source>& sources,
                             int64_t start_step) {
  if (host_leader_) store_.drop_all_but(resumed);
  if (world_.valid() && world_.size() > 1) world_.barrier().wait();
  done_ = resumed;
  complete_.store(resumed);
  layout_ =
      ckpt::ShardLayout::of(sources, (start_step / opt_.memory_every + 1) * opt_.memory_every);
  // Two of each: a save's files are taken back only once the next save is whole everywhere.
  uint64_t mine = layout_.file_bytes();
  std::vector<uint64_t> sizes(static_cast<size_t>(world_size_), mine);
  if (world_size_ > 1) {
    world_
        .all_gather(
            std::span<const std::byte>(reinterpret_cast<const std::byte*>(&mine), 8),
            std::span<std::byte>(reinterpret_cast<std::byte*>(sizes.data()), 8 * sizes.size()))
        .wait();
  }
  // From the files an earlier job of this run left on the host where it can (a restart takes no
  // new page), else new.
  const int from = (rank_ - shift_ + world_size_) % world_size_;
  auto made = [&](int writer, uint64_t size) {
    ckpt::MemoryStore::Shard s = store_.claim(writer, size);
    return s.data() ? std::move(s) : store_.create(writer, size);
  };
  try {
    for (int k = 0; k < 2; ++k) {
      own_free_.push_back(made(rank_, mine));
      if (shift_ > 0) copy_free_.push_back(made(from, sizes[size_t(from)]));
    }
  } catch (const Error& e) {
    // The saves make what they need, and report why they cannot.
    log_warn("{}", e.what());
  }
  if (world_size_ > 1) world_.barrier().wait();
  if (host_leader_) store_.drop_spares();
}

ckpt::MemoryStore::Shard MemoryCheckpoint::take(std::vector<ckpt::MemoryStore::Shard>& pool,
                                                int writer, uint64_t size) {
  while (!pool.empty()) {
    ckpt::MemoryStore::Shard s = std::move(pool.back());
    pool.pop_back();
    if (s.size() == size) return s;  // one of another size goes
  }
  return store_.create(writer, size);
}

bool MemoryCheckpoint::due(int64_t step, bool last) const {
  return opt_.memory_every > 0 && !last && step % opt_.memory_every == 0;
}

double MemoryCheckpoint::save(int64_t step, const std::vector<ckpt::Source>& sources,
                              const json& header, const json& rank_state) {
  Stopwatch clock;
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
  }
  auto job = std::make_unique<Job>();
  job->step = step;
  job->header = header;
  job->rank_state = rank_state;
  layout_ = ckpt::ShardLayout::of(sources, step);
  try {
    TETRA_CHECK(step != error_step_,
                "[ckpt] {}: cannot take {:.1f} MB of memory for a shard (No space left on device; "
                "debug.save_error_step={})",
                store_.root().string(), double(layout_.file_bytes()) / 1e6, step);
    job->shard = take(own_free_, rank_, layout_.file_bytes());
    std::byte* file = job->shard.data();
    layout_.write_header(file);
    for (size_t i = 0; i < sources.size(); ++i) {
      device_.to_host(file + layout_.data_start + layout_.parts[i].at * sizeof(float),
                      sources[i].data, size_t(sources[i].count) * sizeof(float));
    }
  } catch (const Error& e) {
    job->shard = {};
    job->error = e.what();
  }
  job->block_s = clock.elapsed_s();
  const double blocked = job->block_s;
  {
    std::lock_guard lock(mu_);
    pending_ = std::move(job);
    busy_ = true;
  }
  cv_.notify_all();
  return blocked;
}

void MemoryCheckpoint::run() {
  for (;;) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || pending_; });
      if (!pending_) return;
      job = std::move(pending_);
    }
    MemorySaveReport r;
    r.step = job->step;
    r.block_s = job->block_s;
    r.error = job->error;
    Stopwatch clock;
    comm::run_or_abort(world_, [&] { exchange(*job, r); });
    r.copy_s = clock.elapsed_s();
    r.complete = complete_.load();
    job.reset();  // a shard it could not commit is removed
    {
      std::lock_guard lock(mu_);
      reports_.push_back(r);
      busy_ = false;
    }
    cv_.notify_all();
  }
}

void MemoryCheckpoint::exchange(Job& job, MemorySaveReport& report) {
  const comm::flight::Site site("ckpt.memory");
  // This rank's shard, whole in its host's memory.
  std::string fragment;
  if (job.shard.data()) {
    try {
      const json f =
          layout_.fragment(reinterpret_cast<const float*>(job.shard.data() + layout_.data_start),
                           rank_, job.rank_state);
      store_.put_header(job.step, job.header);
      job.shard.commit(job.step, f);
      fragment = f.dump();
      report.kept += job.shard.size();
    } catch (const Error& e) {
      report.error = e.what();
      fragment.clear();
    }
  }
  bool whole = !fragment.empty();
  if (shift_ > 0) {
    // A copy to the buddy, and the copy of the rank this one is the buddy of: lengths (0: none
    // this time), the fragment, the file in pieces.
    const int to = (rank_ + shift_) % world_size_,
              from = (rank_ - shift_ + world_size_) % world_size_;
    const uint64_t lengths[2] = {fragment.size(), fragment.empty() ? 0 : job.shard.size()};
    std::vector<comm::Work> sends;
    sends.push_back(copies_.send(bytes_of(lengths, sizeof lengths), to, kTag));
    if (lengths[1] > 0) {
      sends.push_back(copies_.send(bytes_of(fragment.data(), fragment.size()), to, kTag));
      for (size_t at = 0; at < lengths[1]; at += kPiece) {
        sends.push_back(copies_.send(
            bytes_of(job.shard.data() + at, std::min<size_t>(kPiece, lengths[1] - at)), to, kTag));
      }
    }
    uint64_t in[2] = {0, 0};
    copies_.recv(std::span<std::byte>(reinterpret_cast<std::byte*>(in), sizeof in), from, kTag)
        .wait();
    if (in[1] > 0) {
      std::string theirs(in[0], '\0');
      copies_
          .recv(std::span<std::byte>(reinterpret_cast<std::byte*>(theirs.data()), in[0]), from,
                kTag)
          .wait();
      ckpt::MemoryStore::Shard copy;
      std::vector<std::byte> drain;
      try {
        copy = take(copy_free_, from, in[1]);
      } catch (const Error& e) {
        if (report.error.empty()) report.error = e.what();
        drain.resize(std::min<size_t>(kPiece, in[1]));
      }
      // Every piece's receive posted at once (pieces that have nowhere to go, one at a time).
      std::vector<comm::Work> pieces;
      for (size_t at = 0; at < in[1]; at += kPiece) {
        const size_t n = std::min<size_t>(kPiece, in[1] - at);
        if (copy.data()) {
          pieces.push_back(copies_.recv(std::span<std::byte>(copy.data() + at, n), from, kTag));
        } else {
          copies_.recv(std::span<std::byte>(drain.data(), n), from, kTag).wait();
        }
      }
      for (const comm::Work& w : pieces) w.wait();
      if (copy.data()) {
        try {
          copy.commit(job.step, json::parse(theirs));
          report.kept += in[1];
          written_.push_back({job.step, from, std::move(copy)});
        } catch (const std::exception& e) {
          if (report.error.empty())
            report.error = fmt::format("[ckpt] rank {}'s copy: {}", from, e.what());
          whole = false;
        }
      } else {
        whole = false;
      }
    } else {
      whole = false;  // the sender had nothing: its shard of this step is on no other host
    }
    for (const comm::Work& w : sends) w.wait();
    report.sent = lengths[0] + lengths[1] + sizeof lengths;
  }
  if (job.shard.committed()) written_.push_back({job.step, rank_, std::move(job.shard)});
  // The newest step every rank holds whole (its shard and its copy): older ones can go.
  if (whole) done_ = job.step;
  int64_t complete = done_;
  if (world_size_ > 1) {
    std::vector<int64_t> each(static_cast<size_t>(world_size_));
    copies_
        .all_gather(
            std::span<const std::byte>(reinterpret_cast<const std::byte*>(&done_), 8),
            std::span<std::byte>(reinterpret_cast<std::byte*>(each.data()), 8 * each.size()))
        .wait();
    complete = *std::min_element(each.begin(), each.end());
  }
  complete_.store(complete);
  if (complete < 0) return;
  // This rank's shards of the steps before it are needed no more: its own becomes the next save's
  // file and a copy the next copy's (their pages and mappings kept), the rest go.
  std::vector<Written> kept;
  for (Written& w : written_) {
    if (w.step >= complete) {
      kept.push_back(std::move(w));
    } else if (std::vector<ckpt::MemoryStore::Shard>& pool =
                   w.writer == rank_ ? own_free_ : copy_free_;
               pool.size() < 2) {
      if (w.shard.recycle(w.writer)) pool.push_back(std::move(w.shard));
    } else {
      store_.drop_shard(w.step, w.writer);
    }
  }
  written_ = std::move(kept);
  // What is left of older steps (headers, an earlier attempt's shards) one save later, once every
  // rank of the host has taken its files of them back.
  if (host_leader_ && dropped_below_ >= 0) store_.drop_before(dropped_below_);
  dropped_below_ = complete;
}

std::vector<MemorySaveReport> MemoryCheckpoint::take_reports() {
  std::lock_guard lock(mu_);
  return std::exchange(reports_, {});
}

void MemoryCheckpoint::finish() {
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
  }
  own_free_.clear();
  copy_free_.clear();
  written_.clear();
  if (world_.valid() && world_.size() > 1) world_.barrier().wait();
  if (host_leader_) store_.remove();
}

}  // namespace tetra
