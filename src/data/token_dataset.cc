#include "data/token_dataset.h"

#include <glob.h>

#include <algorithm>
#include <sstream>

#include "core/error.h"

namespace tetra {

namespace {

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

}  // namespace

TokenDataset::TokenDataset(const std::string& spec, int seq_len) : T_(seq_len) {
  TETRA_CHECK(seq_len > 0, "[data] sequence length must be positive (got {})", seq_len);
  for (const auto& path : expand(spec)) {
    auto shard = std::make_unique<TokenShard>(path);
    int64_t windows = shard->size() > 0 ? int64_t(shard->size() - 1) / T_ : 0;
    TETRA_CHECK(windows > 0,
                "[data] {}: {} tokens cannot hold one sample of seq_len+1={} tokens; use a larger "
                "shard or a shorter train.seq_len",
                path, shard->size(), T_ + 1);
    first_.push_back(total_);
    total_ += windows;
    shards_.push_back(std::move(shard));
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

}  // namespace tetra
