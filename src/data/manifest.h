// manifest.json of a dataset written by `tetra data prepare` (layout: docs/data.md). Reading it
// validates every field a consumer relies on; training uses it to verify shard checksums.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tetra {

struct ManifestShard {
  std::string file;  // a plain file name, in the manifest's folder
  uint64_t tokens = 0;
  int version = 1;   // shard version: 1 = uint16 tokens, 7 (2 before) = uint32
  std::string xxh3;  // of the whole file, 16 lowercase hex digits
};

struct Manifest {
  std::string tokenizer_name;
  std::string tokenizer_file;
  std::string tokenizer_hash;
  uint64_t vocab_size = 0;
  uint64_t eot_token = 0;
  std::vector<ManifestShard> train;
  std::vector<ManifestShard> val;

  /** The entry of the shard named `file` in either split, or nullptr. */
  const ManifestShard* find(std::string_view file) const;
};

/** Parses and validates manifest text; origin names it in errors ("[data] <origin>: ..."). */
Manifest parse_manifest(std::string_view text, const std::string& origin);

/** Reads and validates DIR/manifest.json. */
Manifest read_manifest(const std::string& path);

}  // namespace tetra
