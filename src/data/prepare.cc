// `tetra data prepare`: read text files in order, encode them in parallel, cut the token stream
// into train and validation shards, and describe the result in manifest.json.
#include "data/prepare.h"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <span>
#include <thread>

#include "core/atomic_file.h"
#include "core/dir_lock.h"
#include "core/error.h"
#include "core/log.h"
#include "core/paths.h"
#include "core/staged_dir.h"
#include "core/timer.h"
#include "data/bpe_train.h"
#include "data/pretokenize.h"
#include "data/text_check.h"
#include "data/token_shard.h"
#include "data/tokenizer.h"

namespace tetra {

namespace fs = std::filesystem;

namespace {

constexpr size_t kBlockBytes = 32 << 20;  // text read and encoded per step

std::string file_xxh3(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  TETRA_CHECK(f, "[data] cannot re-read {} to checksum it", path);
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  std::vector<char> buf(1 << 20);
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) XXH3_64bits_update(st, buf.data(), n);
  const bool ok = !std::ferror(f);
  std::fclose(f);
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  TETRA_CHECK(ok, "[data] reading {} back failed", path);
  return fmt::format("{:016x}", h);
}

// Collects one split's tokens and writes a shard each time shard_tokens are ready.
class ShardWriter {
 public:
  ShardWriter(std::string dir, std::string prefix, size_t shard_tokens, size_t vocab)
      : dir_(std::move(dir)),
        prefix_(std::move(prefix)),
        shard_tokens_(shard_tokens),
        vocab_(vocab),
        version_(shard_version_for_vocab(vocab)) {}

  void push(std::span<const uint32_t> tokens) {
    while (!tokens.empty()) {
      const size_t take = std::min(tokens.size(), shard_tokens_ - buf_.size());
      buf_.insert(buf_.end(), tokens.begin(), tokens.begin() + take);
      tokens = tokens.subspan(take);
      if (buf_.size() == shard_tokens_) flush();
    }
  }
  void push(uint32_t token) { push(std::span<const uint32_t>(&token, 1)); }
  void finish() {
    if (!buf_.empty()) flush();
  }
  size_t total() const { return total_; }
  const std::vector<ShardInfo>& shards() const { return shards_; }

 private:
  void flush() {
    const uint32_t max_token = *std::max_element(buf_.begin(), buf_.end());
    TETRA_CHECK(max_token < vocab_,
                "[data] token {} is outside the tokenizer's vocabulary ({}); the tokenizer file "
                "is inconsistent",
                max_token, vocab_);
    ShardInfo info;
    info.file = fmt::format("{}_{:06d}.bin", prefix_, shards_.size());
    info.tokens = buf_.size();
    // The vocabulary's format, not the one these tokens would fit: every shard of the dataset
    // has the same one.
    info.version = version_;
    const std::string path = (fs::path(dir_) / info.file).string();
    write_token_shard(path, buf_, version_);
    info.xxh3 = file_xxh3(path);
    total_ += buf_.size();
    shards_.push_back(std::move(info));
    buf_.clear();
  }

  std::string dir_, prefix_;
  size_t shard_tokens_, vocab_;
  int version_;
  std::vector<uint32_t> buf_;
  std::vector<ShardInfo> shards_;
  size_t total_ = 0;
};

// Reads a file block by block, each block ending where a cut cannot change the encoding.
class BlockReader {
 public:
  explicit BlockReader(const std::string& path) : path_(path), in_(path, std::ios::binary) {
    TETRA_CHECK(in_, "[data] cannot open input {}; check that it exists and is readable", path);
    std::error_code ec;
    left_ = fs::file_size(path, ec);
  }
  // False at the end of the file.
  bool next(std::string& block) {
    if (done_) return false;
    std::string buf = std::move(carry_);
    const size_t old = buf.size();
    // Ask for one byte past the expected end so the last block also sees end-of-file.
    const size_t want = std::min(kBlockBytes, left_ + 1);
    buf.resize(old + want);
    in_.read(buf.data() + old, static_cast<std::streamsize>(want));
    TETRA_CHECK(!in_.bad(), "[data] reading {} failed", path_);
    const auto got = static_cast<size_t>(in_.gcount());
    buf.resize(old + got);
    left_ -= std::min(left_, got);
    carry_.clear();
    if (in_.eof()) {
      done_ = true;
    } else {
      // Cut at the last safe point; a block without one (no spaces in 32 MB) is cut as is.
      const size_t cut = rfind_text_split(buf);
      if (cut != std::string_view::npos && cut > 0) {
        carry_ = buf.substr(cut);
        buf.resize(cut);
      }
    }
    block = std::move(buf);
    return !block.empty() || !done_;
  }

 private:
  std::string path_;
  std::ifstream in_;
  std::string carry_;
  size_t left_ = 0;  // bytes not yet read, by the file size at open
  bool done_ = false;
};

bool is_hidden(const fs::path& p) {
  const std::string name = p.filename().string();
  return !name.empty() && name[0] == '.';
}

// The files `tetra data prepare` writes (the lock file included); an output folder holding
// anything else is refused.
bool is_dataset_file(const std::string& name) {
  static const std::regex kNames(
      R"(((train|val)_\d{6}\.bin|manifest\.json|tokenizer\.json)(\.tmp\.\d+)?)");
  return std::regex_match(name, kNames) || name == DirLock::file_of("").filename().string();
}

// The tokenizer to use, validated before anything is read or written: a vocabulary size to
// train, or a loaded tokenizer.
struct TokenizerChoice {
  size_t train_vocab = 0;  // > 0: train a BPE of this size on the inputs
  std::unique_ptr<Tokenizer> loaded;
};

TokenizerChoice check_tokenizer_spec(const std::string& spec) {
  TokenizerChoice c;
  if (spec.rfind("train:", 0) == 0) {
    const std::string n = spec.substr(6);
    size_t used = 0;
    try {
      c.train_vocab = std::stoul(n, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TETRA_CHECK(
        used == n.size() && n[0] != '-' && c.train_vocab >= 257 && c.train_vocab <= 0xFFFFFFFEu,
        "[data] --tokenizer {}: expected train:<vocab size> with a size of at least 257, "
        "e.g. train:4096",
        spec);
    return c;
  }
  std::error_code ec;
  TETRA_CHECK(spec == "byte" || fs::exists(spec, ec),
              "[data] --tokenizer {}: no such file; expected byte, train:<vocab size> (e.g. "
              "train:4096) or the path of a tokenizer.json",
              spec);
  c.loaded = load_tokenizer(spec);
  return c;
}

// Refuses output folders whose replacement would lose data: the input itself, a folder inside an
// input (a re-run would read the dataset as input), a folder holding an input, or one holding
// files that are not a dataset's.
void check_output_folder(const PrepareOptions& o, const fs::path& out) {
  TETRA_CHECK(out.has_relative_path(), "[data] --out {} is the root folder; choose a new folder",
              o.out_dir);
  for (const auto& in : o.inputs) {
    const fs::path cin = resolved_path(in);
    TETRA_CHECK(out != cin, "[data] --out {} is the input {}; write the dataset to another folder",
                o.out_dir, in);
    TETRA_CHECK(!is_within(out, cin),
                "[data] --out {} lies inside the input folder {}; choose an --out outside it (the "
                "dataset would be read as input by the next run)",
                o.out_dir, in);
    TETRA_CHECK(!is_within(cin, out),
                "[data] input {} lies inside --out {}, which is replaced as a whole once the new "
                "dataset is complete; move the input out of it or choose another --out",
                in, o.out_dir);
  }
  std::error_code ec;
  const fs::file_status st = fs::status(out, ec);
  if (!fs::exists(st)) return;
  TETRA_CHECK(fs::is_directory(st), "[data] --out {} exists and is not a folder; choose a folder",
              o.out_dir);
  for (auto it = fs::directory_iterator(out, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    TETRA_CHECK(is_dataset_file(name) && it->is_regular_file(ec),
                "[data] --out {} holds '{}', which is not part of a tetra dataset; the folder is "
                "replaced as a whole, so choose a new or empty folder or move '{}' away",
                o.out_dir, name, name);
  }
  TETRA_CHECK(!ec, "[data] cannot list --out {}: {}", o.out_dir, ec.message());
}

// The lock on --out (core/dir_lock.h), held from before the staging folder is made until the new
// dataset is in place: a second prepare into the same folder is refused, naming this one, instead
// of both running and one silently replacing the other. A missing --out is created to hold the
// lock file, and removed again when the run fails before its dataset is in place.
class OutputLock {
 public:
  OutputLock(const fs::path& out, const std::string& out_arg) : out_(out) {
    std::error_code ec;
    fs::create_directories(out.parent_path(), ec);
    created_ = fs::create_directory(out, ec);
    TETRA_CHECK(!ec && fs::is_directory(out),
                "[data] cannot create --out {} ({}); choose a writable --out", out_arg,
                ec.message());
    lock_ = DirLock::acquire(out, "tetra data prepare --out " + out_arg, "data");
  }
  ~OutputLock() {
    if (!created_ || committed_) return;
    // Still held here (lock_ is released after this body): only our own empty folder goes.
    std::error_code ec;
    fs::remove(DirLock::file_of(out_), ec);
    fs::remove(out_, ec);  // removes nothing unless it is empty
  }
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;

  void committed() { committed_ = true; }

 private:
  fs::path out_;
  DirLock lock_;
  bool created_ = false;
  bool committed_ = false;
};

// The staging folder of a prepare into `out` (core/staged_dir.h), beside it. Made only under the
// output's lock (OutputLock), so no other prepare into `out` is running: the leftovers of other
// runs were left by a run that was killed. They are named, not deleted: .old-* may hold the only
// copy of the previous dataset (a run killed between its two renames).
fs::path dataset_staging(const fs::path& out) {
  std::error_code ec;
  const std::string prefix = fmt::format(".{}.", out.filename().string());
  for (auto it = fs::directory_iterator(out.parent_path(), ec);
       !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const std::string rest = name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : "";
    if (rest.rfind("prepare-", 0) == 0 && rest != fmt::format("prepare-{}", ::getpid())) {
      log_warn(
          "[data] {} is the unfinished dataset of a tetra data prepare that was killed (none is "
          "running on {} now: this run holds its lock); delete it",
          it->path().string(), out.string());
    } else if (rest.rfind("old-", 0) == 0) {
      log_warn(
          "[data] {} is a dataset a killed tetra data prepare moved aside from {}; if {} is "
          "missing or not the dataset you want, move it back, else delete it",
          it->path().string(), out.string(), out.string());
    }
  }
  return out.parent_path() /
         fmt::format(".{}.prepare-{}", out.filename().string(), static_cast<long>(::getpid()));
}

std::unique_ptr<Tokenizer> train_tokenizer(size_t vocab, const std::vector<std::string>& files,
                                           int threads) {
  Stopwatch sw;
  BpeTrainer trainer(threads);
  for (const auto& f : files) {
    BlockReader reader(f);
    std::string block;
    while (reader.next(block)) trainer.add_text(block);
  }
  auto tok = std::make_unique<BpeTokenizer>(trainer.train(vocab));
  log_info("[data] trained a BPE of {} tokens on {} distinct words in {:.1f} s", tok->vocab_size(),
           trainer.num_words(), sw.elapsed_s());
  return tok;
}

}  // namespace

std::vector<std::string> list_input_files(const std::vector<std::string>& inputs) {
  TETRA_CHECK(!inputs.empty(), "[data] no input given; pass --input FILE_OR_FOLDER (repeatable)");
  std::error_code ec;
  std::vector<std::string> files;
  for (const auto& in : inputs) {
    const fs::path p(in);
    TETRA_CHECK(fs::exists(p, ec), "[data] input {} does not exist; check the --input path", in);
    if (fs::is_regular_file(p, ec)) {
      files.push_back(p.string());
      continue;
    }
    TETRA_CHECK(fs::is_directory(p, ec), "[data] input {} is neither a file nor a folder", in);
    std::vector<std::string> found;
    for (auto it = fs::recursive_directory_iterator(p, ec);
         it != fs::recursive_directory_iterator(); it.increment(ec)) {
      TETRA_CHECK(!ec, "[data] listing {} failed: {}", in, ec.message());
      if (is_hidden(it->path())) {
        if (it->is_directory(ec)) it.disable_recursion_pending();
        continue;
      }
      if (it->is_regular_file(ec)) found.push_back(it->path().string());
    }
    TETRA_CHECK(!ec, "[data] listing {} failed: {}", in, ec.message());
    TETRA_CHECK(!found.empty(), "[data] input folder {} holds no files", in);
    std::sort(found.begin(), found.end());
    files.insert(files.end(), found.begin(), found.end());
  }
  return files;
}

PrepareResult prepare_dataset(const PrepareOptions& o) {
  Stopwatch sw;
  // Everything that can be checked is checked before anything is written: a mistake costs no
  // data, and the old dataset in --out stays as it was until the new one is complete.
  TETRA_CHECK(!o.out_dir.empty(), "[data] no output folder; pass --out DIR");
  TETRA_CHECK(o.shard_tokens >= 1 && o.shard_tokens <= 0x7FFFFFFF,
              "[data] --shard-tokens {} is out of range; use 1 .. 2147483647 (llm.c headers "
              "count tokens in int32)",
              o.shard_tokens);
  TETRA_CHECK(o.val_fraction >= 0 && o.val_fraction < 1,
              "[data] --val-fraction {} is out of range; use a value in [0, 1), e.g. 0.05",
              o.val_fraction);
  const int threads = o.threads > 0
                          ? o.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  TokenizerChoice choice = check_tokenizer_spec(o.tokenizer);

  PrepareResult r;
  const std::vector<std::string> files = list_input_files(o.inputs);
  r.input_files = files.size();
  std::error_code ec;
  for (const auto& f : files) {
    const uintmax_t size = fs::file_size(f, ec);
    TETRA_CHECK(!ec, "[data] cannot read the size of {}: {}", f, ec.message());
    r.input_bytes += size;
  }
  TETRA_CHECK(r.input_bytes > 0, "[data] the {} input file(s) are all empty; nothing to tokenize",
              files.size());
  const fs::path out = resolved_path(o.out_dir);
  check_output_folder(o, out);
  if (!o.allow_binary) {
    for (const auto& f : files) {
      const std::string why = binary_input_reason(f);
      TETRA_CHECK(why.empty(),
                  "[data] input {} looks binary: {}; tetra data prepare tokenizes text, so remove "
                  "it from the inputs, or pass --allow-binary to tokenize it anyway",
                  f, why);
    }
  }

  OutputLock lock(out, o.out_dir);
  StagedDir staging(out, dataset_staging(out), "data", "dataset");
  try {
    const std::unique_ptr<Tokenizer> tok = choice.train_vocab > 0
                                               ? train_tokenizer(choice.train_vocab, files, threads)
                                               : std::move(choice.loaded);
    tok->save((staging.path() / "tokenizer.json").string());
    r.tokenizer_hash = tok->hash();
    r.vocab_size = tok->vocab_size();
    const uint32_t eot = tok->eot_token();

    // Validation is the tail of the input bytes, cut at the first safe point at or after `cut`.
    const size_t cut =
        r.input_bytes - static_cast<size_t>(std::llround(o.val_fraction * double(r.input_bytes)));
    ShardWriter train(staging.path().string(), "train", o.shard_tokens, r.vocab_size);
    ShardWriter val(staging.path().string(), "val", o.shard_tokens, r.vocab_size);
    bool in_val = false;
    size_t offset = 0;
    const bool show = o.progress && ::isatty(2);
    Stopwatch encode_sw;
    // text starts at byte `at` of file f.
    auto encode = [&](std::string_view text, const std::string& f, size_t at) {
      if (o.special_tokens == SpecialTokens::refuse) {
        if (const auto m = find_added_token(*tok, text)) {
          fail(
              "[data] input {}: byte {} starts the special token '{}' (id {}), refused by "
              "--special-tokens refuse; remove it from the input, or pass --special-tokens match "
              "to encode it as that token (as Hugging Face does) or ordinary to encode it as text",
              f, at + m->offset, m->token->content, m->token->id);
        }
      }
      const auto ids = o.special_tokens == SpecialTokens::match
                           ? encode_matching_added_tokens(*tok, text, threads)
                           : encode_parallel(*tok, text, threads);
      (in_val ? val : train).push(ids);
    };
    for (const auto& f : files) {
      BlockReader reader(f);
      std::string block;
      bool doc_start = true;
      size_t file_offset = 0;
      while (reader.next(block)) {
        if (!in_val && offset >= cut && o.val_fraction > 0) in_val = true;
        // Every document starts with <|endoftext|>, as in llm.c's data scripts.
        if (doc_start) (in_val ? val : train).push(eot);
        doc_start = false;
        std::string_view text(block);
        if (!in_val && o.val_fraction > 0 && offset + text.size() > cut) {
          const size_t p = cut > offset ? find_text_split(text, cut - offset) : 0;
          if (p != std::string_view::npos) {
            encode(text.substr(0, p), f, file_offset);
            in_val = true;
            text = text.substr(p);
          }
        }
        encode(text, f, file_offset + (block.size() - text.size()));
        offset += block.size();
        file_offset += block.size();
        if (show) {
          const double mb = offset / 1e6;
          std::fprintf(stderr, "\r[data] %5.1f%%  %.1f / %.1f MB  %.1f MB/s  %zu tokens   ",
                       100.0 * offset / r.input_bytes, mb, r.input_bytes / 1e6,
                       mb / std::max(encode_sw.elapsed_s(), 1e-9), train.total() + val.total());
        }
      }
    }
    train.finish();
    val.finish();
    if (show) std::fprintf(stderr, "\n");
    if (o.val_fraction > 0 && val.total() == 0) {
      if (cut >= r.input_bytes) {
        log_warn(
            "[data] the validation split is empty: the input is too small for --val-fraction {}",
            o.val_fraction);
      } else {
        // The split is cut only where cutting cannot change the encoding; text without a space
        // (one run of letters, say) has no such point.
        log_warn(
            "[data] the validation split is empty: the last {} bytes of the input (--val-fraction "
            "{}) hold no point where the text can be cut without changing its encoding (a space "
            "after a printable ASCII character); put the validation text in its own last file, or "
            "pass --val-fraction 0",
            r.input_bytes - cut, o.val_fraction);
      }
    }
    // One warning per split: with a tiny --shard-tokens every shard of it is short.
    for (const ShardWriter* split : {&train, &val}) {
      const auto& shards = split->shards();
      const auto is_short = [](const ShardInfo& s) { return s.tokens < kLlmcMinShardTokens; };
      const auto first = std::find_if(shards.begin(), shards.end(), is_short);
      if (first == shards.end()) continue;
      const auto more = std::count_if(first + 1, shards.end(), is_short);
      log_warn(
          "[data] {}: {} tokens{}; llm.c's DataLoader refuses a shard of fewer than processes x B "
          "x T + 1 tokens ({} for its defaults B=4, T=1024 on one process); tetra reads it, but "
          "for llm.c give the split more text or a larger --shard-tokens",
          (out / first->file).string(), first->tokens,
          more ? fmt::format(" ({} more shards of the split are as short)", more) : "",
          kLlmcMinShardTokens);
    }

    r.train_tokens = train.total();
    r.val_tokens = val.total();
    r.train_shards = train.shards();
    r.val_shards = val.shards();
    r.seconds = sw.elapsed_s();
    r.mb_per_s = r.input_bytes / 1e6 / std::max(r.seconds, 1e-9);
    r.encode_mb_per_s = r.input_bytes / 1e6 / std::max(encode_sw.elapsed_s(), 1e-9);

    using nlohmann::ordered_json;
    auto shard_list = [](const std::vector<ShardInfo>& shards) {
      ordered_json a = ordered_json::array();
      for (const auto& s : shards) {
        a.push_back(
            {{"file", s.file}, {"tokens", s.tokens}, {"version", s.version}, {"xxh3", s.xxh3}});
      }
      return a;
    };
    ordered_json m;
    m["format"] = "tetra-dataset";
    m["version"] = 1;
    m["tokenizer"] = {{"name", tok->name()},
                      {"file", "tokenizer.json"},
                      {"hash", r.tokenizer_hash},
                      {"vocab_size", r.vocab_size},
                      {"eot_token", eot}};
    m["inputs"] = {{"files", r.input_files}, {"bytes", r.input_bytes}};
    m["shard_tokens"] = o.shard_tokens;
    m["val_fraction"] = o.val_fraction;
    m["total_tokens"] = r.train_tokens + r.val_tokens;
    m["splits"] = {{"train", {{"tokens", r.train_tokens}, {"shards", shard_list(r.train_shards)}}},
                   {"val", {{"tokens", r.val_tokens}, {"shards", shard_list(r.val_shards)}}}};
    m["stats"] = {{"seconds", r.seconds},
                  {"mb_per_s", r.mb_per_s},
                  {"encode_mb_per_s", r.encode_mb_per_s},
                  {"threads", threads}};
    const std::string manifest = m.dump(2) + "\n";
    write_file_atomically((staging.path() / "manifest.json").string(),
                          {{reinterpret_cast<const uint8_t*>(manifest.data()), manifest.size()}},
                          "data");
  } catch (const Error& e) {
    // Paths in the message are inside the staging folder, which the user never sees.
    fail("{} (while writing the new dataset beside {}; {} is unchanged)", e.what(), o.out_dir,
         o.out_dir);
  }
  // The new dataset carries the lock file itself (a hard link: the same file, still locked by this
  // run), so that --out names a locked file at every moment of the swap and a run started
  // meanwhile is refused rather than locking a file about to be deleted.
  staging.commit([&] {
    std::error_code ec;
    const fs::path lock = DirLock::file_of(out);
    if (fs::exists(lock, ec)) fs::create_hard_link(lock, DirLock::file_of(staging.path()), ec);
  });
  lock.committed();

  std::fprintf(stderr,
               "[data] %zu tokens (train %zu in %zu shards, val %zu in %zu shards) from %.1f MB "
               "in %.2f s: %.1f MB/s (encoding %.1f MB/s on %d threads)\n",
               r.train_tokens + r.val_tokens, r.train_tokens, r.train_shards.size(), r.val_tokens,
               r.val_shards.size(), r.input_bytes / 1e6, r.seconds, r.mb_per_s, r.encode_mb_per_s,
               threads);
  return r;
}

}  // namespace tetra
