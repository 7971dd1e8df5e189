#include "ckpt/shard.h"

#include <cstring>

#include "ckpt/checkpoint_files.h"

#ifndef TETRA_VERSION
#define TETRA_VERSION "unknown"
#endif

namespace tetra::ckpt {

using json = nlohmann::json;

ShardLayout ShardLayout::of(const std::vector<Source>& sources, int64_t step) {
  ShardLayout l;
  for (const Source& s : sources) {
    l.parts.push_back({s.kind, s.tensor->spec.name, s.tensor->spec.shape, s.tensor->spec.slice,
                       s.first, s.count, l.elements});
    l.elements += size_t(s.count);
  }
  json st = json::object();
  for (const Part& p : l.parts) {
    st[fmt::format("{}:{}:{}:{}", p.kind, p.name, p.slice.offset, p.first)] = {
        {"dtype", "F32"},
        {"shape", {p.count}},
        {"data_offsets", {p.at * sizeof(float), (p.at + size_t(p.count)) * sizeof(float)}}};
  }
  st["__metadata__"] = {{"format", "tetra-checkpoint-shard"}, {"step", std::to_string(step)}};
  l.header = st.dump();
  l.header.append((8 - l.header.size() % 8) % 8, ' ');
  l.data_start = 8 + l.header.size();
  return l;
}

void ShardLayout::write_header(std::byte* file) const {
  const uint64_t length = header.size();
  std::memcpy(file, &length, sizeof length);
  std::memcpy(file + sizeof length, header.data(), header.size());
}

json ShardLayout::fragment(const float* data, int rank, const json& rank_state) const {
  json chunks = json::array();
  for (const Part& p : parts) {
    chunks.push_back({{"kind", p.kind},
                      {"name", p.name},
                      {"shape", p.shape},
                      {"slice", detail::slice_json(p.slice)},
                      {"first", p.first},
                      {"count", p.count},
                      {"file", detail::rank_file(rank)},
                      {"offset", data_start + p.at * sizeof(float)},
                      {"xxh3", detail::hex64(detail::checksum(data + p.at, p.count))}});
  }
  return {{"rank", rank}, {"state", rank_state}, {"chunks", std::move(chunks)}};
}

json merge_fragments(json header, int64_t step, const std::vector<json>& fragments,
                     uint64_t* bytes) {
  json ranks = json::array();
  json tensors = json::object();
  uint64_t total = 0;
  for (size_t r = 0; r < fragments.size(); ++r) {
    const json& f = fragments[r];
    ranks.push_back({{"rank", int(r)}, {"state", f.at("state")}});
    for (const json& c : f.at("chunks")) {
      total += c.at("count").get<uint64_t>() * sizeof(float);
      json& t = tensors[c.at("name").get<std::string>()];
      t["shape"] = c.at("shape");
      for (const char* kind : kKinds) {
        if (!t.contains("chunks") || !t["chunks"].contains(kind)) t["chunks"][kind] = json::array();
      }
      json chunk = c;
      chunk.erase("kind");
      chunk.erase("name");
      chunk.erase("shape");
      t["chunks"][c.at("kind").get<std::string>()].push_back(std::move(chunk));
    }
  }
  json manifest = std::move(header);
  manifest["format"] = detail::kFormat;
  manifest["version"] = detail::kFormatVersion;
  manifest["tetra_version"] = TETRA_VERSION;
  manifest["step"] = step;
  manifest["ranks"] = std::move(ranks);
  manifest["tensors"] = std::move(tensors);
  if (bytes) *bytes = total;
  return manifest;
}

}  // namespace tetra::ckpt
