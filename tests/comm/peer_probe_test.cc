// The network side of the arrival board: an entry survives the trip through a probe's answer,
// and probe_all tells an answering rank from a refused connection, a malformed address, a process
// that ends while being asked and one that never answers.
#include "comm/peer_probe.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "comm/arrival_board.h"

namespace tetra::comm {
namespace {

// The probe port of `server` on the loopback interface.
std::string loopback(const ProbeServer& server) {
  const std::string& a = server.address();
  return "127.0.0.1" + a.substr(a.rfind(':'));
}

TEST(ArrivalBoard, AnEntrySurvivesItsText) {
  SlotView v;
  v.cur_key = 0xabcdef0123456789ull;
  v.cur_seq = 17;
  v.cur_op = 3;
  v.running = true;
  v.age_s = 2.5;
  v.phase = 4;
  v.phase_step = 12;
  v.phase_micro = 3;
  v.phase_stage = 1;
  v.phase_age_s = 1.25;
  v.entered[0] = {v.cur_key, 17};
  v.entered[1] = {42, 9};
  SlotView back;
  ASSERT_TRUE(SlotView::parse(v.serialize(), &back));
  EXPECT_EQ(back.cur_key, v.cur_key);
  EXPECT_EQ(back.cur_seq, 17u);
  EXPECT_EQ(back.cur_op, 3u);
  EXPECT_TRUE(back.running);
  EXPECT_DOUBLE_EQ(back.age_s, 2.5);
  EXPECT_EQ(back.phase, 4u);
  EXPECT_EQ(back.phase_step, 12);
  EXPECT_EQ(back.phase_micro, 3);
  EXPECT_EQ(back.phase_stage, 1);
  EXPECT_DOUBLE_EQ(back.phase_age_s, 1.25);
  EXPECT_EQ(back.entered_on(v.cur_key), 17u);
  EXPECT_EQ(back.entered_on(42), 9u);
  EXPECT_EQ(back.entered_on(7), 0u);
  for (const char* bad : {"", "board", "bored 1 2 3 0 1.0", "board 1 2 3 0 1.0 5",
                          "board 1 2 3 0 1.0 4 12 3 1 1.25 5", "board x"}) {
    EXPECT_FALSE(SlotView::parse(bad, &back)) << bad;
  }
}

TEST(PeerProbe, TellsAnAnswerFromARefusalAndSilence) {
  ProbeServer server([] { return std::string("board 1 2 3 1 0.5"); });
  ASSERT_FALSE(server.address().empty());
  // A port nothing listens on: a socket bound and closed again.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string closed = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  ::close(fd);
  // A listener that never accepts: connections complete in its backlog, no answer comes.
  int mute = ::socket(AF_INET, SOCK_STREAM, 0);
  addr.sin_port = 0;
  ASSERT_EQ(::bind(mute, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(mute, 4), 0);
  len = sizeof addr;
  ASSERT_EQ(::getsockname(mute, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string silent = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  // A listener that takes one connection and closes it unanswered, as a process on its way out.
  int ending = ::socket(AF_INET, SOCK_STREAM, 0);
  addr.sin_port = 0;
  ASSERT_EQ(::bind(ending, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(ending, 4), 0);
  len = sizeof addr;
  ASSERT_EQ(::getsockname(ending, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string dying = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  std::thread closer([ending] { ::close(::accept(ending, nullptr, nullptr)); });

  const std::vector<ProbeReply> r =
      probe_all({server.address(), loopback(server), closed, "", silent, dying}, 0.5);
  closer.join();
  ::close(mute);
  ::close(ending);
  ASSERT_EQ(r.size(), 6u);
  EXPECT_TRUE(r[0].reached) << r[0].error;
  EXPECT_EQ(r[0].text, "board 1 2 3 1 0.5\n");
  EXPECT_TRUE(r[1].reached) << r[1].error;
  EXPECT_FALSE(r[2].reached);
  EXPECT_NE(r[2].error.find("connection refused"), std::string::npos) << r[2].error;
  EXPECT_TRUE(r[2].host_answered);  // a process gone, its host reachable: no partition
  EXPECT_FALSE(r[3].reached);
  EXPECT_NE(r[3].error.find("not probed"), std::string::npos) << r[3].error;
  EXPECT_FALSE(r[3].host_answered);
  EXPECT_FALSE(r[4].reached);
  // Its kernel completed the handshake: the host is reachable, the process is stopped or ending.
  EXPECT_NE(r[4].error.find("did not answer within 0.5 s"), std::string::npos) << r[4].error;
  EXPECT_TRUE(r[4].host_answered);
  EXPECT_FALSE(r[5].reached);
  EXPECT_NE(r[5].error.find("ended unanswered"), std::string::npos) << r[5].error;
  EXPECT_TRUE(r[5].host_answered);
}

}  // namespace
}  // namespace tetra::comm
