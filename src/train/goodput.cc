#include "train/goodput.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/log.h"

namespace tetra {

namespace fs = std::filesystem;

namespace {

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// When this process started (Unix seconds): now less its age, the time since boot
// (/proc/uptime) less its start time after boot (/proc/self/stat, field 22, in clock ticks).
// Now when /proc cannot say.
double process_start() {
  const double now = unix_now();
  std::ifstream up("/proc/uptime"), st("/proc/self/stat");
  double uptime = -1;
  up >> uptime;
  std::string stat((std::istreambuf_iterator<char>(st)), {});
  const size_t paren = stat.rfind(')');  // the command name may hold spaces
  if (uptime < 0 || paren == std::string::npos) return now;
  std::istringstream fields(stat.substr(paren + 2));
  std::string f;
  for (int i = 3; i <= 22 && fields >> f; ++i) {
  }
  const long ticks = sysconf(_SC_CLK_TCK);
  const double age = uptime - std::atof(f.c_str()) / double(ticks > 0 ? ticks : 100);
  return age >= 0 ? now - age : now;
}

}  // namespace

const char* goodput_part_name(GoodputPart p) {
  static const char* const names[kGoodputParts] = {
      "productive", "redone", "checkpoint", "startup", "data", "eval", "restart", "end", "other"};
  return names[size_t(p)];
}

Goodput::Goodput(const std::string& run_dir, int64_t start_step, bool active)
    : active_(active), path_((fs::path(run_dir) / "goodput.json").string()) {
  if (!active_) return;
  const double now = unix_now();
  attempt_start_ = process_start();
  // The launcher's start of this attempt (before mpirun) when it is earlier than this process.
  if (const char* v = std::getenv(kAttemptStartEnv); v && *v) {
    const double launched = std::atof(v);
    if (launched > 0 && launched <= now) attempt_start_ = std::min(attempt_start_, launched);
  }
  first_start_ = attempt_start_;
  updated_at_ = now;
  committed_through_ = start_step;
  if (start_step == 0) return;
  std::ifstream in(path_);
  const nlohmann::json prev = nlohmann::json::parse(in, nullptr, false);
  if (prev.is_discarded() || !prev.is_object() || !prev.contains("seconds")) {
    log_info("[goodput] {}: no account of the run resumed; goodput counts from this process",
             path_);
    return;
  }
  resume(prev, start_step);
}

void Goodput::resume(const nlohmann::json& prev, int64_t start_step) {
  for (size_t p = 0; p < kGoodputParts; ++p) {
    prev_[p] = prev["seconds"].value(goodput_part_name(GoodputPart(p)), 0.0);
  }
  prev_wall_ = prev.value("wall_s", 0.0);
  first_start_ = prev.value("first_start", attempt_start_);
  attempts_ = prev.value("attempts", 1) + 1;
  kept_steps_ = prev.value("kept_steps", int64_t(0));
  redone_steps_ = prev.value("redone_steps", int64_t(0));
  // When the launcher restarted the job, the time from the previous attempt's last step to this
  // attempt's start was lost to the restart: the failed step, the detection, stopping and
  // starting the job. A run resumed by hand (or by a new launcher) was not running in between;
  // that time is not the run's.
  const double last = prev.value("updated_at", attempt_start_);
  const char* attempt = std::getenv(kAttemptEnv);
  const bool restarted = attempt && std::atoi(attempt) > 0;
  double gap = 0;
  if (restarted && attempt_start_ > last) {
    gap = attempt_start_ - last;
    prev_[size_t(GoodputPart::restart)] += gap;
    prev_wall_ += gap;
  }
  if (prev.contains("incidents") && prev["incidents"].is_array()) incidents_ = prev["incidents"];
  const double redone_before = prev_[size_t(GoodputPart::redone)];
  const int64_t redone_steps_before = redone_steps_;
  // The steps after the checkpoint resumed from are trained again: the earlier attempt's time
  // for them was not kept.
  auto redo = [&](double productive, double data) {
    prev_[size_t(GoodputPart::productive)] -= productive;
    prev_[size_t(GoodputPart::data)] -= data;
    prev_[size_t(GoodputPart::redone)] += productive + data;
    --kept_steps_;
    ++redone_steps_;
  };
  int64_t redone_exactly = 0;
  for (const auto& e : prev.value("pending", nlohmann::json::array())) {
    if (e.size() == 3 && e[0].get<double>() > double(start_step)) {
      redo(e[1].get<double>(), e[2].get<double>());
      ++redone_exactly;
    }
  }
  // Resumed from an older checkpoint than the newest (which did not load): the steps between
  // are counted redone at the mean kept step's time.
  const int64_t committed = prev.value("committed_through", start_step);
  if (committed > start_step && kept_steps_ > 0) {
    const double p = prev_[size_t(GoodputPart::productive)] / double(kept_steps_);
    const double d = prev_[size_t(GoodputPart::data)] / double(kept_steps_);
    for (int64_t s = start_step; s < committed && kept_steps_ > 0; ++s) redo(p, d);
  }
  log_info(
      "[goodput] attempt {} of this run: {:.2f} s before it ({:.2f} s lost to restarts), {} "
      "step(s) after the checkpoint of step {} are redone",
      attempts_, prev_wall_, prev_[size_t(GoodputPart::restart)],
      redone_exactly + std::max<int64_t>(0, committed - start_step), start_step);
  if (restarted)
    record_incident(start_step, redone_steps_ - redone_steps_before,
                    gap + prev_[size_t(GoodputPart::redone)] - redone_before);
}

void Goodput::record_incident(int64_t resumed_from, int64_t steps_redone, double seconds_lost) {
  const char* env = std::getenv(kIncidentEnv);
  nlohmann::json seen = nlohmann::json::parse(env ? env : "", nullptr, false);
  if (!seen.is_object()) seen = nlohmann::json::object();
  const auto text = [&](const char* key) {
    return seen.contains(key) && seen[key].is_string() ? seen[key].get<std::string>()
                                                       : std::string();
  };
  const double silence = seen.contains("silence_s") && seen["silence_s"].is_number()
                             ? seen["silence_s"].get<double>()
                             : -1.0;
  const std::string cause = text("cause").empty() ? "not said (a restart by hand?)" : text("cause");
  incidents_.push_back({{"attempt", attempts_ - 1},
                        {"cause", cause},
                        {"silence_s", silence},
                        {"triage", text("triage")},
                        {"change", text("change")},
                        {"resumed_from", resumed_from},
                        {"steps_redone", steps_redone},
                        {"seconds_lost", seconds_lost}});
  log_info(
      "[goodput] incident {}: {}{}; {} step(s) redone, {:.2f} s lost{}{}", incidents_.size(), cause,
      silence >= 0 ? fmt::format(" ({:.2f} s from the last heartbeat to the job's end)", silence)
                   : "",
      steps_redone, seconds_lost, text("triage").empty() ? "" : "; triage: " + text("triage"),
      text("change").empty() ? "" : "; " + text("change"));
}

void Goodput::step(int64_t step, double step_ms, double data_ms) {
  if (!active_) return;
  const double now = unix_now();
  if (!started_) {
    started_ = true;
    add(GoodputPart::startup, std::max(0.0, now - step_ms / 1e3 - attempt_start_));
  }
  const double productive = std::max(0.0, step_ms - data_ms) / 1e3, data = data_ms / 1e3;
  add(GoodputPart::productive, productive);
  add(GoodputPart::data, data);
  ++kept_steps_;
  pending_.push_back({double(step), productive, data});
}

void Goodput::end_step(int64_t newest_checkpoint, nlohmann::json& rec) {
  if (!active_) return;
  if (newest_checkpoint > committed_through_) {
    committed_through_ = newest_checkpoint;
    std::erase_if(pending_, [&](const auto& e) { return e[0] <= double(newest_checkpoint); });
  }
  updated_at_ = unix_now();
  rec["goodput"] = goodput();
  save(false);
}

double Goodput::wall_s() const { return prev_wall_ + (updated_at_ - attempt_start_); }

double Goodput::goodput() const {
  const double wall = wall_s();
  const size_t p = size_t(GoodputPart::productive);
  return wall > 0 ? (prev_[p] + this_[p]) / wall : 0.0;
}

nlohmann::json Goodput::to_json() const {
  double accounted = 0;
  for (double s : this_) accounted += s;
  nlohmann::json seconds = nlohmann::json::object();
  for (size_t p = 0; p < kGoodputParts; ++p) {
    double s = prev_[p] + this_[p];
    if (GoodputPart(p) == GoodputPart::other) s += (updated_at_ - attempt_start_) - accounted;
    seconds[goodput_part_name(GoodputPart(p))] = s;
  }
  nlohmann::json pending = nlohmann::json::array();
  for (const auto& e : pending_) pending.push_back({int64_t(e[0]), e[1], e[2]});
  return {{"wall_s", wall_s()},
          {"goodput", goodput()},
          {"attempts", attempts_},
          {"kept_steps", kept_steps_},
          {"redone_steps", redone_steps_},
          {"seconds", seconds},
          {"first_start", first_start_},
          {"updated_at", updated_at_},
          {"committed_through", committed_through_},
          {"pending", pending},
          {"incidents", incidents_}};
}

void Goodput::save(bool durable) const {
  const std::string text = to_json().dump(1) + "\n";
  if (durable) {
    write_file_atomically(path_, {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}},
                          "train");
    return;
  }
  // After a step: written beside and renamed over, without the fsyncs (10 ms a step on a busy
  // disk), so that a killed process leaves the old or the new account, never a torn one.
  const std::string tmp = path_ + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    TETRA_CHECK(out.flush().good(),
                "[train] {}: cannot write the goodput account ({}); check the disk under run.dir",
                tmp, std::strerror(errno));
  }
  std::error_code ec;
  fs::rename(tmp, path_, ec);
  TETRA_CHECK(!ec, "[train] {}: cannot replace it with {} ({}); check the disk under run.dir",
              path_, tmp, ec.message());
}

void Goodput::finish() {
  if (!active_) return;
  const double now = unix_now();
  if (!started_) {
    add(GoodputPart::startup, std::max(0.0, now - attempt_start_));
  } else {
    add(GoodputPart::end, now - updated_at_);  // since the last step's account
  }
  updated_at_ = now;
  const nlohmann::json j = to_json();
  save(true);
  const double wall = wall_s();
  std::string table = fmt::format("[goodput] {:<12} {:>10} {:>8}", "part", "seconds", "% wall");
  for (size_t p = 0; p < kGoodputParts; ++p) {
    const double s = j["seconds"][goodput_part_name(GoodputPart(p))].get<double>();
    table += fmt::format("\n[goodput]   {:<10} {:>10.2f} {:>7.1f}%",
                         goodput_part_name(GoodputPart(p)), s, wall > 0 ? 100.0 * s / wall : 0.0);
  }
  log_info("{}", table);
  log_info(
      "[goodput] goodput {:.1f}%: {} kept step(s) in {:.2f} s of wall time over {} attempt(s), {} "
      "step(s) redone; the account is in {}",
      100.0 * goodput(), kept_steps_, wall, attempts_, redone_steps_, path_);
}

}  // namespace tetra
