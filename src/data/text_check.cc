#include "data/text_check.h"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "core/error.h"

namespace tetra {

namespace {

// Length of the valid UTF-8 sequence at s[i] (i < n, s[i] >= 0x80), or 0 when it is not one:
// the same rules as utf8_char_at (no overlong forms, surrogates or code points past U+10FFFF),
// without the character-class lookup this check does not need.
size_t utf8_sequence(const unsigned char* s, size_t n, size_t i) {
  const unsigned b0 = s[i];
  auto cont = [&](size_t k) { return i + k < n && (s[i + k] & 0xC0) == 0x80; };
  if (b0 >= 0xC2 && b0 <= 0xDF) return cont(1) ? 2 : 0;
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    if (!cont(1) || !cont(2)) return 0;
    const unsigned b1 = s[i + 1];
    return (b0 == 0xE0 && b1 < 0xA0) || (b0 == 0xED && b1 > 0x9F) ? 0 : 3;
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    if (!cont(1) || !cont(2) || !cont(3)) return 0;
    const unsigned b1 = s[i + 1];
    return (b0 == 0xF0 && b1 < 0x90) || (b0 == 0xF4 && b1 > 0x8F) ? 0 : 4;
  }
  return 0;
}

}  // namespace

size_t first_invalid_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    if (s[i] < 0x80) {
      ++i;
      continue;
    }
    const size_t len = utf8_sequence(s, n, i);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string binary_input_reason(const std::string& path) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  TETRA_CHECK(f != nullptr, "[data] cannot open input {} ({}); check that it is readable", path,
              std::strerror(errno));
  std::fseek(f.get(), 0, SEEK_END);
  const long end = std::ftell(f.get());
  std::fseek(f.get(), 0, SEEK_SET);
  const double size = end > 0 ? double(end) : 1.0;

  std::vector<unsigned char> buf(1 << 20);
  size_t carry = 0;     // bytes of a sequence cut by the previous block, moved to buf's front
  uint64_t offset = 0;  // file offset of buf[0]
  uint64_t invalid = 0;
  for (;;) {
    const size_t got = std::fread(buf.data() + carry, 1, buf.size() - carry, f.get());
    TETRA_CHECK(!std::ferror(f.get()), "[data] reading input {} failed", path);
    const size_t n = carry + got;
    const bool last = got == 0 || std::feof(f.get());
    if (const void* nul = std::memchr(buf.data() + carry, 0, got)) {
      const uint64_t at = offset + uint64_t(static_cast<const unsigned char*>(nul) - buf.data());
      return fmt::format(
          "a NUL byte at offset {} (binary data, or UTF-16 text: convert that to UTF-8)", at);
    }
    // A sequence may continue into the next block: stop 3 bytes short unless this is the end.
    const size_t stop = last ? n : (n > 3 ? n - 3 : 0);
    size_t i = 0;
    while (i < stop) {
      // ASCII, eight bytes at a time.
      if (i + 8 <= stop) {
        uint64_t word;
        std::memcpy(&word, buf.data() + i, 8);
        if ((word & 0x8080808080808080ull) == 0) {
          i += 8;
          continue;
        }
      }
      if (buf[i] < 0x80) {
        ++i;
        continue;
      }
      const size_t len = utf8_sequence(buf.data(), n, i);
      invalid += len == 0;
      i += len == 0 ? 1 : len;
    }
    if (double(invalid) > kMaxInvalidUtf8Share * size) {
      return fmt::format(
          "{} bytes in its first {} are not valid UTF-8, more than {:g}% of its {} bytes (binary "
          "data, or text in another encoding: convert that to UTF-8, e.g. iconv -f latin1 -t "
          "utf-8)",
          invalid, offset + i, 100 * kMaxInvalidUtf8Share, end);
    }
    if (last) return "";
    carry = n - i;
    std::memmove(buf.data(), buf.data() + i, carry);
    offset += i;
  }
}

}  // namespace tetra
