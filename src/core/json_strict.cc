#include "core/json_strict.h"

#include <unordered_set>
#include <vector>

#include "core/error.h"

namespace tetra {

namespace {

// Deeper than any file tetra reads needs; it bounds the recursion of code walking the result.
constexpr int kMaxDepth = 64;

}  // namespace

nlohmann::json parse_json_strict(std::string_view text, const std::string& module,
                                 const std::string& origin) {
  using nlohmann::json;
  // One key set per open container (arrays get an unused one so pops stay paired).
  std::vector<std::unordered_set<std::string>> open;
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= kMaxDepth) {
          fail("[{}] {}: JSON nested deeper than {} levels; the file is corrupt", module, origin,
               kMaxDepth);
        }
        open.emplace_back();
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        open.pop_back();
        break;
      case json::parse_event_t::key:
        if (!open.back().insert(parsed.get<std::string>()).second) {
          fail(
              "[{}] {}: key \"{}\" appears twice in one object; the file is damaged (which value "
              "is meant is unknown): keep one",
              module, origin, parsed.get<std::string>());
        }
        break;
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), on_event);
  } catch (const json::exception& e) {
    fail("[{}] {}: not valid JSON ({}); the file is corrupt or truncated", module, origin,
         e.what());
  }
}

std::string json_excerpt(const nlohmann::json& j) {
  std::string s = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > 60) {
    size_t cut = 57;
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // whole chars
    s = s.substr(0, cut) + "...";
  }
  return s;
}

}  // namespace tetra
