// The arrival board: a shared-memory page per host on which every rank publishes, without locks,
// the last sequence number it entered on each of its groups and what it is doing now. The
// watchdog reads its host's page directly and other hosts' entries over the network
// (peer_probe.h). Internal to comm/.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

namespace tetra::comm {

inline constexpr int kBoardGroups = 32;

// One rank's entry. Written only by its owner; lock-free atomics are address-free, so they work
// across processes.
struct BoardGroup {
  std::atomic<uint64_t> key;
  std::atomic<uint64_t> entered;   // last sequence number entered on this group
  std::atomic<uint64_t> finished;  // last sequence number finished on this group
};

struct BoardSlot {
  std::atomic<uint64_t> host_tag;  // non-zero once the rank is up (on this host)
  std::atomic<uint64_t> cur_key;   // group of the last operation entered
  std::atomic<uint64_t> cur_seq;
  std::atomic<uint32_t> cur_op;
  std::atomic<uint32_t> running;  // 1 while inside an operation
  std::atomic<uint64_t> since;    // bits of now_s() at the last enter/leave
  // The training phase the rank marked last (flight.h): so that a rank that stopped is seen
  // doing something by the ranks that wait for it.
  std::atomic<uint32_t> phase;  // flight::Phase + 1; 0: none marked yet
  std::atomic<int32_t> phase_micro, phase_stage;
  std::atomic<int64_t> phase_step;
  std::atomic<uint64_t> phase_since;  // bits of now_s() when the phase began
  BoardGroup groups[kBoardGroups];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

/** A copy of one entry, read from the page or received from another host. */
struct SlotView {
  uint64_t cur_key = 0, cur_seq = 0;
  uint32_t cur_op = 0;
  bool running = false;
  double age_s = -1;   // seconds since the last enter/leave; -1: no operation issued yet
  uint32_t phase = 0;  // flight::Phase + 1; 0: none marked
  int32_t phase_micro = -1, phase_stage = -1;
  int64_t phase_step = 0;
  double phase_age_s = -1;                                            // seconds in that phase
  std::array<std::pair<uint64_t, uint64_t>, kBoardGroups> entered{};  // group key -> seq

  /** The last sequence number entered on group `key` (0: none). */
  uint64_t entered_on(uint64_t key) const;
  /** One line of text, as a rank answers a probe; parse() reads it back. */
  std::string serialize() const;
  static bool parse(const std::string& text, SlotView* out);
};

/** The entry `b` as of `now` (now_s()). */
SlotView view_of(const BoardSlot& b, double now);

}  // namespace tetra::comm
