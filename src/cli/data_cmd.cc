// tetra data prepare: text files to token shards (see docs/data.md).
#include <cstdio>
#include <string>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "data/prepare.h"

namespace tetra::cli {

namespace {

constexpr const char* kDataUsage =
    "usage: tetra data prepare --input PATH [--input PATH ...] --out DIR\n"
    "                          [--tokenizer byte|train:N|FILE.json] [--shard-tokens N]\n"
    "                          [--val-fraction F] [--threads N] [--allow-binary]\n"
    "                          [--special-tokens match|ordinary|refuse] [--no-progress]\n"
    "\n"
    "Tokenizes text files (folders are searched recursively; each file is one document) into\n"
    "llm.c token shards train_NNNNNN.bin / val_NNNNNN.bin, plus tokenizer.json and\n"
    "manifest.json, in DIR. A dataset already in DIR is replaced only once the new one is\n"
    "complete.\n";

int prepare_main(const Args& args) {
  ArgParser p(
      "data", "tetra data prepare", kDataUsage,
      {{.spec = {"--input", ValueKind::String, "\"\"", "a text file or a folder of them"},
        .metavar = "PATH",
        .repeatable = true},
       {{"--out", ValueKind::String, "\"\"", "output folder (created)"}, "DIR"},
       {{"--tokenizer", ValueKind::String, "\"byte\"",
         "byte: 256 bytes + <|endoftext|>; train:N: train a byte-level BPE of N tokens on the "
         "inputs; FILE.json: a Hugging Face GPT-2-style tokenizer.json"},
        "SPEC"},
       {{"--shard-tokens", ValueKind::Int, "100000000", "tokens per shard", "[1, 2147483647]"},
        "N"},
       {{"--val-fraction", ValueKind::Float, "0.05",
         "the last F of the input bytes becomes validation", "[0, 1)"},
        "F"},
       {{"--threads", ValueKind::Int, "0", "encoding threads; 0 = all cores", "[0, 1024]"}, "N"},
       {{"--allow-binary", ValueKind::Bool, "false",
         "tokenize inputs that look binary (a NUL byte, or more than 1% of the bytes not valid "
         "UTF-8) instead of refusing them"}},
       {{"--special-tokens", ValueKind::String, "\"match\"",
         "what the text of a special token such as <|endoftext|> in an input becomes: match = "
         "that token's id (as Hugging Face), ordinary = plain text, refuse = an error"},
        "MODE"},
       {{"--no-progress", ValueKind::Bool, "false", "no progress line"}}});
  if (!p.parse(args)) return 0;
  PrepareOptions o;
  o.inputs = p.all("--input");
  o.out_dir = p.s("--out");
  o.tokenizer = p.s("--tokenizer");
  o.shard_tokens = size_t(p.i("--shard-tokens"));
  o.val_fraction = p.f("--val-fraction");
  o.threads = int(p.i("--threads"));
  o.allow_binary = p.b("--allow-binary");
  o.progress = !p.b("--no-progress");
  o.special_tokens = parse_special_tokens(p.s("--special-tokens"), "data");
  TETRA_CHECK(!o.inputs.empty(), "[data] no --input given; see tetra data prepare --help");
  TETRA_CHECK(!o.out_dir.empty(), "[data] no --out given; see tetra data prepare --help");
  prepare_dataset(o);
  return 0;
}

}  // namespace

int data_main(const Args& args) {
  const char* usage = "usage: tetra data <subcommand>\n\n  prepare   text files to token shards\n";
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::fputs(usage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "prepare") return prepare_main(Args(args.begin() + 1, args.end()));
  fail(
      "[data] unknown subcommand '{}'; the data subcommand is: prepare (tetra data prepare --help)",
      args[0]);
}

}  // namespace tetra::cli
