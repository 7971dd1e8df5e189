// Triage (comm/triage.h) on flight records made by hand, one per cause class: a stopped rank seen
// on a board, a rank that issued another collective (by its ring, and by the debug hash's abort),
// ranks that wait on each other in two groups, a peer nobody can reach, a crashed rank, and a
// record of an earlier job in the same directory, which is set aside.
#include "comm/triage.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

namespace tetra::comm {
namespace {

using nlohmann::json;

constexpr const char* kDp = "00000000000000d1";  // world ranks 0, 1, 2
constexpr const char* kTp = "00000000000000e1";  // world ranks 1, 2

json op(uint64_t id, uint64_t seq, const char* kind, const char* group_key, size_t bytes,
        const char* state, int peer = -1) {
  const bool started = std::string(state) != "queued";
  return {{"id", id},
          {"seq", seq},
          {"op", kind},
          {"group_key", group_key},
          {"bytes", bytes},
          {"dtype", "f32"},
          {"peer", peer},
          {"site", "reduce_gradients"},
          {"started_ago_s", started ? 8.0 : -1.0},
          {"state", state}};
}

// The record of world rank `rank` of 3, whose ring holds dp #1..#4 done and then `last`.
json record(int rank, json last, const std::string& reason = "watchdog: all_reduce #5 ...") {
  json ops = json::array();
  for (uint64_t s = 1; s <= 4; ++s) ops.push_back(op(s, s, "all_reduce", kDp, 4096, "done"));
  if (!last.is_null()) ops.push_back(std::move(last));
  return {
      {"schema", 1},
      {"job", "job-a"},
      {"rank", rank},
      {"world_size", 3},
      {"reason", reason},
      {"written_unix", 1000.0 + rank},
      {"phases", json::array({{{"phase", "backward"},
                               {"step", 7},
                               {"micro", 1},
                               {"stage", 0},
                               {"began_ago_s", 8.5}}})},
      {"ops", ops},
      {"groups",
       {{kDp, {{"name", "dp"}, {"ranks", {0, 1, 2}}}}, {kTp, {{"name", "tp"}, {"ranks", {1, 2}}}}}},
      {"board", json::array()},
      {"unreached", json::object()}};
}

// A board entry for world rank 2: outside any operation since dp #4, in backward of step 7.
json idle_rank_2() {
  return {{"rank", 2},
          {"source", "board"},
          {"op", "all_reduce"},
          {"seq", 4},
          {"group_key", kDp},
          {"running", false},
          {"op_age_s", 8.2},
          {"phase", "backward"},
          {"phase_step", 7},
          {"micro", 1},
          {"stage", 0},
          {"phase_age_s", 8.4},
          {"entered", {{kDp, 4}}}};
}

std::string joined(const Diagnosis& d) {
  std::string out;
  for (const std::string& line : d.lines) out += line + "\n";
  return out;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(Triage, AStoppedRankSeenOnTheBoardIsNamedWithItsPhase) {
  json r0 = record(0, op(5, 5, "all_reduce", kDp, 4096, "running"));
  r0["board"].push_back(idle_rank_2());
  const Diagnosis d = triage({r0, record(1, op(5, 5, "all_reduce", kDp, 4096, "running"))});
  const std::string text = joined(d);
  EXPECT_EQ(d.cause, "stopped or slow rank") << text;
  EXPECT_TRUE(has(text, "records of world ranks 0, 1 of 3 (job job-a); none of: 2")) << text;
  EXPECT_TRUE(has(text,
                  "group 'dp' (world ranks 0, 1, 2): stuck in all_reduce #5 of 4096 bytes "
                  "f32, issued from reduce_gradients; waiting in it: 0, 1 (for 8.0 s); "
                  "never entered: 2"))
      << text;
  EXPECT_TRUE(has(text,
                  "world rank 2: outside any operation for 8.2 s (last: all_reduce #4 on "
                  "group 'dp'"))
      << text;
  EXPECT_TRUE(has(text, "phase backward (step 7, micro-batch 1, stage 0) for 8.4 s")) << text;
  EXPECT_TRUE(has(text, "cause: stopped or slow rank: world rank(s) 2 are outside")) << text;
}

TEST(Triage, ADifferentCollectiveAtTheSameSequenceNumberIsAProgramBug) {
  const Diagnosis d = triage({record(0, op(5, 5, "all_reduce", kDp, 4096, "running")),
                              record(1, op(5, 5, "all_gather", kDp, 512, "running")),
                              record(2, op(5, 5, "all_reduce", kDp, 4096, "running"))});
  const std::string text = joined(d);
  EXPECT_EQ(d.cause, "mismatched collective") << text;
  EXPECT_TRUE(has(text,
                  "world rank 1 issued all_gather of 512 bytes as #5, where world rank 0 "
                  "issued all_reduce of 4096 bytes"))
      << text;
  EXPECT_TRUE(has(text, "--dist.debug_hash=true")) << text;

  // The debug hash stops the ranks before the collective runs; their records say why.
  const std::string why = "watchdog: ranks issued different collective sequences";
  const Diagnosis h = triage({record(0, json(), why), record(1, json(), why)});
  EXPECT_EQ(h.cause, "mismatched collective") << joined(h);
}

TEST(Triage, RanksWaitingOnEachOtherInTwoGroupsAreADeadlock) {
  // 0 and 1 wait in dp #5; 2 never enters it: it waits in tp #3 for 1, which is in dp.
  const Diagnosis d = triage({record(0, op(5, 5, "all_reduce", kDp, 4096, "running")),
                              record(1, op(5, 5, "all_reduce", kDp, 4096, "running")),
                              record(2, op(5, 3, "all_reduce", kTp, 256, "running"))});
  const std::string text = joined(d);
  EXPECT_EQ(d.cause, "deadlock in the schedule") << text;
  EXPECT_TRUE(has(text, "world rank 2: waiting in all_reduce #3 on group 'tp' (world ranks 1, 2)"))
      << text;
}

TEST(Triage, APeerNobodyReachesIsALostPeer) {
  json r0 = record(0, op(5, 5, "all_reduce", kDp, 4096, "running"));
  r0["unreached"]["2"] = "host cut off: connect to 10.0.0.2:41000 timed out";
  const Diagnosis d = triage({r0, record(1, op(5, 5, "all_reduce", kDp, 4096, "running"))});
  const std::string text = joined(d);
  EXPECT_EQ(d.cause, "lost peer") << text;
  EXPECT_TRUE(has(text, "world rank 2: no record and no answer: host cut off")) << text;
}

TEST(Triage, ARankThatDiedOfASignalIsTheCrash) {
  json r1 = record(1, json(), "fatal signal SIGSEGV (Segmentation fault)");
  r1["phases"][0]["phase"] = "forward";
  const Diagnosis d = triage({record(0, op(5, 5, "all_reduce", kDp, 4096, "running")), r1});
  const std::string text = joined(d);
  EXPECT_EQ(d.cause, "crash") << text;
  EXPECT_TRUE(has(text, "cause: crash: world rank 1 died: fatal signal SIGSEGV")) << text;
  EXPECT_TRUE(has(text, "phase forward (step 7, micro-batch 1, stage 0)")) << text;
}

TEST(Triage, RecordsOfAnEarlierJobAreSetAside) {
  json old = record(2, json(), "fatal signal SIGSEGV (Segmentation fault)");
  old["job"] = "job-old";
  old["written_unix"] = 10.0;
  json r0 = record(0, op(5, 5, "all_reduce", kDp, 4096, "running"));
  r0["board"].push_back(idle_rank_2());
  const Diagnosis d = triage({old, r0});
  const std::string text = joined(d);
  EXPECT_EQ(d.cause, "stopped or slow rank") << text;  // not the old job's crash
  EXPECT_TRUE(has(text, "1 record(s) of an earlier job set aside")) << text;
}

TEST(Triage, NoPendingCollectiveSaysSo) {
  const Diagnosis d = triage({record(0, json(), "SIGUSR1: a record asked for from outside")});
  EXPECT_EQ(d.cause, "no collective pending") << joined(d);
  EXPECT_EQ(triage({}).cause, "no records");
}

}  // namespace
}  // namespace tetra::comm
