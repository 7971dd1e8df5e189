#include "core/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "core/error.h"
#include "tests/test_util.h"

namespace tetra {
namespace {

const ConfigSchema kConfigSchema = {
    {"model.n_layer", ValueKind::Int, "4", "", "[1, 1024]"},
    {"train.seed", ValueKind::Int, "1", "", "[0, inf)"},
    {"train.offset", ValueKind::Int, "0", "", "[-inf, inf]"},
    {"eval.every", ValueKind::Int, "0", ""},
    {"eval.skip", ValueKind::Int, "1", "", "(0, 10)"},
    {"optim.lr", ValueKind::Float, "6e-4", "", "(0, 1000]"},
    {"optim.beta1", ValueKind::Float, "0.9", "", "[0, 1)"},
    {"optim.shift", ValueKind::Float, "0", ""},
    {"data.shuffle", ValueKind::Bool, "false", ""},
    {"run.dir", ValueKind::String, "\"runs/x\"", ""},
    {"optim.schedule", ValueKind::String, "\"cosine\"", "", "cosine | constant"},
    {"layout.schedule", ValueKind::String, "\"\"", "", "\"\" | gpipe | 1f1b"},
};

std::string write_toml(const std::string& text) {
  // Per process: CTest runs the cases of this file as parallel processes.
  auto path = std::filesystem::temp_directory_path() /
              ("tetra_config_test_" + std::to_string(::getpid()) + ".toml");
  std::ofstream(path) << text;
  return path.string();
}

using testing::error_of;

// The message of overriding `key` with `text`, "<no error>" when it is accepted.
std::string override_error(const std::string& key, const std::string& text) {
  return error_of([&] { Config::from_overrides(kConfigSchema, {"--" + key + "=" + text}); });
}

std::string file_error(const std::string& toml) {
  return error_of([&] { Config::load(kConfigSchema, write_toml(toml), {}); });
}

bool has(const std::string& msg, const std::string& part) {
  return msg.find(part) != std::string::npos;
}

TEST(Config, DefaultsFileAndOverridesInThatOrder) {
  std::string path = write_toml("[model]\nn_layer = 6\n[optim]\nlr = 1e-3\n");
  Config c = Config::load(kConfigSchema, path, {"--optim.lr=2e-3", "run.dir=out"});
  EXPECT_EQ(c.i("model.n_layer"), 6);
  EXPECT_DOUBLE_EQ(c.f("optim.lr"), 2e-3);
  EXPECT_FALSE(c.b("data.shuffle"));
  EXPECT_EQ(c.s("run.dir"), "out");
  EXPECT_TRUE(c.is_set("model.n_layer"));
  EXPECT_FALSE(c.is_set("data.shuffle"));
  EXPECT_EQ(std::get<int64_t>(c.at("model.n_layer")), 6);
}

TEST(Config, UnknownKeySuggestsTheClosest) {
  std::string msg = error_of([] { Config::from_overrides(kConfigSchema, {"--model.n_layers=3"}); });
  EXPECT_TRUE(has(msg, "unknown key 'model.n_layers'")) << msg;
  EXPECT_TRUE(has(msg, "Did you mean 'model.n_layer'")) << msg;
  msg = file_error("[optimizer]\nlr = 1.0\n");
  EXPECT_TRUE(has(msg, "Did you mean 'optim.lr'")) << msg;
  EXPECT_TRUE(has(msg, ".toml:2:6: unknown key 'optimizer.lr'")) << msg;
  msg = error_of(
      [] { Config::from_overrides(kConfigSchema, {"--" + std::string(5000, 'x') + "=1"}); });
  EXPECT_TRUE(has(msg, "xxx...'")) << "a runaway key is cut: " << msg.size();
  EXPECT_LT(msg.size(), 400u);
}

TEST(Config, WrongTypesAreRefused) {
  EXPECT_TRUE(has(override_error("model.n_layer", "abc"),
                  "[config] command line: 'model.n_layer' must be an integer in [1, 1024], "
                  "got 'abc'"));
  EXPECT_TRUE(has(file_error("[data]\nshuffle = 3\n"),
                  "'data.shuffle' must be true or false, got 3 (a TOML integer)"));
  EXPECT_TRUE(has(override_error("data.shuffle", "yes"), "must be true or false, got 'yes'"));
  EXPECT_TRUE(has(error_of([] { Config::from_overrides(kConfigSchema, {"--model.n_layer"}); }),
                  "--section.key=value"));
  EXPECT_TRUE(has(error_of([] { Config::load(kConfigSchema, "/nonexistent/x.toml", {}); }),
                  "cannot open config file '/nonexistent/x.toml'"));
  EXPECT_TRUE(has(error_of([] {
                    Config::load(kConfigSchema, std::filesystem::temp_directory_path().string(),
                                 {});
                  }),
                  "is a directory"));
  EXPECT_TRUE(has(file_error("[model\n"), ".toml:1:"));
}

// Integers are parsed as 64-bit values and range-checked before any narrowing; the message
// echoes the value exactly as typed.
TEST(Config, IntegersNeverWrap) {
  const std::string range = "'model.n_layer' must be an integer in [1, 1024], got '";
  for (const char* typed : {"2147483648",
                            "2147483649",
                            "4294967296",
                            "4294967297",
                            "9223372036854775807",
                            "9223372036854775808",
                            "-9223372036854775808",
                            "-9223372036854775809",
                            "99999999999999999999999",
                            "0",
                            "-1",
                            "1025",
                            "1e30",
                            "-1e30",
                            "1e19",
                            "nan",
                            "inf",
                            "-inf",
                            "12abc",
                            "",
                            " 4",
                            "4 ",
                            "0x10",
                            "4.5",
                            "1e-3",
                            "++4",
                            "+-4",
                            "four"}) {
    std::string msg = override_error("model.n_layer", typed);
    EXPECT_TRUE(has(msg, range + typed + "'")) << typed << ": " << msg;
  }
  // int64 range ends are exact.
  Config c = Config::from_overrides(
      kConfigSchema, {"train.seed=9223372036854775807", "train.offset=-9223372036854775808"});
  EXPECT_EQ(c.i("train.seed"), INT64_MAX);
  EXPECT_EQ(c.i("train.offset"), INT64_MIN);
  EXPECT_TRUE(has(override_error("train.seed", "9223372036854775808"),
                  "'train.seed' must be an integer in [0, inf), got '9223372036854775808'"));
  EXPECT_TRUE(
      has(override_error("train.offset", "-9223372036854775809"), "got '-9223372036854775809'"));
  EXPECT_TRUE(has(override_error("train.offset", "9.3e18"), "got '9.3e18'"));
  EXPECT_TRUE(has(override_error("train.seed", "-1"), "got '-1'"));
  // Unranged integer keys fit 32 bits, so a reader's int() is exact.
  EXPECT_EQ(Config::from_overrides(kConfigSchema, {"eval.every=2147483647"}).i("eval.every"),
            INT32_MAX);
  EXPECT_EQ(Config::from_overrides(kConfigSchema, {"eval.every=-2147483648"}).i("eval.every"),
            INT32_MIN);
  EXPECT_TRUE(has(override_error("eval.every", "2147483648"),
                  "'eval.every' must be an integer in [-2147483648, 2147483647], got "
                  "'2147483648'"));
  // Open ends of an integer interval exclude the end itself.
  EXPECT_NE(override_error("eval.skip", "0"), "<no error>");
  EXPECT_EQ(override_error("eval.skip", "1"), "<no error>");
  EXPECT_EQ(override_error("eval.skip", "9"), "<no error>");
  EXPECT_NE(override_error("eval.skip", "10"), "<no error>");
}

TEST(Config, IntegerSpellingsThatAreExact) {
  for (const char* typed : {"1024", "+7", "1e3", "1.0e3", "4.0", "1", "001"}) {
    EXPECT_EQ(override_error("model.n_layer", typed), "<no error>") << typed;
  }
  EXPECT_EQ(Config::from_overrides(kConfigSchema, {"model.n_layer=1e3"}).i("model.n_layer"), 1000);
  EXPECT_EQ(Config::from_overrides(kConfigSchema, {"train.seed=1e18"}).i("train.seed"),
            1000000000000000000);
}

TEST(Config, IntegersFromTheFileAreCheckedToo) {
  std::string msg = file_error("[model]\nn_layer = 4294967297\n");
  EXPECT_TRUE(has(msg,
                  ".toml:2:11: 'model.n_layer' must be an integer in [1, 1024], got "
                  "'4294967297'"))
      << msg;
  EXPECT_TRUE(has(file_error("[model]\nn_layer = 0\n"), "got '0'"));
  EXPECT_TRUE(has(file_error("[model]\nn_layer = -2147483649\n"), "got '-2147483649'"));
  EXPECT_TRUE(has(file_error("[model]\nn_layer = 1e30\n"), "(a TOML floating-point)"));
  EXPECT_TRUE(has(file_error("[model]\nn_layer = nan\n"), "got nan (a TOML floating-point)"));
  EXPECT_TRUE(has(file_error("[model]\nn_layer = inf\n"), "got inf (a TOML floating-point)"));
  EXPECT_TRUE(has(file_error("[model]\nn_layer = \"12abc\"\n"), "(a TOML string)"));
  EXPECT_TRUE(has(file_error("[model]\nn_layer = 9223372036854775808\n"), ".toml:2:"));
  EXPECT_TRUE(has(file_error("[eval]\nevery = 2147483648\n"), "got '2147483648'"));
  EXPECT_TRUE(has(file_error("[train]\nseed = -1\n"), "[0, inf), got '-1'"));
  EXPECT_EQ(Config::load(kConfigSchema, write_toml("[train]\nseed = 9223372036854775807\n"), {})
                .i("train.seed"),
            INT64_MAX);
}

TEST(Config, FloatRangesAndNonFiniteValues) {
  for (const char* ok : {"1e-30", "1000", "6e-4", "+0.5", "1e3"}) {
    EXPECT_EQ(override_error("optim.lr", ok), "<no error>") << ok;
  }
  const std::string lr = "'optim.lr' must be a finite number in (0, 1000], got '";
  for (const char* bad : {"0", "-0", "-1", "1000.0001", "1e30", "nan", "-nan", "inf", "-inf",
                          "infinity", "1e999", "12abc", "", "0x1p3", "1,5"}) {
    EXPECT_TRUE(has(override_error("optim.lr", bad), lr + bad + "'")) << bad;
  }
  EXPECT_EQ(override_error("optim.beta1", "0"), "<no error>");
  EXPECT_EQ(override_error("optim.beta1", "0.999999"), "<no error>");
  EXPECT_TRUE(has(override_error("optim.beta1", "1"), "in [0, 1), got '1'"));
  EXPECT_TRUE(has(override_error("optim.beta1", "-1e-300"), "got '-1e-300'"));
  // Unranged floats are any finite number.
  EXPECT_EQ(override_error("optim.shift", "-1e300"), "<no error>");
  EXPECT_TRUE(has(override_error("optim.shift", "nan"), "'optim.shift' must be a finite number"));
  EXPECT_TRUE(has(override_error("optim.shift", "1e309"), "got '1e309'"));
  // From a file: TOML nan/inf and out-of-range numbers, integers are fine numbers.
  EXPECT_TRUE(has(file_error("[optim]\nlr = nan\n"),
                  ".toml:2:6: 'optim.lr' must be a finite "
                  "number in (0, 1000], got 'nan'"));
  EXPECT_TRUE(has(file_error("[optim]\nlr = -inf\n"), "got '-inf'"));
  EXPECT_TRUE(has(file_error("[optim]\nlr = 0.0\n"), "got '0.0'"));
  EXPECT_TRUE(has(file_error("[optim]\nbeta1 = 1\n"), "in [0, 1), got '1'"));
  EXPECT_TRUE(has(file_error("[optim]\nlr = \"1e-3\"\n"), "(a TOML string)"));
  EXPECT_DOUBLE_EQ(Config::load(kConfigSchema, write_toml("[optim]\nlr = 2\n"), {}).f("optim.lr"),
                   2.0);
}

TEST(Config, StringChoices) {
  EXPECT_EQ(override_error("optim.schedule", "constant"), "<no error>");
  EXPECT_TRUE(has(override_error("optim.schedule", "cosin"),
                  "'optim.schedule' must be one of: cosine, constant, got 'cosin'"));
  EXPECT_TRUE(has(file_error("[optim]\nschedule = \"linear\"\n"), "got 'linear'"));
  EXPECT_EQ(override_error("layout.schedule", ""), "<no error>");
  EXPECT_EQ(override_error("layout.schedule", "\"\""), "<no error>");
  EXPECT_TRUE(has(override_error("layout.schedule", "zb"), "one of: \"\", gpipe, 1f1b, got 'zb'"));
}

TEST(Config, DescribesWhatAKeyAccepts) {
  EXPECT_EQ(describe_valid(kConfigSchema[0]), "an integer in [1, 1024]");
  EXPECT_EQ(describe_valid(kConfigSchema[3]), "an integer in [-2147483648, 2147483647]");
  EXPECT_EQ(describe_valid(kConfigSchema[5]), "a finite number in (0, 1000]");
  EXPECT_EQ(describe_valid(kConfigSchema[7]), "a finite number");
  EXPECT_EQ(describe_valid(kConfigSchema[8]), "true or false");
  EXPECT_EQ(describe_valid(kConfigSchema[9]), "a string");
  EXPECT_EQ(describe_valid(kConfigSchema[10]), "one of: cosine, constant");
}

TEST(Config, DefaultsOutsideTheirRangeAreAProgrammingError) {
  const ConfigSchema bad = {{"a.b", ValueKind::Int, "0", "", "[1, 2]"}};
  EXPECT_TRUE(has(error_of([&] { Config::from_overrides(bad, {}); }),
                  "[config] internal: the default of 'a.b' must be an integer in [1, 2]"));
  const ConfigSchema malformed = {{"a.b", ValueKind::Float, "0", "", "0..1"}};
  EXPECT_TRUE(
      has(error_of([&] { Config::from_overrides(malformed, {}); }), "malformed range '0..1'"));
}

TEST(Config, ParsesTextAsAFile) {
  Config c = Config::parse(kConfigSchema, "[model]\nn_layer = 8\n", "inline", {"optim.lr=1"});
  EXPECT_EQ(c.i("model.n_layer"), 8);
  EXPECT_DOUBLE_EQ(c.f("optim.lr"), 1.0);
  EXPECT_TRUE(
      has(error_of([] { Config::parse(kConfigSchema, "[model]\nn_layer = 0\n", "inline", {}); }),
          "[config] inline:2:11: 'model.n_layer'"));
}

TEST(Config, RoundTripsThroughToml) {
  Config c = Config::from_overrides(kConfigSchema, {"--optim.lr=0.5", "--run.dir=a b"});
  Config d = Config::load(kConfigSchema, write_toml(c.to_toml()), {});
  EXPECT_DOUBLE_EQ(d.f("optim.lr"), 0.5);
  EXPECT_EQ(d.s("run.dir"), "a b");
  EXPECT_EQ(d.i("model.n_layer"), 4);
}

// Whatever a string holds, the saved config loads back to it: a value with three single quotes
// and a newline was once saved as a multi-line literal string that did not parse (found by
// fuzz/config_fuzz.cc).
TEST(Config, StringsRoundTripThroughToml) {
  for (const std::string& dir :
       std::vector<std::string>{"m'''x\nline", "a\"b\\c", "tab\there", "caf\xc3\xa9",
                                std::string("nul\0byte", 8), "\"\"\"\n"}) {
    Config c = Config::from_overrides(kConfigSchema, {"run.dir=" + dir});
    EXPECT_EQ(c.s("run.dir"), dir);
    Config d = Config::parse(kConfigSchema, c.to_toml(), "saved", {});
    EXPECT_EQ(d.s("run.dir"), dir) << c.to_toml();
  }
  EXPECT_TRUE(has(override_error("run.dir", "a\xff"), "'run.dir' must be UTF-8 text"));
  EXPECT_TRUE(has(override_error("run.dir", "\xed\xa0\x80"), "must be UTF-8 text"));
  EXPECT_TRUE(has(override_error("run.dir", "\xc0\xaf"), "must be UTF-8 text"));
}

TEST(Config, EditDistance) {
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("", "abc"), 3u);
  EXPECT_EQ(edit_distance("same", "same"), 0u);
  EXPECT_EQ(closest_suggestion({"--top-k", "--seed"}, "--topk"), " Did you mean '--top-k'?");
  EXPECT_EQ(closest_suggestion({"--top-k", "--seed"}, "--completely-different"), "");
  EXPECT_EQ(closest_suggestion({"--config", "--train.steps"}, "--steps"),
            " Did you mean '--train.steps'?");
}

}  // namespace
}  // namespace tetra
