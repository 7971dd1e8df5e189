// tests/malformed/config/: every malformed TOML config is refused with its clear message. The
// schema below mirrors the ranges of the `tetra train` keys the files use (tests/train/cli_test.cc
// runs the same files through the binary with the real schema).
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>

#include "core/config.h"
#include "tests/test_util.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;

const ConfigSchema kSchema = {
    {"model.n_layer", ValueKind::Int, "4", "", "[1, 1024]"},
    {"train.micro_batch", ValueKind::Int, "8", "", "[1, 16384]"},
    {"train.steps", ValueKind::Int, "100", "", "[1, 1000000000000]"},
    {"data.shuffle", ValueKind::Bool, "false", ""},
    {"optim.lr", ValueKind::Float, "6e-4", "", "(0, 1000]"},
    {"optim.eps", ValueKind::Float, "1e-8", "", "[1e-30, 1]"},
    {"optim.min_lr_ratio", ValueKind::Float, "0.1", "", "[0, 1]"},
    {"optim.weight_decay", ValueKind::Float, "0.1", "", "[0, 1000]"},
    {"optim.beta2", ValueKind::Float, "0.95", "", "[0, 0.9999999]"},
    {"optim.schedule", ValueKind::String, "\"cosine\"", "", "cosine | constant"},
    {"eval.every", ValueKind::Int, "0", "", "[0, 2147483647]"},
    {"run.threads", ValueKind::Int, "0", "", "[0, 1024]"},
    {"run.dir", ValueKind::String, "\"runs/x\"", ""},
};

// File name -> the part of its message that says what is wrong and where.
const std::map<std::string, std::string> kExpected = {
    {"int_wraps_at_2_32.toml",
     "int_wraps_at_2_32.toml:3:11: 'model.n_layer' must be an integer in [1, 1024], got "
     "'4294967297'"},
    {"int_2_32_is_not_zero.toml",
     ":3:15: 'train.micro_batch' must be an integer in [1, 16384], got '4294967296'"},
    {"int_beyond_int64.toml",
     ":2:28: Error while parsing decimal integer: '9223372036854775808' "
     "is not representable in 64 bits"},
    {"float_for_int.toml",
     ":2:9: 'train.steps' must be an integer in [1, 1000000000000], got 1e+30 (a TOML "
     "floating-point)"},
    {"string_for_int.toml",
     ":2:11: 'model.n_layer' must be an integer in [1, 1024], got '12abc' "
     "(a TOML string)"},
    {"nan_lr.toml", ":2:6: 'optim.lr' must be a finite number in (0, 1000], got 'nan'"},
    {"inf_lr.toml", ":2:6: 'optim.lr' must be a finite number in (0, 1000], got 'inf'"},
    {"negative_eps.toml", ":2:7: 'optim.eps' must be a finite number in [1e-30, 1], got '-1.0'"},
    {"min_lr_ratio_above_1.toml",
     ":2:16: 'optim.min_lr_ratio' must be a finite number in [0, 1], got '5.0'"},
    {"negative_weight_decay.toml",
     ":2:16: 'optim.weight_decay' must be a finite number in [0, 1000], got '-1.0'"},
    {"beta_of_1.toml", ":2:9: 'optim.beta2' must be a finite number in [0, 0.9999999], got '1.0'"},
    {"negative_eval_every.toml",
     ":2:9: 'eval.every' must be an integer in [0, 2147483647], got '-1'"},
    {"threads_100000.toml", ":3:11: 'run.threads' must be an integer in [0, 1024], got '100000'"},
    {"unknown_schedule.toml",
     ":2:12: 'optim.schedule' must be one of: cosine, constant, got 'linear'"},
    {"bool_as_string.toml",
     ":2:11: 'data.shuffle' must be true or false, got 'yes' (a TOML string)"},
    {"array_value.toml",
     ":2:11: 'model.n_layer' must be an integer in [1, 1024], got a TOML array"},
    {"key_as_table.toml",
     ":1:1: 'model.n_layer' must be an integer in [1, 1024], got a TOML table"},
    {"unknown_section.toml", ":2:6: unknown key 'optimizer.lr'. Did you mean 'optim.lr'?"},
    {"misspelt_key.toml", ":2:12: unknown key 'model.n_layers'. Did you mean 'model.n_layer'?"},
    {"unclosed_table.toml", ":1:7: Error while parsing table header"},
    {"duplicate_key.toml",
     ":3:11: Error while parsing key-value pair: cannot redefine existing "
     "integer 'n_layer'"},
    {"unterminated_string.toml", ":2:14: Error while parsing string"},
    {"binary.toml", ":1:12: Encountered invalid utf-8 sequence"},
    {"deep_dotted_key.toml", ":1: more than 1000 dots on one line"},
};

TEST(ConfigMalformed, EveryFileGetsItsMessage) {
  const fs::path dir = fs::path(TETRA_SOURCE_DIR) / "tests/malformed/config";
  size_t files = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    ++files;
    auto it = kExpected.find(name);
    ASSERT_NE(it, kExpected.end()) << name << " has no expected message in this test";
    const std::string msg =
        testing::error_of([&] { Config::load(kSchema, entry.path().string(), {}); });
    EXPECT_EQ(msg.rfind("[config] ", 0), 0u) << name << ": " << msg;
    EXPECT_NE(msg.find(it->second), std::string::npos)
        << name << "\n  expected: " << it->second << "\n  got:      " << msg;
    EXPECT_LT(msg.size(), 400u) << name << ": a message stays short";
  }
  EXPECT_EQ(files, kExpected.size()) << "a file of the table is missing from " << dir;
  EXPECT_GE(files, 10u);
}

}  // namespace
}  // namespace tetra
