#include "core/recompute.h"

#include "core/error.h"

namespace tetra {

Recompute parse_recompute(const std::string& text, const std::string& key) {
  if (text == "none") return Recompute::none;
  if (text == "selective") return Recompute::selective;
  if (text == "full") return Recompute::full;
  fail("[config] {}='{}' is unknown; use none, selective or full", key, text);
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::none:
      return "none";
    case Recompute::selective:
      return "selective";
    case Recompute::full:
      return "full";
  }
  return "?";
}

}  // namespace tetra
