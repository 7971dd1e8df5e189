#include "data/manifest.h"

#include <limits>
#include <set>

#include "core/error.h"
#include "core/json_strict.h"
#include "core/read_file.h"

namespace tetra {

namespace {

using nlohmann::json;

// A manifest lists a few numbers per shard; even a million shards stay far below this.
constexpr uintmax_t kMaxManifestBytes = 256ull << 20;

// The fix for a damaged manifest, ending the messages that have no more specific one.
constexpr const char* kRerun = "; the manifest is damaged, re-run tetra data prepare";

bool is_hex16(const std::string& s) {
  if (s.size() != 16) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// Field accessors that name the field's path in their errors.
class Fields {
 public:
  explicit Fields(const std::string& origin) : origin_(origin) {}

  const json& object(const json& parent, const std::string& key, const std::string& where) const {
    const json& v = member(parent, key, where);
    TETRA_CHECK(v.is_object(), "[data] {}: {}{} is {}; expected an object{}", origin_, where, key,
                json_excerpt(v), kRerun);
    return v;
  }
  const json& array(const json& parent, const std::string& key, const std::string& where) const {
    const json& v = member(parent, key, where);
    TETRA_CHECK(v.is_array(), "[data] {}: {}{} is {}; expected a list{}", origin_, where, key,
                json_excerpt(v), kRerun);
    return v;
  }
  std::string string(const json& parent, const std::string& key, const std::string& where) const {
    const json& v = member(parent, key, where);
    TETRA_CHECK(v.is_string(), "[data] {}: {}{} is {}; expected a string{}", origin_, where, key,
                json_excerpt(v), kRerun);
    return v.get<std::string>();
  }
  uint64_t uint(const json& parent, const std::string& key, const std::string& where) const {
    const json& v = member(parent, key, where);
    TETRA_CHECK(v.is_number_unsigned(), "[data] {}: {}{} is {}; expected a non-negative integer{}",
                origin_, where, key, json_excerpt(v), kRerun);
    return v.get<uint64_t>();
  }

 private:
  const json& member(const json& parent, const std::string& key, const std::string& where) const {
    auto it = parent.find(key);
    TETRA_CHECK(it != parent.end(),
                "[data] {}: {}{} is missing; the manifest is damaged or was not written by tetra "
                "data prepare: re-run tetra data prepare",
                origin_, where, key);
    return *it;
  }
  const std::string& origin_;
};

std::vector<ManifestShard> read_split(const Fields& f, const json& splits, const std::string& name,
                                      const std::string& origin) {
  const json& split = f.object(splits, name, "splits.");
  const std::string where = "splits." + name + ".";
  const uint64_t tokens = f.uint(split, "tokens", where);
  const json& list = f.array(split, "shards", where);
  std::vector<ManifestShard> shards;
  uint64_t sum = 0;
  for (size_t k = 0; k < list.size(); ++k) {
    const std::string at = fmt::format("{}shards[{}].", where, k);
    TETRA_CHECK(list[k].is_object(), "[data] {}: {} is {}; expected an object{}", origin,
                at.substr(0, at.size() - 1), json_excerpt(list[k]), kRerun);
    ManifestShard s;
    s.file = f.string(list[k], "file", at);
    TETRA_CHECK(!s.file.empty() && s.file != "." && s.file != ".." &&
                    s.file.find('/') == std::string::npos && s.file.find('\0') == std::string::npos,
                "[data] {}: {}file is \"{}\"; expected a file name in the manifest's folder{}",
                origin, at, s.file, kRerun);
    s.tokens = f.uint(list[k], "tokens", at);
    TETRA_CHECK(s.tokens <= uint64_t(std::numeric_limits<int32_t>::max()),
                "[data] {}: {}tokens is {}; a shard holds at most 2147483647 tokens{}", origin, at,
                s.tokens, kRerun);
    const uint64_t version = f.uint(list[k], "version", at);
    TETRA_CHECK(version == 1 || version == 2 || version == 7,
                "[data] {}: {}version is {}; expected 1 (uint16 tokens), 7 (uint32 tokens) or 2 "
                "(uint32 tokens, earlier tetra){}",
                origin, at, version, kRerun);
    s.version = int(version);
    s.xxh3 = f.string(list[k], "xxh3", at);
    TETRA_CHECK(is_hex16(s.xxh3), "[data] {}: {}xxh3 is \"{}\"; expected 16 lowercase hex digits{}",
                origin, at, s.xxh3, kRerun);
    sum += s.tokens;  // at most 2^31 per shard and far fewer shards than 2^32: no overflow
    shards.push_back(std::move(s));
  }
  TETRA_CHECK(sum == tokens, "[data] {}: splits.{}.tokens is {} but its shards hold {} tokens{}",
              origin, name, tokens, sum, kRerun);
  return shards;
}

}  // namespace

const ManifestShard* Manifest::find(std::string_view file) const {
  for (const auto* split : {&train, &val}) {
    for (const auto& s : *split) {
      if (s.file == file) return &s;
    }
  }
  return nullptr;
}

Manifest parse_manifest(std::string_view text, const std::string& origin) {
  TETRA_CHECK(!text.empty(), "[data] {}: the manifest is empty; re-run tetra data prepare", origin);
  const json root = parse_json_strict(text, "data", origin);
  TETRA_CHECK(root.is_object(), "[data] {}: the manifest is {}; expected a JSON object{}", origin,
              json_excerpt(root), kRerun);
  const Fields f(origin);
  const json format = root.value("format", json());
  TETRA_CHECK(format == "tetra-dataset",
              "[data] {}: \"format\" is {}, not \"tetra-dataset\"; this is not a manifest written "
              "by tetra data prepare",
              origin, format.is_null() ? "missing" : json_excerpt(format));
  const uint64_t version = f.uint(root, "version", "");
  TETRA_CHECK(version == 1,
              "[data] {}: manifest version {} is not supported (this tetra reads version 1); "
              "re-run tetra data prepare",
              origin, version);

  Manifest m;
  const json& tok = f.object(root, "tokenizer", "");
  m.tokenizer_name = f.string(tok, "name", "tokenizer.");
  m.tokenizer_file = f.string(tok, "file", "tokenizer.");
  m.tokenizer_hash = f.string(tok, "hash", "tokenizer.");
  TETRA_CHECK(is_hex16(m.tokenizer_hash),
              "[data] {}: tokenizer.hash is \"{}\"; expected 16 lowercase hex digits{}", origin,
              m.tokenizer_hash, kRerun);
  m.vocab_size = f.uint(tok, "vocab_size", "tokenizer.");
  m.eot_token = f.uint(tok, "eot_token", "tokenizer.");
  TETRA_CHECK(m.vocab_size > 0 && m.eot_token < m.vocab_size,
              "[data] {}: tokenizer.eot_token {} is not below tokenizer.vocab_size {}{}", origin,
              m.eot_token, m.vocab_size, kRerun);

  const json& splits = f.object(root, "splits", "");
  m.train = read_split(f, splits, "train", origin);
  m.val = read_split(f, splits, "val", origin);
  // One format per dataset: llm.c's DataLoader aborts on a uint16 shard beside uint32 ones.
  const ManifestShard* narrow = nullptr;
  const ManifestShard* wide = nullptr;
  for (const auto* split : {&m.train, &m.val}) {
    for (const auto& s : *split) {
      const ManifestShard*& first = s.version == 1 ? narrow : wide;
      if (first == nullptr) first = &s;
    }
  }
  TETRA_CHECK(narrow == nullptr || wide == nullptr,
              "[data] {}: the dataset mixes shard formats: {} is version 1 (uint16 tokens) but {} "
              "is version {} (uint32 tokens); llm.c's DataLoader aborts on a mix: re-run tetra "
              "data prepare, which writes every shard of a dataset in one format",
              origin, narrow ? narrow->file : "", wide ? wide->file : "", wide ? wide->version : 0);
  std::set<std::string_view> names;
  for (const auto* split : {&m.train, &m.val}) {
    for (const auto& s : *split) {
      TETRA_CHECK(names.insert(s.file).second, "[data] {}: shard {} is listed twice{}", origin,
                  s.file, kRerun);
    }
  }
  uint64_t total = 0;
  for (const auto* split : {&m.train, &m.val}) {
    for (const auto& s : *split) total += s.tokens;
  }
  const uint64_t total_tokens = f.uint(root, "total_tokens", "");
  TETRA_CHECK(total_tokens == total,
              "[data] {}: total_tokens is {} but the splits hold {} tokens{}", origin, total_tokens,
              total, kRerun);
  return m;
}

Manifest read_manifest(const std::string& path) {
  return parse_manifest(
      read_small_file(path, kMaxManifestBytes, "data", "a manifest", "re-run tetra data prepare"),
      path);
}

}  // namespace tetra
