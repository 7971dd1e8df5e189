#include "core/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace tetra {

namespace {

const char* kind_name(ValueKind k) {
  switch (k) {
    case ValueKind::Int:
      return "integer";
    case ValueKind::Float:
      return "number";
    case ValueKind::Bool:
      return "boolean";
    case ValueKind::String:
      return "string";
  }
  return "?";
}

std::string suggestion(const ConfigSchema& schema, const std::string& key) {
  const KeySpec* best = nullptr;
  size_t best_d = SIZE_MAX;
  for (const auto& s : schema) {
    size_t d = edit_distance(s.key, key);
    // Also match the key part alone ("lr" under a wrong section).
    auto dot = key.find('.');
    auto sdot = s.key.find('.');
    if (dot != std::string::npos && sdot != std::string::npos &&
        key.substr(dot + 1) == s.key.substr(sdot + 1)) {
      d = std::min<size_t>(d, 1);
    }
    if (d < best_d) best_d = d, best = &s;
  }
  if (best && best_d <= std::max<size_t>(3, key.size() / 3)) {
    return " Did you mean '" + best->key + "'?";
  }
  return " Run with --help-config to list the known keys.";
}

ConfigValue parse_text(const KeySpec& spec, const std::string& text, const std::string& origin) {
  auto bad = [&]() -> ConfigValue {
    fail("[config] {}: '{}' expects {} but got '{}'", origin, spec.key, kind_name(spec.kind), text);
  };
  switch (spec.kind) {
    case ValueKind::Int: {
      int64_t v = 0;
      auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (ec != std::errc() || p != text.data() + text.size()) {
        // allow "1e6"-style integers
        char* end = nullptr;
        double d = std::strtod(text.c_str(), &end);
        if (end && *end == 0 && !text.empty() && d == double(int64_t(d))) return int64_t(d);
        return bad();
      }
      return v;
    }
    case ValueKind::Float: {
      char* end = nullptr;
      double d = std::strtod(text.c_str(), &end);
      if (text.empty() || !end || *end != 0) return bad();
      return d;
    }
    case ValueKind::Bool:
      if (text == "true" || text == "1") return true;
      if (text == "false" || text == "0") return false;
      return bad();
    case ValueKind::String: {
      std::string t = text;
      if (t.size() >= 2 && (t.front() == '"' || t.front() == '\'') && t.back() == t.front()) {
        t = t.substr(1, t.size() - 2);
      }
      return t;
    }
  }
  return bad();
}

ConfigValue from_toml(const KeySpec& spec, const toml::node& node, const std::string& path) {
  auto bad = [&]() -> ConfigValue {
    std::ostringstream os;
    os << node.type();
    fail("[config] {}: '{}' expects {} but got a {}", path, spec.key, kind_name(spec.kind),
         os.str());
  };
  switch (spec.kind) {
    case ValueKind::Int:
      if (auto v = node.value_exact<int64_t>()) return *v;
      return bad();
    case ValueKind::Float:
      if (auto v = node.value<double>()) return *v;
      return bad();
    case ValueKind::Bool:
      if (auto v = node.value_exact<bool>()) return *v;
      return bad();
    case ValueKind::String:
      if (auto v = node.value_exact<std::string>()) return *v;
      return bad();
  }
  return bad();
}

void flatten(const toml::table& table, const std::string& prefix,
             std::vector<std::pair<std::string, const toml::node*>>& out) {
  for (const auto& [k, v] : table) {
    std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const auto* t = v.as_table()) {
      flatten(*t, key, out);
    } else {
      out.emplace_back(key, &v);
    }
  }
}

}  // namespace

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

const KeySpec& Config::spec(const std::string& key) const {
  for (const auto& s : *schema_) {
    if (s.key == key) return s;
  }
  fail("[config] unknown key '{}'.{}", key, suggestion(*schema_, key));
}

Config Config::load(const ConfigSchema& schema, const std::string& toml_path,
                    const std::vector<std::string>& overrides) {
  Config c;
  c.schema_ = &schema;
  for (const auto& s : schema) {
    c.values_[s.key] = parse_text(s, s.default_value, "default");
    c.set_[s.key] = false;
  }
  if (!toml_path.empty()) {
    std::ifstream probe(toml_path);
    TETRA_CHECK(probe.good(), "[config] cannot open config file '{}'; check the --config path",
                toml_path);
    toml::table table;
    try {
      table = toml::parse_file(toml_path);
    } catch (const toml::parse_error& e) {
      fail("[config] {}:{}:{}: {}", toml_path, e.source().begin.line, e.source().begin.column,
           e.description());
    }
    std::vector<std::pair<std::string, const toml::node*>> entries;
    flatten(table, "", entries);
    for (const auto& [key, node] : entries) {
      bool known = std::any_of(schema.begin(), schema.end(), [&](auto& s) { return s.key == key; });
      TETRA_CHECK(known, "[config] {}: unknown key '{}'.{}", toml_path, key,
                  suggestion(schema, key));
      const KeySpec& s = c.spec(key);
      c.values_[key] = from_toml(s, *node, toml_path);
      c.set_[key] = true;
    }
  }
  for (std::string o : overrides) {
    if (o.rfind("--", 0) == 0) o = o.substr(2);
    auto eq = o.find('=');
    TETRA_CHECK(eq != std::string::npos,
                "[config] override '{}' must look like --section.key=value", o);
    std::string key = o.substr(0, eq);
    bool known = std::any_of(schema.begin(), schema.end(), [&](auto& s) { return s.key == key; });
    TETRA_CHECK(known, "[config] unknown key '{}' (from --{}).{}", key, o, suggestion(schema, key));
    c.values_[key] = parse_text(c.spec(key), o.substr(eq + 1), "--" + key);
    c.set_[key] = true;
  }
  return c;
}

void Config::set(const std::string& key, const std::string& value_text) {
  values_[key] = parse_text(spec(key), value_text, "set " + key);
  set_[key] = true;
}

const ConfigValue& Config::value(const std::string& key, ValueKind kind) const {
  const KeySpec& s = spec(key);
  TETRA_CHECK(s.kind == kind, "[config] internal: '{}' is {} but read as {}", key,
              kind_name(s.kind), kind_name(kind));
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
  std::ostringstream os;
  os << root << "\n";
  return os.str();
}

}  // namespace tetra
