#include "model/gpt_io.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <map>
#include <set>

#include "core/error.h"

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

void load_safetensors_into(ParamStore& store, const std::string& path,
                           const std::string& describe) {
  SafeTensorsFile file = read_safetensors(path);
  std::map<std::string, const SafeTensor*> by_name;
  std::vector<std::string> unknown;
  for (const auto& [name, t] : file.tensors) {
    std::string n = name.rfind("transformer.", 0) == 0 ? name : "transformer." + name;
    if (store.find(n) >= 0) {
      by_name[n] = &t;
    } else if (!ignorable(name)) {
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
                                     parallel::TensorParallel* tp) {
  SafeTensorsFile file;
  file.metadata["format"] = "pt";
  std::vector<float> parts, whole;
  for (const ParamEntry& e : store.tensors()) {
    const float* d = flat + e.offset;
    if (e.spec.slice.dim >= 0) {
      // Rank r of the group holds the slice at offset r·extent: gather every rank's, place each
      // element at its global index.
      TETRA_CHECK(tp && tp->size() * e.spec.slice.extent * e.spec.slice.parts ==
                            e.spec.shape[size_t(e.spec.slice.dim)],
                  "[save] internal: '{}' is a slice and no tensor-parallel group assembles it",
                  e.spec.name);
      const size_t n = size_t(e.numel());
      parts.resize(n * size_t(tp->size()));
      whole.resize(size_t(shape_numel(e.spec.shape)));
      tp->all_gather(d, parts.data(), n);
      ParamEntry r = e;
      for (int q = 0; q < tp->size(); ++q) {
        r.spec.slice.offset = q * e.spec.slice.extent;
        for (size_t i = 0; i < n; ++i) whole[size_t(r.global_index(int64_t(i)))] = parts[q * n + i];
      }
      d = whole.data();
    }
    const Shape s = file_shape(e);
    const int64_t n = shape_numel(s);
    if (check_finite) {
      if (int64_t bad = first_non_finite(d, n); bad >= 0) {
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
