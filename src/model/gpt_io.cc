#include "model/gpt_io.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>
#include <variant>

#include "ckpt/hf_config.h"
#include "core/atomic_file.h"
#include "core/error.h"
#include "core/log.h"
#include "core/paths.h"
#include "core/staged_dir.h"
#include "model/gpt_config.h"

namespace tetra {

namespace {

// The file-side shape of a tensor: transposed for Conv1D, without padding rows.
Shape file_shape(const ParamEntry& e) {
  Shape s = e.spec.shape;
  if (e.spec.file.rows >= 0) s[0] = e.spec.file.rows;
  if (e.spec.file.transposed) std::swap(s[0], s[1]);
  return s;
}

bool ignorable(const std::string& name) {
  auto ends = [&](const std::string& suffix) {
    return name.size() >= suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  // Causal-mask buffers that older GPT-2 exports carry, RoPE frequency buffers that older Llama
  // conversions carry (tetra computes the same from rope_theta), and the tied LM head (a Llama's
  // is compared with embed_tokens before it is left out).
  return ends(".attn.bias") || ends(".attn.masked_bias") || ends(".rotary_emb.inv_freq") ||
         name == "lm_head.weight";
}

// The first non-finite value of v, or -1.
int64_t first_non_finite(const float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) return i;
  }
  return -1;
}

}  // namespace

void load_safetensors_into(ParamStore& store, const std::string& path, const std::string& describe,
                           const std::vector<std::string>* whole) {
  load_safetensors_into(store, read_safetensors(path), path, describe, whole);
}

void load_safetensors_into(ParamStore& store, const SafeTensorsFile& file, const std::string& path,
                           const std::string& describe, const std::vector<std::string>* whole) {
  std::map<std::string, const SafeTensor*> by_name;
  std::vector<std::string> unknown;
  const std::set<std::string> others =
      whole ? std::set<std::string>(whole->begin(), whole->end()) : std::set<std::string>();
  auto known = [&](const std::string& n) { return store.find(n) >= 0 || others.count(n) > 0; };
  for (const auto& [name, t] : file.tensors) {
    // A model's own names (Llama's are Hugging Face's as they are), or GPT-2's written without
    // the "transformer." prefix.
    std::string n = name;
    if (!known(n) && name.rfind("transformer.", 0) != 0 && known("transformer." + name)) {
      n = "transformer." + name;
    }
    if (store.find(n) >= 0) {
      by_name[n] = &t;
    } else if (!ignorable(name) && !known(n)) {
      unknown.push_back(name);
    }
  }
  // A tied Llama head reads embed_tokens: a file's lm_head.weight is the same matrix written
  // twice, or the file is an untied model's.
  const bool llama_tied = known(kLlamaEmbedding) && !known(kLmHead);
  if (auto head = file.tensors.find(kLmHead); llama_tied && head != file.tensors.end()) {
    auto emb = file.tensors.find(kLlamaEmbedding);
    TETRA_CHECK(emb != file.tensors.end() && head->second == emb->second,
                "[init] {}: the file holds an lm_head.weight that is not its "
                "model.embed_tokens.weight, i.e. an untied head, but this model ({}) ties the "
                "head to the embedding; set model.tie_embeddings=false",
                path, describe);
  }
  TETRA_CHECK(unknown.empty(),
              "[init] {}: tensors not in a model with this config: {}; is model.n_layer right?",
              path, fmt::join(unknown, ", "));
  std::vector<std::string> problems;
  for (const ParamEntry& e : store.tensors()) {
    auto it = by_name.find(e.spec.name);
    if (it == by_name.end()) {
      problems.push_back(fmt::format("missing '{}'", e.spec.name));
    } else if (it->second->shape != file_shape(e)) {
      problems.push_back(fmt::format("'{}' has shape {} but this model needs {}", e.spec.name,
                                     shape_str(it->second->shape), shape_str(file_shape(e))));
    }
  }
  TETRA_CHECK(problems.empty(),
              "[init] {} does not match the model ({}): {}. Set model.* to the file's shape.", path,
              describe, fmt::join(problems, "; "));

  // Every value is checked before the first one is stored.
  std::vector<std::vector<float>> globals(store.tensors().size());
  for (TensorId id = 0; id < TensorId(store.tensors().size()); ++id) {
    const ParamEntry& e = store.tensor(id);
    std::vector<float> v = by_name.at(e.spec.name)->to_f32();
    if (int64_t bad = first_non_finite(v.data(), int64_t(v.size())); bad >= 0) {
      fail(
          "[init] {}: tensor '{}' holds {} at element {} (of {} in the file's {} layout); the "
          "weights are damaged — retrain or re-export them",
          path, e.spec.name, v[size_t(bad)], bad, v.size(), shape_str(file_shape(e)));
    }
    // Into tetra's layout and global shape: untranspose, zero the padding rows.
    std::vector<float>& g = globals[size_t(id)];
    g.assign(size_t(shape_numel(e.spec.shape)), 0.0f);
    if (e.spec.file.transposed) {
      const int64_t out = e.spec.shape[0], in = e.spec.shape[1];  // file is (in, out)
      for (int64_t i = 0; i < in; ++i)
        for (int64_t o = 0; o < out; ++o) g[size_t(o * in + i)] = v[size_t(i * out + o)];
    } else {
      std::copy(v.begin(), v.end(), g.begin());
    }
  }
  for (TensorId id = 0; id < TensorId(store.tensors().size()); ++id) {
    store.load_global(id, globals[size_t(id)].data());
  }
}

SafeTensorsFile store_to_safetensors(const ParamStore& store, const float* flat, bool check_finite,
                                     parallel::TensorParallel* tp, TensorId skip) {
  SafeTensorsFile file;
  file.metadata["format"] = "pt";
  Device& device = store.device();
  // Host copies of one tensor at a time, on their way into the file.
  std::vector<float> parts, whole;
  Buffer<float> gathered;  // on the device: every rank's slice of one tensor
  for (const ParamEntry& e : store.tensors()) {
    if (skip >= 0 && &e == &store.tensor(skip)) continue;
    const size_t n = size_t(e.numel());
    const float* d = nullptr;
    if (e.spec.slice.dim >= 0) {
      // Rank r of the group holds the slice at offset r·extent: gather every rank's, place each
      // element at its global index.
      TETRA_CHECK(tp && tp->size() * e.spec.slice.extent * e.spec.slice.parts ==
                            e.spec.shape[size_t(e.spec.slice.dim)],
                  "[save] internal: '{}' is a slice and no tensor-parallel group assembles it",
                  e.spec.name);
      if (gathered.size() < n * size_t(tp->size())) {
        gathered = Buffer<float>(n * size_t(tp->size()), {}, device);
      }
      tp->all_gather(flat + e.offset, gathered.data(), n);
      parts.resize(n * size_t(tp->size()));
      device.to_host(parts.data(), gathered.data(), parts.size() * sizeof(float));
      whole.resize(size_t(shape_numel(e.spec.shape)));
      ParamEntry r = e;
      for (int q = 0; q < tp->size(); ++q) {
        r.spec.slice.offset = q * e.spec.slice.extent;
        for (size_t i = 0; i < n; ++i) whole[size_t(r.global_index(int64_t(i)))] = parts[q * n + i];
      }
    } else {
      whole.resize(n);
      device.to_host(whole.data(), flat + e.offset, n * sizeof(float));
    }
    d = whole.data();
    const Shape s = file_shape(e);
    if (check_finite) {
      if (int64_t bad = first_non_finite(d, shape_numel(s)); bad >= 0) {
        fail(
            "[save] tensor '{}' holds {} at element {}; refusing to write non-finite weights "
            "(the file was not written)",
            e.spec.name, d[bad], bad);
      }
    }
    if (e.spec.file.transposed) {
      const int64_t out = e.spec.shape[0], in = e.spec.shape[1];
      std::vector<float> t(size_t(in * out));
      for (int64_t i = 0; i < in; ++i)
        for (int64_t o = 0; o < out; ++o) t[size_t(i * out + o)] = d[o * in + i];
      file.tensors[e.spec.name] = safetensor_f32(s, t.data());
    } else {
      file.tensors[e.spec.name] = safetensor_f32(s, d);
    }
  }
  return file;
}

}  // namespace tetra

namespace tetra {

namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

void write_text(const fs::path& path, const std::string& text, const std::string& module) {
  write_file_atomically(path.string(),
                        {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}}, module);
}

// LlamaConfig (transformers' configuration_llama.py) for tetra's Llama: SiLU-gated MLP, plain
// RoPE (no rope_scaling), no biases, no dropout in tetra's training. With MoE blocks, a
// MixtralConfig (configuration_mixtral.py): every block's MLP num_local_experts SwiGLU experts,
// full causal attention (no sliding window), no router noise.
ordered_json llama_config(const GptConfig& shape, uint32_t eos_id) {
  ordered_json c;
  const bool moe = shape.moe.experts > 0;
  c["architectures"] = {moe ? "MixtralForCausalLM" : "LlamaForCausalLM"};
  c["model_type"] = moe ? "mixtral" : "llama";
  c["vocab_size"] = shape.vocab_size;
  c["hidden_size"] = shape.d_model;
  c["intermediate_size"] = shape.ffn;
  c["num_hidden_layers"] = shape.n_layer;
  c["num_attention_heads"] = shape.n_head;
  c["num_key_value_heads"] = shape.n_kv_head;
  c["head_dim"] = shape.head_size();
  c["max_position_embeddings"] = shape.max_seq;
  c["hidden_act"] = "silu";
  c["rms_norm_eps"] = shape.norm_eps;
  c["rope_theta"] = shape.rope_theta;
  c["rope_scaling"] = nullptr;
  c["attention_dropout"] = 0.0;
  if (moe) {
    c["sliding_window"] = nullptr;
    c["num_local_experts"] = shape.moe.experts;
    c["num_experts_per_tok"] = shape.moe.top_k;
    c["output_router_logits"] = false;
    c["router_aux_loss_coef"] = shape.moe.aux_loss_coeff;
    c["router_jitter_noise"] = 0.0;
  } else {
    c["attention_bias"] = false;
    c["mlp_bias"] = false;
    c["pretraining_tp"] = 1;
  }
  c["initializer_range"] = 0.02;
  c["use_cache"] = true;
  c["tie_word_embeddings"] = shape.tie_embeddings;
  c["bos_token_id"] = eos_id;
  c["eos_token_id"] = eos_id;
  c["torch_dtype"] = "float32";
  return c;
}

// GPT2Config (transformers' configuration_gpt2.py) for tetra's GPT-2: GELU in tanh form
// (gelu_new), LayerNorm eps 1e-5, the LM head tied to wte, no dropout in tetra's training.
ordered_json gpt2_config(const GptConfig& shape, uint32_t eos_id) {
  ordered_json c;
  const bool moe = shape.moe.experts > 0;
  c["architectures"] = {moe ? "TetraGpt2MoeForCausalLM" : "GPT2LMHeadModel"};
  c["model_type"] = moe ? kMoeModelType : "gpt2";
  c["vocab_size"] = shape.vocab_size;
  c["n_positions"] = shape.max_seq;
  c["n_embd"] = shape.d_model;
  c["n_layer"] = shape.n_layer;
  c["n_head"] = shape.n_head;
  c["n_inner"] = nullptr;  // 4 * n_embd
  c["activation_function"] = "gelu_new";
  c["resid_pdrop"] = 0.0;
  c["embd_pdrop"] = 0.0;
  c["attn_pdrop"] = 0.0;
  c["layer_norm_epsilon"] = 1e-5;
  c["initializer_range"] = 0.02;
  c["scale_attn_weights"] = true;
  c["use_cache"] = true;
  c["tie_word_embeddings"] = true;
  c["bos_token_id"] = eos_id;
  c["eos_token_id"] = eos_id;
  c["torch_dtype"] = "float32";
  if (moe) {
    c["num_local_experts"] = shape.moe.experts;
    c["num_experts_per_tok"] = shape.moe.top_k;
    c["moe_every"] = shape.moe.every;
    c["capacity_factor"] = shape.moe.capacity_factor;
    c["router_aux_loss_coef"] = shape.moe.aux_loss_coeff;
    c["router_z_loss_coef"] = shape.moe.z_loss_coeff;
  }
  return c;
}

ordered_json tokenizer_config(const GptConfig& shape, const HfTokenizerFiles& tok) {
  ordered_json c;
  c["tokenizer_class"] = "GPT2Tokenizer";
  c["bos_token"] = tok.eos_token;
  c["eos_token"] = tok.eos_token;
  c["unk_token"] = tok.eos_token;
  c["add_bos_token"] = false;
  c["add_prefix_space"] = false;
  c["clean_up_tokenization_spaces"] = false;
  c["model_max_length"] = shape.max_seq;
  c["added_tokens_decoder"][std::to_string(tok.eos_id)] = {
      {"content", tok.eos_token}, {"lstrip", false},      {"normalized", false},
      {"rstrip", false},          {"single_word", false}, {"special", true}};
  return c;
}

// The staging folder of an export into `target` (core/staged_dir.h), beside it: named for this
// host and process, so that two exports into one target never share one, and one left by a
// killed export of this host with this pid (which is gone, since the pid is ours) is ours to
// replace. The staging folders of other exports from this host whose process is gone were left by
// a killed export: incomplete copies, removed. Any other (a live export, another host's) is left
// alone.
fs::path model_dir_staging(const fs::path& target, const std::string& module) {
  std::error_code ec;
  fs::create_directories(target.parent_path(), ec);
  TETRA_CHECK(fs::is_directory(target.parent_path(), ec),
              "[{}] cannot create the folder {} for the model directory ({}); check the path "
              "and permissions",
              module, target.parent_path().string(), ec.message());
  const std::string prefix = fmt::format(".{}.export-{}-", target.filename().string(), host_name());
  for (auto it = fs::directory_iterator(target.parent_path(), ec);
       !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    long pid = 0;
    const char* digits = name.data() + prefix.size();
    const auto [end, err] = std::from_chars(digits, name.data() + name.size(), pid);
    if (err != std::errc() || end != name.data() + name.size() || pid <= 0) continue;
    if (pid != ::getpid() && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH) {
      std::error_code rm;
      fs::remove_all(it->path(), rm);
      if (!rm) log_info("[{}] removed {}, left by an export that was killed", module, name);
    }
  }
  return target.parent_path() / fmt::format("{}{}", prefix, static_cast<long>(::getpid()));
}

}  // namespace

bool is_model_dir(const std::string& path) {
  std::error_code ec;
  return (!path.empty() && path.back() == '/') || fs::is_directory(path, ec);
}

void check_hf_model_dir_target(const std::string& dir, const std::string& module) {
  const fs::path d(dir);
  std::error_code ec;
  TETRA_CHECK(resolved_path(dir).has_relative_path(),
              "[{}] {} is the root folder; choose a new folder for the model directory", module,
              dir);
  if (!fs::exists(d, ec)) return;
  TETRA_CHECK(fs::is_directory(d, ec), "[{}] {} exists and is not a folder; choose a folder",
              module, dir);
  // Every entry in the way, sorted (hidden ones last: a visible file is the likelier mistake to
  // name), so that the message is the same on every file system. An entry with a model file's name
  // that is not a file (a folder named config.json) is in the way too: no file can replace it.
  std::vector<std::pair<std::string, bool>> foreign;  // name, whether it is one of ours
  for (auto it = fs::directory_iterator(d, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const bool ours = std::find(std::begin(kHfModelFiles), std::end(kHfModelFiles), name) !=
                      std::end(kHfModelFiles);
    if (!ours || !it->is_regular_file(ec)) foreign.emplace_back(name, ours);
  }
  TETRA_CHECK(!ec, "[{}] cannot list {} ({}); check its permissions", module, dir, ec.message());
  if (foreign.empty()) return;
  std::sort(foreign.begin(), foreign.end(), [](const auto& a, const auto& b) {
    return std::make_pair(a.first[0] == '.', a.first) < std::make_pair(b.first[0] == '.', b.first);
  });
  const auto& [name, ours] = foreign[0];
  const std::string more =
      foreign.size() > 1 ? fmt::format(" (and {} more)", foreign.size() - 1) : "";
  fail(
      "[{}] {} holds '{}'{}, which {}; the folder is replaced as a whole, so choose a new or empty "
      "folder, or move '{}' away (a model directory holds only {})",
      module, dir, name, more,
      ours ? "is not a regular file (a model directory's file of that name cannot replace it)"
           : "is not part of a model directory",
      name, fmt::join(kHfModelFiles, ", "));
}

void save_hf_model_dir(const std::string& dir, const GptConfig& shape,
                       const SafeTensorsFile& weights, const HfTokenizerFiles& tokenizer,
                       const std::string& module) {
  TETRA_CHECK(!shape.llama() || shape.moe.experts == 0 || shape.moe.every == 1,
              "[{}] a Llama model with MoE blocks every {} blocks has no Hugging Face class: "
              "MixtralForCausalLM routes every block; train it with model.moe_every=1 to export "
              "it as Mixtral, or write a tetra checkpoint or a .safetensors file instead",
              module, shape.moe.every);
  check_hf_model_dir_target(dir, module);
  const fs::path target = resolved_path(dir);
  StagedDir staged(target, model_dir_staging(target, module), module, "model directory");
  const fs::path& d = staged.path();
  try {
    write_text(d / "tokenizer.json", tokenizer.tokenizer_json, module);
    write_text(d / "tokenizer_config.json", tokenizer_config(shape, tokenizer).dump(2) + "\n",
               module);
    const ordered_json generation = {{"bos_token_id", tokenizer.eos_id},
                                     {"eos_token_id", tokenizer.eos_id}};
    write_text(d / "generation_config.json", generation.dump(2) + "\n", module);
    write_safetensors((d / "model.safetensors").string(), weights);
    const ordered_json config = shape.llama() ? llama_config(shape, tokenizer.eos_id)
                                              : gpt2_config(shape, tokenizer.eos_id);
    write_text(d / "config.json", config.dump(2) + "\n", module);
    // Again at the end: a file put into the target while this one was written would be deleted
    // with the old directory.
    check_hf_model_dir_target(dir, module);
  } catch (const Error& e) {
    // Paths in the message are inside the staging folder, which the user never sees.
    fail("{} (while writing the new model directory beside {}; {} is unchanged)", e.what(), dir,
         dir);
  }
  staged.commit();
}

bool is_model_dir_target(const std::string& path) { return !path.empty() && path.back() == '/'; }

std::string model_weights_path(const std::string& path, const std::string& module) {
  if (!is_model_dir(path)) return path;
  const fs::path weights = fs::path(path) / "model.safetensors";
  std::error_code ec;
  TETRA_CHECK(fs::is_regular_file(weights, ec),
              "[{}] {} is a folder without model.safetensors; give a Hugging Face model "
              "directory (tetra export --hf writes one) or a .safetensors file",
              module, path);
  return weights.string();
}

std::vector<std::string> model_dir_overrides(const std::string& dir, const std::string& module) {
  const HfModelConfig m = read_hf_model_config((fs::path(dir) / "config.json").string(), module);
  if (const auto* l = std::get_if<HfLlamaConfig>(&m)) {
    std::vector<std::string> o = {"model.arch=llama",
                                  "model.vocab_size=" + std::to_string(l->vocab_size),
                                  "model.n_layer=" + std::to_string(l->num_hidden_layers),
                                  "model.n_head=" + std::to_string(l->num_attention_heads),
                                  "model.n_kv_head=" + std::to_string(l->num_key_value_heads),
                                  "model.d_model=" + std::to_string(l->hidden_size),
                                  "model.ffn=" + std::to_string(l->intermediate_size),
                                  "model.max_seq=" + std::to_string(l->max_position_embeddings),
                                  fmt::format("model.rope_theta={}", l->rope_theta),
                                  fmt::format("model.norm_eps={}", l->rms_norm_eps),
                                  fmt::format("model.tie_embeddings={}", l->tie_word_embeddings),
                                  "model.moe_experts=" + std::to_string(l->num_local_experts)};
    if (l->num_local_experts > 0) {
      // Mixtral: every block routed, every token reaching its experts (no capacity).
      o.push_back("model.moe_top_k=" + std::to_string(l->num_experts_per_tok));
      o.push_back("model.moe_every=1");
      o.push_back("moe.capacity_factor=0");
      o.push_back(fmt::format("moe.aux_loss_coeff={}", l->router_aux_loss_coef));
    }
    return o;
  }
  const HfGpt2Config& c = std::get<HfGpt2Config>(m);
  std::vector<std::string> o = {"model.arch=gpt2",
                                "model.vocab_size=" + std::to_string(c.vocab_size),
                                "model.n_layer=" + std::to_string(c.n_layer),
                                "model.n_head=" + std::to_string(c.n_head),
                                "model.d_model=" + std::to_string(c.n_embd),
                                "model.max_seq=" + std::to_string(c.n_positions),
                                "model.moe_experts=" + std::to_string(c.num_local_experts)};
  if (c.num_local_experts > 0) {
    o.push_back("model.moe_top_k=" + std::to_string(c.num_experts_per_tok));
    o.push_back("model.moe_every=" + std::to_string(c.moe_every));
    o.push_back(fmt::format("moe.capacity_factor={}", c.capacity_factor));
    o.push_back(fmt::format("moe.aux_loss_coeff={}", c.router_aux_loss_coef));
    o.push_back(fmt::format("moe.z_loss_coeff={}", c.router_z_loss_coef));
  }
  return o;
}

}  // namespace tetra
