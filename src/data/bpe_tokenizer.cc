// Byte-level BPE encoding and decoding, as GPT-2 does it.
#include <algorithm>
#include <queue>

#include "core/error.h"
#include "data/byte_level.h"
#include "data/pretokenize.h"
#include "data/tokenizer.h"

namespace tetra {

BpeTokenizer::BpeTokenizer(std::vector<std::string> tokens, std::vector<Merge> merges,
                           std::vector<AddedToken> added, uint32_t eot, std::string_view origin)
    : tokens_(std::move(tokens)), merges_(std::move(merges)), added_(std::move(added)), eot_(eot) {
  const size_t V = tokens_.size();
  TETRA_CHECK(V <= 0xFFFFFFFEu, "[tokenizer] {}: vocabulary too large ({} tokens)", origin, V);
  TETRA_CHECK(eot_ < V, "[tokenizer] {}: end-of-text id {} is outside the vocabulary (size {})",
              origin, eot_, V);
  for (const auto& a : added_) {
    TETRA_CHECK(a.id < V, "[tokenizer] {}: added token '{}' has id {} outside the vocabulary",
                origin, a.content, a.id);
  }
  // Lowest id wins when two ids share bytes (an added token repeating a vocab entry).
  std::unordered_map<std::string_view, uint32_t> id_of;
  id_of.reserve(V);
  for (uint32_t id = 0; id < V; ++id) id_of.emplace(tokens_[id], id);
  for (int b = 0; b < 256; ++b) {
    const char c = static_cast<char>(b);
    auto it = id_of.find(std::string_view(&c, 1));
    TETRA_CHECK(it != id_of.end(),
                "[tokenizer] {}: byte 0x{:02x} has no token, so some text could not be encoded; "
                "a byte-level vocabulary holds all 256 bytes",
                origin, b);
    byte_id_[b] = it->second;
  }
  merge_rules_.reserve(merges_.size());
  for (size_t r = 0; r < merges_.size(); ++r) {
    const auto [a, b] = merges_[r];
    TETRA_CHECK(a < V && b < V, "[tokenizer] {}: merge {} refers to id {} outside the vocabulary",
                origin, r, std::max(a, b));
    auto it = id_of.find(tokens_[a] + tokens_[b]);
    TETRA_CHECK(
        it != id_of.end(),
        "[tokenizer] {}: merge {} ('{}' + '{}') makes a token that is not in the vocabulary",
        origin, r, detail::byte_level_encode(tokens_[a]), detail::byte_level_encode(tokens_[b]));
    // A repeated merge keeps its first (lowest) rank, as Hugging Face does.
    merge_rules_.emplace((uint64_t{a} << 32) | b, MergeRule{static_cast<uint32_t>(r), it->second});
  }
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<uint32_t>& out) const {
  if (piece.size() > 64) return encode_long_piece(piece, out);
  // Short pieces: repeatedly merge every occurrence of the lowest-ranked adjacent pair.
  uint32_t sym[64];
  size_t n = piece.size();
  for (size_t i = 0; i < n; ++i) sym[i] = byte_id_[static_cast<unsigned char>(piece[i])];
  while (n > 1) {
    const MergeRule* best = nullptr;
    uint32_t ba = 0, bb = 0;
    for (size_t i = 0; i + 1 < n; ++i) {
      const MergeRule* m = find_merge(sym[i], sym[i + 1]);
      if (m && (!best || m->rank < best->rank)) {
        best = m;
        ba = sym[i];
        bb = sym[i + 1];
      }
    }
    if (!best) break;
    size_t w = 0;
    for (size_t i = 0; i < n; ++i) {
      if (i + 1 < n && sym[i] == ba && sym[i + 1] == bb) {
        sym[w++] = best->id;
        ++i;
      } else {
        sym[w++] = sym[i];
      }
    }
    n = w;
  }
  out.insert(out.end(), sym, sym + n);
}

void BpeTokenizer::encode_long_piece(std::string_view piece, std::vector<uint32_t>& out) const {
  // Long pieces (runs of spaces or symbols) would make the quadratic loop slow: keep the symbols
  // in a linked list and candidate pairs in a heap ordered by (rank, position), as HF does.
  const size_t n = piece.size();
  std::vector<uint32_t> id(n);
  std::vector<int64_t> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) {
    id[i] = byte_id_[static_cast<unsigned char>(piece[i])];
    prev[i] = static_cast<int64_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int64_t>(i + 1) : -1;
  }
  using Cand = std::pair<uint32_t, int64_t>;  // (rank, left position)
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int64_t i) {
    if (i < 0 || next[i] < 0) return;
    if (const MergeRule* m = find_merge(id[i], id[next[i]])) heap.push({m->rank, i});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int64_t>(i));
  while (!heap.empty()) {
    const auto [rank, i] = heap.top();
    heap.pop();
    if (!alive[i] || next[i] < 0) continue;
    const MergeRule* m = find_merge(id[i], id[next[i]]);
    if (!m || m->rank != rank) continue;  // stale: a neighbour merged since this was pushed
    const int64_t j = next[i];
    id[i] = m->id;
    alive[j] = false;
    next[i] = next[j];
    if (next[j] >= 0) prev[next[j]] = i;
    push(prev[i]);
    push(i);
  }
  for (int64_t i = 0; i >= 0; i = next[i]) out.push_back(id[i]);
}

std::vector<uint32_t> BpeTokenizer::encode_around(std::string_view text,
                                                  std::span<const AddedTokenMatch> matches) const {
  std::vector<uint32_t> out;
  out.reserve(text.size() / 3 + 16);
  // Words repeat: remember where each piece's tokens first went in out and copy them from there.
  // Keys point into text, so the cache costs no allocation per piece.
  struct Span {
    size_t begin, len;
  };
  std::unordered_map<std::string_view, Span> cache;
  auto encode_piece_cached = [&](std::string_view piece) {
    if (piece.size() == 1) {
      out.push_back(byte_id_[static_cast<unsigned char>(piece[0])]);
      return;
    }
    auto [it, fresh] = cache.try_emplace(piece, Span{out.size(), 0});
    if (fresh) {
      encode_piece(piece, out);
      it->second.len = out.size() - it->second.begin;
    } else {
      const size_t at = out.size();
      out.resize(at + it->second.len);
      std::copy_n(out.begin() + it->second.begin, it->second.len, out.begin() + at);
    }
  };
  size_t at = 0;
  for (const AddedTokenMatch& m : matches) {
    pretokenize_capped(text.substr(at, m.offset - at), kMaxEncodePieceBytes, encode_piece_cached);
    out.push_back(m.token->id);
    at = m.offset + m.token->content.size();
  }
  pretokenize_capped(text.substr(at), kMaxEncodePieceBytes, encode_piece_cached);
  return out;
}

std::string BpeTokenizer::decode(std::span<const uint32_t> tokens) const {
  std::string out;
  out.reserve(tokens.size() * 4);
  for (uint32_t t : tokens) {
    TETRA_CHECK(t < tokens_.size(),
                "[tokenizer] token id {} is outside the vocabulary (size {}); the tokens were made "
                "with another tokenizer",
                t, tokens_.size());
    out += tokens_[t];
  }
  return out;
}

std::string BpeTokenizer::to_json(int indent) const {
  return detail::hf_tokenizer_json(tokens_, merges_, added_, indent);
}

}  // namespace tetra
