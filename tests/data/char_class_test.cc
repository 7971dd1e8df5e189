// The pre-tokenizer's character classes against the Unicode Character Database itself, read here
// from Debian's unicode-data files (independently of scripts/gen_char_class.py, which made the
// table): \p{L} = General_Category L*, \p{N} = N*, \s = White_Space, for every code point.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "data/pretokenize.h"

namespace tetra {
namespace {

constexpr uint32_t kCodePoints = 0x110000;

std::vector<std::string> split(const std::string& line, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(line);
  for (std::string f; std::getline(ss, f, sep);) out.push_back(f);
  return out;
}

// General_Category of every code point ("Cn" where UnicodeData.txt lists none).
std::vector<std::string> general_categories() {
  std::vector<std::string> cat(kCodePoints, "Cn");
  std::ifstream f(TETRA_UCD_DIR "/UnicodeData.txt");
  EXPECT_TRUE(f.good()) << TETRA_UCD_DIR
      "/UnicodeData.txt is missing: apt-get install unicode-data";
  uint32_t range_first = 0;
  for (std::string line; std::getline(f, line);) {
    const auto fields = split(line, ';');
    const uint32_t cp = uint32_t(std::stoul(fields.at(0), nullptr, 16));
    const std::string& name = fields.at(1);
    if (name.ends_with(", First>")) {
      range_first = cp;
      continue;
    }
    const uint32_t first = name.ends_with(", Last>") ? range_first : cp;
    for (uint32_t c = first; c <= cp; ++c) cat[c] = fields.at(2);
  }
  return cat;
}

std::vector<bool> white_space() {
  std::vector<bool> ws(kCodePoints, false);
  std::ifstream f(TETRA_UCD_DIR "/PropList.txt");
  EXPECT_TRUE(f.good()) << TETRA_UCD_DIR "/PropList.txt is missing: apt-get install unicode-data";
  for (std::string line; std::getline(f, line);) {
    const auto fields = split(line.substr(0, line.find('#')), ';');
    // "0085 ; White_Space"; Pattern_White_Space is another property.
    if (fields.size() != 2 || fields[1].find_first_not_of(' ') == std::string::npos ||
        fields[1].substr(fields[1].find_first_not_of(' '), 12) != "White_Space ") {
      continue;
    }
    const auto span = fields[0];
    const size_t dots = span.find("..");
    const uint32_t lo = uint32_t(std::stoul(span.substr(0, dots), nullptr, 16));
    const uint32_t hi =
        dots == std::string::npos ? lo : uint32_t(std::stoul(span.substr(dots + 2), nullptr, 16));
    for (uint32_t c = lo; c <= hi; ++c) ws[c] = true;
  }
  return ws;
}

const char* name(CharClass c) {
  switch (c) {
    case CharClass::letter:
      return "letter";
    case CharClass::number:
      return "number";
    case CharClass::space:
      return "space";
    case CharClass::other:
      return "other";
  }
  return "?";
}

TEST(CharClass, EqualsTheUnicodeCharacterDatabaseForEveryCodePoint) {
  const auto cat = general_categories();
  const auto ws = white_space();
  size_t assigned = 0, letters = 0, numbers = 0, mismatches = 0;
  for (uint32_t cp = 0; cp < kCodePoints; ++cp) {
    CharClass want = CharClass::other;
    if (ws[cp]) {
      want = CharClass::space;
    } else if (cat[cp][0] == 'L') {
      want = CharClass::letter;
    } else if (cat[cp][0] == 'N') {
      want = CharClass::number;
    }
    assigned += cat[cp] != "Cn";
    letters += want == CharClass::letter;
    numbers += want == CharClass::number;
    const CharClass got = char_class(cp);
    if (got != want && ++mismatches <= 20) {
      ADD_FAILURE() << "U+" << std::hex << cp << " (" << cat[cp] << "): table says " << name(got)
                    << ", the UCD " << name(want);
    }
  }
  EXPECT_EQ(mismatches, 0u);
  // Unicode 15.0: 149,186 graphic, format and control characters plus 137,468 private use.
  EXPECT_GT(assigned, 280000u);
  EXPECT_GT(letters, 130000u);
  EXPECT_GT(numbers, 1700u);
  EXPECT_EQ(char_class(0x110000), CharClass::other);
  EXPECT_EQ(char_class(kInvalidCp), CharClass::other);
}

// The example: in Tamil "க்ரேக்" the virama (U+0BCD) and the vowel sign (U+0BC7) are
// marks, not letters, so Hugging Face cuts the word into six pieces.
TEST(CharClass, CombiningMarksEndALetterRunAsInHuggingFace) {
  std::vector<std::string> pieces;
  pretokenize("க்ரேக்", [&](std::string_view p) { pieces.emplace_back(p); });
  EXPECT_EQ(pieces, (std::vector<std::string>{"க", "்", "ர", "ே", "க", "்"}));
}

}  // namespace
}  // namespace tetra
