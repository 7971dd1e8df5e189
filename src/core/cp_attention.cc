#include "core/cp_attention.h"

#include <fmt/format.h>

#include "core/error.h"

namespace tetra {

CpAttention cp_attention_from_string(const std::string& s) {
  if (s == "ring") return CpAttention::ring;
  if (s == "all_gather") return CpAttention::all_gather;
  if (s == "ulysses") return CpAttention::ulysses;
  fail(
      "[cp] cp.attention='{}': use ring (K/V passed around the cp ring, overlapped), "
      "all_gather (K/V gathered once) or ulysses (all-to-all from sequence to head shards)",
      s);
}

const char* cp_attention_name(CpAttention a) {
  switch (a) {
    case CpAttention::ring:
      return "ring";
    case CpAttention::all_gather:
      return "all_gather";
    case CpAttention::ulysses:
      return "ulysses";
  }
  return "?";
}

std::string cp_attention_label(CpAttention a, int cp, int ulysses) {
  if (a != CpAttention::ulysses || ulysses == 0 || ulysses == cp) return cp_attention_name(a);
  return fmt::format("ulysses {} x ring {}", ulysses, cp / ulysses);
}

}  // namespace tetra
