#include "model/gpt_io.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/read_file.h"
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
  // Causal-mask buffers that older GPT-2 exports carry, and the tied LM head.
  return ends(".attn.bias") || ends(".attn.masked_bias") || name == "lm_head.weight";
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
                           const ParamStore* model) {
  SafeTensorsFile file = read_safetensors(path);
  std::map<std::string, const SafeTensor*> by_name;
  std::vector<std::string> unknown;
  for (const auto& [name, t] : file.tensors) {
    std::string n = name.rfind("transformer.", 0) == 0 ? name : "transformer." + name;
    if (store.find(n) >= 0) {
      by_name[n] = &t;
    } else if (!ignorable(name) && !(model && model->find(n) >= 0)) {
      unknown.push_back(name);
    }
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

// GPT2Config (transformers' configuration_gpt2.py) for tetra's GPT-2: GELU in tanh form
// (gelu_new), LayerNorm eps 1e-5, the LM head tied to wte, no dropout in tetra's training.
ordered_json gpt2_config(const GptConfig& shape, uint32_t eos_id) {
  ordered_json c;
  c["architectures"] = {"GPT2LMHeadModel"};
  c["model_type"] = "gpt2";
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

}  // namespace

bool is_model_dir(const std::string& path) {
  std::error_code ec;
  return (!path.empty() && path.back() == '/') || fs::is_directory(path, ec);
}

void check_hf_model_dir_target(const std::string& dir, const std::string& module) {
  const fs::path d(dir);
  std::error_code ec;
  if (fs::exists(d, ec)) {
    TETRA_CHECK(fs::is_directory(d, ec), "[{}] {} exists and is not a folder; choose a folder",
                module, dir);
    for (const auto& entry : fs::directory_iterator(d, ec)) {
      const std::string name = entry.path().filename().string();
      const bool ours = std::find(std::begin(kHfModelFiles), std::end(kHfModelFiles), name) !=
                        std::end(kHfModelFiles);
      TETRA_CHECK(ours,
                  "[{}] {} holds '{}', which is not part of a model directory; choose a new or "
                  "empty folder, or move '{}' away (a model directory holds only {})",
                  module, dir, name, name, fmt::join(kHfModelFiles, ", "));
    }
  }
}

void save_hf_model_dir(const std::string& dir, const GptConfig& shape,
                       const SafeTensorsFile& weights, const HfTokenizerFiles& tokenizer,
                       const std::string& module) {
  check_hf_model_dir_target(dir, module);
  const fs::path d(dir);
  std::error_code ec;
  fs::create_directories(d, ec);
  TETRA_CHECK(!ec, "[{}] cannot create the model folder {} ({}); check the path and permissions",
              module, dir, ec.message());
  write_text(d / "tokenizer.json", tokenizer.tokenizer_json, module);
  write_text(d / "tokenizer_config.json", tokenizer_config(shape, tokenizer).dump(2) + "\n",
             module);
  const ordered_json generation = {{"bos_token_id", tokenizer.eos_id},
                                   {"eos_token_id", tokenizer.eos_id}};
  write_text(d / "generation_config.json", generation.dump(2) + "\n", module);
  write_safetensors((d / "model.safetensors").string(), weights);
  // Last: a folder with config.json is a complete model for from_pretrained.
  write_text(d / "config.json", gpt2_config(shape, tokenizer.eos_id).dump(2) + "\n", module);
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
  const std::string path = (fs::path(dir) / "config.json").string();
  const std::string text =
      read_small_file(path, 1 << 20, module, "a model config.json",
                      "give a Hugging Face model directory (tetra export --hf writes one)");
  nlohmann::json c;
  try {
    c = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("[{}] {}: not valid JSON ({}); the file is corrupt or truncated", module, path, e.what());
  }
  auto field = [&](const char* key) -> const nlohmann::json& {
    TETRA_CHECK(c.is_object() && c.contains(key), "[{}] {}: no \"{}\"; is this a GPT-2 config?",
                module, path, key);
    return c[key];
  };
  auto require = [&](const char* key, const nlohmann::json& want) {
    const nlohmann::json& v = field(key);
    const bool same =
        v.is_number() && want.is_number() ? v.get<double>() == want.get<double>() : v == want;
    TETRA_CHECK(same, "[{}] {}: {} is {}, but tetra's GPT-2 needs {}; this model cannot be loaded",
                module, path, key, v.dump(), want.dump());
  };
  auto positive = [&](const char* key) {
    const nlohmann::json& v = field(key);
    TETRA_CHECK(v.is_number_integer() && v.get<int64_t>() > 0 && v.get<int64_t>() < (1 << 30),
                "[{}] {}: {} is {}; expected a positive integer", module, path, key, v.dump());
    return std::to_string(v.get<int64_t>());
  };
  require("model_type", "gpt2");
  require("activation_function", "gelu_new");
  require("layer_norm_epsilon", 1e-5);
  if (c.contains("tie_word_embeddings")) require("tie_word_embeddings", true);
  return {"model.vocab_size=" + positive("vocab_size"), "model.n_layer=" + positive("n_layer"),
          "model.n_head=" + positive("n_head"), "model.d_model=" + positive("n_embd"),
          "model.max_seq=" + positive("n_positions")};
}

std::vector<std::string> safetensors_shape_overrides(const std::string& path,
                                                     const std::string& module) {
  SafeTensorsFile f = read_safetensors(path);
  auto find = [&](const std::string& name) -> const SafeTensor& {
    for (const std::string& n : {name, "transformer." + name}) {
      auto it = f.tensors.find(n);
      if (it != f.tensors.end() && it->second.shape.size() == 2) return it->second;
    }
    fail("[{}] {}: no 2-D tensor '{}'; is this a GPT-2 safetensors file?", module, path, name);
  };
  const SafeTensor& wte = find("wte.weight");
  const SafeTensor& wpe = find("wpe.weight");
  std::set<int> layers;
  const std::regex block(R"(^(transformer\.)?h\.(\d+)\.)");
  for (const auto& [name, t] : f.tensors) {
    std::smatch m;
    if (std::regex_search(name, m, block)) layers.insert(std::stoi(m[2].str()));
  }
  TETRA_CHECK(!layers.empty(), "[{}] {}: no transformer blocks (h.N.*) found", module, path);
  return {"model.vocab_size=" + std::to_string(wte.shape[0]),
          "model.d_model=" + std::to_string(wte.shape[1]),
          "model.max_seq=" + std::to_string(wpe.shape[0]),
          "model.n_layer=" + std::to_string(layers.size())};
}

}  // namespace tetra
