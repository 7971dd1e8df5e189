#include "core/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "tests/test_util.h"

namespace tetra {
namespace {

const ConfigSchema kSchema = {
    {"model.n_layer", ValueKind::Int, "4", ""},
    {"optim.lr", ValueKind::Float, "6e-4", ""},
    {"data.shuffle", ValueKind::Bool, "false", ""},
    {"run.dir", ValueKind::String, "\"runs/x\"", ""},
};

std::string write_toml(const std::string& text) {
  // Per process: CTest runs the cases of this file as parallel processes.
  auto path = std::filesystem::temp_directory_path() /
              ("tetra_config_test_" + std::to_string(::getpid()) + ".toml");
  std::ofstream(path) << text;
  return path.string();
}

using testing::error_of;

TEST(Config, DefaultsFileAndOverridesInThatOrder) {
  std::string path = write_toml("[model]\nn_layer = 6\n[optim]\nlr = 1e-3\n");
  Config c = Config::load(kSchema, path, {"--optim.lr=2e-3", "run.dir=out"});
  EXPECT_EQ(c.i("model.n_layer"), 6);
  EXPECT_DOUBLE_EQ(c.f("optim.lr"), 2e-3);
  EXPECT_FALSE(c.b("data.shuffle"));
  EXPECT_EQ(c.s("run.dir"), "out");
  EXPECT_TRUE(c.is_set("model.n_layer"));
  EXPECT_FALSE(c.is_set("data.shuffle"));
}

TEST(Config, UnknownKeySuggestsTheClosest) {
  std::string msg = error_of([] { Config::from_overrides(kSchema, {"--model.n_layers=3"}); });
  EXPECT_NE(msg.find("unknown key 'model.n_layers'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Did you mean 'model.n_layer'"), std::string::npos) << msg;
  msg = error_of([] { Config::load(kSchema, write_toml("[optimizer]\nlr = 1.0\n"), {}); });
  EXPECT_NE(msg.find("Did you mean 'optim.lr'"), std::string::npos) << msg;
}

TEST(Config, WrongTypesAreRefused) {
  EXPECT_NE(error_of([] {
              Config::from_overrides(kSchema, {"--model.n_layer=abc"});
            }).find("expects integer"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              Config::load(kSchema, write_toml("[data]\nshuffle = 3\n"), {});
            }).find("expects boolean"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              Config::from_overrides(kSchema, {"--model.n_layer"});
            }).find("--section.key=value"),
            std::string::npos);
  EXPECT_NE(error_of([] { Config::load(kSchema, "/nonexistent/x.toml", {}); }).find("cannot open"),
            std::string::npos);
  EXPECT_NE(error_of([] { Config::load(kSchema, write_toml("[model\n"), {}); }).find(".toml:"),
            std::string::npos);
}

TEST(Config, RoundTripsThroughToml) {
  Config c = Config::from_overrides(kSchema, {"--optim.lr=0.5", "--run.dir=a b"});
  Config d = Config::load(kSchema, write_toml(c.to_toml()), {});
  EXPECT_DOUBLE_EQ(d.f("optim.lr"), 0.5);
  EXPECT_EQ(d.s("run.dir"), "a b");
  EXPECT_EQ(d.i("model.n_layer"), 4);
}

TEST(Config, EditDistance) {
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("", "abc"), 3u);
  EXPECT_EQ(edit_distance("same", "same"), 0u);
}

}  // namespace
}  // namespace tetra
