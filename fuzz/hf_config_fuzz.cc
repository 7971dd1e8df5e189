// config.json reader (ckpt/hf_config.h) on arbitrary text, through the model_type dispatch that
// tetra generate/export use: either refused with tetra::Error, or a GPT-2 or Llama shape tetra
// can run whose every field lies in its range and every token id inside the vocabulary.
#include <cmath>
#include <cstdint>
#include <string_view>
#include <variant>

#include "ckpt/hf_config.h"
#include "core/error.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tetra::fuzz::quiet_logs();
  return 0;
}

namespace {

template <typename C>
void require_token_ids(const C& c) {
  using tetra::fuzz::require;
  auto inside = [&](int id) { return id >= 0 && id < c.vocab_size; };
  require(!c.bos_token_id || inside(*c.bos_token_id), "bos inside the vocabulary");
  require(!c.pad_token_id || inside(*c.pad_token_id), "pad inside the vocabulary");
  for (int id : c.eos_token_ids) require(inside(id), "eos inside the vocabulary");
}

void check(const tetra::HfGpt2Config& c) {
  using tetra::fuzz::require;
  using L = tetra::HfConfigLimits;
  require(c.vocab_size >= 1 && c.vocab_size <= L::vocab_size, "vocab_size in range");
  require(c.n_positions >= 1 && c.n_positions <= L::n_positions, "n_positions in range");
  require(c.n_embd >= 1 && c.n_embd <= L::n_embd, "n_embd in range");
  require(c.n_layer >= 1 && c.n_layer <= L::n_layer, "n_layer in range");
  require(c.n_head >= 1 && c.n_head <= L::n_head, "n_head in range");
  require(c.n_embd % c.n_head == 0, "n_head divides n_embd");
  require_token_ids(c);
}

void check(const tetra::HfLlamaConfig& c) {
  using tetra::fuzz::require;
  using L = tetra::HfConfigLimits;
  require(c.vocab_size >= 1 && c.vocab_size <= L::vocab_size, "vocab_size in range");
  require(c.hidden_size >= 1 && c.hidden_size <= L::n_embd, "hidden_size in range");
  require(c.intermediate_size >= 1 && c.intermediate_size <= L::intermediate_size,
          "intermediate_size in range");
  require(c.num_hidden_layers >= 1 && c.num_hidden_layers <= L::n_layer, "layers in range");
  require(c.num_attention_heads >= 1 && c.num_attention_heads <= L::n_head, "heads in range");
  require(c.max_position_embeddings >= 1 && c.max_position_embeddings <= L::n_positions,
          "max_position_embeddings in range");
  require(c.hidden_size % c.num_attention_heads == 0, "heads divide hidden_size");
  require((c.hidden_size / c.num_attention_heads) % 2 == 0, "even head size");
  require(c.num_key_value_heads >= 1 && c.num_attention_heads % c.num_key_value_heads == 0,
          "key/value heads divide the heads");
  require(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0 && c.rms_norm_eps < 1,
          "rms_norm_eps in (0, 1)");
  require(std::isfinite(c.rope_theta) && c.rope_theta > 0 && c.rope_theta <= L::rope_theta,
          "rope_theta in (0, 1e12]");
  require_token_ids(c);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tetra;
  try {
    const HfModelConfig c = parse_hf_model_config(
        std::string_view(reinterpret_cast<const char*>(data), size), "<fuzz>", "fuzz");
    std::visit([](const auto& x) { check(x); }, c);
  } catch (const Error&) {
  }
  return 0;
}
