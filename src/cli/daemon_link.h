// The launcher's watch on the hosts of a multi-host job. mpirun starts one daemon per other host
// through an rsh agent (ssh, or what OMPI_MCA_plm_rsh_agent names); tetra launch puts itself
// between the two (`tetra launch-link`, the agent mpirun runs), so that a connection to a host's
// daemon that ends abnormally -- the daemon killed, the host gone -- is written down before mpirun
// learns of it and tears the job down with its own, hostless message. The launcher then names the
// lost host, the ranks that ran there and the newest checkpoint. A network partition is told
// apart by what the ranks' watchdogs noted: hosts they could not reach when a collective was late.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "cli/commands.h"

namespace tetra::cli::launch {

/** The agent the links start (the user's OMPI_MCA_plm_rsh_agent, else ssh), passed in this. */
inline constexpr const char* kDaemonAgentEnv = "TETRA_DAEMON_AGENT";

/** The mpirun arguments that route its daemons through `tetra launch-link` (`self` is this
 *  binary); sets kDaemonAgentEnv for the links. */
std::vector<std::string> daemon_link_args(const std::string& self);

/** A host whose daemon connection ended abnormally while the job ran. */
struct LostHost {
  std::string host;  // as mpirun named it (the --hosts entry)
  std::string how;   // "killed by signal 9 (Killed)", "exited with status 255"
};

/** The hosts the links of the job whose heartbeats are in `dir` found lost, in the order lost. */
std::vector<LostHost> lost_hosts(const std::filesystem::path& dir);

/** A host that another could not reach when a collective was late: what the watchdog of a rank
 *  on `from` noted (cut-RANK files, "FROM TO WHY" lines) before it ended the job. */
struct CutLink {
  std::string from, to, why;
  bool operator==(const CutLink&) const = default;
};

/** The distinct cut links the ranks of the job whose heartbeats are in `dir` noted. */
std::vector<CutLink> cut_links(const std::filesystem::path& dir);

/** Removes what the links and watchdogs of a previous job wrote into `dir`. */
void clear_lost_hosts(const std::filesystem::path& dir);

/** True when `host` answers through the agent mpirun starts its daemons with (the user's
 *  OMPI_MCA_plm_rsh_agent, else ssh, in batch mode): `AGENT HOST true` ends with status 0 within
 *  `timeout_s`. Whether a host left out of a job is back. */
bool host_answers(const std::string& host, double timeout_s);

}  // namespace tetra::cli::launch

namespace tetra::cli {

/** `tetra launch-link [AGENT OPTIONS] HOST COMMAND...`: runs the agent of kDaemonAgentEnv with
 *  the same arguments and returns its status; when it ends abnormally without having been asked
 *  to stop, first records HOST as lost in TETRA_HEARTBEAT_DIR. */
int launch_link_main(const Args& args);

}  // namespace tetra::cli
