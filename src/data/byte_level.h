// GPT-2's byte-level alphabet (bytes_to_unicode) and the Hugging Face tokenizer.json writer the
// tokenizers share. Internal to the data layer.
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace tetra::detail {

/** byte -> UTF-8 of the printable character GPT-2 uses for it (e.g. ' ' -> "Ġ"). */
const std::array<std::string, 256>& byte_level_chars();

/** Raw bytes as byte-level text. */
std::string byte_level_encode(std::string_view bytes);

/** Byte-level text back to raw bytes; false when a character is not in the alphabet. */
bool byte_level_decode(std::string_view text, std::string& bytes);

/** A tokenizer.json that Hugging Face `tokenizers` loads: ByteLevel pre-tokenizer and decoder,
 * BPE model with tokens (raw bytes, by id) as vocab and merges as "a b" strings. */
std::string hf_tokenizer_json(const std::vector<std::string>& tokens,
                              const std::vector<BpeTokenizer::Merge>& merges,
                              const std::vector<AddedToken>& added, int indent);

}  // namespace tetra::detail
