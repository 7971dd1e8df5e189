// The checkpoint writer: each rank snapshots its shards, writes them (on a thread of its own when
// ckpt.async) into step-N.tmp-<nonce>, and rank 0 publishes the directory once every rank's
// fragment is in (docs/checkpoints.md).
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_files.h"
#include "ckpt/shard.h"
#include "core/atomic_file.h"
#include "core/error.h"
#include "core/log.h"
#include "core/read_file.h"
#include "core/timer.h"

namespace tetra::ckpt {

using detail::failed_file;
using detail::fragment_file;
using detail::fsync_dir;
using detail::kMaxManifestBytes;
using detail::rank_file;
using json = nlohmann::json;

struct Writer::Job {
  int64_t step = 0;
  json header, rank_state;
  ShardLayout layout;  // of the snapshot, which holds the file's data
  double block_s = 0;
};

Writer::Writer(WriterOptions options, MemoryLedger* ledger, Device& device)
    : opt_(std::move(options)), tag_{ledger, MemCategory::temporaries}, device_(device) {
  if (opt_.rank == 0) {
    // Temporary directories of saves that never completed (a crash, a kill) are not checkpoints.
    // The job holds ckpt.dir's lock (train/run_outputs.cc), so one of another nonce is a dead
    // job's; names tetra does not write are never removed (the trainer has noted them).
    const DirScan scan = scan_checkpoint_dir(opt_.dir);
    for (const DirScan::Unfinished& u : scan.unfinished) {
      if (u.nonce == opt_.nonce) continue;
      log_info("[ckpt] removing {}, left by a save that did not finish", u.path.string());
      std::error_code ec;
      fs::remove_all(u.path, ec);
    }
  }
  if (opt_.async) thread_ = std::thread([this] { run(); });
}

Writer::~Writer() {
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

double Writer::save(int64_t step, const std::vector<Source>& sources, json header,
                    json rank_state) {
  Stopwatch clock;
  wait();
  auto job = std::make_unique<Job>();
  job->step = step;
  job->header = std::move(header);
  job->rank_state = std::move(rank_state);
  job->layout = ShardLayout::of(sources, step);
  if (snapshot_.size() != job->layout.elements) {
    snapshot_ = Buffer<float>(job->layout.elements, tag_);
  }
  for (size_t i = 0; i < sources.size(); ++i) {
    device_.to_host(snapshot_.data() + job->layout.parts[i].at, sources[i].data,
                    size_t(sources[i].count) * sizeof(float));
  }
  if (!opt_.async) {
    SaveReport r = write(*job);
    r.block_s = clock.elapsed_s();
    std::lock_guard lock(mu_);
    reports_.push_back(r);
    return r.block_s;
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

void Writer::reserve(const std::vector<Source>& sources) {
  size_t elements = 0;
  for (const Source& s : sources) elements += size_t(s.count);
  wait();
  if (snapshot_.size() != elements) snapshot_ = Buffer<float>(elements, tag_);
}

void Writer::wait() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return !busy_; });
}

std::vector<SaveReport> Writer::take_reports() {
  std::lock_guard lock(mu_);
  return std::exchange(reports_, {});
}

int64_t Writer::last_published() const {
  std::lock_guard lock(mu_);
  return last_published_;
}

void Writer::run() {
  for (;;) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || pending_; });
      if (!pending_) return;
      job = std::move(pending_);
    }
    SaveReport r = write(*job);
    r.block_s = job->block_s;
    {
      std::lock_guard lock(mu_);
      reports_.push_back(r);
      busy_ = false;
    }
    cv_.notify_all();
  }
}

SaveReport Writer::write(Job& job) {
  SaveReport r;
  r.step = job.step;
  r.bytes = job.layout.elements * sizeof(float);
  Stopwatch clock;
  const fs::path tmp = opt_.dir / (checkpoint_name(job.step) + ".tmp-" + opt_.nonce);
  try {
    std::error_code ec;
    fs::create_directories(tmp, ec);
    TETRA_CHECK(fs::is_directory(tmp),
                "[ckpt] {}: cannot create the directory ({}); check "
                "ckpt.dir is writable",
                tmp.string(), ec.message());
    // The rank file is a safetensors file: one 1-D F32 tensor per part, in snapshot order.
    const std::string& header = job.layout.header;
    const fs::path file = tmp / rank_file(opt_.rank);
    int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TETRA_CHECK(fd >= 0, "[ckpt] {}: cannot create ({}); check ckpt.dir is writable", file.string(),
                std::strerror(errno));
    int err = 0;
    auto put = [&](const void* data, size_t n) {
      const char* p = static_cast<const char*>(data);
      while (err == 0 && n > 0) {
        ssize_t w = ::write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
          err = w < 0 ? errno : EIO;
          break;
        }
        p += w, n -= size_t(w);
      }
    };
    const uint64_t len = header.size();
    put(&len, sizeof len);
    put(header.data(), header.size());
    const bool faulty = opt_.rank == opt_.fault_rank;
    const size_t half = r.bytes / 2;
    if (faulty && (job.step == opt_.kill_in_save_step || job.step == opt_.error_step)) {
      put(snapshot_.data(), half);
      if (job.step == opt_.kill_in_save_step) {
        ::fsync(fd);
        ::raise(SIGKILL);
      }
      if (err == 0) err = ENOSPC;
    } else {
      put(snapshot_.data(), r.bytes);
    }
    if (err == 0 && ::fsync(fd) != 0) err = errno;
    if (::close(fd) != 0 && err == 0) err = errno;
    if (err != 0) {
      ::unlink(file.c_str());
      fail(
          "[ckpt] {}: writing {:.1f} MB failed ({}); free disk space under ckpt.dir or raise "
          "the file-size limit (ulimit -f)",
          file.string(), double(job.layout.file_bytes()) / 1e6, std::strerror(err));
    }
    const std::string frag =
        job.layout.fragment(snapshot_.data(), opt_.rank, job.rank_state).dump();
    write_file_atomically((tmp / fragment_file(opt_.rank)).string(),
                          {{reinterpret_cast<const uint8_t*>(frag.data()), frag.size()}}, "ckpt");
    if (opt_.rank == 0) publish(job, r);
  } catch (const std::exception& e) {
    // A file-system call's own exception (a rename refused, a directory gone) is reported like
    // tetra's, never left to end the writer thread (std::terminate).
    r.error = dynamic_cast<const Error*>(&e)
                  ? std::string(e.what())
                  : fmt::format("[ckpt] {}: {}; check ckpt.dir", tmp.string(), e.what());
    if (opt_.rank != 0) {
      // Tell rank 0 not to wait for this rank's part.
      const std::string msg = r.error;
      int fd = ::open((tmp / failed_file(opt_.rank)).c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        (void)!::write(fd, msg.data(), msg.size());
        ::close(fd);
      }
    } else {
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
  }
  r.write_s = clock.elapsed_s();
  return r;
}

void Writer::publish(Job& job, SaveReport& report) {
  const fs::path tmp = opt_.dir / (checkpoint_name(job.step) + ".tmp-" + opt_.nonce);
  const std::string name = checkpoint_name(job.step);
  // Every rank's fragment (or its failure) must be there.
  Stopwatch waited;
  std::vector<json> fragments;
  for (int r = 0; r < opt_.world; ++r) {
    const fs::path frag = tmp / fragment_file(r), failed = tmp / failed_file(r);
    for (;;) {
      std::error_code ec;
      if (fs::exists(frag, ec)) break;
      if (fs::exists(failed, ec)) {
        const std::string why =
            read_small_file(failed.string(), 1 << 20, "ckpt", "a failure note", "");
        fail("[ckpt] {} not published: rank {} could not write its part: {}", name, r, why);
      }
      TETRA_CHECK(waited.elapsed_s() < opt_.publish_timeout_s,
                  "[ckpt] {} not published: rank {} did not write its part within {:.0f} s", name,
                  r, opt_.publish_timeout_s);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    fragments.push_back(json::parse(
        read_small_file(frag.string(), kMaxManifestBytes, "ckpt", "a checkpoint fragment", "")));
  }
  uint64_t total = 0;
  const json manifest = merge_fragments(job.header, job.step, fragments, &total);
  const std::string text = manifest.dump(1);
  write_file_atomically((tmp / "manifest.json").string(),
                        {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}}, "ckpt");
  for (int r = 0; r < opt_.world; ++r) {
    std::error_code ec;
    fs::remove(tmp / fragment_file(r), ec);
  }
  fsync_dir(tmp);
  // A checkpoint of the same step from an earlier attempt (one that did not verify) is set
  // aside first: rename cannot replace a non-empty directory. Anything else of that name is not
  // tetra's to remove.
  const fs::path final_dir = opt_.dir / name, aside = opt_.dir / (name + ".old-" + opt_.nonce);
  std::error_code ec;
  if (fs::exists(fs::symlink_status(final_dir, ec))) {
    TETRA_CHECK(fs::is_directory(fs::symlink_status(final_dir, ec)) &&
                    fs::is_regular_file(final_dir / "manifest.json", ec),
                "[ckpt] {} not published: {} exists and is not a checkpoint (no manifest.json "
                "in a directory); move it out of ckpt.dir",
                name, final_dir.string());
    fs::rename(final_dir, aside, ec);
    TETRA_CHECK(!ec, "[ckpt] {} not published: cannot set the earlier {} aside ({})", name,
                final_dir.string(), ec.message());
  }
  fs::rename(tmp, final_dir, ec);
  TETRA_CHECK(!ec, "[ckpt] {} not published: cannot rename {} to {} ({})", name, tmp.string(),
              final_dir.string(), ec.message());
  fsync_dir(opt_.dir);
  fs::remove_all(aside, ec);
  write_file_atomically((opt_.dir / "latest").string(),
                        {{reinterpret_cast<const uint8_t*>(name.data()), name.size()}}, "ckpt");
  report.published = true;
  report.bytes = total;
  {
    std::lock_guard lock(mu_);
    last_published_ = job.step;
  }
  prune(job.step);
}

void Writer::prune(int64_t published) {
  if (opt_.keep <= 0) return;
  const DirScan scan = scan_checkpoint_dir(opt_.dir);
  for (size_t i = size_t(opt_.keep); i < scan.published.size(); ++i) {
    if (scan.published[i].step == published) continue;  // never the one just published
    std::error_code ec;
    fs::remove_all(scan.published[i].path, ec);
  }
}

}  // namespace tetra::ckpt
