// Goodput (seed 000): the share of a run's wall-clock time that went into the steps its final
// model kept, across restarts. Rank 0 accounts every second of its process into productive steps,
// redone steps, checkpoint stalls, start-up, data stalls, evaluation, restarts, the run's end and
// other, and keeps the account in <run.dir>/goodput.json, replaced after every step, so that a
// resumed run (by `tetra launch --max-restarts` or by hand) continues it: the steps the previous
// attempt trained after the checkpoint this one resumes from are moved from productive to redone,
// and when the launcher restarted the job the time between the previous attempt's last step and
// this attempt's start (TETRA_ATTEMPT_START) is time lost to the restart. docs/health.md.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace tetra {

/** The categories of the account, in the order they are printed. */
enum class GoodputPart { productive, redone, checkpoint, startup, data, eval, restart, end, other };
inline constexpr size_t kGoodputParts = 9;
const char* goodput_part_name(GoodputPart p);

/** The environment variables the launcher sets for every attempt: the Unix time (seconds) it
 *  started it, and its number (0: the first, 1: the first restart, ...). */
inline constexpr const char* kAttemptStartEnv = "TETRA_ATTEMPT_START";
inline constexpr const char* kAttemptEnv = "TETRA_ATTEMPT";
/** For a restart: what ended the previous attempt, as the launcher saw it, a JSON object with
 *  "cause", "silence_s" (from the newest heartbeat to the job's end; -1 unknown), "triage" (the
 *  flight records' diagnosis, or "") and "change" (an elastic restart's new layout, or ""); empty
 *  for a first attempt. The account keeps one incident per restart (Goodput::to_json). */
inline constexpr const char* kIncidentEnv = "TETRA_INCIDENT";

class Goodput {
 public:
  /** `active`: this rank keeps the account (rank 0); the others do nothing. `start_step`: the
   *  step this process resumes from; 0 starts a new account. */
  Goodput(const std::string& run_dir, int64_t start_step, bool active);

  /** A step of this process: `step_ms` long, `data_ms` of it waiting for the batch. */
  void step(int64_t step, double step_ms, double data_ms);
  void add_eval(double ms) { add(GoodputPart::eval, ms / 1e3); }
  void add_checkpoint(double ms) { add(GoodputPart::checkpoint, ms / 1e3); }
  /** After a step's records: sets rec["goodput"], persists the account. Steps up to
   *  `newest_checkpoint` can no longer be redone. */
  void end_step(int64_t newest_checkpoint, nlohmann::json& rec);
  /** The run's end: the final account written and its table logged. */
  void finish();

  /** The account as written to goodput.json. */
  nlohmann::json to_json() const;
  double wall_s() const;
  double goodput() const;

 private:
  void add(GoodputPart p, double s) { this_[size_t(p)] += s; }
  void resume(const nlohmann::json& prev, int64_t start_step);
  /** A restart's incident from kIncidentEnv, with what the account measured of it. */
  void record_incident(int64_t resumed_from, int64_t steps_redone, double seconds_lost);
  /** `durable`: fsynced (the run's end); otherwise only renamed over the old account. */
  void save(bool durable) const;

  bool active_;
  std::string path_;
  double attempt_start_ = 0;  // Unix seconds
  double first_start_ = 0;
  double prev_wall_ = 0;                      // earlier attempts, restarts included
  std::array<double, kGoodputParts> prev_{};  // their seconds per category
  std::array<double, kGoodputParts> this_{};  // this attempt's, "other" apart
  int attempts_ = 1;
  int64_t kept_steps_ = 0, redone_steps_ = 0;
  bool started_ = false;
  double updated_at_ = 0;  // Unix seconds of the last step this account holds
  // Steps after the newest checkpoint: (step, productive seconds, data seconds), which a restart
  // from that checkpoint would redo.
  std::vector<std::array<double, 3>> pending_;
  int64_t committed_through_ = 0;  // steps up to this one are behind a checkpoint
  // One per restart: the launcher's account of it, the steps redone and the seconds it cost.
  nlohmann::json incidents_ = nlohmann::json::array();
};

}  // namespace tetra
