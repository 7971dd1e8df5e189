// config.json reader (ckpt/hf_config.h) on arbitrary text: either refused with tetra::Error, or a
// GPT-2 shape tetra can run whose every field lies in its range and every token id inside the
// vocabulary.
#include <cstdint>
#include <string_view>

#include "ckpt/hf_config.h"
#include "core/error.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tetra::fuzz::quiet_logs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tetra;
  using L = HfConfigLimits;
  try {
    const HfGpt2Config c = parse_hf_gpt2_config(
        std::string_view(reinterpret_cast<const char*>(data), size), "<fuzz>", "fuzz");
    fuzz::require(c.vocab_size >= 1 && c.vocab_size <= L::vocab_size, "vocab_size in range");
    fuzz::require(c.n_positions >= 1 && c.n_positions <= L::n_positions, "n_positions in range");
    fuzz::require(c.n_embd >= 1 && c.n_embd <= L::n_embd, "n_embd in range");
    fuzz::require(c.n_layer >= 1 && c.n_layer <= L::n_layer, "n_layer in range");
    fuzz::require(c.n_head >= 1 && c.n_head <= L::n_head, "n_head in range");
    fuzz::require(c.n_embd % c.n_head == 0, "n_head divides n_embd");
    auto inside = [&](int id) { return id >= 0 && id < c.vocab_size; };
    fuzz::require(!c.bos_token_id || inside(*c.bos_token_id), "bos inside the vocabulary");
    fuzz::require(!c.pad_token_id || inside(*c.pad_token_id), "pad inside the vocabulary");
    for (int id : c.eos_token_ids) fuzz::require(inside(id), "eos inside the vocabulary");
  } catch (const Error&) {
  }
  return 0;
}
