// Reading Hugging Face tokenizer.json files (byte-level BPE, as GPT-2's).
#include <nlohmann/json.hpp>
#include <optional>

#include "core/error.h"
#include "core/json_strict.h"
#include "core/log.h"
#include "core/read_file.h"
#include "data/byte_level.h"
#include "data/tokenizer.h"

namespace tetra {

namespace {

using nlohmann::json;

// A "type"-like string field, or "" when absent or not a string.
std::string string_field(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

bool has_component(const json& j, const char* type, const char* list_key) {
  if (!j.is_object()) return false;
  if (string_field(j, "type") == type) return true;
  auto list = j.find(list_key);
  if (list != j.end() && list->is_array()) {
    for (const auto& c : *list) {
      if (has_component(c, type, list_key)) return true;
    }
  }
  return false;
}

bool adds_prefix_space(const json& j) {
  if (!j.is_object()) return false;
  if (string_field(j, "type") == "ByteLevel") {
    auto it = j.find("add_prefix_space");
    return it != j.end() && it->is_boolean() && it->get<bool>();
  }
  auto list = j.find("pretokenizers");
  if (list != j.end() && list->is_array()) {
    for (const auto& c : *list) {
      if (adds_prefix_space(c)) return true;
    }
  }
  return false;
}

std::unique_ptr<Tokenizer> tokenizer_from_json(const std::string& path, const json& root) {
  TETRA_CHECK(root.is_object() && root.contains("model") && root["model"].is_object(),
              "[tokenizer] {}: no \"model\" object; this is not a Hugging Face tokenizer.json",
              path);
  const json& model = root["model"];
  TETRA_CHECK(!model.contains("type") || model["type"].is_string(),
              "[tokenizer] {}: model.type is {}; expected a string such as \"BPE\"", path,
              json_excerpt(model["type"]));
  const std::string type = model.contains("type") ? model["type"].get<std::string>() : "BPE";
  TETRA_CHECK(type == "BPE",
              "[tokenizer] {}: model type is \"{}\"; tetra reads byte-level BPE tokenizers "
              "(GPT-2 style) only",
              path, type);
  const json pre = root.value("pre_tokenizer", json());
  const json dec = root.value("decoder", json());
  TETRA_CHECK(has_component(pre, "ByteLevel", "pretokenizers") ||
                  has_component(dec, "ByteLevel", "decoders"),
              "[tokenizer] {}: neither the pre_tokenizer nor the decoder is ByteLevel; tetra "
              "reads byte-level BPE tokenizers (GPT-2 style) only",
              path);
  TETRA_CHECK(!adds_prefix_space(pre),
              "[tokenizer] {}: the ByteLevel pre_tokenizer has add_prefix_space=true, which tetra "
              "does not implement; set it to false (as GPT-2 does)",
              path);
  if (has_component(pre, "Split", "pretokenizers")) {
    log_warn(
        "[tokenizer] {}: the pre_tokenizer has its own Split pattern; tetra splits with GPT-2's "
        "pattern, so token ids may differ from Hugging Face's (decoding is unaffected)",
        path);
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json v = model.value(key, json());
    TETRA_CHECK(v.is_null() || (v.is_string() && v.get<std::string>().empty()),
                "[tokenizer] {}: model.{} is set; byte-level BPE does not use it", path, key);
  }
  TETRA_CHECK(model.contains("vocab") && model["vocab"].is_object() && !model["vocab"].empty(),
              "[tokenizer] {}: model.vocab is missing or empty", path);
  TETRA_CHECK(model.contains("merges") && model["merges"].is_array(),
              "[tokenizer] {}: model.merges is missing (a list of \"a b\" strings or [a, b] pairs)",
              path);
  const json& vocab = model["vocab"];
  static const json kNoAdded = json::array();
  const json& added_list = root.contains("added_tokens") && !root["added_tokens"].is_null()
                               ? root["added_tokens"]
                               : kNoAdded;
  TETRA_CHECK(added_list.is_array(), "[tokenizer] {}: added_tokens is {}; expected a list", path,
              json_excerpt(added_list));

  // Ids must run 0..V-1 without gaps over vocab and added tokens together, so no valid id
  // reaches the number of entries. Checking that before storing anything keeps a hostile id
  // (2e9 in a 6 KB file) from sizing the tables.
  const size_t entries = vocab.size() + added_list.size();
  std::vector<std::string> tokens;
  std::vector<std::string> shown_of;  // how the file names each id, for collision messages
  std::vector<bool> filled;
  auto set_token = [&](uint64_t id, std::string bytes, const std::string& shown) {
    TETRA_CHECK(id < entries,
                "[tokenizer] {}: token '{}' has id {}, but the file lists only {} tokens (vocab "
                "and added_tokens), so ids must be below {}; the file is corrupt",
                path, shown, id, entries, entries);
    if (id >= tokens.size()) {
      tokens.resize(id + 1);
      shown_of.resize(id + 1);
      filled.resize(id + 1, false);
    }
    if (filled[id]) {
      // An added token may repeat its vocab entry (GPT-2 lists <|endoftext|> in both).
      TETRA_CHECK(tokens[id] == bytes,
                  "[tokenizer] {}: tokens '{}' and '{}' both have id {}; every id names one "
                  "token",
                  path, shown_of[id], shown, id);
      return;
    }
    tokens[id] = std::move(bytes);
    shown_of[id] = shown;
    filled[id] = true;
  };
  for (const auto& [key, value] : vocab.items()) {
    TETRA_CHECK(value.is_number_unsigned(),
                "[tokenizer] {}: vocab entry '{}' has id {}; ids are non-negative integers", path,
                key, json_excerpt(value));
    std::string bytes;
    TETRA_CHECK(detail::byte_level_decode(key, bytes),
                "[tokenizer] {}: vocab entry '{}' has a character outside GPT-2's byte-level "
                "alphabet; only byte-level BPE vocabularies are supported",
                path, key);
    set_token(value.get<uint64_t>(), std::move(bytes), key);
  }
  std::vector<AddedToken> added;
  for (size_t k = 0; k < added_list.size(); ++k) {
    const json& a = added_list[k];
    TETRA_CHECK(a.is_object(), "[tokenizer] {}: added_tokens[{}] is {}; expected an object", path,
                k, json_excerpt(a));
    TETRA_CHECK(a.contains("content") && a["content"].is_string(),
                "[tokenizer] {}: added_tokens[{}] has no \"content\" string", path, k);
    const auto content = a["content"].get<std::string>();
    TETRA_CHECK(a.contains("id") && a["id"].is_number_unsigned(),
                "[tokenizer] {}: added token '{}' has id {}; ids are non-negative integers", path,
                content, a.contains("id") ? json_excerpt(a["id"]) : "(none)");
    TETRA_CHECK(!a.contains("special") || a["special"].is_boolean(),
                "[tokenizer] {}: added token '{}' has \"special\": {}; expected true or false",
                path, content, json_excerpt(a["special"]));
    const auto id = a["id"].get<uint64_t>();
    set_token(id, content, content);
    added.push_back({static_cast<uint32_t>(id), content, a.value("special", false)});
  }
  for (size_t id = 0; id < tokens.size(); ++id) {
    TETRA_CHECK(filled[id], "[tokenizer] {}: no token has id {} (ids must run 0..{} without gaps)",
                path, id, tokens.size() - 1);
  }

  auto vocab_id = [&](const std::string& tok, size_t rank, const std::string& shown) {
    auto it = vocab.find(tok);
    TETRA_CHECK(it != vocab.end(),
                "[tokenizer] {}: merge {} ({}) refers to '{}', which is not in the vocabulary; the "
                "file is corrupt or its merges belong to another vocabulary",
                path, rank, shown, tok);
    return it->get<uint32_t>();
  };
  std::vector<BpeTokenizer::Merge> merges;
  merges.reserve(model["merges"].size());
  for (const auto& m : model["merges"]) {
    const size_t rank = merges.size();
    std::string a, b;
    if (m.is_string()) {
      const auto s = m.get<std::string>();
      const size_t sp = s.find(' ');
      TETRA_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
                  "[tokenizer] {}: merge {} \"{}\" is not two tokens separated by one space", path,
                  rank, s);
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      TETRA_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(),
                  "[tokenizer] {}: merge {} is {}; expected \"a b\" or [\"a\", \"b\"]", path, rank,
                  json_excerpt(m));
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    }
    const std::string shown = "\"" + a + " " + b + "\"";
    merges.emplace_back(vocab_id(a, rank, shown), vocab_id(b, rank, shown));
  }

  // The document separator: <|endoftext|> if present, else the first special added token.
  std::optional<uint32_t> eot;
  for (const auto& a : added) {
    if (a.content == "<|endoftext|>") eot = a.id;
  }
  if (!eot && vocab.contains("<|endoftext|>")) eot = vocab["<|endoftext|>"].get<uint32_t>();
  for (const auto& a : added) {
    if (!eot && a.special) eot = a.id;
  }
  TETRA_CHECK(eot.has_value(),
              "[tokenizer] {}: no <|endoftext|> token (nor any special added token) to separate "
              "documents; add one to added_tokens",
              path);

  bool is_bytes = tokens.size() == 257 && merges.empty() && *eot == 256;
  for (int b = 0; is_bytes && b < 256; ++b) is_bytes = tokens[b] == std::string(1, char(b));
  if (is_bytes) return std::make_unique<ByteTokenizer>();
  return std::make_unique<BpeTokenizer>(std::move(tokens), std::move(merges), std::move(added),
                                        *eot, path);
}

// Far above any real tokenizer.json (GPT-2's is 1.4 MB, large multilingual ones tens of MB):
// a bigger file is almost certainly the wrong file, and reading it whole would be costly.
constexpr uintmax_t kMaxTokenizerBytes = 512ull << 20;

}  // namespace

std::unique_ptr<Tokenizer> parse_tokenizer_json(std::string_view text, const std::string& origin) {
  TETRA_CHECK(!text.empty(), "[tokenizer] {}: the file is empty", origin);
  const json root = parse_json_strict(text, "tokenizer", origin);
  try {
    return tokenizer_from_json(origin, root);
  } catch (const json::exception& e) {
    fail("[tokenizer] {}: malformed tokenizer.json ({})", origin, e.what());
  }
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  return parse_tokenizer_json(
      read_small_file(spec, kMaxTokenizerBytes, "tokenizer", "a tokenizer.json",
                      "pass \"byte\" or the path of a Hugging Face tokenizer.json"),
      spec);
}

}  // namespace tetra
