// One rank's part of a checkpoint as every writer lays it out (the disk writer, the memory store):
// a safetensors file holding one 1-D F32 tensor per part, in order, and the fragment that lists
// its chunks for the manifest; merge_fragments assembles the manifest from every rank's fragment.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"

namespace tetra::ckpt {

struct ShardLayout {
  struct Part {
    std::string kind, name;
    Shape shape;
    Slice slice;
    int64_t first = 0, count = 0;
    size_t at = 0;  // element offset of its data in the file's data
  };
  std::vector<Part> parts;
  size_t elements = 0;
  std::string header;       // the safetensors header, padded to a multiple of 8 bytes
  uint64_t data_start = 0;  // 8 + header.size(): where the data begins in the file

  /** The layout of `sources` in the file of step `step`. */
  static ShardLayout of(const std::vector<Source>& sources, int64_t step);
  uint64_t file_bytes() const { return data_start + elements * sizeof(float); }
  /** Writes the file's first data_start bytes (the header's length and the header) to `file`. */
  void write_header(std::byte* file) const;
  /** The fragment of writer rank `rank`'s file, whose data (`elements` floats, in part order) is
   *  `data`: {"rank", "state": rank_state, "chunks": [...each with its xxh3]}. */
  nlohmann::json fragment(const float* data, int rank, const nlohmann::json& rank_state) const;
};

/** The manifest of step `step` (as manifest.json holds it) from `header` (trainer, layout, config,
 *  model, model_shape) and the fragment of every writer rank, in rank order; `bytes` gets the
 *  data bytes over every chunk. */
nlohmann::json merge_fragments(nlohmann::json header, int64_t step,
                               const std::vector<nlohmann::json>& fragments, uint64_t* bytes);

}  // namespace tetra::ckpt
