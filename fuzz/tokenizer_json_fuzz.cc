// tokenizer.json reader on arbitrary text: either refused with tetra::Error, or a tokenizer that
// round-trips text (decode(encode(b)) == b) and whose saved form loads to the same hash.
#include <cstdint>
#include <string>
#include <string_view>

#include "core/error.h"
#include "data/tokenizer.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tetra::fuzz::quiet_logs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tetra;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::unique_ptr<Tokenizer> tok;
  try {
    tok = parse_tokenizer_json(text, "<fuzz>");
  } catch (const Error&) {
    return 0;
  }
  // The input itself is a handy sample of arbitrary bytes to encode.
  const std::string sample = "Hello, world! it's 42 \xc3\xa9t\xc3\xa9\n\t " + std::string(text);
  const auto ids = tok->encode(sample);
  for (uint32_t id : ids) fuzz::require(id < tok->vocab_size(), "ids inside the vocabulary");
  fuzz::require(tok->decode(ids) == sample, "decode(encode(b)) == b");
  try {
    fuzz::require(parse_tokenizer_json(tok->to_json(), "<saved>")->hash() == tok->hash(),
                  "saved form loads to the same hash");
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    fuzz::require(false, "saved form loads");
  }
  return 0;
}
