// Parsing the JSON files tetra reads from users (tokenizer.json, manifest.json) as untrusted
// input: duplicate keys and runaway nesting are refused instead of silently resolved.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace tetra {

/** Parses text as JSON. Refuses invalid JSON, a key that appears twice in one object (a plain
 * parse keeps the last one silently) and nesting deeper than 64 levels. Errors read
 * "[module] origin: ..." and say what is wrong. */
nlohmann::json parse_json_strict(std::string_view text, const std::string& module,
                                 const std::string& origin);

/** j.dump(), cut to at most 60 characters: a value echoed in an error message. */
std::string json_excerpt(const nlohmann::json& j);

}  // namespace tetra
