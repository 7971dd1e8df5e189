// tetra data prepare: text files to token shards (see docs/data.md).
#include <cstdio>
#include <string>

#include "cli/commands.h"
#include "cli/flag_values.h"
#include "core/error.h"
#include "data/prepare.h"

namespace tetra::cli {

namespace {

constexpr const char* kUsage =
    "usage: tetra data prepare --input PATH [--input PATH ...] --out DIR\n"
    "                          [--tokenizer byte|train:N|FILE.json] [--shard-tokens N]\n"
    "                          [--val-fraction F] [--threads N] [--allow-binary]\n"
    "                          [--no-progress]\n"
    "\n"
    "Tokenizes text files (folders are searched recursively; each file is one document) into\n"
    "llm.c token shards train_NNNNNN.bin / val_NNNNNN.bin, plus tokenizer.json and\n"
    "manifest.json, in DIR.\n"
    "\n"
    "  --input PATH        a text file or a folder of them (repeatable)\n"
    "  --out DIR           output folder (created; a dataset already there is replaced only\n"
    "                      once the new one is complete)\n"
    "  --tokenizer SPEC    byte (default): 256 bytes + <|endoftext|>;\n"
    "                      train:N: train a byte-level BPE of N tokens on the inputs;\n"
    "                      FILE.json: a Hugging Face GPT-2-style tokenizer.json\n"
    "  --shard-tokens N    tokens per shard (default 100000000)\n"
    "  --val-fraction F    the last F of the input bytes becomes validation (default 0.05)\n"
    "  --threads N         encoding threads (default: all cores)\n"
    "  --allow-binary      tokenize inputs that look binary (a NUL byte, or more than 1% of\n"
    "                      the bytes not valid UTF-8) instead of refusing them\n"
    "  --no-progress       no progress line\n";

int prepare_main(const Args& args) {
  PrepareOptions o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (a == "--no-progress") {
      o.progress = false;
      continue;
    }
    if (a == "--allow-binary") {
      o.allow_binary = true;
      continue;
    }
    std::string key = a, value;
    if (const size_t eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      key = a.substr(0, eq);
      value = a.substr(eq + 1);
    } else {
      TETRA_CHECK(i + 1 < args.size(), "[data] {} needs a value; see tetra data prepare --help", a);
      value = args[++i];
    }
    if (key == "--input") {
      o.inputs.push_back(value);
    } else if (key == "--out") {
      o.out_dir = value;
    } else if (key == "--tokenizer") {
      o.tokenizer = value;
    } else if (key == "--shard-tokens") {
      o.shard_tokens = size_t(flag_int("data", key, value, 0));
    } else if (key == "--val-fraction") {
      o.val_fraction = flag_double("data", key, value, "0.05");
    } else if (key == "--threads") {
      o.threads = int(flag_int("data", key, value, 0));
    } else {
      fail("[data] unknown option {}; see tetra data prepare --help", key);
    }
  }
  TETRA_CHECK(!o.inputs.empty(), "[data] no --input given; see tetra data prepare --help");
  TETRA_CHECK(!o.out_dir.empty(), "[data] no --out given; see tetra data prepare --help");
  prepare_dataset(o);
  return 0;
}

}  // namespace

int data_main(const Args& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::fputs("usage: tetra data <subcommand>\n\n  prepare   text files to token shards\n\n",
               args.empty() ? stderr : stdout);
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "prepare") return prepare_main(Args(args.begin() + 1, args.end()));
  fail("[data] unknown subcommand '{}'; the data subcommand is: prepare", args[0]);
}

}  // namespace tetra::cli
