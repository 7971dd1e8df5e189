#include "ckpt/memory_store.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_files.h"
#include "core/atomic_file.h"
#include "core/error.h"
#include "core/read_file.h"

namespace tetra::ckpt {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr uintmax_t kMaxJsonBytes = uintmax_t(1) << 30;

// The writer rank of a fragment's name "rank-NNNNN.json", or -1.
int fragment_rank(const std::string& name) {
  constexpr std::string_view prefix = "rank-", suffix = ".json";
  if (name.size() <= prefix.size() + suffix.size() || !name.starts_with(prefix) ||
      !name.ends_with(suffix)) {
    return -1;
  }
  const std::string digits =
      name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.size() < 5 || digits.size() > 9 ||
      digits.find_first_not_of("0123456789") != std::string::npos) {
    return -1;
  }
  return std::stoi(digits);
}

void write_json(const fs::path& path, const json& j) {
  const std::string text = j.dump();
  write_file_atomically(path.string(),
                        {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}}, "ckpt");
}

// Maps `fd` (`size` bytes) at `data`, its page tables made now, so that a copy into it is a copy
// and not a page fault per page. In pieces of 16 MB: populating it whole (MAP_POPULATE) holds the
// process's memory-map lock for the while, and the training threads' own mappings wait on it
// (measured: 5.3 s instead of 0.65 s for 747 MB, the steps around it 1 s slower each).
void map_shard(const fs::path& path, int fd, size_t size, std::byte*& data) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  TETRA_CHECK(p != MAP_FAILED, "[ckpt] {}: cannot map {:.1f} MB ({})", path.string(),
              double(size) / 1e6, std::strerror(errno));
  data = static_cast<std::byte*>(p);
  constexpr size_t kPiece = size_t(16) << 20;
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  for (size_t at = 0; at < size; at += kPiece) {
    const size_t n = std::min(kPiece, size - at);
    if (::madvise(data + at, n, MADV_POPULATE_WRITE) != 0) {
      // A kernel without it (before 5.14): a write fault per page (a new file's pages are zero).
      volatile std::byte* v = data + at;
      for (size_t k = 0; k < n; k += page) v[k] = std::byte{0};
    }
  }
}

// A name for a shard being written, of this process: a process may hold several of one writer.
fs::path tmp_name(const fs::path& root, int rank) {
  static std::atomic<uint64_t> made{0};
  return root / fmt::format(".{}.tmp-{}-{}", detail::rank_file(rank), ::getpid(), made++);
}

}  // namespace

MemoryStore::MemoryStore(fs::path root) : root_(std::move(root)) {}

fs::path MemoryStore::root_for(const fs::path& memory_dir, const fs::path& ckpt_dir) {
  std::error_code ec;
  fs::path abs = fs::weakly_canonical(fs::absolute(ckpt_dir, ec), ec);
  if (ec) abs = fs::absolute(ckpt_dir).lexically_normal();
  const std::string key = abs.string();
  return memory_dir / fmt::format("tetra-{:016x}", XXH3_64bits(key.data(), key.size()));
}

fs::path MemoryStore::step_dir(int64_t step) const { return root_ / checkpoint_name(step); }

std::vector<MemoryStore::Step> MemoryStore::inventory() const {
  std::vector<Step> out;
  std::error_code ec;
  for (const fs::directory_entry& d : fs::directory_iterator(root_, ec)) {
    const std::optional<int64_t> step = parse_checkpoint_name(d.path().filename().string());
    if (!step || !d.is_directory(ec)) continue;
    Step s;
    s.step = *step;
    for (const fs::directory_entry& f : fs::directory_iterator(d.path(), ec)) {
      const std::string name = f.path().filename().string();
      if (name == "header.json") {
        s.header = true;
        continue;
      }
      const int rank = fragment_rank(name);
      if (rank < 0) continue;
      std::error_code size_ec;
      const uintmax_t size = fs::file_size(d.path() / detail::rank_file(rank), size_ec);
      if (!size_ec) s.shards[rank] = size;
    }
    out.push_back(std::move(s));
  }
  std::sort(out.begin(), out.end(), [](const Step& a, const Step& b) { return a.step > b.step; });
  return out;
}

MemoryStore::Shard::Shard(Shard&& o) noexcept { *this = std::move(o); }

MemoryStore::Shard& MemoryStore::Shard::operator=(Shard&& o) noexcept {
  if (this != &o) {
    release();
    store_ = o.store_;
    tmp_ = std::move(o.tmp_);
    step_ = o.step_;
    rank_ = o.rank_;
    committed_ = o.committed_;
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

MemoryStore::Shard::~Shard() { release(); }

void MemoryStore::Shard::release() {
  if (data_) ::munmap(data_, size_);
  if (fd_ >= 0) {
    ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  data_ = nullptr;
  fd_ = -1;
}

void MemoryStore::Shard::commit(int64_t step, const json& fragment) {
  const fs::path dir = store_->step_dir(step);
  std::error_code ec;
  fs::create_directories(dir, ec);
  TETRA_CHECK(fs::is_directory(dir),
              "[ckpt] {}: cannot create the memory checkpoint's directory ({}); check that "
              "ckpt.memory_dir is writable",
              dir.string(), ec.message());
  const fs::path path = dir / detail::rank_file(rank_);
  fs::rename(tmp_, path, ec);
  TETRA_CHECK(!ec, "[ckpt] {}: cannot rename it to {} ({})", tmp_.string(), path.string(),
              ec.message());
  committed_ = true;
  step_ = step;
  write_json(dir / detail::fragment_file(rank_), fragment);
}

bool MemoryStore::Shard::recycle(int rank) {
  if (!committed_ || !data_) return false;
  const fs::path dir = store_->step_dir(step_);
  ::unlink((dir / detail::fragment_file(rank_)).c_str());
  const fs::path tmp = tmp_name(store_->root(), rank);
  if (::rename((dir / detail::rank_file(rank_)).c_str(), tmp.c_str()) != 0) {
    ::unlink((dir / detail::rank_file(rank_)).c_str());
    release();
    return false;
  }
  tmp_ = tmp;
  rank_ = rank;
  step_ = -1;
  committed_ = false;
  return true;
}

MemoryStore::Shard MemoryStore::create(int rank, uint64_t size) const {
  std::error_code ec;
  fs::create_directories(root_, ec);
  TETRA_CHECK(fs::is_directory(root_),
              "[ckpt] {}: cannot create the memory checkpoints' directory ({}); check that "
              "ckpt.memory_dir is writable",
              root_.string(), ec.message());
  Shard s;
  s.store_ = this;
  s.rank_ = rank;
  s.tmp_ = tmp_name(root_, rank);
  s.fd_ = ::open(s.tmp_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  TETRA_CHECK(s.fd_ >= 0, "[ckpt] {}: cannot create ({}); check that ckpt.memory_dir is writable",
              s.tmp_.string(), std::strerror(errno));
  s.size_ = size_t(size);
  // Every page now: on a tmpfs a page it cannot give would otherwise be a SIGBUS at first touch.
  const int err = ::posix_fallocate(s.fd_, 0, off_t(size));
  TETRA_CHECK(err == 0,
              "[ckpt] {}: cannot take {:.1f} MB of memory for a shard ({}; {:.1f} MB free there); "
              "give the file system more room (/dev/shm is half the RAM by default), set "
              "ckpt.memory_dir elsewhere, or save in memory less often (ckpt.memory_every)",
              s.tmp_.string(), double(size) / 1e6, std::strerror(err), double(free_bytes()) / 1e6);
  map_shard(s.tmp_, s.fd_, s.size_, s.data_);
  return s;
}

void MemoryStore::drop_shard(int64_t step, int rank) const {
  ::unlink((step_dir(step) / detail::fragment_file(rank)).c_str());
  ::unlink((step_dir(step) / detail::rank_file(rank)).c_str());
}

MemoryStore::Mapped::Mapped(Mapped&& o) noexcept { *this = std::move(o); }

MemoryStore::Mapped& MemoryStore::Mapped::operator=(Mapped&& o) noexcept {
  if (this != &o) {
    if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

MemoryStore::Mapped::~Mapped() {
  if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
}

MemoryStore::Mapped MemoryStore::map(int64_t step, int rank) const {
  const fs::path path = step_dir(step) / detail::rank_file(rank);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TETRA_CHECK(fd >= 0, "[ckpt] {}: cannot open ({})", path.string(), std::strerror(errno));
  struct stat st {};
  Mapped m;
  if (::fstat(fd, &st) == 0 && st.st_size > 0) {
    void* p = ::mmap(nullptr, size_t(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) {
      m.data_ = static_cast<const std::byte*>(p);
      m.size_ = size_t(st.st_size);
    }
  }
  const int err = errno;
  ::close(fd);
  TETRA_CHECK(m.data_, "[ckpt] {}: cannot map it ({})", path.string(), std::strerror(err));
  return m;
}

json MemoryStore::fragment(int64_t step, int rank) const {
  const fs::path path = step_dir(step) / detail::fragment_file(rank);
  try {
    return json::parse(read_small_file(path.string(), kMaxJsonBytes, "ckpt",
                                       "a memory checkpoint's fragment", ""));
  } catch (const json::exception& e) {
    fail("[ckpt] {}: malformed ({}); the memory checkpoint cannot be used", path.string(),
         e.what());
  }
}

void MemoryStore::put_header(int64_t step, const json& header) const {
  std::error_code ec;
  fs::create_directories(step_dir(step), ec);
  write_json(step_dir(step) / "header.json", header);
}

json MemoryStore::header(int64_t step) const {
  const fs::path path = step_dir(step) / "header.json";
  try {
    return json::parse(
        read_small_file(path.string(), kMaxJsonBytes, "ckpt", "a memory checkpoint's header", ""));
  } catch (const json::exception& e) {
    fail("[ckpt] {}: malformed ({}); the memory checkpoint cannot be used", path.string(),
         e.what());
  }
}

void MemoryStore::drop_before(int64_t step) const {
  for (const Step& s : inventory()) {
    std::error_code ec;
    if (s.step < step) fs::remove_all(step_dir(s.step), ec);
  }
}

void MemoryStore::drop_all_but(int64_t keep) const {
  std::error_code ec;
  int spares = 0;
  auto spare = [&](const fs::path& file) {
    const fs::path to = root_ / fmt::format(".spare-{}-{}", ::getpid(), spares++);
    if (::rename(file.c_str(), to.c_str()) != 0) ::unlink(file.c_str());
  };
  for (const fs::directory_entry& d : fs::directory_iterator(root_, ec)) {
    const std::string name = d.path().filename().string();
    const std::optional<int64_t> step = parse_checkpoint_name(name);
    if (step && *step != keep) {
      std::error_code it_ec;
      for (const fs::directory_entry& f : fs::directory_iterator(d.path(), it_ec)) {
        const std::string file = f.path().filename().string();
        if (file.starts_with("rank-") && file.ends_with(".safetensors")) spare(f.path());
      }
      std::error_code rm;
      fs::remove_all(d.path(), rm);
    } else if (name.starts_with(".rank-") && name.find(".tmp-") != name.npos) {
      spare(d.path());
    }
  }
}

MemoryStore::Shard MemoryStore::claim(int rank, uint64_t size) const {
  std::error_code ec;
  for (const fs::directory_entry& d : fs::directory_iterator(root_, ec)) {
    if (!d.path().filename().string().starts_with(".spare-")) continue;
    std::error_code size_ec;
    if (fs::file_size(d.path(), size_ec) != size || size_ec) continue;
    Shard s;
    s.store_ = this;
    s.rank_ = rank;
    s.tmp_ = tmp_name(root_, rank);
    if (::rename(d.path().c_str(), s.tmp_.c_str()) != 0) continue;  // another took it
    s.fd_ = ::open(s.tmp_.c_str(), O_RDWR | O_CLOEXEC);
    if (s.fd_ < 0) continue;
    s.size_ = size_t(size);
    map_shard(s.tmp_, s.fd_, s.size_, s.data_);
    return s;
  }
  return Shard();
}

void MemoryStore::drop_spares() const {
  std::error_code ec;
  for (const fs::directory_entry& d : fs::directory_iterator(root_, ec)) {
    if (d.path().filename().string().starts_with(".spare-")) ::unlink(d.path().c_str());
  }
}

void MemoryStore::remove() const {
  std::error_code ec;
  fs::remove_all(root_, ec);
}

uint64_t MemoryStore::free_bytes() const {
  struct statvfs v {};
  fs::path at = root_;
  std::error_code ec;
  while (!at.empty() && !fs::exists(at, ec) && at != at.parent_path()) at = at.parent_path();
  if (::statvfs(at.c_str(), &v) != 0) return 0;
  return uint64_t(v.f_bavail) * v.f_frsize;
}

}  // namespace tetra::ckpt
