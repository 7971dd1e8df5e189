// Reading Hugging Face tokenizer.json files (byte-level BPE, as GPT-2's).
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "core/error.h"
#include "core/log.h"
#include "data/byte_level.h"
#include "data/tokenizer.h"

namespace tetra {

namespace {

using nlohmann::json;

bool has_component(const json& j, const char* type, const char* list_key) {
  if (!j.is_object()) return false;
  if (j.value("type", "") == type) return true;
  if (j.contains(list_key) && j[list_key].is_array()) {
    for (const auto& c : j[list_key]) {
      if (has_component(c, type, list_key)) return true;
    }
  }
  return false;
}

bool adds_prefix_space(const json& j) {
  if (!j.is_object()) return false;
  if (j.value("type", "") == "ByteLevel") return j.value("add_prefix_space", false);
  if (j.contains("pretokenizers") && j["pretokenizers"].is_array()) {
    for (const auto& c : j["pretokenizers"]) {
      if (adds_prefix_space(c)) return true;
    }
  }
  return false;
}

std::unique_ptr<Tokenizer> parse_tokenizer_json(const std::string& path, const json& root) {
  TETRA_CHECK(root.is_object() && root.contains("model") && root["model"].is_object(),
              "[tokenizer] {}: no \"model\" object; this is not a Hugging Face tokenizer.json",
              path);
  const json& model = root["model"];
  const std::string type = model.value("type", "BPE");
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

  // Ids must be dense 0..V-1 over vocab and added tokens together.
  std::vector<std::string> tokens;
  std::vector<bool> filled;
  auto set_token = [&](uint64_t id, std::string bytes, const std::string& shown) {
    TETRA_CHECK(id < (1u << 31), "[tokenizer] {}: token '{}' has id {}, far beyond any vocabulary",
                path, shown, id);
    if (id >= tokens.size()) {
      tokens.resize(id + 1);
      filled.resize(id + 1, false);
    }
    if (!filled[id]) tokens[id] = std::move(bytes);
    filled[id] = true;
  };
  for (const auto& [key, value] : model["vocab"].items()) {
    TETRA_CHECK(value.is_number_unsigned(),
                "[tokenizer] {}: vocab entry '{}' has id {}; ids are non-negative integers", path,
                key, value.dump());
    std::string bytes;
    TETRA_CHECK(detail::byte_level_decode(key, bytes),
                "[tokenizer] {}: vocab entry '{}' has a character outside GPT-2's byte-level "
                "alphabet; only byte-level BPE vocabularies are supported",
                path, key);
    set_token(value.get<uint64_t>(), std::move(bytes), key);
  }
  std::vector<BpeTokenizer::AddedToken> added;
  if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
    TETRA_CHECK(root["added_tokens"].is_array(), "[tokenizer] {}: added_tokens is not a list",
                path);
    for (const auto& a : root["added_tokens"]) {
      TETRA_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_unsigned() &&
                      a.contains("content") && a["content"].is_string(),
                  "[tokenizer] {}: an added token lacks a numeric \"id\" or a \"content\" string",
                  path);
      const auto id = a["id"].get<uint64_t>();
      const auto content = a["content"].get<std::string>();
      set_token(id, content, content);
      added.push_back({static_cast<uint32_t>(id), content, a.value("special", false)});
    }
  }
  for (size_t id = 0; id < tokens.size(); ++id) {
    TETRA_CHECK(filled[id], "[tokenizer] {}: no token has id {} (ids must run 0..{} without gaps)",
                path, id, tokens.size() - 1);
  }

  const json& vocab = model["vocab"];
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
                  m.dump());
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

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  std::ifstream in(spec, std::ios::binary);
  TETRA_CHECK(in,
              "[tokenizer] {}: cannot open it; pass \"byte\" or the path of a Hugging Face "
              "tokenizer.json",
              spec);
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string text = buf.str();
  TETRA_CHECK(!text.empty(), "[tokenizer] {}: the file is empty", spec);
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    fail("[tokenizer] {}: not valid JSON ({}); the file is corrupt or truncated", spec, e.what());
  }
  try {
    return parse_tokenizer_json(spec, root);
  } catch (const json::exception& e) {
    fail("[tokenizer] {}: malformed tokenizer.json ({})", spec, e.what());
  }
}

}  // namespace tetra
