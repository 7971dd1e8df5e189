// Typed configuration: a TOML file plus `--section.key=value` overrides, checked against a
// schema. Unknown keys, wrong types and malformed values are refused with a suggestion.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

namespace tetra {

enum class ValueKind { Int, Float, Bool, String };

using ConfigValue = std::variant<int64_t, double, bool, std::string>;

/** One known key: "section.key", its type, its default (as TOML-literal text) and a help line. */
struct KeySpec {
  std::string key;
  ValueKind kind;
  std::string default_value;
  std::string help;
};

using ConfigSchema = std::vector<KeySpec>;

class Config {
 public:
  /** Parses `toml_path` (may be empty) then `overrides` ("section.key=value", leading "--" ok). */
  static Config load(const ConfigSchema& schema, const std::string& toml_path,
                     const std::vector<std::string>& overrides);
  /** Defaults only, then overrides. */
  static Config from_overrides(const ConfigSchema& schema,
                               const std::vector<std::string>& overrides) {
    return load(schema, "", overrides);
  }

  int64_t i(const std::string& key) const;
  double f(const std::string& key) const;
  bool b(const std::string& key) const;
  const std::string& s(const std::string& key) const;
  /** True when the file or an override set the key (not just its default). */
  bool is_set(const std::string& key) const;

  /** Sets a value programmatically (type-checked against the schema). */
  void set(const std::string& key, const std::string& value_text);

  /** Every key with its effective value, as a TOML document (for run dirs and checkpoints). */
  std::string to_toml() const;

  const ConfigSchema& schema() const { return *schema_; }

 private:
  const KeySpec& spec(const std::string& key) const;
  const ConfigValue& value(const std::string& key, ValueKind kind) const;

  const ConfigSchema* schema_ = nullptr;
  std::map<std::string, ConfigValue> values_;
  std::map<std::string, bool> set_;
};

/** Levenshtein distance; used to suggest the closest known key. */
size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace tetra
