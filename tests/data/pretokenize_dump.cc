// Prints the byte length of each GPT-2 pre-token of a file, one per line, for the Hugging Face
// compatibility test (hf_compat_test.py) to compare with HF's ByteLevel pre-tokenizer.
//
//   pretokenize_dump FILE
#include <cstdio>

#include "core/error.h"
#include "core/read_file.h"
#include "data/pretokenize.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: pretokenize_dump FILE\n");
    return 2;
  }
  try {
    const std::string text = tetra::read_small_file(argv[1], 1ull << 30, "pretokenize_dump",
                                                    "a text file", "pass a text file");
    tetra::pretokenize(text, [](std::string_view p) { std::printf("%zu\n", p.size()); });
  } catch (const tetra::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  return 0;
}
