#include "core/machine_cache.h"

#include <cstdlib>
#include <ctime>
#include <fstream>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/log.h"

namespace tetra {

namespace fs = std::filesystem;
using nlohmann::json;

fs::path machine_cache_path(const std::string& name) {
  // XDG: a relative XDG_CACHE_HOME is invalid and ignored.
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && x[0] == '/') {
    return fs::path(x) / "tetra" / name;
  }
  if (const char* home = std::getenv("HOME"); home && *home) {
    return fs::path(home) / ".cache" / "tetra" / name;
  }
  return {};
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t start = line.find_first_not_of(" \t", line.find(':') + 1);
    if (start != std::string::npos) return line.substr(start);
  }
  return "unknown CPU";
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

MachineCacheRead read_machine_cache(const fs::path& path, int schema, const std::string& machine,
                                    const std::string& entries_key) {
  MachineCacheRead r;
  std::ifstream in(path);
  if (!in) return r;
  json j;
  try {
    in >> j;
  } catch (const json::exception& e) {
    r.problem = fmt::format("is not valid JSON ({})", e.what());
    r.damaged = true;
    return r;
  }
  if (!j.is_object()) {
    r.problem = "is not a JSON object";
    r.damaged = true;
    return r;
  }
  const auto s = j.find("schema");
  if (s == j.end() || *s != schema) {
    r.problem = s == j.end() ? "has the older format without a \"schema\" key"
                             : fmt::format("has schema {}, not {}", s->dump(), schema);
    return r;
  }
  const auto m = j.find("machine");
  if (m == j.end() || !m->is_string() || *m != machine) {
    r.problem = fmt::format("was measured on {}, not on this machine ({})",
                            m == j.end() ? "an unnamed machine" : m->dump(), machine);
    return r;
  }
  const auto e = j.find(entries_key);
  if (e == j.end() || !e->is_object()) {
    r.problem = fmt::format("has no \"{}\" object", entries_key);
    r.damaged = true;
    return r;
  }
  r.entries = *e;
  return r;
}

void write_machine_cache(const fs::path& path, int schema, const std::string& machine,
                         const std::string& entries_key, const json& entries,
                         const std::function<bool(const json&)>& valid, const std::string& module) {
  json all = read_machine_cache(path, schema, machine, entries_key).entries;
  for (auto it = all.begin(); it != all.end();)
    it = valid(it.value()) ? std::next(it) : all.erase(it);
  for (const auto& [key, entry] : entries.items()) all[key] = entry;
  const json out = {{"schema", schema}, {"machine", machine}, {entries_key, all}};
  const std::string text = out.dump(2) + "\n";
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  try {
    write_file_atomically(path.string(),
                          {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}}, module);
  } catch (const Error& e) {
    log_warn("{}; it is not cached, so the next run measures it again", e.what());
  }
}

}  // namespace tetra
