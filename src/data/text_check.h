// Telling text from binary input before `tetra data prepare` tokenizes it (docs/data.md).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace tetra {

/** Inputs whose invalid UTF-8 bytes exceed this share of the file are taken for binary. Text in
 * UTF-8 has none; a stray byte or two (a Latin-1 character in an otherwise UTF-8 file) stays far
 * below it, while compressed or random data is about half invalid. */
constexpr double kMaxInvalidUtf8Share = 0.01;

/** Why the file at `path` looks binary, or "" when it reads as UTF-8 text: a NUL byte (binary
 * formats, UTF-16 text) or more than kMaxInvalidUtf8Share of its bytes not valid UTF-8. Stops
 * reading as soon as the answer is known. Throws tetra::Error when the file cannot be read. */
std::string binary_input_reason(const std::string& path);

/** Offset of the first byte of `text` that does not start a valid UTF-8 sequence (strict: no
 * overlong forms, surrogates or code points past U+10FFFF; a sequence cut short at the end is
 * invalid), or std::string_view::npos when all of it is UTF-8. */
size_t first_invalid_utf8(std::string_view text);

}  // namespace tetra
