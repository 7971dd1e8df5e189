// How a watchdog learns what ranks on other hosts are doing, and whether it can reach them at all:
// every rank answers TCP connections on one port with its arrival-board entry (arrival_board.h),
// and a watchdog whose collective is late connects to the ranks it cannot see on its own host's
// page. An answer shows where the rank is; a refused connection, an unreachable network or no
// answer within the probe's time says that the rank's host is gone or cut off. Internal to comm/.
#pragma once

#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace tetra::comm {

class ProbeServer {
 public:
  /** Listens on every interface of this host (an ephemeral port) and answers every connection
   *  with `answer()` (called on the server's thread; it must not block). */
  explicit ProbeServer(std::function<std::string()> answer);
  ~ProbeServer();
  ProbeServer(const ProbeServer&) = delete;
  ProbeServer& operator=(const ProbeServer&) = delete;

  /** "10.0.0.1,192.168.1.4:41234": this host's IPv4 addresses (127.0.0.1 when it has no other)
   *  and the port; "" when no socket could be opened (the probes then report the rank as not
   *  probed). */
  const std::string& address() const { return address_; }

 private:
  void serve();

  std::function<std::string()> answer_;
  int listen_fd_ = -1, stop_fd_ = -1;
  std::string address_;
  std::thread thread_;
};

struct ProbeReply {
  bool reached = false;  // it answered: `text` is its answer
  std::string text;
  std::string error;  // why not: "no answer within 2 s", "connection refused", ...
  // Not reached, but its host refused, reset or took the connection without an answer: the
  // network reaches that host; the rank's process is gone, ending or stopped.
  bool host_answered = false;
};

/** Connects to every address at once (each of a peer's interfaces; the first to answer counts)
 *  and returns what each peer answered within `timeout_s`. */
std::vector<ProbeReply> probe_all(const std::vector<std::string>& addresses, double timeout_s);

}  // namespace tetra::comm
