// net::sendPieces: a header, a payload and a trailer go out as one stream of
// bytes, whole and in order, also when the socket takes them a little at a
// time (a small send buffer, a slow reader), and a closed peer is an error.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <vector>

#include "mooncake/te/status.h"
#include "net/socket.h"

namespace mooncake::te {
namespace {

using namespace std::chrono_literals;

std::vector<char> bytes(size_t n, int seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>(i * 131 + seed);
  return v;
}

TEST(SocketPieces, ThePiecesArriveWholeAndInOrderThroughASmallSendBuffer) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  const int small = 4096;
  ::setsockopt(fds[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
  const auto header = bytes(24, 1), payload = bytes(3u << 20, 2), trailer = bytes(40, 3);
  std::vector<char> got(header.size() + payload.size() + trailer.size());
  std::thread reader([&] {
    // Reads in small, uneven steps, with pauses: the sender sees partial writes.
    size_t at = 0;
    for (size_t step = 1; at < got.size(); step = step % 7919 + 613) {
      const size_t n = std::min(step, got.size() - at);
      ASSERT_EQ(net::recvAll(fds[1], got.data() + at, n, net::after(10s)), kOk);
      at += n;
      if (at % 64 == 0) std::this_thread::sleep_for(10us);
    }
  });
  // An empty piece is skipped.
  EXPECT_EQ(net::sendPieces(fds[0],
                            {{header.data(), header.size()},
                             {nullptr, 0},
                             {payload.data(), payload.size()},
                             {trailer.data(), trailer.size()}},
                            net::after(10s)),
            kOk);
  reader.join();
  std::vector<char> expected(header);
  expected.insert(expected.end(), payload.begin(), payload.end());
  expected.insert(expected.end(), trailer.begin(), trailer.end());
  EXPECT_EQ(got, expected);
  ::close(fds[0]);
  ::close(fds[1]);
}

TEST(SocketPieces, APeerThatClosedIsAnErrorAndAFullSocketTimesOut) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  const auto payload = bytes(8u << 20, 4);  // more than the socket buffers hold: nobody reads
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(net::sendPieces(fds[0], {{payload.data(), payload.size()}}, net::after(200ms)), kTimeout);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  ::close(fds[1]);
  EXPECT_NE(net::sendPieces(fds[0], {{payload.data(), 100}}, net::after(1s)), kOk);
  ::close(fds[0]);
}

TEST(SocketPieces, MoreThanFourNonEmptyPiecesAreRefused) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  const char b[5] = {1, 2, 3, 4, 5};
  EXPECT_EQ(net::sendPieces(fds[0], {{b, 1}, {b + 1, 1}, {b + 2, 1}, {b + 3, 1}, {b + 4, 1}}, net::after(1s)),
            kInvalidArgument);
  ::close(fds[0]);
  ::close(fds[1]);
}

}  // namespace
}  // namespace mooncake::te
