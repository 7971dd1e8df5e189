// GPT-2's pre-tokenization, written out by hand instead of with a regex library:
//
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//
// Text is decoded as UTF-8; a byte that does not start a valid UTF-8 sequence is one character of
// class "other", so every byte sequence splits into pieces that concatenate back to it.
// \p{L}, \p{N} and \s are Unicode's General_Category L, N and White_Space for every code point,
// from a table generated out of the Unicode Character Database (char_class.cc), as Oniguruma, the
// regex engine of Hugging Face's tokenizers, defines them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace tetra {

enum class CharClass : uint8_t { letter, number, space, other };

/** Class of a Unicode code point: \p{L}, \p{N}, \s or other (unassigned code points too). */
CharClass char_class(uint32_t cp);

struct Utf8Char {
  uint32_t cp;   // code point, or kInvalidCp for a byte that is not valid UTF-8
  uint32_t len;  // bytes consumed: 1..4
  CharClass cls;
};

constexpr uint32_t kInvalidCp = 0xFFFFFFFFu;

namespace detail {
extern const CharClass kAsciiClass[128];
}

/** Decodes the character starting at s[i] (i < n); strict UTF-8 (no overlongs, no surrogates). */
inline Utf8Char utf8_char_at(const unsigned char* s, size_t n, size_t i) {
  const uint32_t b0 = s[i];
  if (b0 < 0x80) return {b0, 1, detail::kAsciiClass[b0]};
  auto cont = [&](size_t k) { return i + k < n && (s[i + k] & 0xC0) == 0x80; };
  uint32_t cp = 0, len = 0;
  if (b0 >= 0xC2 && b0 <= 0xDF && cont(1)) {
    cp = ((b0 & 0x1F) << 6) | (s[i + 1] & 0x3F);
    len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF && cont(1) && cont(2)) {
    const uint32_t b1 = s[i + 1];
    if ((b0 == 0xE0 && b1 < 0xA0) || (b0 == 0xED && b1 > 0x9F))
      return {kInvalidCp, 1, CharClass::other};
    cp = ((b0 & 0x0F) << 12) | ((b1 & 0x3F) << 6) | (s[i + 2] & 0x3F);
    len = 3;
  } else if (b0 >= 0xF0 && b0 <= 0xF4 && cont(1) && cont(2) && cont(3)) {
    const uint32_t b1 = s[i + 1];
    if ((b0 == 0xF0 && b1 < 0x90) || (b0 == 0xF4 && b1 > 0x8F))
      return {kInvalidCp, 1, CharClass::other};
    cp = ((b0 & 0x07) << 18) | ((b1 & 0x3F) << 12) | ((s[i + 2] & 0x3F) << 6) | (s[i + 3] & 0x3F);
    len = 4;
  } else {
    return {kInvalidCp, 1, CharClass::other};
  }
  return {cp, len, char_class(cp)};
}

/** Calls piece(std::string_view) for each GPT-2 pre-token of text, in order. */
template <typename F>
void pretokenize(std::string_view text, F&& piece) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const size_t start = i;
    if (s[i] == '\'' && i + 1 < n) {
      const unsigned char a = s[i + 1];
      const unsigned char b = i + 2 < n ? s[i + 2] : 0;
      size_t len = 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        len = 2;
      } else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
        len = 3;
      }
      if (len) {
        piece(text.substr(start, len));
        i += len;
        continue;
      }
    }
    Utf8Char c = utf8_char_at(s, n, i);
    if (c.cp == ' ' && i + 1 < n) {
      const Utf8Char d = utf8_char_at(s, n, i + 1);
      if (d.cls != CharClass::space) {
        i += 1;
        c = d;
      }
    }
    if (c.cls != CharClass::space) {
      // ` ?\p{L}+`, ` ?\p{N}+` or ` ?[^\s\p{L}\p{N}]+`: a run of one class.
      i += c.len;
      while (i < n) {
        const Utf8Char e = utf8_char_at(s, n, i);
        if (e.cls != c.cls) break;
        i += e.len;
      }
      piece(text.substr(start, i - start));
      continue;
    }
    // `\s+(?!\S)|\s+`: a whitespace run, less its last character when a non-space follows and
    // the run is longer than one (that character then leads the next piece).
    size_t last = i, count = 0;
    while (i < n) {
      const Utf8Char e = utf8_char_at(s, n, i);
      if (e.cls != CharClass::space) break;
      last = i;
      i += e.len;
      ++count;
    }
    if (i < n && count > 1) i = last;
    piece(text.substr(start, i - start));
  }
}

/** pretokenize(), with every piece longer than `max_bytes` (>= 4) given in parts of at most that
 * many bytes, each cut before a character (a UTF-8 sequence start) where one lies in its last
 * three bytes. A run of letters, digits or symbols without a space can be megabytes long; the cap
 * bounds what one piece costs (BPE training and encoding are superlinear in a piece's length). */
template <typename F>
void pretokenize_capped(std::string_view text, size_t max_bytes, F&& piece) {
  pretokenize(text, [&](std::string_view p) {
    while (p.size() > max_bytes) {
      size_t cut = max_bytes;
      for (size_t back = 0; back < 3 && (static_cast<unsigned char>(p[cut]) & 0xC0) == 0x80;
           ++back) {
        --cut;
      }
      if ((static_cast<unsigned char>(p[cut]) & 0xC0) == 0x80) cut = max_bytes;
      piece(p.substr(0, cut));
      p.remove_prefix(cut);
    }
    if (!p.empty()) piece(p);
  });
}

/** First offset p >= from where text may be cut without changing its pre-tokenization (and so
 * its encoding): a space after a printable ASCII character. Returns npos when there is none. */
size_t find_text_split(std::string_view text, size_t from);

/** The last such offset in text, or npos. */
size_t rfind_text_split(std::string_view text);

/** Offsets 0 = c0 < c1 < ... < ck = text.size() cutting text at split points into chunks of at
 * least `target` bytes (the last may be shorter), for encoding chunks independently. */
std::vector<size_t> text_chunk_cuts(std::string_view text, size_t target);

}  // namespace tetra
