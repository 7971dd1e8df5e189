#include "model/weights_shape.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <set>
#include <string_view>

#include "ckpt/hf_config.h"
#include "core/error.h"
#include "model/gpt_io.h"

namespace tetra {

namespace fs = std::filesystem;

namespace {

// Block numbers as written after `prefix` ("h.", "model.layers."): digits only, parsed without
// overflow (a name such as h.99999999999.x is a number too large, never an exception). Refuses
// numbers that are not 0 .. n-1, naming the tensor.
std::set<int64_t> block_numbers(const SafeTensorsFile& f, std::string_view strip,
                                std::string_view prefix, const std::string& path,
                                const std::string& module, const char* family) {
  std::set<int64_t> layers;
  for (const auto& [name, t] : f.tensors) {
    std::string_view n = name;
    if (!strip.empty() && n.rfind(strip, 0) == 0) n.remove_prefix(strip.size());
    if (n.rfind(prefix, 0) != 0) continue;
    n.remove_prefix(prefix.size());
    const size_t dot = n.find('.');
    const std::string_view digits = n.substr(0, dot);
    int64_t layer = -1;
    const auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), layer);
    TETRA_CHECK(dot != std::string_view::npos && !digits.empty() && err == std::errc() &&
                    end == digits.data() + digits.size() && layer >= 0 &&
                    layer < int64_t(HfConfigLimits::n_layer),
                "[{}] {}: tensor '{}' is not a block tensor {}N.* with N in 0 .. {}; the file is "
                "damaged or not a {} safetensors file",
                module, path, name, prefix, HfConfigLimits::n_layer - 1, family);
    layers.insert(layer);
  }
  TETRA_CHECK(!layers.empty(), "[{}] {}: no transformer blocks ({}N.*) found", module, path,
              prefix);
  TETRA_CHECK(*layers.rbegin() + 1 == int64_t(layers.size()),
              "[{}] {}: the blocks are not numbered 0 .. {}: {} blocks, the last {}{}; some are "
              "missing, so the file is damaged or incomplete",
              module, path, layers.size() - 1, layers.size(), prefix, *layers.rbegin());
  return layers;
}

// Mixture-of-experts blocks: those of w.n_layer with a router (E, C) under one of `names(l)`;
// every k-th block. Sets w.moe_experts and w.moe_every.
template <typename Names>
void router_blocks(const SafeTensorsFile& f, WeightsShape& w, const std::string& path,
                   const std::string& module, Names names) {
  std::vector<int64_t> routed;
  for (int64_t l = 0; l < w.n_layer; ++l) {
    for (const std::string& n : names(l)) {
      auto it = f.tensors.find(n);
      if (it == f.tensors.end()) continue;
      TETRA_CHECK(it->second.shape.size() == 2 && it->second.shape[0] >= 1 &&
                      (w.moe_experts == 0 || it->second.shape[0] == w.moe_experts),
                  "[{}] {}: router '{}' has shape {}; every MoE block's router is (experts, "
                  "d_model) with the same experts",
                  module, path, n, shape_str(it->second.shape));
      w.moe_experts = it->second.shape[0];
      routed.push_back(l);
    }
  }
  if (routed.empty()) return;
  w.moe_every = routed.front() + 1;
  std::vector<int64_t> want;
  for (int64_t l = w.moe_every - 1; l < w.n_layer; l += w.moe_every) want.push_back(l);
  TETRA_CHECK(
      routed == want,
      "[{}] {}: the blocks with a router (numbers {}) are not every {}-th block; tetra's MoE "
      "models have one in blocks l with l % moe_every == moe_every - 1",
      module, path, fmt::join(routed, ", "), w.moe_every);
}

// A Llama file (LlamaForCausalLM names; MixtralForCausalLM's with MoE blocks): embed_tokens,
// model.layers.N, lm_head when untied.
WeightsShape llama_weights_shape(const SafeTensorsFile& f, const std::string& path,
                                 const std::string& module) {
  auto find = [&](const std::string& name) -> const SafeTensor& {
    auto it = f.tensors.find(name);
    TETRA_CHECK(it != f.tensors.end() && it->second.shape.size() == 2,
                "[{}] {}: no 2-D tensor '{}'; every LlamaForCausalLM file has it, so the file is "
                "damaged or incomplete",
                module, path, name);
    return it->second;
  };
  const SafeTensor& emb = find(kLlamaEmbedding);
  WeightsShape w;
  w.llama = true;
  w.vocab_size = emb.shape[0];
  w.d_model = emb.shape[1];
  w.n_layer = int64_t(block_numbers(f, "", "model.layers.", path, module, "Llama").size());
  router_blocks(f, w, path, module, [](int64_t l) {
    return std::vector<std::string>{"model.layers." + std::to_string(l) +
                                    ".block_sparse_moe.gate.weight"};
  });
  // A Mixtral's experts hold the SwiGLU channels; a dense block's MLP (block 0 is one unless
  // every block is routed).
  w.ffn = find(w.moe_experts > 0 && w.moe_every == 1
                   ? "model.layers.0.block_sparse_moe.experts.0.w1.weight"
                   : "model.layers.0.mlp.gate_proj.weight")
              .shape[0];
  w.kv_width = find("model.layers.0.self_attn.k_proj.weight").shape[0];
  auto head = f.tensors.find(kLmHead);
  w.lm_head = head != f.tensors.end();
  w.lm_head_is_embedding = w.lm_head && head->second == emb;
  return w;
}

}  // namespace

WeightsShape weights_shape(const SafeTensorsFile& f, const std::string& path,
                           const std::string& module) {
  auto find = [&](const std::string& name) -> const SafeTensor& {
    for (const std::string& n : {name, "transformer." + name}) {
      auto it = f.tensors.find(n);
      if (it != f.tensors.end() && it->second.shape.size() == 2) return it->second;
    }
    fail(
        "[{}] {}: no 2-D tensor '{}'; is this a GPT-2 safetensors file? (a Llama file has "
        "model.embed_tokens.weight)",
        module, path, name);
  };
  if (f.tensors.count(kLlamaEmbedding) > 0) return llama_weights_shape(f, path, module);
  const SafeTensor& wte = find("wte.weight");
  const SafeTensor& wpe = find("wpe.weight");
  const std::set<int64_t> layers = block_numbers(f, "transformer.", "h.", path, module, "GPT-2");
  WeightsShape w;
  w.vocab_size = wte.shape[0];
  w.d_model = wte.shape[1];
  w.max_seq = wpe.shape[0];
  w.n_layer = int64_t(layers.size());
  router_blocks(f, w, path, module, [](int64_t l) {
    return std::vector<std::string>{"transformer.h." + std::to_string(l) + ".mlp.router.weight",
                                    "h." + std::to_string(l) + ".mlp.router.weight"};
  });
  return w;
}

std::vector<std::string> weights_shape_overrides(const WeightsShape& w) {
  if (w.llama) {
    return {"model.arch=llama",
            "model.vocab_size=" + std::to_string(w.vocab_size),
            "model.d_model=" + std::to_string(w.d_model),
            "model.n_layer=" + std::to_string(w.n_layer),
            "model.ffn=" + std::to_string(w.ffn),
            fmt::format("model.tie_embeddings={}", !w.lm_head),
            "model.moe_experts=" + std::to_string(w.moe_experts),
            "model.moe_every=" + std::to_string(w.moe_every)};
  }
  return {"model.arch=gpt2",
          "model.vocab_size=" + std::to_string(w.vocab_size),
          "model.d_model=" + std::to_string(w.d_model),
          "model.max_seq=" + std::to_string(w.max_seq),
          "model.n_layer=" + std::to_string(w.n_layer),
          "model.moe_experts=" + std::to_string(w.moe_experts),
          "model.moe_every=" + std::to_string(w.moe_every)};
}

std::optional<std::string> llama_kv_heads_override(const WeightsShape& w, int64_t n_head) {
  if (!w.llama || n_head <= 0 || w.d_model % n_head != 0) return std::nullopt;
  const int64_t hs = w.d_model / n_head;
  if (hs == 0 || w.kv_width % hs != 0) return std::nullopt;
  return "model.n_kv_head=" + std::to_string(w.kv_width / hs);
}

void check_shape_matches_weights(const GptConfig& shape, const WeightsShape& w,
                                 const std::string& weights_path, const std::string& config_path,
                                 const std::string& model_arg,
                                 const std::vector<std::string>& overrides,
                                 const std::string& module) {
  const bool hf_keys = config_path.empty() && is_model_dir(model_arg);
  const std::string source = !config_path.empty() ? "--config " + config_path
                             : hf_keys            ? (fs::path(model_arg) / "config.json").string()
                                                  : std::string("the tensor shapes");
  struct Field {
    const char* hf;     // config.json's key
    const char* tetra;  // the model.* key
    std::string have;   // the shape's value
    std::string file;   // what the weights have, "32 wte's columns"
    bool same;
  };
  auto number = [](const char* hf, const char* tetra, int64_t have, int64_t file,
                   const char* tensor) {
    return Field{hf, tetra, std::to_string(have), fmt::format("{} {}", file, tensor), have == file};
  };
  std::vector<Field> fields;
  if (shape.llama() != w.llama) {
    // The families differ: no other field is comparable.
    fields.push_back({"model_type", "model.arch", shape.llama() ? "llama" : "gpt2",
                      w.llama ? "Llama tensors (model.embed_tokens, model.layers.N)"
                              : "GPT-2 tensors (transformer.wte, transformer.h.N)",
                      false});
  } else if (w.llama) {
    const int64_t hs = shape.head_size();
    std::string kv = w.kv_width % hs == 0
                         ? fmt::format("{} key/value heads (k_proj's {} rows / head size {})",
                                       w.kv_width / hs, w.kv_width, hs)
                         : fmt::format(
                               "k_proj's {} rows, not a whole number of heads of size {} "
                               "(d_model / n_head)",
                               w.kv_width, hs);
    const bool tied_ok = shape.tie_embeddings ? !w.lm_head || w.lm_head_is_embedding : w.lm_head;
    const char* head = !w.lm_head               ? "no lm_head.weight (a tied head)"
                       : w.lm_head_is_embedding ? "an lm_head.weight equal to embed_tokens"
                                                : "an lm_head.weight of its own (an untied head)";
    fields = {
        number("vocab_size", "model.vocab_size", shape.vocab_size, w.vocab_size,
               "embed_tokens' rows"),
        number("hidden_size", "model.d_model", shape.d_model, w.d_model, "embed_tokens' columns"),
        number("num_hidden_layers", "model.n_layer", shape.n_layer, w.n_layer,
               "blocks model.layers.N"),
        number("intermediate_size", "model.ffn", shape.ffn, w.ffn,
               w.moe_experts > 0 && w.moe_every == 1 ? "the experts' w1 rows" : "gate_proj's rows"),
        number("num_local_experts", "model.moe_experts", shape.moe.experts, w.moe_experts,
               "rows of the routers (block_sparse_moe.gate)"),
        number("moe_every", "model.moe_every", w.moe_experts > 0 ? shape.moe.every : 1, w.moe_every,
               "blocks with a router"),
        {"num_key_value_heads", "model.n_kv_head", std::to_string(shape.n_kv_head), kv,
         int64_t(shape.n_kv_head) * hs == w.kv_width},
        {"tie_word_embeddings", "model.tie_embeddings", shape.tie_embeddings ? "true" : "false",
         head, tied_ok}};
  } else {
    fields = {
        number("vocab_size", "model.vocab_size", shape.vocab_size, w.vocab_size, "wte's rows"),
        number("n_embd", "model.d_model", shape.d_model, w.d_model, "wte's columns"),
        number("n_positions", "model.max_seq", shape.max_seq, w.max_seq, "wpe's rows"),
        number("n_layer", "model.n_layer", shape.n_layer, w.n_layer, "blocks h.N"),
        number("num_local_experts", "model.moe_experts", shape.moe.experts, w.moe_experts,
               "rows of the routers"),
        number("moe_every", "model.moe_every", w.moe_experts > 0 ? shape.moe.every : 1, w.moe_every,
               "blocks with a router")};
  }
  std::vector<std::string> wrong, blamed;
  for (const Field& f : fields) {
    if (f.same) continue;
    // The last override of the key wins, as in Config::load.
    std::string override_of;
    for (const std::string& o : overrides) {
      if (o.rfind(std::string(f.tetra) + "=", 0) == 0) override_of = "--" + o;
    }
    const std::string origin = override_of.empty() ? source : override_of;
    if (override_of.empty()) {
      wrong.push_back(fmt::format("{} in {} is {} but the weights have {}",
                                  hf_keys ? f.hf : f.tetra, source, f.have, f.file));
    } else {
      wrong.push_back(fmt::format("{} but the weights have {}", override_of, f.file));
    }
    if (std::find(blamed.begin(), blamed.end(), origin) == blamed.end()) blamed.push_back(origin);
  }
  TETRA_CHECK(wrong.empty(),
              "[{}] the model shape does not match the weights {}: {}; they do not belong "
              "together: correct {}, or give the weights {} describes",
              module, weights_path, fmt::join(wrong, "; "), fmt::join(blamed, " and "),
              blamed.size() > 1 ? "they" : "it");
}

}  // namespace tetra
