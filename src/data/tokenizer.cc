// What every tokenizer shares: hashing, saving, the byte-level alphabet, the tokenizer.json
// writer, parallel encoding, and the byte tokenizer.
#include "data/tokenizer.h"

#include <fmt/format.h>
#include <omp.h>
#include <xxhash.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "core/atomic_file.h"
#include "core/error.h"
#include "data/byte_level.h"
#include "data/pretokenize.h"

namespace tetra {

namespace detail {

namespace {
void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// GPT-2's bytes_to_unicode as code points: printable Latin-1 bytes stand for themselves, the
// other 68 bytes take 256, 257, ... in byte order.
std::array<uint32_t, 256> byte_level_code_points() {
  std::array<uint32_t, 256> cps{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    cps[b] = printable ? b : next++;
  }
  return cps;
}

std::string json_string(std::string_view s) { return nlohmann::json(std::string(s)).dump(); }
}  // namespace

const std::array<std::string, 256>& byte_level_chars() {
  static const std::array<std::string, 256> chars = [] {
    std::array<std::string, 256> out;
    const auto cps = byte_level_code_points();
    for (int b = 0; b < 256; ++b) append_utf8(cps[b], out[b]);
    return out;
  }();
  return chars;
}

std::string byte_level_encode(std::string_view bytes) {
  const auto& chars = byte_level_chars();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) out += chars[b];
  return out;
}

bool byte_level_decode(std::string_view text, std::string& bytes) {
  static const std::array<int16_t, 324> byte_of = [] {
    std::array<int16_t, 324> t;
    t.fill(-1);
    const auto cps = byte_level_code_points();
    for (int b = 0; b < 256; ++b) t[cps[b]] = static_cast<int16_t>(b);
    return t;
  }();
  bytes.clear();
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t i = 0; i < text.size();) {
    const Utf8Char c = utf8_char_at(s, text.size(), i);
    if (c.cp >= byte_of.size() || byte_of[c.cp] < 0) return false;
    bytes += static_cast<char>(byte_of[c.cp]);
    i += c.len;
  }
  return true;
}

std::string hf_tokenizer_json(const std::vector<std::string>& tokens,
                              const std::vector<BpeTokenizer::Merge>& merges,
                              const std::vector<AddedToken>& added, int indent) {
  const bool pretty = indent >= 0;
  const std::string nl = pretty ? "\n" : "";
  const std::string sp = pretty ? " " : "";
  const std::string i1 = pretty ? std::string(indent, ' ') : "";
  const std::string i2 = i1 + i1, i3 = i2 + i1;
  std::string out = "{" + nl;
  out += i1 + "\"version\":" + sp + "\"1.0\"," + nl;
  out += i1 + "\"truncation\":" + sp + "null," + nl;
  out += i1 + "\"padding\":" + sp + "null," + nl;
  out += i1 + "\"added_tokens\":" + sp + "[";
  for (size_t k = 0; k < added.size(); ++k) {
    const auto& a = added[k];
    out += (k ? "," : "") + nl + i2 +
           fmt::format(
               "{{\"id\":{0}{1},\"content\":{0}{2},\"single_word\":{0}false,\"lstrip\":{0}false,"
               "\"rstrip\":{0}false,\"normalized\":{0}false,\"special\":{0}{3}}}",
               sp, a.id, json_string(a.content), a.special ? "true" : "false");
  }
  out += (added.empty() ? "" : nl + i1) + "]," + nl;
  out += i1 + "\"normalizer\":" + sp + "null," + nl;
  const std::string byte_level = fmt::format(
      "{{\"type\":{0}\"ByteLevel\",\"add_prefix_space\":{0}false,\"trim_offsets\":{0}true,"
      "\"use_regex\":{0}true}}",
      sp);
  out += i1 + "\"pre_tokenizer\":" + sp + byte_level + "," + nl;
  out += i1 + "\"post_processor\":" + sp + "null," + nl;
  out += i1 + "\"decoder\":" + sp + byte_level + "," + nl;
  out += i1 + "\"model\":" + sp + "{" + nl;
  out += i2 + "\"type\":" + sp + "\"BPE\"," + nl;
  out += i2 + "\"dropout\":" + sp + "null," + nl;
  out += i2 + "\"unk_token\":" + sp + "null," + nl;
  out += i2 + "\"continuing_subword_prefix\":" + sp + "null," + nl;
  out += i2 + "\"end_of_word_suffix\":" + sp + "null," + nl;
  out += i2 + "\"fuse_unk\":" + sp + "false," + nl;
  out += i2 + "\"byte_fallback\":" + sp + "false," + nl;
  out += i2 + "\"vocab\":" + sp + "{";
  // A JSON object cannot hold a key twice: an id whose bytes repeat a lower id's stays out of
  // vocab (it can only be an added token, listed above).
  std::unordered_set<std::string_view> seen;
  bool first = true;
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (!seen.insert(tokens[id]).second) continue;
    out += (first ? "" : ",") + nl + i3 + json_string(byte_level_encode(tokens[id])) + ":" + sp +
           std::to_string(id);
    first = false;
  }
  out += nl + i2 + "}," + nl;
  out += i2 + "\"merges\":" + sp + "[";
  for (size_t k = 0; k < merges.size(); ++k) {
    const std::string m = byte_level_encode(tokens[merges[k].first]) + " " +
                          byte_level_encode(tokens[merges[k].second]);
    out += (k ? "," : "") + nl + i3 + json_string(m);
  }
  out += (merges.empty() ? "" : nl + i2) + "]" + nl;
  out += i1 + "}" + nl + "}" + nl;
  return out;
}

}  // namespace detail

std::string Tokenizer::hash() const {
  const std::string json = to_json();
  return fmt::format("{:016x}", XXH3_64bits(json.data(), json.size()));
}

void Tokenizer::save(const std::string& path) const {
  const std::string json = to_json(2);
  write_file_atomically(path, {{reinterpret_cast<const uint8_t*>(json.data()), json.size()}},
                        "tokenizer");
}

std::vector<uint32_t> ByteTokenizer::encode(std::string_view text) const {
  return std::vector<uint32_t>(reinterpret_cast<const unsigned char*>(text.data()),
                               reinterpret_cast<const unsigned char*>(text.data()) + text.size());
}

std::vector<uint32_t> ByteTokenizer::encode_around(std::string_view text,
                                                   std::span<const AddedTokenMatch> matches) const {
  std::vector<uint32_t> out;
  out.reserve(text.size());
  size_t at = 0;
  for (const AddedTokenMatch& m : matches) {
    const auto part = encode(text.substr(at, m.offset - at));
    out.insert(out.end(), part.begin(), part.end());
    out.push_back(m.token->id);
    at = m.offset + m.token->content.size();
  }
  const auto tail = encode(text.substr(at));
  out.insert(out.end(), tail.begin(), tail.end());
  return out;
}

std::string ByteTokenizer::decode(std::span<const uint32_t> tokens) const {
  std::string out;
  out.reserve(tokens.size());
  for (uint32_t t : tokens) {
    if (t < 256) {
      out += static_cast<char>(t);
    } else if (t == 256) {
      out += "<|endoftext|>";
    } else {
      fail(
          "[tokenizer] token id {} is outside the byte tokenizer's vocabulary (size 257); the "
          "tokens were made with another tokenizer",
          t);
    }
  }
  return out;
}

const std::vector<AddedToken>& ByteTokenizer::added_tokens() const {
  static const std::vector<AddedToken> added{{256, "<|endoftext|>", true}};
  return added;
}

std::string ByteTokenizer::to_json(int indent) const {
  std::vector<std::string> tokens(257);
  for (int b = 0; b < 256; ++b) tokens[b] = std::string(1, static_cast<char>(b));
  tokens[256] = "<|endoftext|>";
  return detail::hf_tokenizer_json(tokens, {}, added_tokens(), indent);
}

namespace {
// Where encode_parallel cuts text: {0, text.size()} for one thread or a short text, else chunks
// of at least 256 KB, several per thread so that uneven chunks still balance.
std::vector<size_t> parallel_chunk_cuts(std::string_view text, int threads) {
  constexpr size_t kMinChunk = 1 << 18;
  threads = std::max(threads, 1);
  if (threads == 1 || text.size() < 2 * kMinChunk) return {0, text.size()};
  return text_chunk_cuts(text,
                         std::max(kMinChunk, text.size() / (4 * static_cast<size_t>(threads))));
}
}  // namespace

std::vector<uint32_t> encode_parallel(const Tokenizer& tok, std::string_view text, int threads) {
  const std::vector<size_t> cuts = parallel_chunk_cuts(text, threads);
  if (cuts.size() == 2) return tok.encode(text);
  const int n = static_cast<int>(cuts.size()) - 1;
  std::vector<std::vector<uint32_t>> parts(n);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int k = 0; k < n; ++k) parts[k] = tok.encode(text.substr(cuts[k], cuts[k + 1] - cuts[k]));
  size_t total = 0;
  for (const auto& p : parts) total += p.size();
  std::vector<uint32_t> out;
  out.reserve(total);
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

SpecialTokens parse_special_tokens(std::string_view value, std::string_view module) {
  if (value == "match") return SpecialTokens::match;
  if (value == "ordinary") return SpecialTokens::ordinary;
  if (value == "refuse") return SpecialTokens::refuse;
  fail(
      "[{}] --special-tokens {}: expected match (a special token's text becomes its id, as in "
      "Hugging Face), ordinary (encoded as plain text) or refuse (an error)",
      module, value);
}

namespace {
// The next occurrence of every added token at or after a moving offset. A token's position is
// searched again only once the offset passes it, so a whole text costs one scan per token.
class AddedTokenScanner {
 public:
  AddedTokenScanner(const Tokenizer& tok, std::string_view text, size_t from)
      : added_(tok.added_tokens()), text_(text), next_(added_.size()) {
    for (size_t k = 0; k < added_.size(); ++k) search(k, from);
  }
  /** The leftmost occurrence at or after `from`, the longest content among those starting there. */
  std::optional<AddedTokenMatch> next(size_t from) {
    std::optional<AddedTokenMatch> best;
    for (size_t k = 0; k < added_.size(); ++k) {
      if (next_[k] != std::string_view::npos && next_[k] < from) search(k, from);
      const size_t at = next_[k];
      if (at == std::string_view::npos) continue;
      if (!best || at < best->offset ||
          (at == best->offset && added_[k].content.size() > best->token->content.size())) {
        best = AddedTokenMatch{at, &added_[k]};
      }
    }
    return best;
  }

 private:
  void search(size_t k, size_t from) {
    next_[k] =
        added_[k].content.empty() ? std::string_view::npos : text_.find(added_[k].content, from);
  }
  const std::vector<AddedToken>& added_;
  std::string_view text_;
  std::vector<size_t> next_;
};
}  // namespace

std::optional<AddedTokenMatch> find_added_token(const Tokenizer& tok, std::string_view text,
                                                size_t from) {
  return AddedTokenScanner(tok, text, from).next(from);
}

std::vector<uint32_t> encode_matching_added_tokens(const Tokenizer& tok, std::string_view text,
                                                   int threads) {
  AddedTokenScanner scan(tok, text, 0);
  std::vector<AddedTokenMatch> matches;
  for (size_t at = 0; const auto m = scan.next(at);) {
    matches.push_back(*m);
    at = m->offset + m->token->content.size();
  }
  if (matches.empty()) return encode_parallel(tok, text, threads);
  // Chunks as encode_parallel cuts them, less any cut inside a match (an added token holding a
  // space); each chunk is encoded around the matches it holds.
  std::vector<size_t> cuts = parallel_chunk_cuts(text, threads);
  auto inside = [&](size_t c) {
    const auto m =
        std::upper_bound(matches.begin(), matches.end(), c,
                         [](size_t x, const AddedTokenMatch& a) { return x < a.offset; });
    return m != matches.begin() && c < std::prev(m)->offset + std::prev(m)->token->content.size();
  };
  std::erase_if(cuts, [&](size_t c) { return c != 0 && c != text.size() && inside(c); });
  const int n = static_cast<int>(cuts.size()) - 1;
  std::vector<std::vector<uint32_t>> parts(size_t(std::max(n, 0)));
#pragma omp parallel for num_threads(std::max(threads, 1)) schedule(dynamic, 1)
  for (int k = 0; k < n; ++k) {
    const size_t lo = cuts[k], hi = cuts[k + 1];
    std::vector<AddedTokenMatch> local;
    for (auto it = std::lower_bound(matches.begin(), matches.end(), lo,
                                    [](const AddedTokenMatch&a, size_t x) { return a.offset < x; });
         it != matches.end() && it->offset < hi; ++it) {
      local.push_back({it->offset - lo, it->token});
    }
    parts[size_t(k)] = tok.encode_around(text.substr(lo, hi - lo), local);
  }
  std::vector<uint32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

}  // namespace tetra
