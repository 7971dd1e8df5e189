// Training a byte-level BPE (GPT-2 style) on text. Deterministic: the same texts and vocabulary
// size give the same merges, whatever the thread count or the order texts are added in.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>

#include "data/tokenizer.h"

namespace tetra {

/** Words (pre-tokens) longer than this many bytes are counted in parts of at most this size
 * (pretokenize_capped), so no token is longer: as tokenizer trainers cap token length (Hugging
 * Face's max_token_length, SentencePiece's max_sentencepiece_length), and so that text without a
 * space costs what text with spaces does instead of one ever-growing word whose merges are
 * megabyte-long tokens. GPT-2's words are far shorter; its longest tokens are runs of symbols. */
constexpr size_t kMaxTrainWordBytes = 64;

class BpeTrainer {
 public:
  explicit BpeTrainer(int threads = 1) : threads_(threads < 1 ? 1 : threads) {}

  /** Pre-tokenizes text and counts its pieces; the text may be freed afterwards. */
  void add_text(std::string_view text);
  /** Reads and adds a file; throws tetra::Error naming it when it cannot be read. */
  void add_file(const std::string& path);
  size_t num_words() const { return counts_.size(); }

  /** Learns merges until the vocabulary (256 bytes + merges + "<|endoftext|>" as the last id)
   * reaches vocab_size, or no pair is left to merge. Ties in pair frequency go to the pair whose
   * bytes (first token, then second) sort first. */
  BpeTokenizer train(size_t vocab_size) const;

 private:
  int threads_;
  std::unordered_map<std::string, int64_t> counts_;
};

}  // namespace tetra
