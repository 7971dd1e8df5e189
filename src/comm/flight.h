// The flight recorder: what each rank was doing when a job hung or died. The watchdog keeps the
// rank's last dist.history communication operations (watchdog.h); this file adds the training
// phases the trainer and the pipeline executor mark (forward of micro-batch m on stage s, the
// optimizer, a checkpoint write, ...), the call site each operation was issued from, and the
// writing of all of it to <dir>/rank-<N>.json: on a watchdog timeout, a collective mismatch, a
// fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT), SIGTERM from the launcher, an error
// exit, or SIGUSR1 from outside (the rank goes on). `tetra triage` reads the files (triage.h).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

namespace tetra::comm {
struct BoardSlot;
}

namespace tetra::comm::flight {

enum class Phase : uint8_t {
  startup,
  data,
  forward,
  backward,
  recv_activations,
  recv_gradients,
  send,
  reduce_gradients,
  optimizer,
  evaluation,
  checkpoint,
  between_steps,
  finishing,
};
const char* phase_name(Phase p);

/** The training step (from 1) the phases marked from now on belong to. */
void set_step(int64_t step);
/** Marks what this rank does from now on; micro-batch and pipeline stage -1 where none. */
void enter(Phase p, int micro = -1, int stage = -1);

/** The call site recorded with the operations this thread issues while it lives (a static
 *  string: "dp.bucket", "zero3.gather", ...); nested sites stack. Without one, an operation's
 *  site is the current phase's name. */
class Site {
 public:
  explicit Site(const char* label) noexcept;
  ~Site();
  Site(const Site&) = delete;
  Site& operator=(const Site&) = delete;

 private:
  const char* prev_;
};
const char* current_site();

/** Where this process's record goes (`dir`/rank-<world_rank>.json, the directory made on the
 *  first write), and the signal handlers that write it. Called once the world is up. */
void configure(const std::string& dir, int world_rank);
/** The directory configure() set; "" before. */
const std::string& dir();

/** The communication layer's part of the record (the watchdog's operations, groups and
 *  arrival board), and the board entry the phases are published on. */
void attach(std::function<nlohmann::json()> comm_state, BoardSlot* own_slot);
void detach();

/** This rank's record as of now, `reason` saying why it is taken. */
nlohmann::json record(const std::string& reason);
/** Writes `rec` to the configured directory; returns the path, or "" when none is configured or
 *  the write failed. After a final record (`final`: the process is ending) later calls write
 *  nothing, so that the launcher's SIGTERM does not replace a timeout's record. */
std::string write(const nlohmann::json& rec, bool final = true);
/** write(record(reason), final). */
std::string dump(const std::string& reason, bool final = true);

}  // namespace tetra::comm::flight
