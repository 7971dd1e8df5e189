// Unicode's \p{L}, \p{N} and White_Space for GPT-2 pre-tokenization, from the ranges that
// scripts/gen_char_class.py generates out of the Unicode Character Database (char_class_table.inc),
// looked up through a two-stage table built from them on first use.
#include <algorithm>
#include <array>
#include <cstring>
#include <iterator>
#include <vector>

#include "data/pretokenize.h"

namespace tetra {

namespace detail {

namespace {
constexpr CharClass ascii_class(int c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return CharClass::letter;
  if (c >= '0' && c <= '9') return CharClass::number;
  if (c == ' ' || (c >= 0x09 && c <= 0x0D)) return CharClass::space;
  return CharClass::other;
}
}  // namespace

#define TETRA_A8(c)                                                                               \
  ascii_class(c), ascii_class(c + 1), ascii_class(c + 2), ascii_class(c + 3), ascii_class(c + 4), \
      ascii_class(c + 5), ascii_class(c + 6), ascii_class(c + 7)
const CharClass kAsciiClass[128] = {TETRA_A8(0),  TETRA_A8(8),   TETRA_A8(16),  TETRA_A8(24),
                                    TETRA_A8(32), TETRA_A8(40),  TETRA_A8(48),  TETRA_A8(56),
                                    TETRA_A8(64), TETRA_A8(72),  TETRA_A8(80),  TETRA_A8(88),
                                    TETRA_A8(96), TETRA_A8(104), TETRA_A8(112), TETRA_A8(120)};
#undef TETRA_A8

}  // namespace detail

namespace {

struct Range {
  uint32_t lo, hi;
  CharClass cls;
};

constexpr CharClass L = CharClass::letter;
constexpr CharClass N = CharClass::number;
constexpr CharClass S = CharClass::space;

constexpr Range kRanges[] = {
#include "data/char_class_table.inc"
};

constexpr uint32_t kCodePoints = 0x110000;
constexpr uint32_t kBlockBits = 8;
constexpr uint32_t kBlock = 1u << kBlockBits;

// Stage 1 maps each 256-code-point block to one of the distinct blocks of stage 2 (127 of 4,352:
// most blocks are all "other", all letters or repeat another), so a lookup is two loads from
// 41 KB instead of a binary search over 800 ranges.
struct ClassTable {
  std::array<uint16_t, kCodePoints / kBlock> block;
  std::vector<CharClass> classes;
};

ClassTable build_class_table() {
  std::vector<CharClass> flat(kCodePoints, CharClass::other);
  for (uint32_t c = 0; c < 0x80; ++c) flat[c] = detail::kAsciiClass[c];
  for (const Range& r : kRanges) std::fill(&flat[r.lo], &flat[r.hi] + 1, r.cls);
  ClassTable t;
  for (uint32_t b = 0; b < t.block.size(); ++b) {
    const CharClass* blk = &flat[b * kBlock];
    size_t k = 0;
    const size_t distinct = t.classes.size() / kBlock;
    while (k < distinct && std::memcmp(&t.classes[k * kBlock], blk, kBlock) != 0) ++k;
    if (k == distinct) t.classes.insert(t.classes.end(), blk, blk + kBlock);
    t.block[b] = uint16_t(k);
  }
  return t;
}

}  // namespace

CharClass char_class(uint32_t cp) {
  if (cp < 0x80) return detail::kAsciiClass[cp];
  if (cp >= kCodePoints) return CharClass::other;
  static const ClassTable table = build_class_table();
  return table.classes[size_t(table.block[cp >> kBlockBits]) * kBlock + (cp & (kBlock - 1))];
}

namespace {
// Any piece ending in printable ASCII stops there, and a piece starting with a space does not
// depend on what precedes it, so text splits before such a space exactly as it does whole.
bool is_text_split(std::string_view text, size_t p) {
  const auto prev = static_cast<unsigned char>(text[p - 1]);
  return text[p] == ' ' && prev > 0x20 && prev < 0x7F;
}
}  // namespace

size_t find_text_split(std::string_view text, size_t from) {
  for (size_t p = std::max<size_t>(from, 1); p < text.size(); ++p) {
    if (is_text_split(text, p)) return p;
  }
  return std::string_view::npos;
}

size_t rfind_text_split(std::string_view text) {
  for (size_t p = text.size(); p-- > 1;) {
    if (is_text_split(text, p)) return p;
  }
  return std::string_view::npos;
}

std::vector<size_t> text_chunk_cuts(std::string_view text, size_t target) {
  std::vector<size_t> cuts{0};
  while (true) {
    const size_t p = find_text_split(text, cuts.back() + target);
    if (p == std::string_view::npos) break;
    cuts.push_back(p);
  }
  cuts.push_back(text.size());
  return cuts;
}

}  // namespace tetra
