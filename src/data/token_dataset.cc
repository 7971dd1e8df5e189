#include "data/token_dataset.h"

#include <glob.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>

#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "data/manifest.h"

namespace tetra {

namespace {

namespace fs = std::filesystem;

std::vector<std::string> expand(const std::string& spec) {
  std::vector<std::string> paths;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    if (item.find_first_of("*?[") == std::string::npos) {
      paths.push_back(item);
      continue;
    }
    glob_t g{};
    int rc = ::glob(item.c_str(), 0, nullptr, &g);
    std::vector<std::string> found;
    if (rc == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) found.emplace_back(g.gl_pathv[i]);
    }
    globfree(&g);
    TETRA_CHECK(!found.empty(), "[data] no file matches '{}'; check data.train / data.val", item);
    std::sort(found.begin(), found.end());
    paths.insert(paths.end(), found.begin(), found.end());
  }
  TETRA_CHECK(!paths.empty(), "[data] no data files given; set data.train=PATH (a token shard)");
  return paths;
}

// Checks a shard against the manifest.json of its folder, read once per folder.
class ManifestCheck {
 public:
  // Shards and bytes checksummed so far, and the seconds it took.
  int shards() const { return shards_; }
  uint64_t bytes() const { return bytes_; }
  double seconds() const { return seconds_; }

  void check(const TokenShard& shard) {
    const fs::path path(shard.path());
    const std::string dir = path.parent_path().string();
    auto it = manifests_.find(dir);
    if (it == manifests_.end()) {
      const fs::path file = path.parent_path() / "manifest.json";
      std::error_code ec;
      std::optional<Manifest> m;
      if (fs::exists(file, ec)) m = read_manifest(file.string());
      it = manifests_.emplace(dir, std::move(m)).first;
    }
    if (!it->second) return;  // no manifest: nothing to verify against
    const std::string manifest = (path.parent_path() / "manifest.json").string();
    const std::string name = path.filename().string();
    const ManifestShard* entry = it->second->find(name);
    TETRA_CHECK(entry != nullptr,
                "[data] {}: not listed in {}, so it is not part of that dataset (a stray shard of "
                "an earlier run?); re-run tetra data prepare, or set data.verify=false to use it "
                "unchecked",
                shard.path(), manifest);
    TETRA_CHECK(entry->tokens == shard.size() && entry->version == shard.version(),
                "[data] {}: holds {} tokens (version {}) but {} lists {} tokens (version {}); the "
                "shard or the manifest was replaced, re-run tetra data prepare",
                shard.path(), shard.size(), shard.version(), manifest, entry->tokens,
                entry->version);
    Stopwatch clock;
    const std::string actual = shard.file_xxh3();
    seconds_ += clock.elapsed_s();
    bytes_ += shard.file_bytes();
    ++shards_;
    TETRA_CHECK(actual == entry->xxh3,
                "[data] {}: checksum mismatch: {} lists xxh3 {} but the file has {}; the shard is "
                "corrupt or was changed after it was written, re-run tetra data prepare",
                shard.path(), manifest, entry->xxh3, actual);
  }

 private:
  std::map<std::string, std::optional<Manifest>> manifests_;
  int shards_ = 0;
  uint64_t bytes_ = 0;
  double seconds_ = 0;
};

}  // namespace

TokenDataset::TokenDataset(const std::string& spec, int seq_len, bool verify) : T_(seq_len) {
  TETRA_CHECK(seq_len > 0, "[data] sequence length must be positive (got {})", seq_len);
  ManifestCheck manifests;
  for (const auto& path : expand(spec)) {
    auto shard = std::make_unique<TokenShard>(path);
    // Before any checksum: a mix of formats is refused at once.
    if (!shards_.empty()) {
      check_one_shard_format({shards_[0]->path(), path}, {shards_[0]->version(), shard->version()},
                             fmt::format("the shard list '{}'", spec));
    }
    if (verify) manifests.check(*shard);
    int64_t windows = shard->size() > 0 ? int64_t(shard->size() - 1) / T_ : 0;
    TETRA_CHECK(windows > 0,
                "[data] {}: {} tokens cannot hold one sample of seq_len+1={} tokens; use a larger "
                "shard or a shorter train.seq_len",
                path, shard->size(), T_ + 1);
    first_.push_back(total_);
    total_ += windows;
    shards_.push_back(std::move(shard));
  }
  verified_bytes_ = manifests.bytes();
  verify_seconds_ = manifests.seconds();
  if (manifests.shards() > 0) {
    log_info(
        "[data] verified {} shard(s), {:.1f} MB, against their manifest in {:.2f} s ({:.1f} GB/s)",
        manifests.shards(), verified_bytes_ / 1e6, verify_seconds_,
        verified_bytes_ / 1e9 / std::max(verify_seconds_, 1e-9));
  }
}

size_t TokenDataset::num_tokens() const {
  size_t n = 0;
  for (const auto& s : shards_) n += s->size();
  return n;
}

void TokenDataset::sample(int64_t j, int32_t* out) const {
  TETRA_CHECK(j >= 0 && j < total_, "[data] sample {} out of range [0, {})", j, total_);
  size_t s = size_t(std::upper_bound(first_.begin(), first_.end(), j) - first_.begin()) - 1;
  shards_[s]->read(size_t(j - first_[s]) * T_, size_t(T_) + 1, out);
}

uint32_t TokenDataset::max_token() const {
  uint32_t m = 0;
  for (const auto& s : shards_) m = std::max(m, s->max_token());
  return m;
}

std::string TokenDataset::tokenizer_path() const {
  const fs::path dir = fs::path(shards_.front()->path()).parent_path();
  std::error_code ec;
  if (!fs::exists(dir / "manifest.json", ec)) return "";
  return (dir / read_manifest((dir / "manifest.json").string()).tokenizer_file).string();
}

}  // namespace tetra
