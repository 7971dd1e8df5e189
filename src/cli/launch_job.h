// tetra launch's supervision of one job: it runs mpirun and watches it until it ends, with every
// wait bounded. A train job is given a start-up deadline (every rank must write its first
// heartbeat, ready to train, within it) and then a heartbeat timeout (a rank whose heartbeat does
// not advance for that long is hung); mpirun that outlives its ranks (Open MPI 4.1 hangs tearing
// down a job whose ranks failed at start-up) is stopped; stopping is SIGTERM to mpirun, then
// SIGKILL to it and to every rank it started, each after a grace period.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace tetra::cli::launch {

/** Seconds mpirun gets after SIGTERM before SIGKILL goes to it and its ranks, and after SIGKILL
 *  before the launcher stops waiting for it. */
inline constexpr double kStopGraceS = 10;
/** How long mpirun may go on with no process of its job left before it is stopped. */
inline constexpr double kOrphanedMpirunS = 5;

struct WatchOptions {
  std::filesystem::path beats;     // TETRA_HEARTBEAT_DIR, where each rank writes rank-N
  int ranks = 1;                   // the job's world size: rank-N files with N >= ranks are not its
  bool heartbeats = false;         // the command writes heartbeats (tetra train)
  double startup_timeout_s = 0;    // every rank must write a heartbeat by then; 0: no limit
  double heartbeat_timeout_s = 0;  // then a heartbeat must advance this often; 0: no limit
  // Within a step, once a rank's median step is known: at most heartbeat_factor x that median,
  // at least heartbeat_min_s (and never above heartbeat_timeout_s). 0: the timeout throughout.
  double heartbeat_factor = 0;
  double heartbeat_min_s = 0;
  // The step the ranks start from (0, or the checkpoint a restart resumes from), which their
  // first heartbeat names: until the next, a rank is in its first step, which is allowed the
  // start-up deadline too. -1: not known (the command resumes itself), no such allowance.
  int64_t start_step = 0;
  // Called every turn of the watch (10 times a second) while the job runs.
  std::function<void()> tick;
};

/** A rank's newest heartbeat: the step it finished last, the newest checkpoint it knows, where it
 *  is (the phases of train/fault_hooks.h's BeatPhase) and its median step (0: not measured). */
struct Beat {
  enum Phase { training = 0, finishing = 1, between_steps = 2 };
  int64_t step = 0, checkpoint = 0;
  Phase phase = training;
  double median_step_s = 0;
  bool operator==(const Beat&) const = default;
};

struct JobOutcome {
  int status = 0;             // mpirun's wait status (0 when it could not be reaped)
  int code = 0;               // what the launcher returns for this attempt
  std::string stopped_for;    // why the launcher stopped the job; empty when it ended by itself
  bool hung = false;          // stopped for a missed start-up deadline or heartbeat timeout
  bool reaped = true;         // false: mpirun outlived SIGKILL and was left behind
  std::map<int, Beat> beats;  // rank -> its newest heartbeat, for ranks that wrote one
};

/** Forwards SIGINT, SIGTERM and SIGHUP sent to this process to the running mpirun (a terminal's
 *  Ctrl-C already reaches it: that is not sent twice), and remembers that the user asked to stop.
 */
void forward_stop_signals();
/** True once a stop signal arrived: the job is not restarted. */
bool stop_requested();

/** Runs `cmd` (mpirun and its arguments) until it ends or the launcher stops it. */
JobOutcome run_job(const std::vector<std::string>& cmd, const WatchOptions& opt);

/** "0-3, 5, 7-9": a sorted rank list, runs of consecutive ranks as ranges. */
std::string rank_list(const std::vector<int>& ranks);

/** Removes the heartbeat files (rank-N) a previous job left in `dir`, nothing else. */
void clear_beats(const std::filesystem::path& dir);

/** Seconds from the newest heartbeat file in `dir` to now (after a job ended: how long its ranks
 *  had been silent when it did); -1 when no rank wrote one. */
double heartbeat_silence(const std::filesystem::path& dir);

}  // namespace tetra::cli::launch
