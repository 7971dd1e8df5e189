// BPE training: count pre-tokenized words, then merge the most frequent pair repeatedly, keeping
// pair counts up to date incrementally (only words that hold the merged pair are revisited).
#include "data/bpe_train.h"

#include <algorithm>
#include <fstream>
#include <queue>
#include <sstream>

#include "core/error.h"
#include "core/log.h"
#include "data/pretokenize.h"

namespace tetra {

namespace {

using Pair = uint64_t;  // (left id << 32) | right id
inline Pair make_pair_key(uint32_t a, uint32_t b) { return (uint64_t{a} << 32) | b; }
inline uint32_t left_of(Pair p) { return static_cast<uint32_t>(p >> 32); }
inline uint32_t right_of(Pair p) { return static_cast<uint32_t>(p); }

struct Word {
  std::vector<uint32_t> sym;
  int64_t count;
};

struct Candidate {
  int64_t count;
  Pair pair;
};

}  // namespace

void BpeTrainer::add_text(std::string_view text) {
  using Counts = std::unordered_map<std::string_view, int64_t>;
  auto count = [](std::string_view t, Counts& c) {
    pretokenize_capped(t, kMaxTrainWordBytes, [&](std::string_view piece) { ++c[piece]; });
  };
  // Cut where pre-tokenization cannot change, count each chunk on its own thread, then sum
  // (addition commutes, so the result does not depend on the thread count).
  const size_t target = text.size() / (4 * static_cast<size_t>(threads_)) + 1;
  const std::vector<size_t> cuts = threads_ > 1 && text.size() > (1 << 20)
                                       ? text_chunk_cuts(text, target)
                                       : std::vector<size_t>{0, text.size()};
  const int n = static_cast<int>(cuts.size()) - 1;
  std::vector<Counts> partial(n);
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1)
  for (int k = 0; k < n; ++k) count(text.substr(cuts[k], cuts[k + 1] - cuts[k]), partial[k]);
  for (const auto& c : partial) {
    for (const auto& [w, k] : c) counts_[std::string(w)] += k;
  }
}

void BpeTrainer::add_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TETRA_CHECK(in, "[tokenizer] cannot read {} for BPE training; check the path", path);
  std::stringstream buf;
  buf << in.rdbuf();
  add_text(buf.str());
}

BpeTokenizer BpeTrainer::train(size_t vocab_size) const {
  TETRA_CHECK(vocab_size >= 257,
              "[tokenizer] BPE vocabulary size {} is too small; it holds the 256 bytes and "
              "<|endoftext|>, so ask for at least 257",
              vocab_size);
  TETRA_CHECK(vocab_size <= (1u << 31), "[tokenizer] BPE vocabulary size {} is too large",
              vocab_size);
  // Words in byte order, so ids and iteration never depend on hash-map order.
  std::vector<std::pair<std::string_view, int64_t>> sorted(counts_.begin(), counts_.end());
  std::sort(sorted.begin(), sorted.end());

  std::vector<std::string> tokens(256);
  for (int b = 0; b < 256; ++b) tokens[b] = std::string(1, static_cast<char>(b));
  std::unordered_map<std::string, uint32_t> id_of;
  for (uint32_t b = 0; b < 256; ++b) id_of[tokens[b]] = b;

  std::vector<Word> words;
  words.reserve(sorted.size());
  std::unordered_map<Pair, int64_t> pair_count;
  std::unordered_map<Pair, std::vector<uint32_t>> where;  // pair -> words that held it
  for (const auto& [w, c] : sorted) {
    Word word{{}, c};
    for (unsigned char b : w) word.sym.push_back(b);
    const auto wi = static_cast<uint32_t>(words.size());
    for (size_t i = 0; i + 1 < word.sym.size(); ++i) {
      const Pair p = make_pair_key(word.sym[i], word.sym[i + 1]);
      pair_count[p] += c;
      auto& list = where[p];
      if (list.empty() || list.back() != wi) list.push_back(wi);
    }
    words.push_back(std::move(word));
  }

  // Max-heap on count; on equal counts the pair with the smaller bytes comes first. Entries go
  // stale as counts change: one whose count differs from the current count is re-queued.
  auto lower = [&tokens](const Candidate& x, const Candidate& y) {
    if (x.count != y.count) return x.count < y.count;
    const auto& xa = tokens[left_of(x.pair)];
    const auto& ya = tokens[left_of(y.pair)];
    if (xa != ya) return xa > ya;
    return tokens[right_of(x.pair)] > tokens[right_of(y.pair)];
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(lower)> heap(lower);
  for (const auto& [p, c] : pair_count) heap.push({c, p});

  std::vector<BpeTokenizer::Merge> merges;
  std::vector<Pair> touched;
  while (tokens.size() + 1 < vocab_size && !heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    auto pc = pair_count.find(top.pair);
    const int64_t current = pc == pair_count.end() ? 0 : pc->second;
    if (current != top.count) {
      if (current > 0 && current < top.count) heap.push({current, top.pair});
      continue;
    }
    if (current <= 0) continue;
    const uint32_t a = left_of(top.pair), b = right_of(top.pair);
    std::string merged = tokens[a] + tokens[b];
    uint32_t id;
    if (auto it = id_of.find(merged); it != id_of.end()) {
      id = it->second;
    } else {
      id = static_cast<uint32_t>(tokens.size());
      id_of.emplace(merged, id);
      tokens.push_back(std::move(merged));
    }
    merges.emplace_back(a, b);

    std::vector<uint32_t> affected = std::move(where[top.pair]);
    where.erase(top.pair);
    touched.clear();
    for (uint32_t wi : affected) {
      Word& w = words[wi];
      auto& s = w.sym;
      bool holds = false;
      for (size_t i = 0; i + 1 < s.size() && !holds; ++i) holds = s[i] == a && s[i + 1] == b;
      if (!holds) continue;
      for (size_t i = 0; i + 1 < s.size(); ++i)
        pair_count[make_pair_key(s[i], s[i + 1])] -= w.count;
      size_t out = 0;
      for (size_t i = 0; i < s.size(); ++i) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          s[out++] = id;
          ++i;
        } else {
          s[out++] = s[i];
        }
      }
      s.resize(out);
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        const Pair p = make_pair_key(s[i], s[i + 1]);
        pair_count[p] += w.count;
        if (s[i] == id || s[i + 1] == id) {
          auto& list = where[p];
          if (list.empty() || list.back() != wi) list.push_back(wi);
          touched.push_back(p);
        }
      }
    }
    pair_count.erase(top.pair);
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    for (Pair p : touched) {
      const int64_t c = pair_count[p];
      if (c > 0) heap.push({c, p});
    }
  }
  const size_t learned = tokens.size();
  if (learned + 1 < vocab_size) {
    log_warn("[tokenizer] the corpus ran out of pairs to merge: vocabulary is {} instead of {}",
             learned + 1, vocab_size);
  }
  tokens.push_back("<|endoftext|>");
  const auto eot = static_cast<uint32_t>(learned);
  return BpeTokenizer(std::move(tokens), std::move(merges), {{eot, "<|endoftext|>", true}}, eot,
                      "trained BPE");
}

}  // namespace tetra
