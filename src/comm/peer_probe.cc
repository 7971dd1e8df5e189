#include "comm/peer_probe.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/timer.h"

namespace tetra::comm {

namespace {

// This host's IPv4 addresses, loopback last (and only when there is no other).
std::vector<std::string> host_addresses() {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) == 0) {
    for (const ifaddrs* a = list; a; a = a->ifa_next) {
      if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET) continue;
      char text[INET_ADDRSTRLEN] = {};
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
      if (!inet_ntop(AF_INET, &in->sin_addr, text, sizeof text)) continue;
      if (std::string(text).rfind("127.", 0) == 0) continue;
      out.emplace_back(text);
    }
    freeifaddrs(list);
  }
  if (out.empty()) out.emplace_back("127.0.0.1");
  return out;
}

std::string describe_errno(int err) {
  switch (err) {
    case ECONNREFUSED:
      return "connection refused (nothing listens there: its process is gone)";
    case ENETUNREACH:
      return "network unreachable (no route to its host: a link is down)";
    case EHOSTUNREACH:
      return "host unreachable";
    default:
      return std::strerror(err);
  }
}

}  // namespace

ProbeServer::ProbeServer(std::function<std::string()> answer) : answer_(std::move(answer)) {
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  stop_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (listen_fd_ < 0 || stop_fd_ < 0) return;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof addr;
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listen_fd_, 64) != 0 ||
      ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return;
  }
  address_ = fmt::format("{}:{}", fmt::join(host_addresses(), ","), ntohs(addr.sin_port));
  thread_ = std::thread([this] { serve(); });
}

ProbeServer::~ProbeServer() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!::write(stop_fd_, &one, sizeof one);
    thread_.join();
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (stop_fd_ >= 0) ::close(stop_fd_);
}

void ProbeServer::serve() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0 && errno != EINTR) return;
    if (fds[1].revents) return;
    if (!(fds[0].revents & POLLIN)) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    // A few hundred bytes into an empty socket buffer: the send does not block.
    const std::string text = answer_() + "\n";
    (void)!::send(fd, text.data(), text.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    ::close(fd);
  }
}

std::vector<ProbeReply> probe_all(const std::vector<std::string>& addresses, double timeout_s) {
  std::vector<ProbeReply> out(addresses.size());
  struct Attempt {
    size_t peer;
    int fd;
    bool connected = false;
    std::string got;
  };
  std::vector<Attempt> live;
  for (size_t p = 0; p < addresses.size(); ++p) {
    const std::string& a = addresses[p];
    const size_t colon = a.rfind(':');
    if (a.empty() || colon == std::string::npos) {
      out[p].error = "not probed (it has no probe port)";
      continue;
    }
    const int port = std::atoi(a.c_str() + colon + 1);
    size_t start = 0;
    while (start < colon) {
      size_t end = std::min(a.find(',', start), colon);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(uint16_t(port));
      const std::string ip = a.substr(start, end - start);
      start = end + 1;
      if (inet_pton(AF_INET, ip.c_str(), &addr.sin_addr) != 1) continue;
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) continue;
      if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 &&
          errno != EINPROGRESS) {
        out[p].error = describe_errno(errno);
        out[p].host_answered |= errno == ECONNREFUSED;
        ::close(fd);
        continue;
      }
      live.push_back({p, fd, false, {}});
    }
  }
  const double deadline = now_s() + timeout_s;
  while (!live.empty()) {
    const double left = deadline - now_s();
    if (left <= 0) break;
    std::vector<pollfd> fds;
    for (const Attempt& at : live) {
      fds.push_back({at.fd, short(at.connected ? POLLIN : POLLOUT), 0});
    }
    if (::poll(fds.data(), fds.size(), int(left * 1e3) + 1) < 0 && errno != EINTR) break;
    std::vector<Attempt> still;
    for (size_t i = 0; i < live.size(); ++i) {
      Attempt& at = live[i];
      bool done = out[at.peer].reached;
      if (!done && fds[i].revents && !at.connected) {
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(at.fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err == 0) {
          at.connected = true;
        } else {
          out[at.peer].error = describe_errno(err);
          out[at.peer].host_answered |= err == ECONNREFUSED;
          done = true;
        }
      } else if (!done && fds[i].revents) {
        char buf[4096];
        const ssize_t n = ::read(at.fd, buf, sizeof buf);
        if (n > 0) {
          at.got.append(buf, size_t(n));
        } else if (n == 0 && !at.got.empty()) {
          // The whole answer has come: the peer closes after writing it.
          out[at.peer].reached = true;
          out[at.peer].text = at.got;
          done = true;
        } else if (n == 0 || errno != EAGAIN) {
          // Its host's kernel took the connection (it was in the listen queue) and then closed
          // or reset it unanswered: the process ended while being asked.
          out[at.peer].error = "its host took the connection, but the process ended unanswered";
          out[at.peer].host_answered = true;
          done = true;
        }
      }
      if (done) {
        ::close(at.fd);
      } else {
        still.push_back(at);
      }
    }
    live = std::move(still);
  }
  for (const Attempt& at : live) {
    ::close(at.fd);
    ProbeReply& reply = out[at.peer];
    if (reply.reached) continue;
    if (at.connected) {
      // The network reaches the host (its kernel completed the handshake); the process does not
      // answer: stopped, or stuck on its way out.
      reply.host_answered = true;
      reply.error = fmt::format(
          "its host took the connection, but the process did not answer within {:.3g} s "
          "(stopped, or ending)",
          timeout_s);
    } else if (!reply.host_answered) {
      reply.error = fmt::format(
          "no answer within {:.3g} s (a network partition, or the host is down)", timeout_s);
    }
  }
  return out;
}

}  // namespace tetra::comm
