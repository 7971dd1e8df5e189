// `tetra data prepare`: read text files in order, encode them in parallel, cut the token stream
// into train and validation shards, and describe the result in manifest.json.
#include "data/prepare.h"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <span>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "data/bpe_train.h"
#include "data/pretokenize.h"
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
        vocab_(vocab) {}

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
    info.version = max_token <= 0xFFFF ? 1 : 2;  // the rule write_token_shard follows
    const std::string path = (fs::path(dir_) / info.file).string();
    write_token_shard(path, buf_);
    info.xxh3 = file_xxh3(path);
    total_ += buf_.size();
    shards_.push_back(std::move(info));
    buf_.clear();
  }

  std::string dir_, prefix_;
  size_t shard_tokens_, vocab_;
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

std::unique_ptr<Tokenizer> make_tokenizer(const PrepareOptions& o,
                                          const std::vector<std::string>& files, int threads) {
  const std::string& spec = o.tokenizer;
  if (spec.rfind("train:", 0) != 0) return load_tokenizer(spec);
  const std::string n = spec.substr(6);
  size_t vocab = 0;
  try {
    size_t used = 0;
    vocab = std::stoul(n, &used);
    if (used != n.size()) vocab = 0;
  } catch (const std::exception&) {
    vocab = 0;
  }
  TETRA_CHECK(vocab >= 257,
              "[data] --tokenizer {}: expected train:<vocab size> with a size of at least 257, "
              "e.g. train:4096",
              spec);
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

std::vector<std::string> list_input_files(const std::vector<std::string>& inputs,
                                          const std::string& exclude_dir) {
  TETRA_CHECK(!inputs.empty(), "[data] no input given; pass --input FILE_OR_FOLDER (repeatable)");
  std::error_code ec;
  const fs::path exclude = exclude_dir.empty() ? fs::path() : fs::weakly_canonical(exclude_dir, ec);
  auto excluded = [&](const fs::path& p) {
    if (exclude.empty()) return false;
    const fs::path c = fs::weakly_canonical(p, ec);
    auto [e, _] = std::mismatch(exclude.begin(), exclude.end(), c.begin(), c.end());
    return e == exclude.end();
  };
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
      if (it->is_directory(ec) && excluded(it->path())) {
        it.disable_recursion_pending();
        continue;
      }
      if (it->is_regular_file(ec)) found.push_back(it->path().string());
    }
    TETRA_CHECK(!found.empty(), "[data] input folder {} holds no files", in);
    std::sort(found.begin(), found.end());
    files.insert(files.end(), found.begin(), found.end());
  }
  return files;
}

PrepareResult prepare_dataset(const PrepareOptions& o) {
  Stopwatch sw;
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

  PrepareResult r;
  const std::vector<std::string> files = list_input_files(o.inputs, o.out_dir);
  r.input_files = files.size();
  std::error_code ec;
  for (const auto& f : files) {
    const uintmax_t size = fs::file_size(f, ec);
    TETRA_CHECK(!ec, "[data] cannot read the size of {}: {}", f, ec.message());
    r.input_bytes += size;
  }
  TETRA_CHECK(r.input_bytes > 0, "[data] the {} input file(s) are all empty; nothing to tokenize",
              files.size());

  fs::create_directories(o.out_dir, ec);
  TETRA_CHECK(fs::is_directory(o.out_dir),
              "[data] cannot create output folder {} ({}); choose a writable --out", o.out_dir,
              ec.message());
  // Shards of an earlier run would otherwise mix with this one's.
  const std::regex shard_name(R"((train|val)_\d{6}\.bin)");
  for (const auto& e : fs::directory_iterator(o.out_dir)) {
    if (std::regex_match(e.path().filename().string(), shard_name)) fs::remove(e.path());
  }

  const std::unique_ptr<Tokenizer> tok = make_tokenizer(o, files, threads);
  const std::string tok_path = (fs::path(o.out_dir) / "tokenizer.json").string();
  const bool is_file = o.tokenizer != "byte" && o.tokenizer.rfind("train:", 0) != 0;
  if (is_file && fs::exists(tok_path) && fs::equivalent(o.tokenizer, tok_path)) {
    // Already in place.
  } else if (is_file) {
    fs::copy_file(o.tokenizer, tok_path, fs::copy_options::overwrite_existing, ec);
    TETRA_CHECK(!ec, "[data] cannot copy {} to {}: {}", o.tokenizer, tok_path, ec.message());
  } else {
    tok->save(tok_path);
  }
  r.tokenizer_hash = tok->hash();
  r.vocab_size = tok->vocab_size();
  const uint32_t eot = tok->eot_token();

  // Validation is the tail of the input bytes, cut at the first safe point at or after `cut`.
  const size_t cut =
      r.input_bytes - static_cast<size_t>(std::llround(o.val_fraction * double(r.input_bytes)));
  ShardWriter train(o.out_dir, "train", o.shard_tokens, r.vocab_size);
  ShardWriter val(o.out_dir, "val", o.shard_tokens, r.vocab_size);
  bool in_val = false;
  size_t offset = 0;
  const bool show = o.progress && ::isatty(2);
  Stopwatch encode_sw;
  auto encode = [&](std::string_view text) {
    const auto ids = encode_parallel(*tok, text, threads);
    (in_val ? val : train).push(ids);
  };
  for (const auto& f : files) {
    BlockReader reader(f);
    std::string block;
    bool doc_start = true;
    while (reader.next(block)) {
      if (!in_val && offset >= cut && o.val_fraction > 0) in_val = true;
      // Every document starts with <|endoftext|>, as in llm.c's data scripts.
      if (doc_start) (in_val ? val : train).push(eot);
      doc_start = false;
      std::string_view text(block);
      if (!in_val && o.val_fraction > 0 && offset + text.size() > cut) {
        const size_t p = cut > offset ? find_text_split(text, cut - offset) : 0;
        if (p != std::string_view::npos) {
          encode(text.substr(0, p));
          in_val = true;
          text = text.substr(p);
        }
      }
      encode(text);
      offset += block.size();
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
    log_warn("[data] the validation split is empty: the input is too small for --val-fraction {}",
             o.val_fraction);
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
  const std::string manifest = (fs::path(o.out_dir) / "manifest.json").string();
  std::ofstream out(manifest, std::ios::binary);
  out << m.dump(2) << "\n";
  TETRA_CHECK(out.good(), "[data] writing {} failed (disk full?)", manifest);

  std::fprintf(stderr,
               "[data] %zu tokens (train %zu in %zu shards, val %zu in %zu shards) from %.1f MB "
               "in %.2f s: %.1f MB/s (encoding %.1f MB/s on %d threads)\n",
               r.train_tokens + r.val_tokens, r.train_tokens, r.train_shards.size(), r.val_tokens,
               r.val_shards.size(), r.input_bytes / 1e6, r.seconds, r.mb_per_s, r.encode_mb_per_s,
               threads);
  return r;
}

}  // namespace tetra
