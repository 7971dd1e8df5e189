// Tokenizer throughput: BPE training time, then encode MB/s at 1 and 2 threads, with memcpy over
// the same text as the ceiling for comparison.
//
//   tokenizer_bench [TEXT_FILE] [--tokenizer byte|train:N|FILE.json] [--repeat N]
//
// Without a file it generates 8 MB of pseudo-English; the default tokenizer is train:4096.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/timer.h"
#include "data/bpe_train.h"
#include "data/tokenizer.h"

namespace {

std::string generated_text(size_t bytes) {
  static const char* kWords[] = {
      "the",     "of",     "and",  "to",    "in",    "that",    "is",      "was",    "for",
      "with",    "he",     "it",   "as",    "on",    "time",    "people",  "would",  "government",
      "because", "number", "1961", "which", "their", "through", "however", "système"};
  std::mt19937 rng(0);
  std::string s;
  while (s.size() < bytes) {
    s += kWords[rng() % std::size(kWords)];
    s += (rng() % 12 == 0) ? ".\n" : (rng() % 8 == 0 ? ", " : " ");
  }
  return s;
}

double best_seconds(int repeat, const std::function<void()>& f) {
  double best = 1e30;
  for (int r = 0; r < repeat; ++r) {
    tetra::Stopwatch sw;
    f();
    best = std::min(best, sw.elapsed_s());
  }
  return best;
}

int run(int argc, char** argv) {
  std::string path, spec = "train:4096";
  int repeat = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--tokenizer" && i + 1 < argc) {
      spec = argv[++i];
    } else if (a == "--repeat" && i + 1 < argc) {
      repeat = std::max(1, std::atoi(argv[++i]));
    } else if (a.rfind("--", 0) == 0) {
      tetra::fail(
          "[bench] unknown option {}; usage: tokenizer_bench [FILE] [--tokenizer SPEC] "
          "[--repeat N]",
          a);
    } else {
      path = a;
    }
  }
  std::string text;
  if (path.empty()) {
    text = generated_text(8 << 20);
    path = "<generated>";
  } else {
    std::ifstream in(path, std::ios::binary);
    TETRA_CHECK(in, "[bench] cannot read {}", path);
    std::stringstream s;
    s << in.rdbuf();
    text = s.str();
  }
  const double mb = text.size() / 1e6;
  std::printf("text: %s, %.2f MB\n", path.c_str(), mb);

  std::unique_ptr<tetra::Tokenizer> tok;
  if (spec.rfind("train:", 0) == 0) {
    const size_t vocab = std::stoul(spec.substr(6));
    tetra::Stopwatch sw;
    tetra::BpeTrainer trainer(1);
    trainer.add_text(text);
    tok = std::make_unique<tetra::BpeTokenizer>(trainer.train(vocab));
    std::printf("bpe train (1 thread): vocab %zu, %zu distinct words, %.2f s\n", tok->vocab_size(),
                trainer.num_words(), sw.elapsed_s());
  } else {
    tok = tetra::load_tokenizer(spec);
  }

  std::vector<char> copy(text.size());
  const double t_copy = best_seconds(repeat, [&] {
    std::memcpy(copy.data(), text.data(), text.size());
    asm volatile("" : : "r"(copy.data()) : "memory");
  });
  std::printf("memcpy (ceiling):      %10.1f MB/s\n", mb / t_copy);

  std::vector<uint32_t> ids;
  double one = 0;
  for (int threads : {1, 2}) {
    const double t =
        best_seconds(repeat, [&] { ids = tetra::encode_parallel(*tok, text, threads); });
    if (threads == 1) one = mb / t;
    std::printf(
        "encode %s, %d thread%s: %8.1f MB/s  (%.2f bytes/token, %.0fx below memcpy%s)\n",
        tok->name().c_str(), threads, threads == 1 ? " " : "s", mb / t,
        double(text.size()) / ids.size(), (mb / t_copy) / (mb / t),
        threads == 2 ? fmt::format(", {:.2f}x the 1-thread rate", (mb / t) / one).c_str() : "");
  }
  std::string back;
  const double t_dec = best_seconds(repeat, [&] { back = tok->decode(ids); });
  std::printf("decode, 1 thread:      %10.1f MB/s\n", mb / t_dec);
  TETRA_CHECK(back == text, "[bench] decode(encode(text)) differs from the text");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const tetra::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
