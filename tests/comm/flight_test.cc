// The flight recorder (comm/flight.h) in one process: phases are kept in order with their step,
// micro-batch and stage; SIGUSR1 writes a record and the process goes on; a final record is not
// replaced by a later one (the launcher's SIGTERM after a watchdog's timeout); call sites stack.
#include "comm/flight.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

namespace tetra::comm::flight {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

json read_record(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in, nullptr, false);
}

TEST(Flight, PhasesSignalsAndTheFinalRecord) {
  const fs::path dir = fs::temp_directory_path() / "flight";
  fs::remove_all(dir);
  configure(dir.string(), 3);
  EXPECT_EQ(flight::dir(), dir.string());
  EXPECT_STREQ(current_site(), "");  // nothing marked yet

  set_step(7);
  enter(Phase::forward, 1, 0);
  EXPECT_STREQ(current_site(), "forward");
  {
    Site bucket("dp.bucket");
    EXPECT_STREQ(current_site(), "dp.bucket");
    {
      Site gather("zero3.gather");
      EXPECT_STREQ(current_site(), "zero3.gather");
    }
    EXPECT_STREQ(current_site(), "dp.bucket");
  }
  enter(Phase::backward, 1, 0);

  json r = record("asked");
  EXPECT_EQ(r["rank"], 3);
  EXPECT_EQ(r["reason"], "asked");
  EXPECT_EQ(r["step"], 7);
  ASSERT_EQ(r["phases"].size(), 2u) << r.dump(1);
  EXPECT_EQ(r["phases"][0]["phase"], "forward");
  EXPECT_GE(r["phases"][0]["ended_ago_s"].get<double>(), 0.0);  // ended when backward began
  EXPECT_EQ(r["phases"][1]["phase"], "backward");
  EXPECT_EQ(r["phases"][1]["micro"], 1);
  EXPECT_EQ(r["phases"][1]["stage"], 0);
  EXPECT_EQ(r["phases"][1]["ended_ago_s"].get<double>(), -1.0);  // current

  // SIGUSR1 from outside: a record now, and the process goes on.
  const fs::path path = dir / "rank-3.json";
  ASSERT_EQ(::raise(SIGUSR1), 0);
  for (int i = 0; i < 500 && !fs::exists(path); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(fs::exists(path)) << "SIGUSR1 wrote no record";
  EXPECT_NE(read_record(path)["reason"].get<std::string>().find("SIGUSR1"), std::string::npos);

  // A final record stays: nothing after it replaces it.
  enter(Phase::optimizer);
  EXPECT_EQ(dump("watchdog: a collective missed its deadline"), path.string());
  EXPECT_EQ(dump("SIGTERM: the launcher ended the job"), "");
  const json final_record = read_record(path);
  EXPECT_EQ(final_record["reason"], "watchdog: a collective missed its deadline");
  EXPECT_EQ(final_record["phases"].back()["phase"], "optimizer");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tetra::comm::flight
