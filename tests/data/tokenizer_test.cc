// Tokenizers: byte-level round trips, GPT-2 pre-tokenization, BPE training determinism, and
// reading Hugging Face tokenizer.json files (a hand-written GPT-2-style one included).
#include "data/tokenizer.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/bpe_train.h"
#include "data/pretokenize.h"
#include "tests/test_util.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;

// Pseudo-English with numbers, punctuation, contractions, newlines and some non-ASCII words.
std::string make_corpus(size_t bytes, uint32_t seed) {
  static const char* kWords[] = {
      "the",   "of",      "and",   "to",    "a",    "in",      "that",  "is",    "was",   "he",
      "for",   "it",      "with",  "as",    "his",  "on",      "be",    "at",    "by",    "I",
      "this",  "had",     "not",   "are",   "but",  "from",    "or",    "have",  "an",    "they",
      "which", "one",     "you",   "were",  "her",  "all",     "she",   "there", "would", "their",
      "we",    "him",     "been",  "has",   "when", "who",     "will",  "more",  "no",    "if",
      "out",   "so",      "said",  "what",  "up",   "its",     "about", "into",  "than",  "them",
      "can",   "only",    "other", "new",   "some", "could",   "time",  "these", "two",   "may",
      "then",  "do",      "first", "any",   "my",   "now",     "such",  "like",  "our",   "over",
      "man",   "me",      "even",  "most",  "made", "after",   "also",  "did",   "many",  "before",
      "must",  "through", "years", "where", "much", "your",    "way",   "well",  "down",  "café",
      "naïve", "Zürich",  "λόγος", "мир",   "東京", "données", "Ökonom"};
  static const char* kPunct[] = {".", ",", ";", ":", "!", "?", " -", "'s", "'ll", "n't", "\"", ")"};
  std::mt19937 rng(seed);
  std::string out;
  while (out.size() < bytes) {
    const uint32_t r = rng() % 100;
    if (r < 75) {
      if (!out.empty() && out.back() != '\n') out += ' ';
      out += kWords[rng() % std::size(kWords)];
    } else if (r < 88) {
      out += kPunct[rng() % std::size(kPunct)];
    } else if (r < 94) {
      out += ' ' + std::to_string(rng() % 5000);
    } else if (r < 98) {
      out += '\n';
    } else {
      out += "\n\n   ";
    }
  }
  return out;
}

std::string random_bytes(std::mt19937& rng, size_t max_len) {
  // Mix fully random bytes with ASCII text and valid multibyte characters, so pieces of every
  // class (and broken UTF-8 between them) occur.
  static const char* kBits[] = {"é", "東", "😀",    " ",    "  ",       "\n",   "'s", "a",
                                "Z", "7",  "\xff", "\xc3", "\xe2\x82", " the", "\t"};
  std::string s;
  const size_t n = rng() % (max_len + 1);
  while (s.size() < n) {
    if (rng() % 2) {
      s += static_cast<char>(rng() % 256);
    } else {
      s += kBits[rng() % std::size(kBits)];
    }
  }
  return s;
}

const BpeTokenizer& trained() {
  static const BpeTokenizer tok = [] {
    BpeTrainer trainer(2);
    trainer.add_text(make_corpus(1 << 20, 1));
    return trainer.train(1024);
  }();
  return tok;
}

std::vector<std::string> pieces(std::string_view text) {
  std::vector<std::string> out;
  pretokenize(text, [&](std::string_view p) { out.emplace_back(p); });
  return out;
}

// GPT-2's bpe() written plainly: merge every occurrence of the lowest-ranked pair, repeat.
std::vector<uint32_t> reference_encode(const BpeTokenizer& tok, std::string_view text) {
  std::map<std::pair<std::string, std::string>, size_t> rank;
  std::map<std::string, uint32_t> id;
  for (size_t r = 0; r < tok.merges().size(); ++r) {
    const auto [a, b] = tok.merges()[r];
    rank.emplace(std::make_pair(tok.token_bytes(a), tok.token_bytes(b)), r);
  }
  for (uint32_t i = 0; i < tok.vocab_size(); ++i) id.emplace(tok.token_bytes(i), i);
  std::vector<uint32_t> out;
  for (const auto& piece : pieces(text)) {
    std::vector<std::string> w;
    for (char c : piece) w.emplace_back(1, c);
    while (w.size() > 1) {
      size_t best = SIZE_MAX;
      std::pair<std::string, std::string> bp;
      for (size_t i = 0; i + 1 < w.size(); ++i) {
        auto it = rank.find({w[i], w[i + 1]});
        if (it != rank.end() && it->second < best) {
          best = it->second;
          bp = it->first;
        }
      }
      if (best == SIZE_MAX) break;
      std::vector<std::string> nw;
      for (size_t i = 0; i < w.size(); ++i) {
        if (i + 1 < w.size() && w[i] == bp.first && w[i + 1] == bp.second) {
          nw.push_back(w[i] + w[i + 1]);
          ++i;
        } else {
          nw.push_back(w[i]);
        }
      }
      w = std::move(nw);
    }
    for (const auto& t : w) out.push_back(id.at(t));
  }
  return out;
}

class TempDir {
 public:
  TempDir() : path_(fs::temp_directory_path() / ("tetra_tok_test_" + std::to_string(getpid()))) {
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name, const std::string& text) const {
    const std::string p = (path_ / name).string();
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }

 private:
  fs::path path_;
};

using testing::error_of;

TEST(Pretokenize, MatchesGpt2Pattern) {
  // Expected pieces worked out by hand from the GPT-2 regex.
  EXPECT_EQ(pieces("Hello world"), (std::vector<std::string>{"Hello", " world"}));
  EXPECT_EQ(pieces("it's they'll I'M"),
            (std::vector<std::string>{"it", "'s", " they", "'ll", " I", "'", "M"}));
  EXPECT_EQ(pieces("a  b"), (std::vector<std::string>{"a", " ", " b"}));
  EXPECT_EQ(pieces("a \n\nb"), (std::vector<std::string>{"a", " \n", "\n", "b"}));
  EXPECT_EQ(pieces("x   "), (std::vector<std::string>{"x", "   "}));
  EXPECT_EQ(pieces("abc123 456!?"), (std::vector<std::string>{"abc", "123", " 456", "!?"}));
  EXPECT_EQ(pieces(" 's"), (std::vector<std::string>{" '", "s"}));
  EXPECT_EQ(pieces("café über"), (std::vector<std::string>{"café", " über"}));
  EXPECT_EQ(pieces("東京 2½"), (std::vector<std::string>{"東京", " 2½"}));
  EXPECT_EQ(pieces("a\xff\xfe b"), (std::vector<std::string>{"a", "\xff\xfe", " b"}));
  EXPECT_EQ(pieces("\tword"), (std::vector<std::string>{"\t", "word"}));
  EXPECT_EQ(pieces(""), std::vector<std::string>{});
}

TEST(Pretokenize, PiecesCoverEveryByte) {
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    const std::string s = random_bytes(rng, 100);
    std::string joined;
    for (const auto& p : pieces(s)) {
      EXPECT_FALSE(p.empty());
      joined += p;
    }
    ASSERT_EQ(joined, s);
  }
}

TEST(ByteTokenizer, RoundTripsRandomBytes) {
  ByteTokenizer tok;
  std::mt19937 rng(1);
  for (int i = 0; i < 1000; ++i) {
    const std::string s = random_bytes(rng, 200);
    ASSERT_EQ(tok.decode(tok.encode(s)), s);
  }
  EXPECT_EQ(tok.vocab_size(), 257u);
  EXPECT_EQ(tok.decode(std::vector<uint32_t>{104, 105, 256}), "hi<|endoftext|>");
}

TEST(BpeTokenizer, RoundTrips10kRandomByteStrings) {
  const BpeTokenizer& tok = trained();
  std::mt19937 rng(2);
  for (int i = 0; i < 10000; ++i) {
    const std::string s = random_bytes(rng, 300);
    const auto ids = tok.encode(s);
    for (uint32_t t : ids) ASSERT_LT(t, tok.vocab_size());
    ASSERT_EQ(tok.decode(ids), s) << "string " << i;
  }
}

TEST(BpeTokenizer, RoundTripsCorpusAndCompresses) {
  const BpeTokenizer& tok = trained();
  const std::string text = make_corpus(200'000, 99);  // not the training text
  const auto ids = tok.encode(text);
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_LT(ids.size(), text.size() / 3) << "a 1k BPE should compress this text over 3x";
  EXPECT_EQ(encode_parallel(tok, text, 3), ids);
}

TEST(BpeTokenizer, MatchesReferenceAlgorithmIncludingLongPieces) {
  const BpeTokenizer& tok = trained();
  std::string text = make_corpus(20'000, 5);
  text.append(301, ' ').append("x").append(200, '!').append(150, 'a');
  text += " thethethethethethethethethethethethethethethethethethethethethethethethethe";
  EXPECT_EQ(tok.encode(text), reference_encode(tok, text));
}

TEST(BpeTokenizer, RefusesTokensOutsideVocab) {
  const BpeTokenizer& tok = trained();
  const std::vector<uint32_t> bad{1, 2, static_cast<uint32_t>(tok.vocab_size())};
  EXPECT_NE(error_of([&] { tok.decode(bad); }).find("outside the vocabulary"), std::string::npos);
  ByteTokenizer bytes;
  EXPECT_NE(error_of([&] { bytes.decode(std::vector<uint32_t>{300}); }).find("outside"),
            std::string::npos);
}

TEST(BpeTrain, IsDeterministic) {
  const std::string text = make_corpus(300'000, 3);
  BpeTrainer t1(1), t2(2);
  t1.add_text(text);
  // Same text in two halves cut at a safe point, on two threads: the same counts.
  const size_t cut = find_text_split(text, text.size() / 2);
  t2.add_text(std::string_view(text).substr(cut));
  t2.add_text(std::string_view(text).substr(0, cut));
  const BpeTokenizer a = t1.train(600);
  const BpeTokenizer b = t2.train(600);
  EXPECT_EQ(a.vocab_size(), 600u);
  EXPECT_EQ(a.eot_token(), 599u);
  EXPECT_EQ(a.merges(), b.merges());
  EXPECT_EQ(a.hash(), b.hash());
  EXPECT_EQ(a.to_json(), b.to_json());
}

TEST(BpeTrain, FirstMergeIsTheMostFrequentPair) {
  BpeTrainer t;
  t.add_text("aaab aaab aaab xy xy");  // (a,a) 6 times beats (a,b), (x,y), (' ',a)...
  const BpeTokenizer tok = t.train(258);
  ASSERT_EQ(tok.merges().size(), 1u);
  EXPECT_EQ(tok.token_bytes(256), "aa");
  EXPECT_EQ(tok.eot_token(), 257u);
}

TEST(BpeTrain, RefusesTinyVocab) {
  BpeTrainer t;
  t.add_text("hello");
  EXPECT_NE(error_of([&] { t.train(100); }).find("at least 257"), std::string::npos);
}

TEST(TokenizerJson, SaveLoadRoundTrip) {
  TempDir dir;
  const BpeTokenizer& tok = trained();
  const std::string path = dir.file("tok.json", "");
  tok.save(path);
  const auto loaded = load_tokenizer(path);
  EXPECT_EQ(loaded->name(), "bpe");
  EXPECT_EQ(loaded->hash(), tok.hash());
  EXPECT_EQ(loaded->eot_token(), tok.eot_token());
  const std::string text = make_corpus(10'000, 11);
  EXPECT_EQ(loaded->encode(text), tok.encode(text));

  const std::string bpath = dir.file("byte.json", "");
  ByteTokenizer().save(bpath);
  const auto byte = load_tokenizer(bpath);
  EXPECT_EQ(byte->name(), "byte");
  EXPECT_EQ(byte->hash(), ByteTokenizer().hash());
  EXPECT_EQ(load_tokenizer("byte")->vocab_size(), 257u);
}

// A tiny tokenizer.json laid out as GPT-2's: byte tokens in bytes_to_unicode order (so 't' is
// 83, 'Ġ' (space) is 220, '\n' is 198), four merges, and <|endoftext|> in vocab and added_tokens.
std::string tiny_gpt2_json(bool pair_merges, const std::string& extra_merge = "") {
  std::vector<int> order;
  for (int b = '!'; b <= '~'; ++b) order.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) order.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) order.push_back(b);
  int next = 256;
  std::map<int, int> cp;
  for (int b : order) cp[b] = b;
  for (int b = 0; b < 256; ++b) {
    if (!cp.count(b)) {
      cp[b] = next++;
      order.push_back(b);
    }
  }
  auto utf8 = [](int c) {
    std::string s;
    if (c < 0x80) {
      s += static_cast<char>(c);
    } else {
      s += static_cast<char>(0xC0 | (c >> 6));
      s += static_cast<char>(0x80 | (c & 0x3F));
    }
    return s;
  };
  auto quoted = [](const std::string& s) {
    std::string q = "\"";
    for (char c : s) {
      if (c == '"' || c == '\\') q += '\\';
      q += c;
    }
    return q + "\"";
  };
  std::string vocab;
  for (size_t id = 0; id < order.size(); ++id) {
    vocab += quoted(utf8(cp[order[id]])) + ": " + std::to_string(id) + ", ";
  }
  vocab += R"("Ġt": 256, "he": 257, "Ġthe": 258, "er": 259, "<|endoftext|>": 260)";
  std::vector<std::pair<std::string, std::string>> m = {
      {"Ġ", "t"}, {"h", "e"}, {"Ġt", "he"}, {"e", "r"}};
  std::string merges;
  for (const auto& [a, b] : m) {
    if (!merges.empty()) merges += ", ";
    if (pair_merges) {
      merges.append("[").append(quoted(a)).append(", ").append(quoted(b)).append("]");
    } else {
      merges.append(quoted(a + ' ' + b));
    }
  }
  if (!extra_merge.empty()) merges += ", " + extra_merge;
  return R"({"version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [{"id": 260, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": true, "special": true}],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true},
  "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false},
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true},
  "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "vocab": {)" +
         vocab + "}, \"merges\": [" + merges + "]}}";
}

TEST(TokenizerJson, LoadsGpt2StyleFileAndMatchesHandEncoding) {
  TempDir dir;
  for (bool pairs : {false, true}) {
    const auto tok = load_tokenizer(dir.file("gpt2.json", tiny_gpt2_json(pairs)));
    EXPECT_EQ(tok->vocab_size(), 261u);
    EXPECT_EQ(tok->eot_token(), 260u);
    // "the" -> t + he; " other" -> Ġ o t he r ('he' outranks 'er', so 'er' never forms);
    // " é" -> Ġ + the two bytes of é (0xC3 -> 127, 0xA9 -> 102); "\n" -> 198; " the" -> Ġthe;
    // " her" -> Ġ he r.
    const std::string text = "the other é\n the her";
    const std::vector<uint32_t> expected = {83,  257, 220, 78,  83,  257, 81, 220,
                                            127, 102, 198, 258, 220, 257, 81};
    EXPECT_EQ(tok->encode(text), expected);
    EXPECT_EQ(tok->decode(expected), text);
    EXPECT_EQ(tok->decode(std::vector<uint32_t>{260}), "<|endoftext|>");
  }
}

TEST(TokenizerJson, RefusesBadFiles) {
  TempDir dir;
  auto refused = [&](const std::string& name, const std::string& text, const std::string& what) {
    const std::string path = dir.file(name, text);
    const std::string err = error_of([&] { load_tokenizer(path); });
    EXPECT_NE(err.find("[tokenizer] " + path + ": "), std::string::npos) << err;
    EXPECT_NE(err.find(what), std::string::npos) << name << ": " << err;
  };
  const std::string good = tiny_gpt2_json(false);
  refused("truncated.json", good.substr(0, good.size() / 2), "not valid JSON");
  refused("empty.json", "", "empty");
  refused("nomodel.json", R"({"version": "1.0"})", "no \"model\"");
  refused("wordpiece.json", R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})", "WordPiece");
  std::string no_vocab = good;
  no_vocab.replace(no_vocab.find("\"vocab\""), 7, "\"vocab_\"");
  refused("novocab.json", no_vocab, "model.vocab is missing");
  std::string no_merges = good;
  no_merges.replace(no_merges.find("\"merges\""), 8, "\"merges_\"");
  refused("nomerges.json", no_merges, "model.merges is missing");
  refused("unknown.json", tiny_gpt2_json(false, "\"Ġthe zz\""), "'zz', which is not in the vocab");
  refused("badmerge.json", tiny_gpt2_json(false, "\"abc\""), "two tokens separated by one space");
  std::string not_bytes = good;
  not_bytes.replace(not_bytes.find("ByteLevel"), 9, "Whitespace");
  not_bytes.replace(not_bytes.find("ByteLevel"), 9, "Whitespace");
  not_bytes.replace(not_bytes.find("ByteLevel"), 9, "Metaspace");
  refused("metaspace.json", not_bytes, "nor the decoder is ByteLevel");
  std::string gap = good;
  gap.replace(gap.find("\"er\": 259"), 9, "\"er\": 261");
  refused("gap.json", gap, "no token has id 259");
  std::string missing_byte = good;
  missing_byte.replace(missing_byte.find("\"!\": 0, "), 3, "\"<|x|>\"");
  refused("nobyte.json", missing_byte, "byte 0x21 has no token");
  const std::string err = error_of([] { load_tokenizer("/nonexistent/tokenizer.json"); });
  EXPECT_NE(err.find("cannot open"), std::string::npos) << err;
}

// Ids are bounded by the number of entries before anything is sized by them: a 6 KB file naming
// id 2e9 or 3e7 fails at once instead of allocating gigabytes or throwing std::bad_alloc.
TEST(TokenizerJson, RefusesBadIds) {
  TempDir dir;
  auto refused = [&](const std::string& name, const std::string& text, const std::string& what) {
    const std::string path = dir.file(name, text);
    const std::string err = error_of([&] { load_tokenizer(path); });
    EXPECT_NE(err.find("[tokenizer] " + path + ": "), std::string::npos) << err;
    EXPECT_NE(err.find(what), std::string::npos) << name << ": " << err;
  };
  const std::string good = tiny_gpt2_json(false);
  auto with = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  rusage before{};
  getrusage(RUSAGE_SELF, &before);
  refused("huge_id.json", with("\"er\": 259", "\"er\": 2000000000"),
          "token 'er' has id 2000000000, but the file lists only 262 tokens (vocab and "
          "added_tokens), so ids must be below 262");
  refused("big_id.json", with("\"er\": 259", "\"er\": 30000000"), "has id 30000000, but");
  refused("added_id.json", with("{\"id\": 260", "{\"id\": 4294967296"),
          "token '<|endoftext|>' has id 4294967296, but");
  rusage after{};
  getrusage(RUSAGE_SELF, &after);
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 100 << 10) << "KB more at peak";

  refused("negative.json", with("\"er\": 259", "\"er\": -259"),
          "vocab entry 'er' has id -259; ids are non-negative integers");
  refused("fraction.json", with("\"er\": 259", "\"er\": 259.5"),
          "vocab entry 'er' has id 259.5; ids are non-negative integers");
  refused("string_id.json", with("\"er\": 259", "\"er\": \"259\""), "has id \"259\"");
  refused("dup_id.json", with("\"er\": 259", "\"er\": 258"),
          "both have id 258; every id names one token");
  refused("dup_key.json", with("\"er\": 259", "\"he\": 259"),
          "key \"he\" appears twice in one object");
  refused("added_clash.json", with("{\"id\": 260", "{\"id\": 259"),
          "tokens 'er' and '<|endoftext|>' both have id 259");
  refused("added_noid.json", with("{\"id\": 260, ", "{"),
          "added token '<|endoftext|>' has id (none)");
  refused("added_nocontent.json", with("\"content\": \"<|endoftext|>\", ", ""),
          "added_tokens[0] has no \"content\" string");
  refused("added_notlist.json", with("\"added_tokens\": [", "\"added_tokens\": 7, \"x\": ["),
          "added_tokens is 7; expected a list");
  refused("special_str.json", with("\"special\": true", "\"special\": \"yes\""),
          "has \"special\": \"yes\"; expected true or false");
  refused("type_num.json", with("\"type\": \"BPE\"", "\"type\": 3"),
          "model.type is 3; expected a string");
  refused("deep.json", std::string(100, '[') + std::string(100, ']'), "nested deeper than 64");
  const std::string folder = fs::path(dir.file("x", "")).parent_path().string();
  const std::string err = error_of([&] { load_tokenizer(folder); });
  EXPECT_NE(err.find("not a regular file"), std::string::npos) << err;
}

TEST(TokenizerJson, ParsesFromMemory) {
  const auto tok = parse_tokenizer_json(tiny_gpt2_json(true), "<test>");
  EXPECT_EQ(tok->vocab_size(), 261u);
  EXPECT_NE(error_of([] { parse_tokenizer_json("", "<test>"); }).find("[tokenizer] <test>: "),
            std::string::npos);
}

// Hugging Face's default: an added token's text becomes its id, the text around it is encoded on
// its own (so "a  " before the token keeps its trailing whitespace run).
TEST(SpecialTokens, MatchGivesTheIdAndEncodesTheRestAlone) {
  const BpeTokenizer& tok = trained();
  const uint32_t eot = tok.eot_token();
  auto concat = [](std::vector<std::vector<uint32_t>> parts) {
    std::vector<uint32_t> out;
    for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
  };
  EXPECT_EQ(encode_matching_added_tokens(tok, "the a  <|endoftext|>of<|endoftext|>", 1),
            concat({tok.encode("the a  "), {eot}, tok.encode("of"), {eot}}));
  EXPECT_EQ(encode_matching_added_tokens(tok, "<|endoftext|>", 1), std::vector<uint32_t>{eot});
  EXPECT_EQ(encode_matching_added_tokens(tok, "no token <|endoftext|", 2),
            tok.encode("no token <|endoftext|"));
  const auto m = find_added_token(tok, "xx<|endoftext|>", 0);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->offset, 2u);
  EXPECT_EQ(m->token->id, eot);
  EXPECT_FALSE(find_added_token(tok, "xx<|endoftext|>", 3).has_value());
  EXPECT_EQ(encode_matching_added_tokens(ByteTokenizer(), "a<|endoftext|>", 1),
            (std::vector<uint32_t>{'a', 256}));
}

// Over threads the text is cut only between matches and at safe points: the ids equal one thread's
// and those of encoding every stretch alone.
TEST(SpecialTokens, MatchOverThreadsEqualsOneThread) {
  const BpeTokenizer& tok = trained();
  std::string text;
  std::vector<uint32_t> want;
  std::mt19937 rng(5);
  while (text.size() < (1 << 20)) {
    const std::string doc = make_corpus(100 + rng() % 900, rng());
    text += doc + "<|endoftext|>";
    const auto ids = tok.encode(doc);
    want.insert(want.end(), ids.begin(), ids.end());
    want.push_back(tok.eot_token());
  }
  EXPECT_EQ(encode_matching_added_tokens(tok, text, 1), want);
  EXPECT_EQ(encode_matching_added_tokens(tok, text, 3), want);
}

// At one offset the longest added token wins; an earlier offset wins over a longer token.
TEST(SpecialTokens, LeftmostThenLongestAsHuggingFace) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.emplace_back(1, char(b));
  tokens.push_back("<s>");
  tokens.push_back("<s><s>");
  tokens.push_back("s>x");
  const BpeTokenizer tok(tokens, {},
                         {{256, "<s>", true}, {257, "<s><s>", true}, {258, "s>x", false}}, 256);
  EXPECT_EQ(encode_matching_added_tokens(tok, "a<s><s>b", 1),
            (std::vector<uint32_t>{'a', 257, 'b'}));
  EXPECT_EQ(encode_matching_added_tokens(tok, "<s>x", 1), (std::vector<uint32_t>{256, 'x'}));
  EXPECT_EQ(encode_matching_added_tokens(tok, "s>x<s>", 1), (std::vector<uint32_t>{258, 256}));
}

TEST(SpecialTokens, ParsesTheOption) {
  EXPECT_EQ(parse_special_tokens("match", "data"), SpecialTokens::match);
  EXPECT_EQ(parse_special_tokens("ordinary", "data"), SpecialTokens::ordinary);
  EXPECT_EQ(parse_special_tokens("refuse", "data"), SpecialTokens::refuse);
  EXPECT_EQ(error_of([] { parse_special_tokens("Match", "generate"); }),
            "[generate] --special-tokens Match: expected match (a special token's text becomes "
            "its id, as in Hugging Face), ordinary (encoded as plain text) or refuse (an error)");
}

}  // namespace
}  // namespace tetra
