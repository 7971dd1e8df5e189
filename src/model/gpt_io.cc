#include "model/gpt_io.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <set>

#include "core/error.h"

namespace tetra {

namespace {

// The file-side shape of a parameter: Conv1D transposed, wte without padding rows.
Shape file_shape(const Gpt& model, const Param& p) {
  Shape s = p.view.shape;
  if (p.conv1d) std::swap(s[0], s[1]);
  if (p.padded_rows) s[0] = model.config().vocab_size;
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

}  // namespace

void load_gpt_safetensors(Gpt& model, const std::string& path) {
  SafeTensorsFile file = read_safetensors(path);
  std::map<std::string, const SafeTensor*> by_name;
  std::vector<std::string> unknown;
  std::set<std::string> known;
  for (const auto& p : model.params()) known.insert(p.view.name);
  for (const auto& [name, t] : file.tensors) {
    std::string n = name.rfind("transformer.", 0) == 0 ? name : "transformer." + name;
    if (known.count(n)) {
      by_name[n] = &t;
    } else if (!ignorable(name)) {
      unknown.push_back(name);
    }
  }
  TETRA_CHECK(unknown.empty(),
              "[init] {}: tensors not in a GPT-2 with this config: {}; is model.n_layer right?",
              path, fmt::join(unknown, ", "));
  std::vector<std::string> problems;
  for (const auto& p : model.params()) {
    auto it = by_name.find(p.view.name);
    if (it == by_name.end()) {
      problems.push_back(fmt::format("missing '{}'", p.view.name));
      continue;
    }
    Shape want = file_shape(model, p);
    if (it->second->shape != want) {
      problems.push_back(fmt::format("'{}' has shape {} but this model needs {}", p.view.name,
                                     shape_str(it->second->shape), shape_str(want)));
    }
  }
  TETRA_CHECK(problems.empty(),
              "[init] {} does not match the model ({}): {}. Set model.* to the file's shape.", path,
              model.config().describe(), fmt::join(problems, "; "));

  for (auto& p : model.params()) {
    std::vector<float> v = by_name.at(p.view.name)->to_f32();
    float* d = model.data_of(p);
    if (p.conv1d) {
      int64_t out = p.view.shape[0], in = p.view.shape[1];  // file is (in, out)
      for (int64_t i = 0; i < in; ++i)
        for (int64_t o = 0; o < out; ++o) d[o * in + i] = v[size_t(i * out + o)];
    } else {
      std::copy(v.begin(), v.end(), d);
      if (p.padded_rows) std::fill(d + v.size(), d + p.view.numel(), 0.0f);
    }
  }
}

SafeTensorsFile gpt_to_safetensors(const Gpt& model, const float* flat) {
  SafeTensorsFile file;
  file.metadata["format"] = "pt";
  for (const auto& p : model.params()) {
    const float* d = flat + p.view.offset;
    Shape s = file_shape(model, p);
    if (p.conv1d) {
      int64_t out = p.view.shape[0], in = p.view.shape[1];
      std::vector<float> t(size_t(in * out));
      for (int64_t i = 0; i < in; ++i)
        for (int64_t o = 0; o < out; ++o) t[size_t(i * out + o)] = d[o * in + i];
      file.tensors[p.view.name] = safetensor_f32(s, t.data());
    } else {
      file.tensors[p.view.name] = safetensor_f32(s, d);
    }
  }
  return file;
}

}  // namespace tetra
