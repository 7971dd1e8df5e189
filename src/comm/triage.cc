#include "comm/triage.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include "core/error.h"
#include "core/read_file.h"

namespace tetra::comm {

namespace {

using nlohmann::json;

struct OpView {
  uint64_t id = 0, seq = 0;
  std::string op, group_key, dtype, site, state;
  size_t bytes = 0;
  int peer = -1;
  double started_ago_s = -1;
  bool p2p() const { return op == "send" || op == "recv"; }
  bool pending() const { return state == "queued" || state == "running"; }
};

struct GroupView {
  std::string name = "?";
  std::vector<int> ranks;
};

// What is known of one world rank: its own record, or its entry on a board another rank's record
// carries, or why nobody could see it.
struct RankView {
  bool recorded = false, seen = false;
  std::string reason, source;
  std::map<std::string, uint64_t> entered;  // group key -> last collective sequence number entered
  std::vector<OpView> ops;                  // own record only
  std::optional<OpView> pending;            // oldest pending operation (own record)
  std::optional<OpView> last_done;          // newest finished operation (own record)
  // From a board entry (or derived from the own record).
  std::string cur_op, cur_group;
  uint64_t cur_seq = 0;
  bool running = false;
  double op_age_s = -1;
  std::string phase;
  int64_t phase_step = 0;
  int micro = -1, stage = -1;
  double phase_age_s = -1;
  std::string unreached;
};

OpView op_of(const json& o) {
  OpView v;
  v.id = o.value("id", uint64_t(0));
  v.seq = o.value("seq", uint64_t(0));
  v.op = o.value("op", "");
  v.group_key = o.value("group_key", "");
  v.dtype = o.value("dtype", "");
  v.site = o.value("site", "");
  v.state = o.value("state", "");
  v.bytes = o.value("bytes", size_t(0));
  v.peer = o.value("peer", -1);
  v.started_ago_s = o.value("started_ago_s", -1.0);
  return v;
}

std::string list(const std::vector<int>& v) {
  return v.empty() ? std::string("none") : fmt::format("{}", fmt::join(v, ", "));
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

class Triage {
 public:
  explicit Triage(const std::vector<json>& all) { load(all); }
  Diagnosis run();

 private:
  void load(const std::vector<json>& all);
  std::string group_text(const std::string& key) const;
  std::string phase_text(const RankView& v) const;
  std::string doing(int w) const;
  bool waits_elsewhere(int w, const std::string& key) const;

  int world_ = 0, other_jobs_ = 0;
  std::string job_;
  std::map<std::string, GroupView> groups_;
  std::map<int, RankView> ranks_;
  std::vector<std::string> hosts_;
};

void Triage::load(const std::vector<json>& all) {
  const json* newest = &all.front();
  for (const json& r : all) {
    if (r.value("written_unix", 0.0) > newest->value("written_unix", 0.0)) newest = &r;
  }
  job_ = newest->value("job", "");
  std::vector<const json*> recs;
  for (const json& r : all) {
    if (r.value("job", "") == job_) {
      recs.push_back(&r);
    } else {
      ++other_jobs_;
    }
  }
  for (const json* r : recs) {
    world_ = std::max(world_, r->value("world_size", 0));
    if (r->contains("hosts") && hosts_.empty())
      hosts_ = (*r)["hosts"].get<std::vector<std::string>>();
    const json groups = r->value("groups", json::object());
    for (const auto& [key, g] : groups.items()) {
      groups_[key] = GroupView{g.value("name", "?"), g.value("ranks", std::vector<int>())};
    }
  }
  for (const json* r : recs) {
    RankView& v = ranks_[r->value("rank", -1)];
    v.recorded = v.seen = true;
    v.source = "own record";
    v.reason = r->value("reason", "");
    for (const json& o : r->value("ops", json::array())) {
      OpView op = op_of(o);
      if (!op.p2p() && op.started_ago_s >= 0) {
        v.entered[op.group_key] = std::max(v.entered[op.group_key], op.seq);
      }
      if (op.pending() && (!v.pending || (v.pending->p2p() && !op.p2p()))) v.pending = op;
      if (!op.pending()) v.last_done = op;
      v.ops.push_back(std::move(op));
    }
    if (v.pending) {
      v.cur_op = v.pending->op;
      v.cur_group = v.pending->group_key;
      v.cur_seq = v.pending->seq;
      v.running = true;
      v.op_age_s = v.pending->started_ago_s;
    }
    const json phases = r->value("phases", json::array());
    if (!phases.empty()) {
      const json& p = phases.back();
      v.phase = p.value("phase", "");
      v.phase_step = p.value("step", int64_t(0));
      v.micro = p.value("micro", -1);
      v.stage = p.value("stage", -1);
      v.phase_age_s = p.value("began_ago_s", -1.0);
    }
  }
  // Ranks without a record of their own, as their hosts' boards (or probes) show them: a
  // board's entry is read in place and preferred to a probe's copy.
  for (const json* r : recs) {
    for (const json& b : r->value("board", json::array())) {
      RankView& v = ranks_[b.value("rank", -1)];
      const std::string source = b.value("source", "board");
      if (v.recorded || (v.seen && v.source == "board" && source != "board")) continue;
      v.seen = true;
      v.source = source;
      v.running = b.value("running", false);
      v.cur_op = b.value("op", "");
      v.cur_seq = b.value("seq", uint64_t(0));
      v.cur_group = b.value("group_key", "");
      v.op_age_s = b.value("op_age_s", -1.0);
      v.phase = b.value("phase", "");
      v.phase_step = b.value("phase_step", int64_t(0));
      v.micro = b.value("micro", -1);
      v.stage = b.value("stage", -1);
      v.phase_age_s = b.value("phase_age_s", -1.0);
      v.entered.clear();
      const json entered = b.value("entered", json::object());
      for (const auto& [key, seq] : entered.items()) {
        v.entered[key] = seq.get<uint64_t>();
      }
    }
    const json unreached = r->value("unreached", json::object());
    for (const auto& [w, why] : unreached.items()) {
      RankView& v = ranks_[std::stoi(w)];
      if (!v.seen) v.unreached = why.get<std::string>();
    }
  }
}

std::string Triage::group_text(const std::string& key) const {
  auto it = groups_.find(key);
  if (it == groups_.end()) return "a group no record names";
  return fmt::format("group '{}' (world ranks {})", it->second.name, list(it->second.ranks));
}

std::string Triage::phase_text(const RankView& v) const {
  if (v.phase.empty()) return "no phase marked yet";
  std::string out = "phase " + v.phase;
  std::vector<std::string> where;
  if (v.phase_step > 0) where.push_back(fmt::format("step {}", v.phase_step));
  if (v.micro >= 0) where.push_back(fmt::format("micro-batch {}", v.micro));
  if (v.stage >= 0) where.push_back(fmt::format("stage {}", v.stage));
  if (!where.empty()) out += fmt::format(" ({})", fmt::join(where, ", "));
  if (v.phase_age_s >= 0) out += fmt::format(" for {:.1f} s", v.phase_age_s);
  return out;
}

// Whether world rank w waits in an operation other than the collective of group `key`.
bool Triage::waits_elsewhere(int w, const std::string& key) const {
  auto it = ranks_.find(w);
  if (it == ranks_.end() || !it->second.running) return false;
  return it->second.cur_group != key || it->second.cur_op == "send" || it->second.cur_op == "recv";
}

std::string Triage::doing(int w) const {
  auto it = ranks_.find(w);
  if (it == ranks_.end() || (!it->second.seen && it->second.unreached.empty())) {
    return "no record, and no record of another rank on its host shows it";
  }
  const RankView& v = it->second;
  if (!v.seen) return "no record and no answer: " + v.unreached;
  std::string out;
  if (v.running) {
    out = fmt::format("waiting in {} #{} on {}", v.cur_op, v.cur_seq, group_text(v.cur_group));
    if (v.op_age_s >= 0) out += fmt::format(" for {:.1f} s", v.op_age_s);
    if (v.pending && !v.pending->site.empty()) out += fmt::format(" (from {})", v.pending->site);
  } else if (v.recorded) {
    out = "outside any operation";
    if (v.last_done) {
      out += fmt::format(" (last: {} #{} on {}, {})", v.last_done->op, v.last_done->seq,
                         group_text(v.last_done->group_key), v.last_done->state);
    }
  } else {
    out = v.op_age_s < 0 ? std::string("has issued no operation")
                         : fmt::format("outside any operation for {:.1f} s (last: {} #{} on {})",
                                       v.op_age_s, v.cur_op, v.cur_seq, group_text(v.cur_group));
  }
  out += "; " + phase_text(v);
  if (!v.recorded) out += fmt::format(" [from a {}]", v.source);
  if (v.recorded && !starts_with(v.reason, "watchdog") && !starts_with(v.reason, "SIGTERM")) {
    out += "; its record: " + v.reason;
  }
  return out;
}

Diagnosis Triage::run() {
  Diagnosis d;
  std::vector<int> recorded, missing;
  for (int w = 0; w < world_; ++w) {
    auto it = ranks_.find(w);
    (it != ranks_.end() && it->second.recorded ? recorded : missing).push_back(w);
  }
  d.lines.push_back(fmt::format("records of world ranks {} of {} (job {}); none of: {}{}",
                                list(recorded), world_, job_, list(missing),
                                other_jobs_ ? fmt::format("; {} record(s) of an earlier job set "
                                                          "aside",
                                                          other_jobs_)
                                            : ""));

  // The collectives ranks wait in, by (group, sequence number); a rank waiting in a send or a
  // receive waits for its peer.
  std::map<std::pair<std::string, uint64_t>, std::vector<int>> stuck;
  std::map<int, int> p2p_waits;  // world rank -> the world rank it waits for
  for (const auto& [w, v] : ranks_) {
    if (!v.running) continue;
    if (v.cur_op == "send" || v.cur_op == "recv") {
      auto g = groups_.find(v.cur_group);
      if (v.pending && g != groups_.end() && v.pending->peer >= 0 &&
          size_t(v.pending->peer) < g->second.ranks.size()) {
        p2p_waits[w] = g->second.ranks[size_t(v.pending->peer)];
      }
      continue;
    }
    stuck[{v.cur_group, v.cur_seq}].push_back(w);
  }

  std::vector<int> never_all, lost, mismatched;
  bool all_entered_somewhere = false;
  int shown = 0;
  std::vector<std::pair<std::pair<std::string, uint64_t>, std::vector<int>>> points(stuck.begin(),
                                                                                    stuck.end());
  std::sort(points.begin(), points.end(),
            [](const auto& a, const auto& b) { return a.second.size() > b.second.size(); });
  for (const auto& [point, waiting] : points) {
    const auto& [key, seq] = point;
    if (shown++ == 3) break;
    const RankView& first = ranks_.at(waiting.front());
    const std::string op = first.cur_op;
    const size_t bytes = first.pending ? first.pending->bytes : 0;
    std::vector<int> members = waiting, never, finished, unknown;
    if (auto g = groups_.find(key); g != groups_.end()) members = g->second.ranks;
    std::vector<std::string> detail;
    for (int m : members) {
      if (std::find(waiting.begin(), waiting.end(), m) != waiting.end()) {
        const RankView& v = ranks_.at(m);
        if (v.pending && first.pending &&
            (v.pending->op != first.pending->op || v.pending->bytes != first.pending->bytes)) {
          mismatched.push_back(m);
          detail.push_back(
              fmt::format("world rank {} issued {} of {} bytes as #{}, where world "
                          "rank {} issued {} of {} bytes",
                          m, v.pending->op, v.pending->bytes, seq, waiting.front(), op, bytes));
        }
        continue;
      }
      auto it = ranks_.find(m);
      if (it == ranks_.end() || !it->second.seen) {
        never.push_back(m);
        if (it != ranks_.end() && !it->second.unreached.empty()) lost.push_back(m);
        continue;
      }
      const RankView& v = it->second;
      const OpView* same = nullptr;
      for (const OpView& o : v.ops) {
        if (o.group_key == key && o.seq == seq && !o.p2p()) same = &o;
      }
      if (same && (same->op != op || same->bytes != bytes)) {
        mismatched.push_back(m);
        detail.push_back(fmt::format(
            "world rank {} issued {} of {} bytes as #{}, where world rank {} issued {} of {} bytes",
            m, same->op, same->bytes, seq, waiting.front(), op, bytes));
      } else if (auto e = v.entered.find(key); e != v.entered.end() && e->second >= seq) {
        finished.push_back(m);
      } else {
        never.push_back(m);
      }
    }
    std::string site = first.pending && !first.pending->site.empty()
                           ? fmt::format(", issued from {}", first.pending->site)
                           : "";
    std::string what = bytes > 0 ? fmt::format(" of {} bytes {}", bytes, first.pending->dtype) : "";
    d.lines.push_back(fmt::format(
        "{}: stuck in {} #{}{}{}; waiting in it: {}{}; never entered: {}", group_text(key), op, seq,
        what, site, list(waiting),
        first.op_age_s >= 0 ? fmt::format(" (for {:.1f} s)", first.op_age_s) : "", list(never)));
    if (!finished.empty()) d.lines.push_back(fmt::format("  finished it: {}", list(finished)));
    for (const std::string& line : detail) d.lines.push_back("  " + line);
    for (size_t i = 0; i < never.size() && i < 8; ++i) {
      d.lines.push_back(fmt::format("  world rank {}: {}", never[i], doing(never[i])));
    }
    if (never.empty() && detail.empty()) all_entered_somewhere = true;
    never_all.insert(never_all.end(), never.begin(), never.end());
  }
  for (const auto& [w, peer] : p2p_waits) {
    if (shown++ >= 4) break;
    const RankView& v = ranks_.at(w);
    d.lines.push_back(fmt::format("world rank {} waits in {} #{} {} world rank {} on {}{}", w,
                                  v.cur_op, v.cur_seq, v.cur_op == "send" ? "to" : "from", peer,
                                  group_text(v.cur_group),
                                  v.op_age_s >= 0 ? fmt::format(" for {:.1f} s", v.op_age_s) : ""));
    if (!p2p_waits.contains(peer)) {
      d.lines.push_back(fmt::format("  world rank {}: {}", peer, doing(peer)));
      never_all.push_back(peer);
      if (auto it = ranks_.find(peer); it != ranks_.end() && !it->second.unreached.empty()) {
        lost.push_back(peer);
      }
    }
  }
  std::sort(never_all.begin(), never_all.end());
  never_all.erase(std::unique(never_all.begin(), never_all.end()), never_all.end());

  std::vector<int> crashed, errored;
  for (const auto& [w, v] : ranks_) {
    if (starts_with(v.reason, "fatal signal")) crashed.push_back(w);
    if (starts_with(v.reason, "error")) errored.push_back(w);
  }
  std::vector<int> stopped, waiting_elsewhere;
  for (int w : never_all) {
    if (std::find(lost.begin(), lost.end(), w) != lost.end()) continue;
    auto it = ranks_.find(w);
    if (it == ranks_.end() || !it->second.seen) continue;
    const bool elsewhere =
        it->second.running && std::any_of(stuck.begin(), stuck.end(), [&](const auto& p) {
          return waits_elsewhere(w, p.first.first);
        });
    (elsewhere || p2p_waits.contains(w) ? waiting_elsewhere : stopped).push_back(w);
  }

  // The debug hash (dist.debug_hash) stops the ranks before a differing collective runs.
  const bool hash_differs = std::any_of(ranks_.begin(), ranks_.end(), [](const auto& r) {
    return r.second.reason.find("different collective sequences") != std::string::npos;
  });

  std::string hint;
  if (!mismatched.empty()) {
    d.cause = "mismatched collective";
    hint = fmt::format(
        "world rank(s) {} issued a different collective at the same sequence number: a program "
        "bug (a collective under a rank-dependent condition, or issued in another order); "
        "--dist.debug_hash=true stops at the first difference",
        list(mismatched));
  } else if (hash_differs) {
    d.cause = "mismatched collective";
    hint =
        "the debug hash found ranks whose collective sequences differ (the watchdog's report "
        "names the first differing rank): a program bug (a collective under a rank-dependent "
        "condition, or issued in another order)";
  } else if (!crashed.empty()) {
    d.cause = "crash";
    hint = fmt::format("world rank {} died: {}; {}", crashed.front(),
                       ranks_.at(crashed.front()).reason, phase_text(ranks_.at(crashed.front())));
  } else if (!errored.empty()) {
    d.cause = "error exit";
    hint = fmt::format("world rank {} stopped: {}", errored.front(),
                       ranks_.at(errored.front()).reason);
  } else if (!lost.empty()) {
    d.cause = "lost peer";
    hint = fmt::format(
        "world rank(s) {} cannot be reached or their process ended (a host down, a cut link, a "
        "killed process): see that host's log and the launcher's verdict",
        list(lost));
  } else if (!stopped.empty()) {
    d.cause = "stopped or slow rank";
    hint = fmt::format(
        "world rank(s) {} are outside any collective while the others wait: a stopped process "
        "(SIGSTOP, a debugger), a hang in a kernel or in I/O, or a rank far slower than the "
        "rest (tetra launch names stragglers)",
        list(stopped));
  } else if (!waiting_elsewhere.empty()) {
    d.cause = "deadlock in the schedule";
    hint = fmt::format(
        "every rank that has not entered waits in another operation (world rank(s) {}): the "
        "ranks wait on each other; operations issued in a different order by rank (a pipeline "
        "schedule, a group's collectives under a condition)",
        list(waiting_elsewhere));
  } else if (all_entered_somewhere) {
    d.cause = "lost peer";
    hint =
        "every member entered and the collective does not finish: a lost link or a failed "
        "transport between them";
  } else if (!never_all.empty()) {
    d.cause = "stopped or slow rank";
    hint = fmt::format("world rank(s) {} never entered and no record says what they do",
                       list(never_all));
  } else {
    d.cause = "no collective pending";
    hint = "no rank is waiting in an operation";
    for (const auto& [w, v] : ranks_) {
      if (v.recorded) {
        hint += fmt::format("; world rank {}: {}", w, v.reason);
        break;
      }
    }
  }
  d.lines.push_back(fmt::format("cause: {}: {}", d.cause, hint));
  return d;
}

}  // namespace

Diagnosis triage(const std::vector<json>& records) {
  if (records.empty()) return {"no records", {"no flight records"}};
  return Triage(records).run();
}

FlightRecords read_flight_records(const std::vector<std::string>& dirs, double since_unix) {
  namespace fs = std::filesystem;
  // 2,000 operations take ~1 MB.
  constexpr uintmax_t kMaxRecordBytes = uintmax_t(1) << 28;
  FlightRecords out;
  std::map<int, json> newest;
  for (const std::string& dir : dirs) {
    std::error_code ec;
    TETRA_CHECK(fs::is_directory(dir, ec),
                "[triage] {} is not a directory; give a run's run.dir (or its flight/ directory)",
                dir);
    const fs::path flight =
        fs::is_directory(fs::path(dir) / "flight", ec) ? fs::path(dir) / "flight" : fs::path(dir);
    for (const auto& e : fs::directory_iterator(flight, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("rank-", 0) != 0 || e.path().extension() != ".json") continue;
      ++out.files;
      const json rec = json::parse(
          read_small_file(e.path().string(), kMaxRecordBytes, "triage", "a flight record", ""),
          nullptr, false);
      if (rec.is_discarded() || !rec.is_object() || !rec.contains("rank") ||
          !rec["rank"].is_number_integer() || !rec.contains("reason")) {
        out.skipped.push_back(e.path().string());
        continue;
      }
      if (rec.value("written_unix", 0.0) < since_unix) continue;
      const int rank = rec["rank"].get<int>();
      auto it = newest.find(rank);
      if (it == newest.end() ||
          rec.value("written_unix", 0.0) > it->second.value("written_unix", 0.0)) {
        newest[rank] = rec;
      }
    }
  }
  for (auto& [rank, rec] : newest) out.newest.push_back(std::move(rec));
  return out;
}

}  // namespace tetra::comm
