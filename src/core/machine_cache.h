// Measurements kept per machine under $XDG_CACHE_HOME/tetra/ (default $HOME/.cache/tetra/): the
// fp32 peak (peak.json) and the matmul library chosen per product (matmul.json). Each file is
//
//   {"schema": <n>, "machine": "<CPU model> (<ISA and library>)", "<entries>": {key: entry, ...}}
//
// A missing, damaged, older-format or other-machine file has no entries for this machine: the
// caller measures again and rewrites it. Writes are atomic, so concurrent runs see the old file or
// the new; a cache that cannot be written costs a warning, never the run.
#pragma once

#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

namespace tetra {

/** $XDG_CACHE_HOME/tetra/<name>, else $HOME/.cache/tetra/<name>; empty when neither is set. */
std::filesystem::path machine_cache_path(const std::string& name);

/** "model name" of /proc/cpuinfo. */
std::string cpu_model();
/** The current UTC time as 2025-01-31T12:00:00Z. */
std::string utc_now();

struct MachineCacheRead {
  nlohmann::json entries = nlohmann::json::object();  // of a current file of this machine
  std::string problem;   // why there are none (empty: missing file, or nothing wrong)
  bool damaged = false;  // the problem is damage, not an older format or another machine
};

/** The entries object `entries_key` of the cache at `path` for `machine`. */
MachineCacheRead read_machine_cache(const std::filesystem::path& path, int schema,
                                    const std::string& machine, const std::string& entries_key);

/** Adds `entries` to those the file holds now (another process may have added some since this
 *  one read it), dropping held entries `valid` rejects; warns in `module`'s name on failure. */
void write_machine_cache(const std::filesystem::path& path, int schema, const std::string& machine,
                         const std::string& entries_key, const nlohmann::json& entries,
                         const std::function<bool(const nlohmann::json&)>& valid,
                         const std::string& module);

}  // namespace tetra
