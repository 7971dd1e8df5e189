// Triage: the diagnosis of a hang or a crash from flight records (flight.h). Any subset of a
// job's records will do: each carries its host's arrival board and what probes of other hosts
// answered, so one rank's record already names the ranks that never arrived and what they were
// doing. The watchdog runs it on its own record when it fires; `tetra triage <run.dir>...` on
// every record it finds.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tetra::comm {

struct Diagnosis {
  /** The likely cause class: "stopped or slow rank", "mismatched collective", "lost peer",
   *  "deadlock in the schedule", "crash", "error exit", or "no collective pending". */
  std::string cause;
  /** A few lines of explanation: which collective each group is stuck in, which ranks never
   *  entered it and what they did instead, the cause with what to check. */
  std::vector<std::string> lines;
};

/** The diagnosis of `records` (rank-N.json contents; records of other jobs than the newest
 *  record's are set aside, and said so). */
Diagnosis triage(const std::vector<nlohmann::json>& records);

/** The flight records under run directories (each its flight/ directory, or the directory itself
 *  when it holds rank-N.json files): the newest of each rank, written at `since_unix` or later. */
struct FlightRecords {
  std::vector<nlohmann::json> newest;  // one per rank, by rank
  std::vector<std::string> skipped;    // rank-N.json files that are not flight records
  size_t files = 0;                    // rank-N.json files seen
};
/** Throws tetra::Error when a directory is not one. */
FlightRecords read_flight_records(const std::vector<std::string>& dirs, double since_unix = 0);

}  // namespace tetra::comm
