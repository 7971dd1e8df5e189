// The checkpoint directory scanner (ckpt::scan_checkpoint_dir, parse_checkpoint_name) on a
// ckpt.dir whose entries are arbitrary names. Each input line is one entry: its first byte says
// what it is ('d' a directory, 'm' a directory holding a manifest.json, 't' a directory holding
// one file, anything else a file) and the rest is its name. Properties: nothing but tetra::Error
// escapes; a name parses to a step only when it is exactly checkpoint_name(step); published
// checkpoints come newest first, each named for its step; every entry is either published,
// unfinished, noted as ignored or not tetra's (no "step-" prefix); and a writer starting in the
// directory removes only the unfinished saves of other nonces, never anything else.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "fuzz/fuzz_util.h"

namespace {

namespace fs = std::filesystem;

fs::path dir;

// A name the file system takes as one entry of `dir` (no separator, no NUL, not . or ..).
bool usable(std::string_view name) {
  return !name.empty() && name.size() <= 200 && name != "." && name != ".." &&
         name.find('/') == std::string_view::npos && name.find('\0') == std::string_view::npos;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tetra::fuzz::quiet_logs();
  dir = fs::temp_directory_path() / ("tetra_ckpt_dir_fuzz_" + std::to_string(::getpid()));
  std::atexit([] {
    std::error_code ec;
    fs::remove_all(dir, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tetra;
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir);
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  std::set<std::string> made;
  size_t at = 0;
  while (at < input.size() && made.size() < 64) {
    const size_t end = std::min(input.find('\n', at), input.size());
    const std::string_view line = input.substr(at, end - at);
    at = end + 1;
    // The parser sees every line, usable as a file name or not.
    if (const std::optional<int64_t> step = ckpt::parse_checkpoint_name(line)) {
      fuzz::require(*step >= 0 && ckpt::checkpoint_name(*step) == line,
                    "a parsed name is exactly checkpoint_name(step)");
    }
    if (line.size() < 2 || !usable(line.substr(1))) continue;
    const std::string name(line.substr(1));
    if (!made.insert(name).second) continue;
    const fs::path p = dir / name;
    switch (line[0]) {
      case 'd':
        fs::create_directory(p, ec);
        break;
      case 'm':
        fs::create_directory(p, ec);
        std::ofstream(p / "manifest.json") << "{}";
        break;
      case 't':
        fs::create_directory(p, ec);
        std::ofstream(p / "rank-00000.safetensors") << "x";
        break;
      default:
        std::ofstream(p) << "x";
    }
  }
  try {
    const ckpt::DirScan scan = ckpt::scan_checkpoint_dir(dir);
    std::set<fs::path> seen;
    int64_t previous = INT64_MAX;
    for (const auto& c : scan.published) {
      fuzz::require(c.step < previous, "published checkpoints strictly newest first");
      previous = c.step;
      fuzz::require(ckpt::checkpoint_name(c.step) == c.path.filename().string(),
                    "a published checkpoint is named for its step");
      fuzz::require(fs::is_regular_file(c.path / "manifest.json"), "published has a manifest");
      seen.insert(c.path);
    }
    for (const auto& u : scan.unfinished) {
      const std::string n = u.path.filename().string();
      fuzz::require(ckpt::parse_checkpoint_name(n.substr(0, n.find('.'))).has_value(),
                    "an unfinished save is named for a step");
      fuzz::require(!u.nonce.empty(), "an unfinished save has a nonce");
      seen.insert(u.path);
    }
    fuzz::require(seen.size() == scan.published.size() + scan.unfinished.size(),
                  "no entry is both published and unfinished");
    size_t stepish = 0;
    for (const auto& e : fs::directory_iterator(dir)) {
      if (e.path().filename().string().rfind("step-", 0) == 0) ++stepish;
    }
    fuzz::require(stepish == seen.size() + scan.ignored.size(),
                  "every step-* entry is published, unfinished or noted as ignored");
    // A writer's start removes the unfinished saves of other nonces and nothing else.
    std::set<fs::path> kept;
    for (const auto& e : fs::directory_iterator(dir)) kept.insert(e.path());
    for (const auto& u : scan.unfinished) {
      if (u.nonce != "fuzz") kept.erase(u.path);
    }
    {
      ckpt::WriterOptions o;
      o.dir = dir;
      o.nonce = "fuzz";
      o.async = false;
      ckpt::Writer w(o, nullptr);
    }
    std::set<fs::path> after;
    for (const auto& e : fs::directory_iterator(dir)) after.insert(e.path());
    fuzz::require(after == kept, "the writer removed exactly the other nonces' unfinished saves");
    // The user-facing lookup: a refusal or the published ones, never a crash.
    ckpt::locate_checkpoints(dir, "fuzz");
  } catch (const Error&) {
  }
  return 0;
}
