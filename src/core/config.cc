#include "core/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/error.h"

namespace tetra {

namespace {

constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
// Echoed values are cut here, so a runaway value cannot bury the message.
constexpr size_t kShownChars = 80;

std::string shown(const std::string& text) {
  if (text.size() <= kShownChars) return text;
  return text.substr(0, kShownChars) + "...";
}

std::string trimmed(std::string_view s) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  return std::string(s);
}

// spec.valid of a number key, split into its ends: "[a, b)" -> '[', "a", "b", ')'.
struct Interval {
  bool lo_open = false, hi_open = false;
  std::string lo, hi;
};

Interval split_interval(const KeySpec& spec) {
  const std::string& v = spec.valid;
  const size_t comma = v.find(',');
  TETRA_CHECK(v.size() >= 5 && (v.front() == '[' || v.front() == '(') &&
                  (v.back() == ']' || v.back() == ')') && comma != std::string::npos,
              "[config] internal: '{}' has the malformed range '{}'; write it as [a, b] or (a, b)",
              spec.key, v);
  return Interval{v.front() == '(', v.back() == ')', trimmed(v.substr(1, comma - 1)),
                  trimmed(v.substr(comma + 1, v.size() - comma - 2))};
}

// Whole-text parses: nothing may follow the number. A leading '+' is accepted as TOML does.
bool parse_int64(std::string_view text, int64_t& out, bool& out_of_range) {
  if (text.size() > 1 && text.front() == '+' && text[1] != '-') text.remove_prefix(1);
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  out_of_range = ec == std::errc::result_out_of_range && p == text.data() + text.size();
  return ec == std::errc() && p == text.data() + text.size();
}

bool parse_double(std::string_view text, double& out) {
  if (text.size() > 1 && text.front() == '+' && text[1] != '-') text.remove_prefix(1);
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && p == text.data() + text.size() && !text.empty();
}

int64_t int_end(const KeySpec& spec, const std::string& end, bool open, bool low) {
  if (end == "-inf" || end == "inf") return end == "inf" ? kInt64Max : kInt64Min;
  int64_t v = 0;
  bool out_of_range = false;
  TETRA_CHECK(parse_int64(end, v, out_of_range),
              "[config] internal: '{}' has the range '{}' whose end '{}' is not an integer",
              spec.key, spec.valid, end);
  if (open) v += low ? 1 : -1;
  return v;
}

std::pair<int64_t, int64_t> int_range(const KeySpec& spec) {
  if (spec.valid.empty()) {
    // Unranged integer keys are read into `int` fields; 32 bits keeps that narrowing exact.
    return {std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()};
  }
  const Interval in = split_interval(spec);
  return {int_end(spec, in.lo, in.lo_open, true), int_end(spec, in.hi, in.hi_open, false)};
}

bool float_in_range(const KeySpec& spec, double v) {
  if (!std::isfinite(v)) return false;
  if (spec.valid.empty()) return true;
  const Interval in = split_interval(spec);
  double lo = 0, hi = 0;
  TETRA_CHECK(parse_double(in.lo, lo) && parse_double(in.hi, hi),
              "[config] internal: '{}' has the range '{}' whose ends are not numbers", spec.key,
              spec.valid);
  return (in.lo_open ? v > lo : v >= lo) && (in.hi_open ? v < hi : v <= hi);
}

std::vector<std::string> choices(const KeySpec& spec) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= spec.valid.size()) {
    size_t bar = spec.valid.find('|', start);
    if (bar == std::string::npos) bar = spec.valid.size();
    std::string c = trimmed(std::string_view(spec.valid).substr(start, bar - start));
    out.push_back(c == "\"\"" ? "" : c);
    start = bar + 1;
  }
  return out;
}

[[noreturn]] void refuse(const KeySpec& spec, const std::string& typed, const std::string& where) {
  fail("{}'{}' must be {}, got '{}'", where, spec.key, describe_valid(spec), shown(typed));
}

// Checks a parsed value against spec.valid; `typed` is the value as the user wrote it.
ConfigValue checked(const KeySpec& spec, ConfigValue v, const std::string& typed,
                    const std::string& where) {
  switch (spec.kind) {
    case ValueKind::Int: {
      const auto [lo, hi] = int_range(spec);
      const int64_t i = std::get<int64_t>(v);
      if (i < lo || i > hi) refuse(spec, typed, where);
      break;
    }
    case ValueKind::Float:
      if (!float_in_range(spec, std::get<double>(v))) refuse(spec, typed, where);
      break;
    case ValueKind::String:
      if (!spec.valid.empty()) {
        const auto c = choices(spec);
        if (std::find(c.begin(), c.end(), std::get<std::string>(v)) == c.end()) {
          refuse(spec, typed, where);
        }
      }
      break;
    case ValueKind::Bool:
      break;
  }
  return v;
}

std::string suggestion(const ConfigSchema& schema, const std::string& key) {
  for (const auto& s : schema) {
    if (!s.former.empty() && s.former == key) {
      return fmt::format(" It was renamed '{}'; use that name.", s.key);
    }
  }
  std::vector<std::string> keys;
  for (const auto& s : schema) keys.push_back(s.key);
  std::string s = closest_suggestion(keys, key);
  return s.empty() ? " Run with --help to list the known keys." : s;
}

ConfigValue from_toml(const KeySpec& spec, const toml::node& node, const std::string& where) {
  std::ostringstream typed;
  node.visit([&](const auto& n) { typed << n; });
  switch (spec.kind) {
    case ValueKind::Int:
      if (auto v = node.value_exact<int64_t>()) return checked(spec, *v, typed.str(), where);
      break;
    case ValueKind::Float:
      // An integer literal is a fine number; value<double>() also takes it.
      if (node.is_number()) {
        if (auto v = node.value<double>()) return checked(spec, *v, typed.str(), where);
      }
      break;
    case ValueKind::Bool:
      if (auto v = node.value_exact<bool>()) return *v;
      break;
    case ValueKind::String:
      if (auto v = node.value_exact<std::string>()) return checked(spec, *v, *v, where);
      // A free-form key takes a bare integer as its text, as on the command line (every = 50).
      if (spec.valid.empty() && node.is_integer()) {
        return checked(spec, typed.str(), typed.str(), where);
      }
      break;
  }
  std::ostringstream type;
  type << node.type();
  if (node.is_table() || node.is_array()) {
    fail("{}'{}' must be {}, got a TOML {}", where, spec.key, describe_valid(spec), type.str());
  }
  fail("{}'{}' must be {}, got {} (a TOML {})", where, spec.key, describe_valid(spec),
       shown(typed.str()), type.str());
}

// toml++ recurses once per level of a dotted key ("a.b.c = 1" or "[a.b.c]") and overflows the
// stack at tens of thousands of levels. A key lies on one line, so a line with this many dots
// is refused before parsing; a tetra key has one dot.
constexpr size_t kMaxDotsPerLine = 1000;

void check_key_depth(std::string_view text, const std::string& origin) {
  size_t line = 1, dots = 0;
  for (char c : text) {
    if (c == '\n') {
      ++line;
      dots = 0;
    } else if (c == '.' && ++dots > kMaxDotsPerLine) {
      fail(
          "[config] {}:{}: more than {} dots on one line; keys are section.key, so this is not "
          "a tetra config",
          origin, line, kMaxDotsPerLine);
    }
  }
}

// "section.key" entries of a parsed document. A table is descended into unless the schema knows
// its name as a key (then it is a value of the wrong type); an empty table that is not a
// section of the schema is kept as an entry, so a misspelt empty section is still reported.
void flatten(const toml::table& table, const std::string& prefix, const ConfigSchema& schema,
             std::vector<std::pair<std::string, const toml::node*>>& out) {
  for (const auto& [k, v] : table) {
    std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    const auto* t = v.as_table();
    const bool is_key =
        std::any_of(schema.begin(), schema.end(), [&](auto& s) { return s.key == key; });
    const bool is_section = std::any_of(schema.begin(), schema.end(), [&](auto& s) {
      return s.key.size() > key.size() && s.key.compare(0, key.size() + 1, key + ".") == 0;
    });
    if (t && !is_key && (!t->empty() || is_section)) {
      flatten(*t, key, schema, out);
    } else {
      out.emplace_back(key, &v);
    }
  }
}

// Well-formed UTF-8: no stray continuation bytes, overlong forms, surrogates or code points
// beyond U+10FFFF.
bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80           ? 1
                     : (c >> 5) == 0x6  ? 2
                     : (c >> 4) == 0xE  ? 3
                     : (c >> 3) == 0x1E ? 4
                                        : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    static constexpr uint32_t kMinOfLength[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMinOfLength[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

}  // namespace

ConfigValue parse_value(const KeySpec& spec, const std::string& text, const std::string& where) {
  switch (spec.kind) {
    case ValueKind::Int: {
      int64_t v = 0;
      bool out_of_range = false;
      if (parse_int64(text, v, out_of_range)) return checked(spec, v, text, where);
      // "1e6"-style integers: only an integral, finite value inside int64 is converted.
      double d = 0;
      if (out_of_range || !parse_double(text, d) || !std::isfinite(d) || d != std::trunc(d) ||
          d < -0x1p63 || d >= 0x1p63) {
        refuse(spec, text, where);
      }
      return checked(spec, int64_t(d), text, where);
    }
    case ValueKind::Float: {
      double d = 0;
      if (!parse_double(text, d)) refuse(spec, text, where);
      return checked(spec, d, text, where);
    }
    case ValueKind::Bool:
      if (text == "true" || text == "1") return true;
      if (text == "false" || text == "0") return false;
      refuse(spec, text, where);
    case ValueKind::String: {
      std::string t = text;
      if (t.size() >= 2 && (t.front() == '"' || t.front() == '\'') && t.back() == t.front()) {
        t = t.substr(1, t.size() - 2);
      }
      return checked(spec, t, text, where);
    }
  }
  refuse(spec, text, where);
}

std::string describe_valid(const KeySpec& spec) {
  switch (spec.kind) {
    case ValueKind::Int: {
      if (!spec.valid.empty()) return "an integer in " + spec.valid;
      const auto [lo, hi] = int_range(spec);
      return fmt::format("an integer in [{}, {}]", lo, hi);
    }
    case ValueKind::Float:
      return spec.valid.empty() ? "a finite number" : "a finite number in " + spec.valid;
    case ValueKind::Bool:
      return "true or false";
    case ValueKind::String: {
      if (spec.valid.empty()) return "a string";
      std::string out = "one of: ";
      const auto c = choices(spec);
      for (size_t i = 0; i < c.size(); ++i) {
        out += (i ? ", " : "") + (c[i].empty() ? std::string("\"\"") : c[i]);
      }
      return out;
    }
  }
  return "?";
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string closest_suggestion(const std::vector<std::string>& candidates,
                               const std::string& typed) {
  // No name is this long; comparing a huge typo against every candidate would only cost time.
  if (typed.size() > 200) return "";
  // The name without its section or leading dashes: "optim.lr" and "--lr" both give "lr".
  auto tail = [](const std::string& name) {
    const auto dot = name.find('.');
    if (dot != std::string::npos) return name.substr(dot + 1);
    return name.substr(std::min(name.find_first_not_of('-'), name.size()));
  };
  const std::string* best = nullptr;
  size_t best_d = SIZE_MAX;
  for (const auto& c : candidates) {
    size_t d = edit_distance(c, typed);
    // A right key under a wrong or missing section is one step away.
    if (tail(c) == tail(typed) && !tail(c).empty()) d = std::min<size_t>(d, 1);
    if (d < best_d) best_d = d, best = &c;
  }
  if (best && best_d <= std::max<size_t>(3, typed.size() / 3)) {
    return " Did you mean '" + *best + "'?";
  }
  return "";
}

const KeySpec& Config::spec(const std::string& key) const {
  for (const auto& s : *schema_) {
    if (s.key == key) return s;
  }
  fail("[config] unknown key '{}'.{}", shown(key), suggestion(*schema_, key));
}

Config Config::load(const ConfigSchema& schema, const std::string& toml_path,
                    const std::vector<std::string>& overrides) {
  if (toml_path.empty()) return parse(schema, "", "", overrides);
  std::error_code ec;
  TETRA_CHECK(!std::filesystem::is_directory(toml_path, ec),
              "[config] the config file '{}' is a directory; pass a .toml file to --config",
              toml_path);
  std::ifstream in(toml_path, std::ios::binary);
  TETRA_CHECK(in.good(), "[config] cannot open config file '{}'; check the --config path",
              toml_path);
  std::ostringstream text;
  text << in.rdbuf();
  TETRA_CHECK(!in.bad(), "[config] cannot read config file '{}'; check the --config path",
              toml_path);
  return parse(schema, text.str(), toml_path, overrides);
}

Config Config::parse(const ConfigSchema& schema, std::string_view toml_text,
                     const std::string& origin, const std::vector<std::string>& overrides) {
  Config c;
  c.schema_ = &schema;
  for (const auto& s : schema) {
    c.values_[s.key] = parse_value(s, s.default_value, "[config] internal: the default of ");
    c.set_[s.key] = false;
  }
  if (!origin.empty()) {
    check_key_depth(toml_text, origin);
    toml::table table;
    try {
      table = toml::parse(toml_text, origin);
    } catch (const toml::parse_error& e) {
      fail("[config] {}:{}:{}: {}; fix the TOML syntax there", origin, e.source().begin.line,
           e.source().begin.column, e.description());
    }
    std::vector<std::pair<std::string, const toml::node*>> entries;
    flatten(table, "", schema, entries);
    for (const auto& entry : entries) {
      const std::string& key = entry.first;
      const toml::node* node = entry.second;
      const auto where = fmt::format("[config] {}:{}:{}: ", origin, node->source().begin.line,
                                     node->source().begin.column);
      bool known = std::any_of(schema.begin(), schema.end(), [&](auto& s) { return s.key == key; });
      TETRA_CHECK(known, "{}unknown key '{}'.{}", where, shown(key), suggestion(schema, key));
      c.values_[key] = from_toml(c.spec(key), *node, where);
      c.set_[key] = true;
    }
  }
  for (std::string o : overrides) {
    if (o.rfind("--", 0) == 0) o = o.substr(2);
    auto eq = o.find('=');
    TETRA_CHECK(eq != std::string::npos,
                "[config] override '{}' must look like --section.key=value", shown(o));
    std::string key = o.substr(0, eq);
    bool known = std::any_of(schema.begin(), schema.end(), [&](auto& s) { return s.key == key; });
    TETRA_CHECK(known, "[config] unknown key '{}' (from --{}).{}", shown(key), shown(o),
                suggestion(schema, key));
    const KeySpec& spec = c.spec(key);
    // A TOML document holds only UTF-8, and the config is saved as one (config.toml of a run).
    TETRA_CHECK(spec.kind != ValueKind::String || valid_utf8(o),
                "[config] command line: '{}' must be UTF-8 text; the value has invalid bytes", key);
    c.values_[key] = parse_value(spec, o.substr(eq + 1), "[config] command line: ");
    c.set_[key] = true;
  }
  return c;
}

const ConfigValue& Config::value(const std::string& key, ValueKind kind) const {
  const KeySpec& s = spec(key);
  TETRA_CHECK(s.kind == kind, "[config] internal: '{}' is {} but read as another type", key,
              describe_valid(s));
  return values_.at(key);
}

const ConfigValue& Config::at(const std::string& key) const {
  spec(key);
  return values_.at(key);
}

int64_t Config::i(const std::string& key) const {
  return std::get<int64_t>(value(key, ValueKind::Int));
}
double Config::f(const std::string& key) const {
  return std::get<double>(value(key, ValueKind::Float));
}
bool Config::b(const std::string& key) const { return std::get<bool>(value(key, ValueKind::Bool)); }
const std::string& Config::s(const std::string& key) const {
  return std::get<std::string>(value(key, ValueKind::String));
}
bool Config::is_set(const std::string& key) const {
  spec(key);
  return set_.at(key);
}

std::string Config::to_toml() const {
  toml::table root;
  for (const auto& s : *schema_) {
    auto dot = s.key.find('.');
    std::string section = s.key.substr(0, dot), name = s.key.substr(dot + 1);
    if (!root.contains(section)) root.insert(section, toml::table{});
    toml::table& t = *root[section].as_table();
    std::visit([&](const auto& v) { t.insert(name, v); }, values_.at(s.key));
  }
  // Basic strings only: toml++'s literal and multi-line forms cannot hold every string (a value
  // with three quotes and a newline was written as a multi-line literal that did not parse back).
  std::ostringstream os;
  os << toml::toml_formatter(root, toml::format_flags::indentation) << "\n";
  return os.str();
}

}  // namespace tetra
