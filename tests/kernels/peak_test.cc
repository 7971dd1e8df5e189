// The peak cache: every partial, stale or damaged file still gives a usable peak and is rewritten
// in the current schema; a good entry is reused; a busy measurement is repeated once quiet. A
// stand-in machine (fixed rates, a chosen load) keeps these tests independent of this CPU and its
// load; one case measures the real machine.
#include "kernels/cpu/peak.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/matmul.h"
#include "tests/test_util.h"

namespace tetra::cpu {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::ScopedEnv;

constexpr const char* kMachine = "Test CPU 9000 (avx2)";

class PeakCache : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tetra_peak_test_" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    path_ = dir_ / "cache" / "peak.json";
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The stand-in machine: `threads` x 100 GFLOP/s in fp32 and x 300 in bf16, measured under
  // `load_`.
  PeakSource source() {
    return {[this](int threads, bool bf16) {
              ++measured_;
              return (bf16 ? 300.0 : 100.0) * threads;
            },
            [this] { return load_; }, kMachine};
  }
  double peak(int threads, bool* from_cache = nullptr, bool bf16 = false) {
    return peak_gflops(threads, bf16, path_, source(), from_cache);
  }
  void write(const std::string& text) {
    fs::create_directories(path_.parent_path());
    std::ofstream(path_) << text;
  }
  json cache() const {
    std::ifstream in(path_);
    return json::parse(in);
  }
  // A current-schema file holding `entries` for the stand-in machine.
  static std::string current(const json& entries) {
    return json{{"schema", 3}, {"machine", kMachine}, {"threads", entries}}.dump();
  }
  // The file is in the current schema and holds a well-formed entry of `gflops` at `threads`.
  void expect_entry(int threads, double gflops) const {
    const json j = cache();
    EXPECT_EQ(j["schema"], 3) << j.dump();
    EXPECT_EQ(j["machine"], kMachine) << j.dump();
    const json& e = j["threads"][std::to_string(threads)];
    EXPECT_DOUBLE_EQ(e["gflops"].get<double>(), gflops) << j.dump();
    EXPECT_DOUBLE_EQ(e["load_average"].get<double>(), load_) << j.dump();
    EXPECT_EQ(e["measured_at"].get<std::string>().size(), 20u) << j.dump();  // ISO 8601, UTC
  }

  fs::path dir_, path_;
  int measured_ = 0;
  double load_ = 0.1;
};

TEST_F(PeakCache, MissingFileIsMeasuredWrittenAndThenReused) {
  bool from_cache = true;
  EXPECT_DOUBLE_EQ(peak(2, &from_cache), 200.0);
  EXPECT_FALSE(from_cache);
  expect_entry(2, 200.0);
  EXPECT_DOUBLE_EQ(peak(2, &from_cache), 200.0);
  EXPECT_TRUE(from_cache);
  EXPECT_EQ(measured_, 1);
}

TEST_F(PeakCache, DamagedFilesAreMeasuredAgainAndRewritten) {
  const std::vector<std::string> damaged = {
      "{\"schema\": 3, \"machine\"", "", "[1, 2]", "42", "\xff\xfe", current(json(7))};
  for (const std::string& text : damaged) {
    write(text);
    measured_ = 0;
    EXPECT_DOUBLE_EQ(peak(2), 200.0) << text;
    EXPECT_EQ(measured_, 1) << text;
    expect_entry(2, 200.0);
  }
}

TEST_F(PeakCache, OlderFormatsAreReplaced) {
  // The per-thread keys the trainer wrote before, and the planner's all-core key alone.
  for (const char* text : {R"({"fp32_gflops_2t": 80.5, "load_at_fp32_gflops_2t": 0.1})",
                           R"({"fp32_gflops": 250.5})", R"({"schema": 1, "threads": {}})"}) {
    write(text);
    measured_ = 0;
    EXPECT_DOUBLE_EQ(peak(2), 200.0) << text;
    EXPECT_EQ(measured_, 1) << text;
    expect_entry(2, 200.0);
    EXPECT_FALSE(cache().contains("fp32_gflops")) << text;
    EXPECT_FALSE(cache().contains("fp32_gflops_2t")) << text;
  }
}

TEST_F(PeakCache, MissingThreadCountIsMeasuredAndAddedBesideTheOthers) {
  write(current({{"1", {{"gflops", 61.0}, {"load_average", 0.2}, {"measured_at", "x"}}}}));
  EXPECT_DOUBLE_EQ(peak(2), 200.0);
  EXPECT_EQ(measured_, 1);
  expect_entry(2, 200.0);
  bool from_cache = false;
  EXPECT_DOUBLE_EQ(peak(1, &from_cache), 61.0);
  EXPECT_TRUE(from_cache);
  EXPECT_EQ(measured_, 1);
}

// The bf16 product's peak is a second entry per thread count ("bf16:<n>"), measured, kept and
// reused beside the fp32 one without disturbing it.
TEST_F(PeakCache, Bf16PeakIsKeptBesideTheFp32One) {
  EXPECT_DOUBLE_EQ(peak(2), 200.0);
  bool from_cache = true;
  EXPECT_DOUBLE_EQ(peak(2, &from_cache, /*bf16=*/true), 600.0);
  EXPECT_FALSE(from_cache);
  EXPECT_EQ(measured_, 2);
  expect_entry(2, 200.0);
  const json file = cache();
  EXPECT_DOUBLE_EQ(file.at("threads").at("bf16:2").at("gflops").get<double>(), 600.0)
      << file.dump();
  EXPECT_DOUBLE_EQ(peak(2, &from_cache, true), 600.0);
  EXPECT_TRUE(from_cache);
  EXPECT_DOUBLE_EQ(peak(2, &from_cache), 200.0);
  EXPECT_TRUE(from_cache);
  EXPECT_EQ(measured_, 2);
}

TEST_F(PeakCache, MalformedEntriesAreMeasuredAgain) {
  const json good = {{"gflops", 61.0}, {"load_average", 0.2}, {"measured_at", "x"}};
  for (const json& bad :
       {json{{"gflops", "fast"}, {"load_average", 0.1}},
        json{{"gflops", nullptr}, {"load_average", 0.1}},
        json{{"gflops", -3.0}, {"load_average", 0.1}}, json{{"gflops", 0}, {"load_average", 0.1}},
        json{{"gflops", 90.0}, {"load_average", "low"}}, json{{"gflops", 90.0}}, json(90.0),
        json::array({90.0})}) {
    write(current({{"1", good}, {"2", bad}}));
    measured_ = 0;
    EXPECT_DOUBLE_EQ(peak(2), 200.0) << bad.dump();
    EXPECT_EQ(measured_, 1) << bad.dump();
    expect_entry(2, 200.0);
    EXPECT_EQ(cache()["threads"]["1"], good) << "a good entry beside a bad one is kept";
  }
}

TEST_F(PeakCache, AnotherMachinesFileIsMeasuredAgain) {
  write(json{{"schema", 3},
             {"machine", "Other CPU (avx512_core_amx)"},
             {"threads", {{"2", {{"gflops", 900.0}, {"load_average", 0.0}}}}}}
            .dump());
  EXPECT_DOUBLE_EQ(peak(2), 200.0);
  EXPECT_EQ(measured_, 1);
  expect_entry(2, 200.0);
}

TEST_F(PeakCache, BusyMeasurementIsRepeatedOnceTheMachineIsQuiet) {
  write(current({{"2", {{"gflops", 50.0}, {"load_average", 3.0}, {"measured_at", "x"}}}}));
  load_ = 2.0;  // still busy: the low value stands rather than another low one
  EXPECT_DOUBLE_EQ(peak(2), 50.0);
  EXPECT_EQ(measured_, 0);
  load_ = 0.1;  // quiet: measured again, and the quiet value replaces it
  EXPECT_DOUBLE_EQ(peak(2), 200.0);
  EXPECT_EQ(measured_, 1);
  expect_entry(2, 200.0);
}

TEST_F(PeakCache, ABusyMeasurementIsRepeatedWhenTheLoadHalvedAndTheBestRateKept) {
  write(current({{"2", {{"gflops", 50.0}, {"load_average", 8.0}, {"measured_at", "x"}}}}));
  load_ = 3.0;  // still above 1, but half of 8: measured again (200 here), the better value kept
  EXPECT_DOUBLE_EQ(peak(2), 200.0);
  EXPECT_EQ(measured_, 1);
  expect_entry(2, 200.0);
  write(current({{"2", {{"gflops", 500.0}, {"load_average", 8.0}, {"measured_at", "x"}}}}));
  EXPECT_DOUBLE_EQ(peak(2), 500.0);  // a new measurement below the cached one does not replace it
  EXPECT_EQ(measured_, 2);
  const json e = cache()["threads"]["2"];
  EXPECT_DOUBLE_EQ(e["gflops"].get<double>(), 500.0);
  EXPECT_DOUBLE_EQ(e["load_average"].get<double>(), 8.0);  // with the load it was measured under
}

TEST_F(PeakCache, UnwritableOrAbsentCacheStillGivesAPeak) {
  std::ofstream(dir_ / "file") << "a file where the cache directory should be";
  path_ = dir_ / "file" / "peak.json";
  EXPECT_DOUBLE_EQ(peak(2), 200.0);
  EXPECT_DOUBLE_EQ(peak(2), 200.0);
  EXPECT_EQ(measured_, 2);
  path_.clear();  // no cache at all (no HOME)
  EXPECT_DOUBLE_EQ(peak(1), 100.0);
  EXPECT_EQ(measured_, 3);
}

TEST_F(PeakCache, ThreadCountBelowOneIsRefused) {
  EXPECT_THROW(peak(0), Error);
  EXPECT_EQ(measured_, 0);
}

TEST_F(PeakCache, PathFollowsXdgCacheHomeThenHome) {
  ScopedEnv home("HOME", "/h"), xdg("XDG_CACHE_HOME", "/x/cache");
  EXPECT_EQ(peak_cache_path(), fs::path("/x/cache/tetra/peak.json"));
  {
    ScopedEnv relative("XDG_CACHE_HOME", "relative");  // invalid under XDG: ignored
    EXPECT_EQ(peak_cache_path(), fs::path("/h/.cache/tetra/peak.json"));
  }
  ScopedEnv no_xdg("XDG_CACHE_HOME", nullptr);
  EXPECT_EQ(peak_cache_path(), fs::path("/h/.cache/tetra/peak.json"));
  ScopedEnv no_home("HOME", nullptr);
  EXPECT_TRUE(peak_cache_path().empty());
}

TEST_F(PeakCache, MeasuresThisMachineIntoTheCacheUnderHome) {
  ScopedEnv xdg("XDG_CACHE_HOME", (dir_ / "xdg").c_str());
  ScopedEnv measured("TETRA_PEAK_GFLOPS", nullptr);  // tests/hermetic.sh gives one
  const double g = fp32_peak_gflops(1);
  EXPECT_GT(g, 0.1);
  std::ifstream in(dir_ / "xdg" / "tetra" / "peak.json");
  ASSERT_TRUE(in) << "no cache written under XDG_CACHE_HOME";
  const json j = json::parse(in);
  EXPECT_EQ(j["machine"], machine_peak_source().machine);
  EXPECT_DOUBLE_EQ(j["threads"]["1"]["gflops"].get<double>(), g);
  std::cout << "[ peak     ] " << j["machine"].get<std::string>() << ": " << g
            << " GFLOP/s fp32 at 1 thread" << std::endl;
  // bf16: measured where the CPU has bf16 instructions (the only place a bf16 run is allowed),
  // refused elsewhere, where oneDNN's bf16 product, if it has one, is emulated.
  if (!bf16_matmul_path().hardware) {
    EXPECT_THROW(bf16_peak_gflops(1), Error);
    std::cout << "[ peak     ] bf16 refused: " << bf16_matmul_path().describe() << std::endl;
    return;
  }
  const double g16 = bf16_peak_gflops(1);
  EXPECT_GT(g16, 0.1);
  const json j16 = json::parse(std::ifstream(dir_ / "xdg" / "tetra" / "peak.json"));
  EXPECT_DOUBLE_EQ(j16.at("threads").at("bf16:1").at("gflops").get<double>(), g16);
  EXPECT_DOUBLE_EQ(j16.at("threads").at("1").at("gflops").get<double>(), g);
  std::cout << "[ peak     ] " << g16 << " GFLOP/s bf16 (" << bf16_matmul_path().describe()
            << ") at 1 thread, " << g16 / g << "x fp32" << std::endl;
}

TEST_F(PeakCache, CopyBandwidthIsMeasuredAndKeptAsTheBestUnderHome) {
  ScopedEnv xdg("XDG_CACHE_HOME", (dir_ / "xdg").c_str());
  const double bw = copy_bandwidth();
  // Any memory system of the last 20 years copies faster than 1 GB/s and slower than 10 TB/s.
  EXPECT_GT(bw, 1e9);
  EXPECT_LT(bw, 1e13);
  EXPECT_EQ(copy_bandwidth(), bw) << "measured once per process";
  std::ifstream in(dir_ / "xdg" / "tetra" / "memory.json");
  ASSERT_TRUE(in) << "no memory.json written under XDG_CACHE_HOME";
  const json j = json::parse(in);
  EXPECT_EQ(j["machine"], machine_peak_source().machine);
  EXPECT_DOUBLE_EQ(j["bandwidth"]["copy"]["bytes_per_s"].get<double>(), bw);
  std::cout << "[ copy     ] " << bw / 1e9 << " GB/s (read + written) from one thread" << std::endl;
}

// The copy bandwidth of a quiet machine is read from memory.json without measuring; a figure
// measured under load is measured again once the machine is quieter, and the better one is kept.
TEST_F(PeakCache, CopyBandwidthIsReadFromTheCacheUnlessMeasuredUnderLoad) {
  const fs::path path = dir_ / "memory.json";
  int measured = 0;
  auto measure = [&](double gbs) {
    return [&measured, gbs] {
      ++measured;
      return gbs * 1e9;
    };
  };
  // Nothing kept: measured (at load 1.8) and kept with its load.
  EXPECT_EQ(copy_bandwidth(path, 1.8, measure(20)), 20e9);
  EXPECT_EQ(measured, 1);
  EXPECT_EQ(json::parse(std::ifstream(path))["bandwidth"]["copy"]["load_average"], 1.8);
  // Still busy (1.2 > 1.8 / 2): the kept figure, nothing measured.
  EXPECT_EQ(copy_bandwidth(path, 1.2, measure(25)), 20e9);
  EXPECT_EQ(measured, 1);
  // Quieter (0.3): measured again; the better figure kept, with the quiet load.
  EXPECT_EQ(copy_bandwidth(path, 0.3, measure(30)), 30e9);
  EXPECT_EQ(measured, 2);
  EXPECT_EQ(json::parse(std::ifstream(path))["bandwidth"]["copy"]["load_average"], 0.3);
  // Measured on a quiet machine: read as it is, whatever the load now.
  EXPECT_EQ(copy_bandwidth(path, 0.0, measure(40)), 30e9);
  EXPECT_EQ(copy_bandwidth(path, 1.9, measure(40)), 30e9);
  EXPECT_EQ(measured, 2);
  // A kept figure without its load (an older memory.json) counts as quiet.
  std::ofstream(path) << json({{"schema", 1},
                               {"machine", machine_peak_source().machine},
                               {"bandwidth", {{"copy", {{"bytes_per_s", 5e9}}}}}})
                             .dump();
  EXPECT_EQ(copy_bandwidth(path, 0.1, measure(40)), 5e9);
  EXPECT_EQ(measured, 2);
  // No cache: measured each time, nothing written.
  EXPECT_EQ(copy_bandwidth(fs::path(), 0.1, measure(7)), 7e9);
  EXPECT_EQ(measured, 3);
}

// TETRA_PEAK_GFLOPS: a per-thread figure, nothing measured or cached; a bad value is refused.
TEST_F(PeakCache, AGivenPeakIsTakenPerThreadWithoutMeasuring) {
  ScopedEnv xdg("XDG_CACHE_HOME", (dir_ / "given").c_str());
  ScopedEnv given("TETRA_PEAK_GFLOPS", "37.5");
  bool from_cache = true;
  EXPECT_DOUBLE_EQ(fp32_peak_gflops(2, &from_cache), 75.0);
  EXPECT_FALSE(from_cache);
  EXPECT_DOUBLE_EQ(bf16_peak_gflops(2, &from_cache), 75.0);
  EXPECT_FALSE(from_cache);
  EXPECT_FALSE(fs::exists(dir_ / "given" / "tetra" / "peak.json"));
  for (const char* bad : {"0", "-3", "fast", "12x", "inf"}) {
    ScopedEnv wrong("TETRA_PEAK_GFLOPS", bad);
    try {
      fp32_peak_gflops(1);
      ADD_FAILURE() << bad << " was taken";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("TETRA_PEAK_GFLOPS=") + bad +
                                           " is not a positive number of GFLOP/s per thread"),
                std::string::npos)
          << e.what();
    }
  }
  ScopedEnv unset("TETRA_PEAK_GFLOPS", nullptr);
  EXPECT_FALSE(given_peak_gflops(4).has_value());
}

}  // namespace
}  // namespace tetra::cpu
