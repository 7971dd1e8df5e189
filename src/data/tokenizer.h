// Tokenizers: a plain byte tokenizer and GPT-2's byte-level BPE, read from and written to
// Hugging Face tokenizer.json files. Both are lossless: decode(encode(b)) == b for every byte
// string b, valid UTF-8 or not.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tetra {

/** A token of Hugging Face's added_tokens list (stored verbatim, not byte-level mapped). */
struct AddedToken {
  uint32_t id;
  std::string content;
  bool special;
};

/** An added token found in a text. */
struct AddedTokenMatch {
  size_t offset;  // byte offset in the text
  const AddedToken* token;
};

/** Maps text to token ids and back. Implementations are immutable and safe to share between
 * threads. encode() treats its input as plain text: "<|endoftext|>" inside it is encoded as
 * ordinary characters, never as the EOT token; callers insert eot_token() themselves, or use
 * encode_matching_added_tokens() to match such text as Hugging Face does. */
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  virtual std::vector<uint32_t> encode(std::string_view text) const = 0;
  /** encode() of each stretch of text between `matches` (added tokens found in it, in order, not
   * overlapping), each match's id between them: Hugging Face's encoding of text. The stretches
   * share one piece cache, so many short ones cost no more than one long one. */
  virtual std::vector<uint32_t> encode_around(std::string_view text,
                                              std::span<const AddedTokenMatch> matches) const = 0;
  /** Throws tetra::Error for an id >= vocab_size(). */
  virtual std::string decode(std::span<const uint32_t> tokens) const = 0;
  virtual size_t vocab_size() const = 0;
  /** The document separator, "<|endoftext|>" (50256 in GPT-2; the last id when tetra trains). */
  virtual uint32_t eot_token() const = 0;
  /** "byte" or "bpe". */
  virtual std::string name() const = 0;
  /** Hugging Face's added_tokens: "<|endoftext|>" and any other token matched as a whole. */
  virtual const std::vector<AddedToken>& added_tokens() const = 0;
  /** The canonical Hugging Face tokenizer.json text; indent < 0 gives the compact form. */
  virtual std::string to_json(int indent = -1) const = 0;

  /** xxh3-64 of the compact to_json(), as 16 hex digits: identifies the tokenizer in manifests. */
  std::string hash() const;
  /** Writes to_json(2) to path atomically (core/atomic_file.h); throws tetra::Error naming the
   * path on failure. */
  void save(const std::string& path) const;
};

/** One token per byte (ids 0..255) plus "<|endoftext|>" as 256. */
class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<uint32_t> encode(std::string_view text) const override;
  std::vector<uint32_t> encode_around(std::string_view text,
                                      std::span<const AddedTokenMatch> matches) const override;
  std::string decode(std::span<const uint32_t> tokens) const override;
  size_t vocab_size() const override { return 257; }
  uint32_t eot_token() const override { return 256; }
  std::string name() const override { return "byte"; }
  const std::vector<AddedToken>& added_tokens() const override;
  std::string to_json(int indent = -1) const override;
};

/** A pre-token (piece) longer than this is encoded in parts of at most this many bytes
 * (pretokenize_capped). BPE over one piece needs memory and time for all of it at once: a 32 MB
 * run of letters without a space took 1.2 GB and 26 s, while its 64 KiB parts take a few MB, and
 * equal parts are encoded once. Hugging Face encodes such a run whole, so ids can differ around
 * the cuts of a run longer than 64 KiB; text whose runs are shorter is encoded exactly as HF does.
 */
constexpr size_t kMaxEncodePieceBytes = 64 << 10;

/** Byte-level BPE exactly as GPT-2: GPT-2's pre-tokenization (data/pretokenize.h), then merges
 * applied lowest rank first within each piece (a piece over kMaxEncodePieceBytes in parts). */
class BpeTokenizer final : public Tokenizer {
 public:
  using Merge = std::pair<uint32_t, uint32_t>;

  /** tokens[id] is the token's raw bytes; merges are in rank order; every single byte must be a
   * token and every merge's concatenation too. origin names the source in error messages. */
  BpeTokenizer(std::vector<std::string> tokens, std::vector<Merge> merges,
               std::vector<AddedToken> added, uint32_t eot, std::string_view origin = "<memory>");

  std::vector<uint32_t> encode(std::string_view text) const override {
    return encode_around(text, {});
  }
  std::vector<uint32_t> encode_around(std::string_view text,
                                      std::span<const AddedTokenMatch> matches) const override;
  std::string decode(std::span<const uint32_t> tokens) const override;
  size_t vocab_size() const override { return tokens_.size(); }
  uint32_t eot_token() const override { return eot_; }
  std::string name() const override { return "bpe"; }
  const std::vector<AddedToken>& added_tokens() const override { return added_; }
  std::string to_json(int indent = -1) const override;

  const std::vector<Merge>& merges() const { return merges_; }
  const std::string& token_bytes(uint32_t id) const { return tokens_.at(id); }

 private:
  struct MergeRule {
    uint32_t rank;
    uint32_t id;
  };
  void encode_piece(std::string_view piece, std::vector<uint32_t>& out) const;
  void encode_long_piece(std::string_view piece, std::vector<uint32_t>& out) const;
  const MergeRule* find_merge(uint32_t a, uint32_t b) const {
    auto it = merge_rules_.find((uint64_t{a} << 32) | b);
    return it == merge_rules_.end() ? nullptr : &it->second;
  }

  std::vector<std::string> tokens_;
  std::vector<Merge> merges_;
  std::vector<AddedToken> added_;
  uint32_t eot_;
  uint32_t byte_id_[256];
  std::unordered_map<uint64_t, MergeRule> merge_rules_;
};

/** "byte" gives the ByteTokenizer; anything else is a path to a Hugging Face tokenizer.json
 * holding a byte-level BPE (GPT-2 style). Errors read "[tokenizer] <path>: <what to fix>". */
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec);

/** The tokenizer a tokenizer.json text describes; origin names it in errors. */
std::unique_ptr<Tokenizer> parse_tokenizer_json(std::string_view text, const std::string& origin);

/** encode() over threads: text is cut only where the cut cannot change the encoding, so the
 * result equals tok.encode(text). */
std::vector<uint32_t> encode_parallel(const Tokenizer& tok, std::string_view text, int threads);

/** What encoding does with the text of an added token (e.g. "<|endoftext|>") in its input:
 * `match` gives the token's id, as Hugging Face's tokenizers do by default; `ordinary` encodes it
 * as plain text (tiktoken's encode_ordinary); `refuse` is an error naming it. */
enum class SpecialTokens { match, ordinary, refuse };

/** Parses --special-tokens; errors read "[module] --special-tokens VALUE: ...". */
SpecialTokens parse_special_tokens(std::string_view value, std::string_view module);

/** The first occurrence at or after `from` of an added token's content (at the leftmost offset,
 * the longest content), as Hugging Face's added vocabulary finds them; nullopt when none. */
std::optional<AddedTokenMatch> find_added_token(const Tokenizer& tok, std::string_view text,
                                                size_t from = 0);

/** Encodes text as Hugging Face does by default: each added token found (find_added_token) becomes
 * its id and the text between them is encoded (encode_around), over threads like encode_parallel.
 */
std::vector<uint32_t> encode_matching_added_tokens(const Tokenizer& tok, std::string_view text,
                                                   int threads);

}  // namespace tetra
