// A compact approximation of Unicode's \p{L}, \p{N} and White_Space for GPT-2 pre-tokenization.
// Exact for ASCII and Latin-1; for other scripts it lists the letter and digit blocks by range,
// so some marks, punctuation and rare letters inside those blocks are misclassified (see
// docs/data.md). A misclassification only moves a piece boundary: encoding stays lossless.
#include <algorithm>
#include <iterator>

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

// Sorted, non-overlapping ranges above ASCII; anything not listed is "other".
constexpr Range kRanges[] = {
    {0x85, 0x85, S},     {0xA0, 0xA0, S},       {0xAA, 0xAA, L},       {0xB2, 0xB3, N},
    {0xB5, 0xB5, L},     {0xB9, 0xB9, N},       {0xBA, 0xBA, L},       {0xBC, 0xBE, N},
    {0xC0, 0xD6, L},     {0xD8, 0xF6, L},       {0xF8, 0x2C1, L},      {0x2C6, 0x2D1, L},
    {0x2E0, 0x2E4, L},   {0x2EC, 0x2EC, L},     {0x2EE, 0x2EE, L},     {0x370, 0x374, L},
    {0x376, 0x377, L},   {0x37A, 0x37D, L},     {0x37F, 0x37F, L},     {0x386, 0x386, L},
    {0x388, 0x3F5, L},   {0x3F7, 0x481, L},     {0x48A, 0x52F, L},     {0x531, 0x556, L},
    {0x559, 0x559, L},   {0x560, 0x588, L},     {0x5D0, 0x5EA, L},     {0x5EF, 0x5F2, L},
    {0x620, 0x64A, L},   {0x660, 0x669, N},     {0x66E, 0x66F, L},     {0x671, 0x6D3, L},
    {0x6D5, 0x6D5, L},   {0x6E5, 0x6E6, L},     {0x6EE, 0x6EF, L},     {0x6F0, 0x6F9, N},
    {0x6FA, 0x6FC, L},   {0x6FF, 0x6FF, L},     {0x904, 0x939, L},     {0x93D, 0x93D, L},
    {0x950, 0x950, L},   {0x958, 0x961, L},     {0x966, 0x96F, N},     {0x971, 0x980, L},
    {0x985, 0x9B9, L},   {0x9E6, 0x9EF, N},     {0xE01, 0xE30, L},     {0xE32, 0xE33, L},
    {0xE40, 0xE46, L},   {0xE50, 0xE59, N},     {0x10A0, 0x10FF, L},   {0x1100, 0x11FF, L},
    {0x1680, 0x1680, S}, {0x1E00, 0x1FBC, L},   {0x2000, 0x200A, S},   {0x2028, 0x2029, S},
    {0x202F, 0x202F, S}, {0x205F, 0x205F, S},   {0x2070, 0x2070, N},   {0x2071, 0x2071, L},
    {0x2074, 0x2079, N}, {0x207F, 0x207F, L},   {0x2080, 0x2089, N},   {0x2090, 0x209C, L},
    {0x2150, 0x2189, N}, {0x2460, 0x249B, N},   {0x24EA, 0x24FF, N},   {0x2776, 0x2793, N},
    {0x2C00, 0x2CE4, L}, {0x3000, 0x3000, S},   {0x3005, 0x3006, L},   {0x3007, 0x3007, N},
    {0x3021, 0x3029, N}, {0x3041, 0x3096, L},   {0x309D, 0x309F, L},   {0x30A1, 0x30FA, L},
    {0x30FC, 0x30FF, L}, {0x3105, 0x312F, L},   {0x3131, 0x318E, L},   {0x3400, 0x4DBF, L},
    {0x4E00, 0x9FFF, L}, {0xA000, 0xA48C, L},   {0xAC00, 0xD7A3, L},   {0xF900, 0xFAFF, L},
    {0xFB00, 0xFB06, L}, {0xFF10, 0xFF19, N},   {0xFF21, 0xFF3A, L},   {0xFF41, 0xFF5A, L},
    {0xFF66, 0xFFBE, L}, {0x1D400, 0x1D7CB, L}, {0x1D7CE, 0x1D7FF, N}, {0x20000, 0x2FA1F, L},
};

}  // namespace

CharClass char_class(uint32_t cp) {
  if (cp < 0x80) return detail::kAsciiClass[cp];
  const Range* end = std::end(kRanges);
  const Range* r = std::upper_bound(std::begin(kRanges), end, cp,
                                    [](uint32_t c, const Range& x) { return c < x.lo; });
  if (r == std::begin(kRanges)) return CharClass::other;
  --r;
  return cp <= r->hi ? r->cls : CharClass::other;
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
