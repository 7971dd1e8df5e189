// Typed configuration: a TOML file plus `--section.key=value` overrides, checked against a
// schema. Unknown keys, wrong types, malformed and out-of-range values are refused with a
// message that names the key, the value as typed and what the key accepts.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace tetra {

enum class ValueKind { Int, Float, Bool, String };

using ConfigValue = std::variant<int64_t, double, bool, std::string>;

/** One known key: "section.key", its type, its default (as TOML-literal text), a help line and
 * the values it accepts (`valid`):
 *  - Int/Float: an interval, "[1, 1024]", "(0, inf)", "[0, 1)"; inf and -inf leave a side open.
 *    A Float is always finite. Empty: an Int fits in 32 bits, a Float is any finite number.
 *  - String: fixed choices "cosine | constant" (`""` stands for the empty string); empty: any.
 *  - Bool: always true or false; `valid` stays empty.
 * `former` is the name the key had before it was renamed (model.layers for model.n_layer): a
 * config that still uses it is refused with the new name. */
struct KeySpec {
  std::string key;
  ValueKind kind;
  std::string default_value;
  std::string help;
  std::string valid = {};
  std::string former = {};  // its name before a rename, "" for none
};

using ConfigSchema = std::vector<KeySpec>;

/** Parses `text` (as typed on a command line) as a value of `spec` and checks it against
 * spec.valid; the error starts with "[config] <origin>: " and names the key, text and range. */
ConfigValue parse_value(const KeySpec& spec, const std::string& text, const std::string& origin);

/** What `spec` accepts, in words: "an integer in [1, 1024]", "one of: auto, always, never". */
std::string describe_valid(const KeySpec& spec);

class Config {
 public:
  /** Parses `toml_path` (may be empty) then `overrides` ("section.key=value", leading "--" ok). */
  static Config load(const ConfigSchema& schema, const std::string& toml_path,
                     const std::vector<std::string>& overrides);
  /** As load(), with the TOML document given as text; `origin` names it in messages. */
  static Config parse(const ConfigSchema& schema, std::string_view toml_text,
                      const std::string& origin, const std::vector<std::string>& overrides);
  /** Defaults only, then overrides. */
  static Config from_overrides(const ConfigSchema& schema,
                               const std::vector<std::string>& overrides) {
    return parse(schema, "", "", overrides);
  }

  int64_t i(const std::string& key) const;
  double f(const std::string& key) const;
  bool b(const std::string& key) const;
  const std::string& s(const std::string& key) const;
  /** The value of `key`, whatever its kind. */
  const ConfigValue& at(const std::string& key) const;
  /** True when the file or an override set the key (not just its default). */
  bool is_set(const std::string& key) const;

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

/** " Did you mean 'x'?" for the candidate closest to `typed`, or "" when none is close. */
std::string closest_suggestion(const std::vector<std::string>& candidates,
                               const std::string& typed);

}  // namespace tetra
