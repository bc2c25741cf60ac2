// The software verbs provider (transport/rdma/soft): what a reliable
// connection on a NIC does, over TCP. Data lands where it should; keys,
// ranges, queue-pair states and the send queue's depth are enforced; errors
// complete the failing WR and flush the rest, in post order; a peer that is
// gone or hung runs out the retries; the completion queue overruns. GPU
// memory (CUDA builds, where a GPU is) is reached as GPUDirect RDMA would,
// host and GPU registrations mixed on one queue pair.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#if MOONCAKE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "common/piped_child.h"
#include "mooncake/te/status.h"
#include "test_pattern.h"
#include "transport/rdma/soft/soft_provider.h"
#include "transport/rdma/verbs.h"

namespace mooncake::te::rdma {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

int loopbackGidIndex(const PortInfo& port) {
  for (const GidEntry& entry : port.gids) {
    if (entry.interface == "lo") return entry.index;
  }
  return port.gids.empty() ? 0 : port.gids.back().index;
}

std::unique_ptr<Device> openDevice(uint32_t cq_entries = 4096) {
  std::unique_ptr<Device> device;
  EXPECT_EQ(makeSoftwareProvider()->open("soft0", DeviceOptions{cq_entries}, device), kOk);
  return device;
}

ConnectOptions loopbackOptions(const Device& device, uint8_t timeout = 14, uint8_t retry_count = 7) {
  ConnectOptions options;
  options.gid_index = loopbackGidIndex(device.port());
  options.timeout = timeout;
  options.retry_count = retry_count;
  return options;
}

QpAddress addressOf(const Device& device, const QueuePair& qp, uint32_t psn) {
  QpAddress address;
  address.qp_num = qp.number();
  address.psn = psn;
  address.gid = device.port().gids[static_cast<size_t>(loopbackGidIndex(device.port()))].gid;
  address.mtu = device.port().mtu;
  return address;
}

// A requester QP on `a` and its responder QP on `b`.
struct Pair {
  std::unique_ptr<QueuePair> requester;
  std::unique_ptr<QueuePair> responder;
};

// The PSNs each side of a Pair starts from.
constexpr uint32_t kRequesterPsn = 1000;
constexpr uint32_t kResponderPsn = 2000;

// The two QPs of a Pair, not connected yet.
Pair createdPair(Device& a, Device& b, uint32_t max_send_wr, uint32_t max_inline) {
  Pair pair;
  EXPECT_EQ(a.createQueuePair(max_send_wr, max_inline, pair.requester), kOk);
  EXPECT_EQ(b.createQueuePair(max_send_wr, max_inline, pair.responder), kOk);
  return pair;
}

// Aims the requester at the responder, which is on `b`.
int connectRequester(Pair& pair, Device& b, const ConnectOptions& options) {
  return pair.requester->connect(addressOf(b, *pair.responder, kResponderPsn), kRequesterPsn, options);
}

// Aims the responder at the requester, which is on `a` and (so the
// responder is told) starts from `requester_psn`.
int connectResponder(Pair& pair, Device& a, const ConnectOptions& options, uint32_t requester_psn = kRequesterPsn) {
  return pair.responder->connect(addressOf(a, *pair.requester, requester_psn), kResponderPsn, options);
}

// A Pair connected to each other over the loopback GID.
Pair connectedPair(Device& a, Device& b, uint32_t max_send_wr = 128, uint32_t max_inline = 64, uint8_t timeout = 14,
                   uint8_t retry_count = 7) {
  Pair pair = createdPair(a, b, max_send_wr, max_inline);
  if (!pair.requester || !pair.responder) return pair;
  EXPECT_EQ(connectResponder(pair, a, loopbackOptions(b, timeout, retry_count)), kOk);
  EXPECT_EQ(connectRequester(pair, b, loopbackOptions(a, timeout, retry_count)), kOk);
  return pair;
}

// Host memory registered on one device (deregistered when it goes, unless
// the test did so).
struct Buffer {
  Buffer(Device& d, size_t n, uint64_t seed = 0) : device(d), bytes(n) {
    if (seed != 0) te::testing::fillPattern(bytes.data(), n, seed);
    EXPECT_EQ(device.registerMemory(bytes.data(), n, keys), kOk);
  }
  ~Buffer() {
    if (registered) device.deregisterMemory(bytes.data());
  }
  int deregister() {
    registered = false;
    return device.deregisterMemory(bytes.data());
  }
  char* at(size_t offset) { return bytes.data() + offset; }
  uint64_t remote(size_t offset = 0) { return reinterpret_cast<uint64_t>(bytes.data() + offset); }
  void fill(char value) { std::fill(bytes.begin(), bytes.end(), value); }

  Device& device;
  std::vector<char> bytes;
  MemoryKeys keys;
  bool registered = true;
};

// Whether every byte of [begin, end) is `value`.
bool allBytesAre(const char* begin, const char* end, char value) {
  return std::all_of(begin, end, [value](char c) { return c == value; });
}

WorkRequest workRequest(uint64_t wr_id, bool read, bool signaled, const void* local, uint32_t lkey, uint64_t remote,
                        uint32_t rkey, uint32_t length) {
  WorkRequest wr;
  wr.wr_id = wr_id;
  wr.read = read;
  wr.signaled = signaled;
  wr.local = local;
  wr.length = length;
  wr.lkey = lkey;
  wr.remote = remote;
  wr.rkey = rkey;
  return wr;
}

// A WRITE from `from` to an address of another process's (or a gone)
// registration, under its rkey.
WorkRequest writeTo(uint64_t wr_id, Buffer& from, size_t from_offset, uint64_t remote, uint32_t rkey, uint32_t length,
                    bool signaled) {
  return workRequest(wr_id, false, signaled, from.at(from_offset), from.keys.lkey, remote, rkey, length);
}

WorkRequest writeRequest(uint64_t wr_id, Buffer& from, size_t from_offset, Buffer& to, size_t to_offset,
                         uint32_t length, bool signaled) {
  return writeTo(wr_id, from, from_offset, to.remote(to_offset), to.keys.rkey, length, signaled);
}

WorkRequest readRequest(uint64_t wr_id, Buffer& into, size_t into_offset, Buffer& from, size_t from_offset,
                        uint32_t length, bool signaled) {
  WorkRequest wr = writeRequest(wr_id, into, into_offset, from, from_offset, length, signaled);
  wr.read = true;
  return wr;
}

int postOne(QueuePair& qp, const WorkRequest& wr) {
  size_t posted = 0;
  return qp.post(&wr, 1, posted);
}

// Polls until `count` completions came or `budget` passed.
std::vector<WorkCompletion> waitCompletions(Device& device, size_t count, std::chrono::milliseconds budget = 5s) {
  std::vector<WorkCompletion> got;
  const auto deadline = Clock::now() + budget;
  WorkCompletion batch[64];
  while (got.size() < count && Clock::now() < deadline) {
    const int n = device.pollCompletions(batch, 64, 50ms);
    if (n < 0) {
      ADD_FAILURE() << "pollCompletions: " << errorName(n);
      break;
    }
    got.insert(got.end(), batch, batch + n);
  }
  return got;
}

bool noCompletionWithin(Device& device, std::chrono::milliseconds wait) {
  WorkCompletion c;
  return device.pollCompletions(&c, 1, wait) == 0;
}

void expectCompletion(const WorkCompletion& c, uint64_t wr_id, Completion status, uint32_t qp_num) {
  EXPECT_EQ(c.wr_id, wr_id);
  EXPECT_EQ(c.status, status) << completionName(c.status) << " instead of " << completionName(status);
  EXPECT_EQ(c.qp_num, qp_num);
}

// What one completion should say; its vendor_error is checked where given.
struct Expected {
  uint64_t wr_id;
  Completion status;
  std::optional<soft::VendorError> vendor_error = std::nullopt;
};

// Waits for as many completions on `device` as `expected` lists, and
// expects them to be those, of QP `qp_num`, in that order. (Fatal when
// fewer came: call it inside ASSERT_NO_FATAL_FAILURE.)
void expectCompletions(Device& device, uint32_t qp_num, const std::vector<Expected>& expected) {
  const auto done = waitCompletions(device, expected.size());
  ASSERT_EQ(done.size(), expected.size());
  for (size_t i = 0; i < done.size(); ++i) {
    expectCompletion(done[i], expected[i].wr_id, expected[i].status, qp_num);
    if (expected[i].vendor_error) {
      EXPECT_EQ(done[i].vendor_error, *expected[i].vendor_error);
    }
  }
}

// Posts `wr` on its own and expects its one completion, on `device`, to
// have `status` (and `vendor_error`, where given).
void postExpecting(Device& device, QueuePair& qp, const WorkRequest& wr, Completion status,
                   std::optional<soft::VendorError> vendor_error = std::nullopt) {
  ASSERT_EQ(postOne(qp, wr), kOk);
  expectCompletions(device, qp.number(), {{wr.wr_id, status, vendor_error}});
}

// Streams WRITEs (`write(n)` makes the n-th, each signaled) on `qp`, no
// more than 4 outstanding, while another thread deregisters `target` after
// 30 ms and then fills it with 0xEE; until one is refused or `budget`
// passed. The first failure must be the refusal (kRemoteAccess); flushes
// follow it. `refused`: whether one was.
template <class Region, class MakeWrite>
void streamWhileDeregistering(Device& device, QueuePair& qp, Region& target, std::chrono::milliseconds budget,
                              MakeWrite write, bool& refused) {
  std::thread deregistering([&] {
    std::this_thread::sleep_for(30ms);
    EXPECT_EQ(target.deregister(), kOk);
    target.fill(char(0xEE));
  });
  refused = false;
  size_t next = 0, outstanding_signaled = 0;
  const auto deadline = Clock::now() + budget;
  WorkCompletion batch[16];
  while (!refused && Clock::now() < deadline) {
    if (outstanding_signaled < 4) {
      if (postOne(qp, write(next)) == kOk) {
        ++outstanding_signaled;
        ++next;
      }
      continue;
    }
    const int n = device.pollCompletions(batch, 16, 100ms);
    ASSERT_GE(n, 0);
    for (int i = 0; i < n; ++i) {
      --outstanding_signaled;
      if (batch[i].status == Completion::kSuccess) continue;
      EXPECT_EQ(batch[i].status, refused ? Completion::kFlushed : Completion::kRemoteAccess);
      refused = true;
    }
  }
  deregistering.join();
}

// One signaled WRITE (wr_id 1, 4096 bytes) that completes: the connection
// works before the test breaks it.
void writeOnce(Device& device, QueuePair& qp, Buffer& source, Buffer& target) {
  ASSERT_EQ(postOne(qp, writeRequest(1, source, 0, target, 0, 4096, true)), kOk);
  ASSERT_EQ(waitCompletions(device, 1).size(), 1u);
}

// Clears the stall even when an assertion leaves the test early.
struct StallGuard {
  StallGuard() { soft::setResponderStalled(true); }
  ~StallGuard() { soft::setResponderStalled(false); }
};

// ---- devices, keys, connection ---------------------------------------------

TEST(SoftVerbs, DevicesPortsAndQueuePairNumbers) {
  auto provider = makeSoftwareProvider();
  EXPECT_STREQ(provider->name(), "software");
  ::setenv("MC_SOFTVERBS_DEVICES", "3", 1);
  EXPECT_EQ(provider->deviceNames(), (std::vector<std::string>{"soft0", "soft1", "soft2"}));
  std::unique_ptr<Device> third;
  EXPECT_EQ(provider->open("soft2", DeviceOptions{}, third), kOk);
  ::unsetenv("MC_SOFTVERBS_DEVICES");
  EXPECT_EQ(provider->deviceNames(), std::vector<std::string>{"soft0"});
  std::unique_ptr<Device> none;
  EXPECT_EQ(provider->open("soft1", DeviceOptions{}, none), kDeviceNotFound);
  EXPECT_EQ(provider->open("mlx5_0", DeviceOptions{}, none), kDeviceNotFound);
  EXPECT_EQ(none, nullptr);

  auto a = openDevice(), b = openDevice();
  const PortInfo& port = a->port();
  EXPECT_EQ(port.device, "soft0");
  EXPECT_EQ(third->port().device, "soft2");
  EXPECT_EQ(port.port, 1);
  EXPECT_TRUE(port.ethernet);
  EXPECT_EQ(port.lid, 0);
  EXPECT_EQ(port.mtu, 4096u);
  ASSERT_FALSE(port.gids.empty());
  for (size_t i = 0; i < port.gids.size(); ++i) {
    const GidEntry& entry = port.gids[i];
    EXPECT_EQ(entry.index, static_cast<int>(i));
    EXPECT_TRUE(entry.rocev2);
    EXPECT_FALSE(entry.interface.empty());
    // IPv4-mapped: ::ffff:a.b.c.d
    for (int k = 0; k < 10; ++k) EXPECT_EQ(entry.gid.raw[k], 0) << entry.gid.str();
    EXPECT_EQ(entry.gid.raw[10], 0xff);
    EXPECT_EQ(entry.gid.raw[11], 0xff);
  }
  const GidEntry& last = port.gids.back();
  EXPECT_EQ(last.interface, "lo");
  EXPECT_EQ(last.gid.raw[12], 127);
  EXPECT_EQ(last.gid.raw[15], 1);

  // qp_num: the NIC's listen port over an 8-bit index; two NICs differ.
  std::unique_ptr<QueuePair> q0, q1, other;
  ASSERT_EQ(a->createQueuePair(16, 0, q0), kOk);
  ASSERT_EQ(a->createQueuePair(16, 0, q1), kOk);
  ASSERT_EQ(b->createQueuePair(16, 0, other), kOk);
  EXPECT_LE(q0->number(), 0xFFFFFFu);
  EXPECT_NE(q0->number() >> 8, 0u);
  EXPECT_EQ(q0->number() >> 8, q1->number() >> 8);
  EXPECT_NE(q0->number() & 0xff, q1->number() & 0xff);
  EXPECT_NE(q0->number() >> 8, other->number() >> 8);
  std::unique_ptr<QueuePair> refused;
  EXPECT_EQ(a->createQueuePair(0, 0, refused), kInvalidArgument);
  EXPECT_EQ(a->createQueuePair(16, 1 << 20, refused), kInvalidArgument);

  // 256 per device; a destroyed QP's index is given out again.
  std::vector<std::unique_ptr<QueuePair>> many;
  for (int i = 2; i < 256; ++i) {
    many.emplace_back();
    ASSERT_EQ(a->createQueuePair(1, 0, many.back()), kOk) << i;
  }
  EXPECT_EQ(a->createQueuePair(1, 0, refused), kTooManyRequests);
  const uint32_t freed = many[10]->number();
  many[10].reset();
  std::unique_ptr<QueuePair> again;
  ASSERT_EQ(a->createQueuePair(1, 0, again), kOk);
  EXPECT_EQ(again->number(), freed);
}

TEST(SoftVerbs, RegistrationKeysAreDistinctAndChecked) {
  auto device = openDevice();
  std::vector<char> one(4096), two(4096);
  MemoryKeys k1, k2;
  ASSERT_EQ(device->registerMemory(one.data(), one.size(), k1), kOk);
  ASSERT_EQ(device->registerMemory(two.data(), two.size(), k2), kOk);
  EXPECT_NE(k1.lkey, 0u);
  EXPECT_NE(k1.rkey, 0u);
  EXPECT_NE(k1.lkey, k1.rkey);
  EXPECT_NE(k1.lkey, k2.lkey);
  EXPECT_NE(k1.rkey, k2.rkey);
  MemoryKeys ignored;
  EXPECT_EQ(device->registerMemory(one.data(), 100, ignored), kInvalidArgument);  // same base
  EXPECT_EQ(device->registerMemory(nullptr, 100, ignored), kInvalidArgument);
  EXPECT_EQ(device->registerMemory(two.data() + 8, 0, ignored), kInvalidArgument);
  // Overlapping at another base is allowed, as with ibv_reg_mr.
  MemoryKeys inner;
  EXPECT_EQ(device->registerMemory(one.data() + 64, 128, inner), kOk);
  EXPECT_EQ(device->deregisterMemory(one.data() + 64), kOk);
  EXPECT_EQ(device->deregisterMemory(one.data() + 1), kInvalidArgument);
  EXPECT_EQ(device->deregisterMemory(one.data()), kOk);
  EXPECT_EQ(device->deregisterMemory(one.data()), kInvalidArgument);
  EXPECT_EQ(device->registerMemory(one.data(), one.size(), k1), kOk);  // registrable again
  EXPECT_EQ(device->deregisterMemory(one.data()), kOk);
  EXPECT_EQ(device->deregisterMemory(two.data()), kOk);
}

TEST(SoftVerbs, ConnectValidatesItsArgumentsAndHappensOnce) {
  auto a = openDevice(), b = openDevice();
  Pair pair = createdPair(*a, *b, 8, 0);
  ASSERT_TRUE(pair.requester && pair.responder);
  QueuePair* qp = pair.requester.get();
  const QpAddress good = addressOf(*b, *pair.responder, 7);
  const ConnectOptions options = loopbackOptions(*a);

  QpAddress bad = good;
  bad.qp_num = 0;
  EXPECT_EQ(qp->connect(bad, 1, options), kInvalidArgument);
  bad = good;
  bad.gid = Gid{};
  bad.gid.raw[0] = 0xfe;  // a link-local IPv6 GID: no IPv4 to reach
  EXPECT_EQ(qp->connect(bad, 1, options), kInvalidArgument);
  bad = good;
  bad.mtu = 1000;
  EXPECT_EQ(qp->connect(bad, 1, options), kInvalidArgument);
  ConnectOptions bad_options = options;
  bad_options.gid_index = static_cast<int>(a->port().gids.size());
  EXPECT_EQ(qp->connect(good, 1, bad_options), kInvalidArgument);
  bad_options = options;
  bad_options.gid_index = -1;
  EXPECT_EQ(qp->connect(good, 1, bad_options), kInvalidArgument);

  // Still in RESET after each refusal: nothing can be posted.
  std::vector<char> bytes(64);
  MemoryKeys keys;
  ASSERT_EQ(a->registerMemory(bytes.data(), bytes.size(), keys), kOk);
  WorkRequest wr;
  wr.local = bytes.data();
  wr.length = 64;
  wr.lkey = keys.lkey;
  size_t posted = 99;
  EXPECT_EQ(qp->post(&wr, 1, posted), kInvalidArgument);
  EXPECT_EQ(posted, 0u);

  EXPECT_EQ(qp->connect(good, 1, options), kOk);
  EXPECT_EQ(qp->connect(good, 1, options), kInvalidArgument);  // once only
  EXPECT_TRUE(noCompletionWithin(*a, 50ms));
  EXPECT_EQ(a->deregisterMemory(bytes.data()), kOk);
}

// ---- data movement ----------------------------------------------------------

TEST(SoftVerbs, WriteAndReadBetweenTwoDevicesOfOneProcess) {
  ::setenv("MC_SOFTVERBS_DEVICES", "2", 1);
  auto provider = makeSoftwareProvider();
  std::unique_ptr<Device> a, b;
  ASSERT_EQ(provider->open("soft0", DeviceOptions{}, a), kOk);
  ASSERT_EQ(provider->open("soft1", DeviceOptions{}, b), kOk);
  ::unsetenv("MC_SOFTVERBS_DEVICES");
  constexpr size_t kSize = 2 << 20;
  Buffer source(*a, kSize, 11), target(*b, kSize), back(*a, kSize);
  Pair pair = connectedPair(*a, *b);
  ASSERT_TRUE(pair.requester && pair.responder);

  // Three unsignaled WRITEs and a signaled one, of odd sizes and offsets
  // (one longer than a staging chunk), as one chain.
  const WorkRequest chain[] = {
      writeRequest(1, source, 0, target, 0, 4096, false),
      writeRequest(2, source, 4096, target, 4096, 700001, false),
      writeRequest(3, source, 704097, target, 704097, 3, false),
      writeRequest(4, source, 704100, target, 704100, kSize - 704100, true),
  };
  size_t posted = 0;
  ASSERT_EQ(pair.requester->post(chain, 4, posted), kOk);
  EXPECT_EQ(posted, 4u);
  ASSERT_NO_FATAL_FAILURE(expectCompletions(*a, pair.requester->number(), {{4, Completion::kSuccess}}));
  EXPECT_TRUE(noCompletionWithin(*a, 100ms));  // the unsignaled ones said nothing
  EXPECT_EQ(target.bytes, source.bytes);

  // READ it back in two pieces, one of several chunks.
  te::testing::fillPattern(target.bytes.data(), kSize, 12);
  const WorkRequest reads[] = {
      readRequest(5, back, 0, target, 0, 1000000, false),
      readRequest(6, back, 1000000, target, 1000000, kSize - 1000000, true),
  };
  ASSERT_EQ(pair.requester->post(reads, 2, posted), kOk);
  ASSERT_NO_FATAL_FAILURE(expectCompletions(*a, pair.requester->number(), {{6, Completion::kSuccess}}));
  EXPECT_EQ(back.bytes, target.bytes);
  EXPECT_TRUE(noCompletionWithin(*b, 20ms));  // the responder's side has nothing to report
}

TEST(SoftVerbs, RequestsOfOneQueuePairRunAndCompleteInPostOrder) {
  auto a = openDevice(), b = openDevice();
  constexpr uint32_t kPiece = 8192;
  Buffer first(*a, kPiece, 21), second(*a, kPiece, 22), seen_first(*a, kPiece), seen_second(*a, kPiece);
  Buffer target(*b, kPiece);
  Pair pair = connectedPair(*a, *b);
  // WRITE, READ, WRITE, READ of one range: each READ sees the WRITE before it.
  const WorkRequest chain[] = {
      writeRequest(1, first, 0, target, 0, kPiece, true),
      readRequest(2, seen_first, 0, target, 0, kPiece, true),
      writeRequest(3, second, 0, target, 0, kPiece, true),
      readRequest(4, seen_second, 0, target, 0, kPiece, true),
  };
  size_t posted = 0;
  ASSERT_EQ(pair.requester->post(chain, 4, posted), kOk);
  ASSERT_NO_FATAL_FAILURE(expectCompletions(
      *a, pair.requester->number(),
      {{1, Completion::kSuccess}, {2, Completion::kSuccess}, {3, Completion::kSuccess}, {4, Completion::kSuccess}}));
  EXPECT_EQ(seen_first.bytes, first.bytes);
  EXPECT_EQ(seen_second.bytes, second.bytes);
  EXPECT_EQ(target.bytes, second.bytes);
}

TEST(SoftVerbs, PipelinedStreamOf64KiBWritesWithinTheSendQueueDepth) {
  auto a = openDevice(), b = openDevice();
  constexpr uint32_t kPiece = 64 * 1024;
  constexpr size_t kCount = 1000;
  constexpr uint32_t kDepth = 128;
  constexpr size_t kSignalEvery = 16;
  Buffer source(*a, kPiece * kCount, 31), target(*b, kPiece * kCount);
  Pair pair = connectedPair(*a, *b, kDepth);
  // Slots are counted as the caller can know them: an unsignaled WR's slot
  // is known free once a later signaled one completed.
  size_t next = 0, retired = 0;
  uint64_t expected_wr_id = kSignalEvery - 1;
  const auto start = Clock::now();
  WorkCompletion batch[64];
  while (retired < kCount) {
    while (next < kCount && next - retired < kDepth) {
      const bool signaled = next % kSignalEvery == kSignalEvery - 1 || next == kCount - 1;
      ASSERT_EQ(
          postOne(*pair.requester, writeRequest(next, source, next * kPiece, target, next * kPiece, kPiece, signaled)),
          kOk)
          << next;
      ++next;
    }
    const int n = a->pollCompletions(batch, 64, 2000ms);
    ASSERT_GT(n, 0) << "stalled at " << retired << " retired, " << next << " posted";
    for (int i = 0; i < n; ++i) {
      expectCompletion(batch[i], expected_wr_id, Completion::kSuccess, pair.requester->number());
      retired = batch[i].wr_id + 1;
      expected_wr_id = std::min<uint64_t>(expected_wr_id + kSignalEvery, kCount - 1);
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_TRUE(target.bytes == source.bytes);
  std::printf("[          ] %zu x 64 KiB WRITEs in %.3f s (%.0f MiB/s)\n", kCount, seconds,
              kCount * kPiece / 1048576.0 / seconds);
  EXPECT_LT(seconds, 4.0);
  // A queue deeper than max_send_wr would not have been allowed.
  std::vector<WorkRequest> too_many;
  for (uint32_t i = 0; i < kDepth + 1; ++i) too_many.push_back(writeRequest(5000 + i, source, 0, target, 0, 8, false));
  too_many.back().signaled = true;
  size_t posted = 0;
  EXPECT_EQ(pair.requester->post(too_many.data(), too_many.size(), posted), kTooManyRequests);
  EXPECT_EQ(posted, kDepth);
}

// ---- errors -----------------------------------------------------------------

TEST(SoftVerbs, WrongRkeyFailsThatRequestAndFlushesEveryLaterOne) {
  auto a = openDevice(), b = openDevice();
  Buffer source(*a, 65536, 41), target(*b, 65536);
  Pair pair = connectedPair(*a, *b);
  const uint32_t qp = pair.requester->number();
  WorkRequest wrong = writeRequest(2, source, 0, target, 4096, 4096, false);
  wrong.rkey ^= 0x5a5a5a5a;
  const WorkRequest chain[] = {
      writeRequest(1, source, 0, target, 0, 4096, true),     wrong,
      writeRequest(3, source, 0, target, 8192, 4096, false), writeRequest(4, source, 0, target, 12288, 4096, true),
      readRequest(5, source, 0, target, 0, 4096, false),
  };
  size_t posted = 0;
  ASSERT_EQ(pair.requester->post(chain, 5, posted), kOk);
  ASSERT_NO_FATAL_FAILURE(expectCompletions(*a, qp,
                                            {{1, Completion::kSuccess},
                                             {2, Completion::kRemoteAccess, soft::kUnknownRkey},
                                             {3, Completion::kFlushed},
                                             {4, Completion::kFlushed},
                                             {5, Completion::kFlushed}}));
  EXPECT_TRUE(noCompletionWithin(*a, 50ms));
  EXPECT_TRUE(std::equal(source.at(0), source.at(4096), target.at(0)));
  // Nothing of the refused WRITE landed; flushed ones did not run either.
  EXPECT_TRUE(allBytesAre(target.at(4096), target.at(65536), 0));

  // In the error state a post is accepted and flushed, signaled or not.
  ASSERT_NO_FATAL_FAILURE(
      postExpecting(*a, *pair.requester, writeRequest(6, source, 0, target, 0, 64, false), Completion::kFlushed));
  // The responder's QP went to the error state with it, as an RC responder
  // does on an access violation.
  Buffer back(*b, 4096);
  ASSERT_NO_FATAL_FAILURE(
      postExpecting(*b, *pair.responder, writeRequest(7, back, 0, source, 0, 64, true), Completion::kFlushed));
}

TEST(SoftVerbs, RemoteRangeOutsideTheRegistrationIsRemoteAccess) {
  auto a = openDevice(), b = openDevice();
  constexpr uint32_t kSize = 65536;
  Buffer source(*a, kSize, 51), target(*b, kSize);
  {
    Pair pair = connectedPair(*a, *b);
    // One byte past the end.
    ASSERT_NO_FATAL_FAILURE(postExpecting(*a, *pair.requester,
                                          writeRequest(1, source, 0, target, kSize - 100, 101, false),
                                          Completion::kRemoteAccess, soft::kRemoteOutOfRange));
    EXPECT_TRUE(allBytesAre(target.at(0), target.at(kSize), 0));
  }
  {
    Pair pair = connectedPair(*a, *b);
    // A READ starting before the registration.
    WorkRequest before = readRequest(2, source, 0, target, 0, 64, true);
    before.remote -= 1;
    ASSERT_NO_FATAL_FAILURE(
        postExpecting(*a, *pair.requester, before, Completion::kRemoteAccess, soft::kRemoteOutOfRange));
  }
}

TEST(SoftVerbs, WrongLkeyIsLocalProtectionInItsTurn) {
  auto a = openDevice(), b = openDevice();
  Buffer source(*a, 65536, 61), target(*b, 65536);
  Pair pair = connectedPair(*a, *b);
  const uint32_t qp = pair.requester->number();
  WorkRequest wrong_key = writeRequest(2, source, 0, target, 4096, 4096, false);
  wrong_key.lkey = source.keys.rkey;  // the rkey is not an lkey
  const WorkRequest chain[] = {
      writeRequest(1, source, 0, target, 0, 4096, true),
      wrong_key,
      writeRequest(3, source, 0, target, 8192, 4096, false),
  };
  size_t posted = 0;
  ASSERT_EQ(pair.requester->post(chain, 3, posted), kOk);
  EXPECT_EQ(posted, 3u);
  ASSERT_NO_FATAL_FAILURE(expectCompletions(
      *a, qp,
      {{1, Completion::kSuccess}, {2, Completion::kLocalProtection, soft::kBadLkey}, {3, Completion::kFlushed}}));
  EXPECT_TRUE(allBytesAre(target.at(4096), target.at(65536), 0));

  // A local range running past its registration, on a fresh pair.
  Pair fresh = connectedPair(*a, *b);
  ASSERT_NO_FATAL_FAILURE(postExpecting(*a, *fresh.requester, writeRequest(4, source, 65536 - 10, target, 0, 11, false),
                                        Completion::kLocalProtection));
}

TEST(SoftVerbs, PostRulesOfTheSendQueueAndInlineData) {
  auto a = openDevice(), b = openDevice();
  Buffer source(*a, 65536, 71), target(*b, 65536);
  constexpr uint32_t kDepth = 8, kInline = 64;
  std::unique_ptr<QueuePair> unconnected;
  ASSERT_EQ(a->createQueuePair(kDepth, kInline, unconnected), kOk);
  size_t posted = 99;
  WorkRequest one = writeRequest(1, source, 0, target, 0, 64, true);
  EXPECT_EQ(unconnected->post(&one, 1, posted), kInvalidArgument);
  EXPECT_EQ(posted, 0u);

  Pair pair = connectedPair(*a, *b, kDepth, kInline);
  const uint32_t qp = pair.requester->number();
  // One chain deeper than the queue: the first kDepth are taken.
  std::vector<WorkRequest> chain;
  for (uint32_t i = 0; i < kDepth + 3; ++i) chain.push_back(writeRequest(10 + i, source, 0, target, 0, 512, false));
  chain[kDepth - 1].signaled = true;
  EXPECT_EQ(pair.requester->post(chain.data(), chain.size(), posted), kTooManyRequests);
  EXPECT_EQ(posted, kDepth);
  ASSERT_NO_FATAL_FAILURE(expectCompletions(*a, qp, {{10 + kDepth - 1, Completion::kSuccess}}));

  // Refused at post: zero length, an inline READ, inline past max_inline.
  std::vector<char> bytes(kInline + 1, 'x');
  WorkRequest empty = writeRequest(30, source, 0, target, 0, 0, true);
  WorkRequest inline_read = readRequest(31, source, 0, target, 0, 16, true);
  inline_read.inline_data = true;
  WorkRequest too_long;
  too_long.wr_id = 32;
  too_long.inline_data = true;
  too_long.local = bytes.data();
  too_long.length = kInline + 1;
  too_long.remote = target.remote();
  too_long.rkey = target.keys.rkey;
  for (const WorkRequest& refused : {empty, inline_read, too_long}) {
    EXPECT_EQ(pair.requester->post(&refused, 1, posted), kInvalidArgument) << refused.wr_id;
    EXPECT_EQ(posted, 0u);
  }
  // A chain stops at the first refused WR; those before it run.
  const WorkRequest mixed[] = {writeRequest(40, source, 0, target, 0, 32, false),
                               writeRequest(41, source, 0, target, 0, 32, true), empty};
  EXPECT_EQ(pair.requester->post(mixed, 3, posted), kInvalidArgument);
  EXPECT_EQ(posted, 2u);
  ASSERT_NO_FATAL_FAILURE(expectCompletions(*a, qp, {{41, Completion::kSuccess}}));

  // Inline bytes are taken at post: overwriting them right after changes nothing.
  std::vector<char> original(kInline);
  te::testing::fillPattern(original.data(), kInline, 72);
  std::vector<char> reused = original;
  WorkRequest inline_write = too_long;
  inline_write.wr_id = 50;
  inline_write.signaled = true;
  inline_write.local = reused.data();
  inline_write.length = kInline;
  inline_write.lkey = 0;  // no registration needed
  inline_write.remote = target.remote(1000);
  ASSERT_EQ(postOne(*pair.requester, inline_write), kOk);
  std::fill(reused.begin(), reused.end(), 0);
  ASSERT_NO_FATAL_FAILURE(expectCompletions(*a, qp, {{50, Completion::kSuccess}}));
  EXPECT_TRUE(std::equal(original.begin(), original.end(), target.at(1000)));
}

TEST(SoftVerbs, DeregisteredRemoteRegionIsRemoteAccess) {
  auto a = openDevice(), b = openDevice();
  Buffer source(*a, 65536, 81), target(*b, 65536), back(*a, 65536);
  {
    Pair pair = connectedPair(*a, *b);
    ASSERT_NO_FATAL_FAILURE(
        postExpecting(*a, *pair.requester, writeRequest(1, source, 0, target, 0, 65536, true), Completion::kSuccess));
    ASSERT_EQ(target.deregister(), kOk);
    ASSERT_NO_FATAL_FAILURE(postExpecting(*a, *pair.requester, writeRequest(2, source, 0, target, 0, 64, false),
                                          Completion::kRemoteAccess, soft::kUnknownRkey));
  }
  Pair pair = connectedPair(*a, *b);
  ASSERT_NO_FATAL_FAILURE(
      postExpecting(*a, *pair.requester, readRequest(3, back, 0, target, 0, 64, false), Completion::kRemoteAccess));
  EXPECT_TRUE(allBytesAre(back.at(0), back.at(64), 0));
}

TEST(SoftVerbs, NoByteOfARegionIsTouchedOnceDeregisterReturned) {
  auto a = openDevice(), b = openDevice();
  constexpr uint32_t kPiece = 64 * 1024;
  constexpr size_t kPieces = 64;
  Buffer source(*a, kPiece * kPieces, 91), target(*b, kPiece * kPieces);
  Pair pair = connectedPair(*a, *b, 64);
  // WRITEs into the region until one is refused. Every WR signaled: the
  // refused one and the flushed ones are told apart from successes.
  bool refused = false;
  ASSERT_NO_FATAL_FAILURE(streamWhileDeregistering(
      *a, *pair.requester, target, 4s,
      [&](size_t next) {
        const size_t piece = next % kPieces;
        return writeRequest(next, source, piece * kPiece, target, piece * kPiece, kPiece, true);
      },
      refused));
  EXPECT_TRUE(refused);
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(allBytesAre(target.at(0), target.at(target.bytes.size()), char(0xEE)));
}

// ---- a responder that is gone or hung ---------------------------------------

TEST(SoftVerbs, DestroyedRemoteDeviceIsRetryExceeded) {
  auto a = openDevice(), b = openDevice();
  Buffer source(*a, 4096, 101);
  auto target = std::make_unique<Buffer>(*b, 4096);
  const uint64_t target_addr = target->remote();
  const uint32_t target_rkey = target->keys.rkey;
  // A long retry window (timeout 18: about 1 s per try, 8 tries): what ends
  // the WR is the lost connection, not the timer.
  Pair pair = connectedPair(*a, *b, 16, 0, 18, 7);
  const QpAddress dead_address = addressOf(*b, *pair.responder, kResponderPsn);
  ASSERT_NO_FATAL_FAILURE(writeOnce(*a, *pair.requester, source, *target));

  target.reset();
  b.reset();  // its responder QP is still open: the device stops it
  WorkRequest wr = writeTo(2, source, 0, target_addr, target_rkey, 64, false);
  const auto start = Clock::now();
  ASSERT_NO_FATAL_FAILURE(postExpecting(*a, *pair.requester, wr, Completion::kRetryExceeded, soft::kConnectionLost));
  EXPECT_LT(Clock::now() - start, 2s);
  size_t posted = 0;
  EXPECT_EQ(pair.responder->post(&wr, 1, posted), kEndpointError);  // stopped with its device
  pair.responder.reset();

  // A QP aimed at the NIC that is gone: the connection is refused.
  std::unique_ptr<QueuePair> late;
  ASSERT_EQ(a->createQueuePair(16, 0, late), kOk);
  ASSERT_EQ(late->connect(dead_address, kRequesterPsn, loopbackOptions(*a, 18, 7)), kOk);
  wr.wr_id = 3;
  ASSERT_NO_FATAL_FAILURE(postExpecting(*a, *late, wr, Completion::kRetryExceeded, soft::kConnectFailed));
}

TEST(SoftVerbs, DestroyedRemoteQueuePairIsRetryExceeded) {
  auto a = openDevice(), b = openDevice();
  Buffer source(*a, 4096, 111), target(*b, 4096);
  Pair pair = connectedPair(*a, *b, 16, 0, 18, 7);
  ASSERT_NO_FATAL_FAILURE(writeOnce(*a, *pair.requester, source, target));
  pair.responder.reset();
  const auto start = Clock::now();
  ASSERT_NO_FATAL_FAILURE(
      postExpecting(*a, *pair.requester, writeRequest(2, source, 0, target, 0, 64, false), Completion::kRetryExceeded));
  EXPECT_LT(Clock::now() - start, 2s);
}

TEST(SoftVerbs, StalledResponderRunsOutTheRetryWindow) {
  auto a = openDevice(), b = openDevice();
  Buffer source(*a, 65536, 121), target(*b, 65536);
  // timeout 12, 3 retries: 4.096 us * 4096 * 4 = 67.1 ms.
  const auto window = std::chrono::microseconds(4096 * 4 * 4096 / 1000);
  Pair pair = connectedPair(*a, *b, 16, 0, 12, 3);
  ASSERT_NO_FATAL_FAILURE(writeOnce(*a, *pair.requester, source, target));
  {
    StallGuard stalled;
    const auto start = Clock::now();
    const WorkRequest chain[] = {writeRequest(2, source, 0, target, 0, 65536, false),
                                 writeRequest(3, source, 0, target, 0, 65536, true)};
    size_t posted = 0;
    ASSERT_EQ(pair.requester->post(chain, 2, posted), kOk);
    ASSERT_NO_FATAL_FAILURE(expectCompletions(
        *a, pair.requester->number(), {{2, Completion::kRetryExceeded, soft::kAckTimeout}, {3, Completion::kFlushed}}));
    const auto elapsed = Clock::now() - start;
    EXPECT_GE(elapsed, window);
    EXPECT_LT(elapsed, 3s);
  }
  // The smallest window is 10 ms, whatever the exponent says.
  Pair quick = connectedPair(*a, *b, 16, 0, 1, 0);
  StallGuard stalled;
  const auto start = Clock::now();
  ASSERT_NO_FATAL_FAILURE(postExpecting(*a, *quick.requester, writeRequest(4, source, 0, target, 0, 64, false),
                                        Completion::kRetryExceeded));
  EXPECT_GE(Clock::now() - start, 10ms);
}

TEST(SoftVerbs, DestroyingAQueuePairStopsItsCompletions) {
  auto a = openDevice(), b = openDevice();
  Buffer source(*a, 65536, 131), target(*b, 65536);
  Pair pair = connectedPair(*a, *b, 64, 0, 16, 7);
  {
    StallGuard stalled;
    std::vector<WorkRequest> chain;
    for (uint64_t i = 0; i < 32; ++i) chain.push_back(writeRequest(i, source, 0, target, 0, 65536, true));
    size_t posted = 0;
    ASSERT_EQ(pair.requester->post(chain.data(), chain.size(), posted), kOk);
    std::this_thread::sleep_for(20ms);
    pair.requester.reset();
  }
  // Neither the answers that now come nor a flush reach the queue.
  EXPECT_TRUE(noCompletionWithin(*a, 200ms));
}

// ---- the responder's QP must be this requester's peer -----------------------

TEST(SoftVerbs, ResponderQpConnectedElsewhereIsRemoteOperation) {
  auto a = openDevice(), b = openDevice();
  Buffer source(*a, 4096, 141), target(*b, 4096);
  Pair pair = createdPair(*a, *b, 16, 0);
  std::unique_ptr<QueuePair> bystander;
  ASSERT_TRUE(pair.requester && pair.responder);
  ASSERT_EQ(a->createQueuePair(16, 0, bystander), kOk);
  // The responder is aimed at the bystander, the requester at the responder.
  ASSERT_EQ(pair.responder->connect(addressOf(*a, *bystander, kRequesterPsn), kResponderPsn, loopbackOptions(*b)), kOk);
  ASSERT_EQ(connectRequester(pair, *b, loopbackOptions(*a)), kOk);
  const WorkRequest chain[] = {writeRequest(1, source, 0, target, 0, 64, false),
                               writeRequest(2, source, 0, target, 0, 64, false)};
  size_t posted = 0;
  ASSERT_EQ(pair.requester->post(chain, 2, posted), kOk);
  ASSERT_NO_FATAL_FAILURE(
      expectCompletions(*a, pair.requester->number(),
                        {{1, Completion::kRemoteOperation, soft::kRemoteQpMismatch}, {2, Completion::kFlushed}}));
  EXPECT_TRUE(allBytesAre(target.at(0), target.at(target.bytes.size()), 0));
}

TEST(SoftVerbs, ResponderExpectingAnotherPsnOrNeverConnectedIsRemoteOperation) {
  auto a = openDevice(), b = openDevice();
  Buffer source(*a, 4096, 151), target(*b, 4096);
  {
    Pair pair = createdPair(*a, *b, 16, 0);
    ASSERT_TRUE(pair.requester && pair.responder);
    ASSERT_EQ(connectResponder(pair, *a, loopbackOptions(*b), kRequesterPsn + 1), kOk);
    ASSERT_EQ(connectRequester(pair, *b, loopbackOptions(*a)), kOk);
    ASSERT_NO_FATAL_FAILURE(postExpecting(*a, *pair.requester, writeRequest(1, source, 0, target, 0, 64, false),
                                          Completion::kRemoteOperation, soft::kRemotePsnMismatch));
  }
  {
    // The responder's QP stays in RESET: refused once half the requester's
    // retry window (timeout 12, 1 retry: 33.6 ms) has passed, before the
    // requester's own timer would give up.
    Pair pair = createdPair(*a, *b, 16, 0);
    ASSERT_TRUE(pair.requester && pair.responder);
    ASSERT_EQ(connectRequester(pair, *b, loopbackOptions(*a, 12, 1)), kOk);
    const auto start = Clock::now();
    ASSERT_NO_FATAL_FAILURE(postExpecting(*a, *pair.requester, writeRequest(2, source, 0, target, 0, 64, false),
                                          Completion::kRemoteOperation, soft::kRemoteQpNotConnected));
    EXPECT_GE(Clock::now() - start, 15ms);
  }
}

TEST(SoftVerbs, ResponderAimedAtAnotherGidIsRemoteOperation) {
  auto a = openDevice(), b = openDevice();
  Buffer source(*a, 4096, 155), target(*b, 4096);
  Pair pair = createdPair(*a, *b, 16, 0);
  ASSERT_TRUE(pair.requester && pair.responder);
  QpAddress elsewhere = addressOf(*a, *pair.requester, kRequesterPsn);
  elsewhere.gid.raw[15] ^= 0x03;  // 127.0.0.2: not the GID the requester sends from
  ASSERT_EQ(pair.responder->connect(elsewhere, kResponderPsn, loopbackOptions(*b)), kOk);
  ASSERT_EQ(connectRequester(pair, *b, loopbackOptions(*a)), kOk);
  ASSERT_NO_FATAL_FAILURE(postExpecting(*a, *pair.requester, writeRequest(1, source, 0, target, 0, 64, false),
                                        Completion::kRemoteOperation, soft::kRemoteGidMismatch));
}

TEST(SoftVerbs, ResponderQpInTheErrorStateIsRemoteOperation) {
  auto a = openDevice(), b = openDevice();
  Buffer on_a(*a, 4096, 156), on_b(*b, 4096, 157);
  Pair pair = connectedPair(*a, *b);
  // The QP on b fails on its own (a WR of its own with a wrong lkey)...
  WorkRequest wrong = writeRequest(1, on_b, 0, on_a, 0, 64, false);
  wrong.lkey ^= 1;
  ASSERT_NO_FATAL_FAILURE(postExpecting(*b, *pair.responder, wrong, Completion::kLocalProtection));
  // ... and then serves nothing: a's WRITE to it is refused, nothing lands.
  const std::vector<char> before = on_b.bytes;
  ASSERT_NO_FATAL_FAILURE(postExpecting(*a, *pair.requester, writeRequest(2, on_a, 0, on_b, 0, 64, false),
                                        Completion::kRemoteOperation, soft::kRemoteQpInError));
  EXPECT_EQ(on_b.bytes, before);
}

TEST(SoftVerbs, ResponderConnectingLateWithinTheWindowIsServed) {
  auto a = openDevice(), b = openDevice();
  Buffer source(*a, 4096, 161), target(*b, 4096);
  Pair pair = createdPair(*a, *b, 16, 0);
  ASSERT_TRUE(pair.requester && pair.responder);
  // The requester posts before the responder's QP is connected (as a NIC
  // retransmits until it is).
  ASSERT_EQ(connectRequester(pair, *b, loopbackOptions(*a)), kOk);
  ASSERT_EQ(postOne(*pair.requester, writeRequest(1, source, 0, target, 0, 4096, true)), kOk);
  std::this_thread::sleep_for(50ms);
  ASSERT_EQ(connectResponder(pair, *a, loopbackOptions(*b)), kOk);
  ASSERT_NO_FATAL_FAILURE(expectCompletions(*a, pair.requester->number(), {{1, Completion::kSuccess}}));
  EXPECT_EQ(target.bytes, source.bytes);
}

// ---- the completion queue ---------------------------------------------------

TEST(SoftVerbs, CompletionQueueOverrunMakesTheDeviceUnusable) {
  auto a = openDevice(4), b = openDevice();
  Buffer source(*a, 4096, 171), target(*b, 512);
  Pair pair = connectedPair(*a, *b);
  std::vector<WorkRequest> chain;
  for (uint64_t i = 0; i < 8; ++i) chain.push_back(writeRequest(i, source, i * 64, target, i * 64, 64, true));
  size_t posted = 0;
  ASSERT_EQ(pair.requester->post(chain.data(), chain.size(), posted), kOk);
  // Not polled for a while: eight small WRITEs over loopback take well under
  // a millisecond (watching the target's bytes instead would race the
  // responder's copy).
  std::this_thread::sleep_for(300ms);
  WorkCompletion out[16];
  EXPECT_EQ(a->pollCompletions(out, 16, 100ms), kEndpointError);
  EXPECT_EQ(a->pollCompletions(out, 16, 0ms), kEndpointError);  // for good

  // The same with flushes, which complete at post: deterministic.
  auto c = openDevice(4);
  Buffer local(*c, 4096, 172);
  Pair failing = connectedPair(*c, *b);
  WorkRequest wrong = writeRequest(100, local, 0, target, 0, 64, false);
  wrong.rkey ^= 1;
  ASSERT_EQ(postOne(*failing.requester, wrong), kOk);
  auto done = waitCompletions(*c, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status, Completion::kRemoteAccess);
  std::vector<WorkRequest> flushed(4, writeRequest(101, local, 0, target, 0, 64, false));
  ASSERT_EQ(failing.requester->post(flushed.data(), flushed.size(), posted), kOk);
  EXPECT_EQ(c->pollCompletions(out, 16, 0ms), 4);  // exactly full
  flushed.push_back(flushed.back());
  ASSERT_EQ(failing.requester->post(flushed.data(), flushed.size(), posted), kOk);
  EXPECT_EQ(c->pollCompletions(out, 16, 0ms), kEndpointError);
}

TEST(SoftVerbs, PollTimesOutAndWakeEndsAWait) {
  auto device = openDevice();
  WorkCompletion out[4];
  auto start = Clock::now();
  EXPECT_EQ(device->pollCompletions(out, 4, 150ms), 0);
  auto elapsed = Clock::now() - start;
  EXPECT_GE(elapsed, 140ms);
  EXPECT_LT(elapsed, 1500ms);
  EXPECT_EQ(device->pollCompletions(out, 4, 0ms), 0);
  EXPECT_EQ(device->pollCompletions(out, 0, 0ms), kInvalidArgument);

  std::thread waker([&] {
    std::this_thread::sleep_for(50ms);
    device->wake();
  });
  start = Clock::now();
  EXPECT_EQ(device->pollCompletions(out, 4, 10s), 0);
  elapsed = Clock::now() - start;
  waker.join();
  EXPECT_GE(elapsed, 40ms);
  EXPECT_LT(elapsed, 2s);
  // A wake() while nobody waits ends the next wait (a shutdown racing the
  // poller's loop is not lost), and only that one.
  device->wake();
  start = Clock::now();
  EXPECT_EQ(device->pollCompletions(out, 4, 10s), 0);
  EXPECT_LT(Clock::now() - start, 1s);
  start = Clock::now();
  EXPECT_EQ(device->pollCompletions(out, 4, 100ms), 0);
  EXPECT_GE(Clock::now() - start, 90ms);
}

// ---- a peer process that dies or hangs ----------------------------------------

// The responder in a child process: one device, a registered buffer and a
// QP connected to the parent's. Forked before this process starts threads of
// its own (the test's devices come after).
class PeerChild {
 public:
  struct Published {
    QpAddress address;
    uint64_t buffer = 0;
    uint32_t rkey = 0;
  };

  PeerChild() : child_(::mooncake::testing::PipedChild::fork(runChild)) {}

  bool started() const { return child_.started(); }
  bool readPublished(Published& out) { return child_.readAll(&out, sizeof(out)); }
  // Gives the child the parent's address; true once it is connected.
  bool connectTo(const QpAddress& parent) {
    char ready = 0;
    return child_.writeAll(&parent, sizeof(parent)) && child_.readAll(&ready, 1) && ready == 'R';
  }
  void kill() { child_.kill(); }
  bool stop() { return child_.stop(); }

 private:
  static int runChild(int in, int out) {
    using ::mooncake::testing::readAllFrom;
    using ::mooncake::testing::writeAllTo;
    std::unique_ptr<Device> device;
    if (makeSoftwareProvider()->open("soft0", DeviceOptions{}, device) != kOk) return 1;
    std::vector<char> buffer(65536);
    MemoryKeys keys;
    std::unique_ptr<QueuePair> qp;
    if (device->registerMemory(buffer.data(), buffer.size(), keys) != kOk ||
        device->createQueuePair(16, 0, qp) != kOk) {
      return 2;
    }
    Published published{addressOf(*device, *qp, 3000), reinterpret_cast<uint64_t>(buffer.data()), keys.rkey};
    QpAddress parent;
    if (!writeAllTo(out, &published, sizeof(published)) || !readAllFrom(in, &parent, sizeof(parent))) return 3;
    if (qp->connect(parent, 3000, loopbackOptions(*device)) != kOk) return 4;
    if (!writeAllTo(out, "R", 1)) return 5;
    char ignored;
    while (::read(in, &ignored, 1) > 0) {
    }
    return 0;  // the parent closed: the end
  }

  ::mooncake::testing::PipedChild child_;  // killed and reaped when this goes
};

// The parent's side of the peer-process tests: the child (forked first,
// before the device starts threads of its own) and a QP on a device of this
// process, connected to the child's.
struct PeerConnection {
  PeerChild child;
  std::unique_ptr<Device> device;
  std::unique_ptr<QueuePair> qp;
  PeerChild::Published published;

  // Connects, with the retry window of `timeout` and `retry_count`, and
  // checks a WRITE and a READ through it land.
  void connectAndCheck(uint8_t timeout, uint8_t retry_count) {
    ASSERT_TRUE(child.started());
    device = openDevice();
    ASSERT_EQ(device->createQueuePair(16, 0, qp), kOk);
    ASSERT_TRUE(child.readPublished(published));
    ASSERT_TRUE(child.connectTo(addressOf(*device, *qp, 4000)));
    ASSERT_EQ(qp->connect(published.address, 4000, loopbackOptions(*device, timeout, retry_count)), kOk);
    Buffer source(*device, 4096, 181), back(*device, 4096);
    WorkRequest read = writeToChild(2, back, 4096, true);
    read.read = true;
    const WorkRequest chain[] = {writeToChild(1, source, 4096, false), read};
    size_t posted = 0;
    ASSERT_EQ(qp->post(chain, 2, posted), kOk);
    ASSERT_NO_FATAL_FAILURE(expectCompletions(*device, qp->number(), {{2, Completion::kSuccess}}));
    EXPECT_EQ(back.bytes, source.bytes);
  }

  // A WRITE from the start of `from` into the child's buffer.
  WorkRequest writeToChild(uint64_t wr_id, Buffer& from, uint32_t length, bool signaled) const {
    return writeTo(wr_id, from, 0, published.buffer, published.rkey, length, signaled);
  }
};

TEST(SoftVerbs, PeerProcessKilledIsRetryExceededAtOnce) {
  PeerConnection peer;
  // A retry window of about 8.6 s (timeout 18, 7 retries): the dead peer's
  // closed connection ends the WR long before it.
  ASSERT_NO_FATAL_FAILURE(peer.connectAndCheck(18, 7));
  peer.child.kill();
  Buffer local(*peer.device, 64, 182);
  const WorkRequest wr = peer.writeToChild(3, local, 64, false);
  const auto start = Clock::now();
  ASSERT_NO_FATAL_FAILURE(postExpecting(*peer.device, *peer.qp, wr, Completion::kRetryExceeded, soft::kConnectionLost));
  EXPECT_LT(Clock::now() - start, 2s);
}

TEST(SoftVerbs, PeerProcessStoppedIsRetryExceededAfterTheWindow) {
  PeerConnection peer;
  // timeout 12, 3 retries: 67.1 ms.
  ASSERT_NO_FATAL_FAILURE(peer.connectAndCheck(12, 3));
  ASSERT_TRUE(peer.child.stop());
  Buffer local(*peer.device, 64, 191);
  const WorkRequest wr = peer.writeToChild(3, local, 64, true);
  const auto start = Clock::now();
  ASSERT_NO_FATAL_FAILURE(postExpecting(*peer.device, *peer.qp, wr, Completion::kRetryExceeded, soft::kAckTimeout));
  const auto elapsed = Clock::now() - start;
  EXPECT_GE(elapsed, std::chrono::microseconds(67108));
  EXPECT_LT(elapsed, 3s);
}

// ---- GPU memory -------------------------------------------------------------
// registerDeviceMemory(): the responder and the requester reach GPU memory
// through CUDA copies, as a NIC reaches it directly with GPUDirect RDMA. The
// tests that need a GPU skip, and say why, where none is (or in a build
// without CUDA).

TEST(SoftVerbs, DeviceMemoryNeedsACudaBuildAndGpuMemory) {
  auto device = openDevice();
  std::vector<char> host(4096);
  MemoryKeys keys;
#if MOONCAKE_WITH_CUDA
  // Host memory is no device's GPU memory (with a GPU or without one).
  EXPECT_EQ(device->registerDeviceMemory(host.data(), host.size(), 0, keys), kInvalidArgument);
  EXPECT_EQ(device->registerDeviceMemory(host.data(), host.size(), -1, keys), kInvalidArgument);
  EXPECT_EQ(device->registerDeviceMemory(nullptr, 4096, 0, keys), kInvalidArgument);
#else
  EXPECT_EQ(device->registerDeviceMemory(host.data(), host.size(), 0, keys), kNotImplemented);
#endif
  // Nothing was registered: the base is free for a host registration.
  EXPECT_EQ(device->registerMemory(host.data(), host.size(), keys), kOk);
  EXPECT_EQ(device->deregisterMemory(host.data()), kOk);
}

// Whether this process sees a CUDA GPU; if not, `why`.
bool gpuPresent(std::string& why) {
#if MOONCAKE_WITH_CUDA
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaSuccess && count > 0) return true;
  why = err != cudaSuccess ? std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err)
                           : std::string("cudaGetDeviceCount found none");
#else
  why = "built without CUDA (MOONCAKE_WITH_CUDA=0)";
#endif
  return false;
}

#define REQUIRE_GPU()                                                           \
  do {                                                                          \
    std::string why_no_gpu;                                                     \
    if (!gpuPresent(why_no_gpu)) GTEST_SKIP() << "no CUDA GPU: " << why_no_gpu; \
  } while (0)

// The CUDA runtime calls of the tests, which reach them only where a GPU is.
#if MOONCAKE_WITH_CUDA
int gpuCount() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}
void* gpuAlloc(size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n), cudaSuccess) << n << " bytes";
  return p;
}
void gpuFree(void* p) { EXPECT_EQ(cudaFree(p), cudaSuccess); }
void gpuUpload(void* gpu, const void* host, size_t n) {
  EXPECT_EQ(cudaMemcpy(gpu, host, n, cudaMemcpyHostToDevice), cudaSuccess);
}
void gpuDownload(void* host, const void* gpu, size_t n) {
  EXPECT_EQ(cudaMemcpy(host, gpu, n, cudaMemcpyDeviceToHost), cudaSuccess);
}
#else
int gpuCount() { return 0; }
void* gpuAlloc(size_t) {
  ADD_FAILURE() << "no CUDA in this build";
  return nullptr;
}
void gpuFree(void*) {}
void gpuUpload(void*, const void*, size_t) { ADD_FAILURE() << "no CUDA in this build"; }
void gpuDownload(void*, const void*, size_t) { ADD_FAILURE() << "no CUDA in this build"; }
#endif

// Host memory, or GPU memory of CUDA device 0 starting kGpuOffset bytes
// into a cudaMalloc allocation (an odd address, as a sub-allocation's may
// be), registered on one device, with `expected`: what it should hold.
class Memory {
 public:
  enum Kind { kHost, kGpu };
  static constexpr size_t kGpuOffset = 7;

  Memory(Device& device, Kind kind, size_t n, uint64_t seed = 0) : device_(device), kind_(kind) {
    expected.resize(n);
    if (seed != 0) te::testing::fillPattern(expected.data(), n, seed);
    if (kind == kHost) {
      host_ = expected;
      data = host_.data();
      EXPECT_EQ(device.registerMemory(data, n, keys), kOk);
    } else {
      allocation_ = gpuAlloc(kGpuOffset + n + 64);
      if (allocation_ == nullptr) return;
      data = static_cast<char*>(allocation_) + kGpuOffset;
      gpuUpload(data, expected.data(), n);
      EXPECT_EQ(device.registerDeviceMemory(data, n, 0, keys), kOk);
    }
    registered_ = true;
  }
  ~Memory() {
    if (registered_) device_.deregisterMemory(data);
    if (allocation_ != nullptr) gpuFree(allocation_);
  }
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;

  int deregister() {
    registered_ = false;
    return device_.deregisterMemory(data);
  }
  uint64_t remote(size_t offset = 0) const { return reinterpret_cast<uint64_t>(data + offset); }
  size_t size() const { return expected.size(); }
  // What it holds now.
  std::vector<char> contents() const {
    if (kind_ == kHost) return host_;
    std::vector<char> out(size());
    gpuDownload(out.data(), data, size());
    return out;
  }
  // Sets every byte, of the memory and of `expected`, to `value`.
  void fill(char value) {
    std::fill(expected.begin(), expected.end(), value);
    if (kind_ == kHost) {
      std::fill(host_.begin(), host_.end(), value);
    } else {
      gpuUpload(data, expected.data(), size());
    }
  }

  char* data = nullptr;  // host or GPU address
  MemoryKeys keys;
  std::vector<char> expected;

 private:
  Device& device_;
  const Kind kind_;
  std::vector<char> host_;
  void* allocation_ = nullptr;
  bool registered_ = false;
};

// Fails with where `memory` first differs from what it should hold.
void expectHolds(const Memory& memory, const char* name) {
  const std::vector<char> got = memory.contents();
  const auto at = std::mismatch(got.begin(), got.end(), memory.expected.begin()).first;
  EXPECT_TRUE(at == got.end()) << name << " differs first at byte " << (at - got.begin()) << " of " << got.size();
}

// One WRITE from `local` into `remote`, or READ from `remote` into `local`.
struct Transfer {
  bool is_read = false;
  Memory* local = nullptr;
  size_t local_offset = 0;
  Memory* remote = nullptr;
  size_t remote_offset = 0;
  uint32_t length = 0;

  WorkRequest request(uint64_t wr_id, bool signaled) const {
    return workRequest(wr_id, is_read, signaled, local->data + local_offset, local->keys.lkey,
                       remote->remote(remote_offset), remote->keys.rkey, length);
  }
  static Transfer write(Memory& local, size_t local_offset, Memory& remote, size_t remote_offset, uint32_t length) {
    return Transfer{false, &local, local_offset, &remote, remote_offset, length};
  }
  static Transfer read(Memory& local, size_t local_offset, Memory& remote, size_t remote_offset, uint32_t length) {
    return Transfer{true, &local, local_offset, &remote, remote_offset, length};
  }

  // What it does to the memories' `expected`, when it succeeds.
  void apply() const {
    const char* from = is_read ? remote->expected.data() + remote_offset : local->expected.data() + local_offset;
    char* to = is_read ? local->expected.data() + local_offset : remote->expected.data() + remote_offset;
    std::memmove(to, from, length);
  }
};

// Posts `transfers` as one chain, each signaled, and expects each to
// succeed, in order.
void runAll(Device& device, QueuePair& qp, const std::vector<Transfer>& transfers) {
  std::vector<WorkRequest> chain;
  std::vector<Expected> expected;
  for (size_t i = 0; i < transfers.size(); ++i) {
    chain.push_back(transfers[i].request(i + 1, true));
    expected.push_back({i + 1, Completion::kSuccess});
  }
  size_t posted = 0;
  ASSERT_EQ(qp.post(chain.data(), chain.size(), posted), kOk);
  ASSERT_EQ(posted, chain.size());
  ASSERT_NO_FATAL_FAILURE(expectCompletions(device, qp.number(), expected));
  for (const Transfer& transfer : transfers) transfer.apply();
}

// Makes every copy into or out of GPU memory fail while in scope.
struct DeviceCopyFailureGuard {
  DeviceCopyFailureGuard() { soft::setDeviceCopiesFailing(true); }
  ~DeviceCopyFailureGuard() { soft::setDeviceCopiesFailing(false); }
};

TEST(SoftVerbsGpu, RegistrationKeysBaseAddressesAndDeregistration) {
  REQUIRE_GPU();
  auto device = openDevice();
  constexpr size_t kSize = 1 << 20;
  Memory host(*device, Memory::kHost, kSize), gpu(*device, Memory::kGpu, kSize);
  ASSERT_NE(gpu.data, nullptr);
  EXPECT_NE(gpu.keys.lkey, 0u);
  EXPECT_NE(gpu.keys.rkey, 0u);
  EXPECT_NE(gpu.keys.lkey, gpu.keys.rkey);
  for (uint32_t key : {host.keys.lkey, host.keys.rkey}) {
    EXPECT_NE(gpu.keys.lkey, key);
    EXPECT_NE(gpu.keys.rkey, key);
  }
  // One registration per base address, whichever kind.
  MemoryKeys ignored;
  EXPECT_EQ(device->registerDeviceMemory(gpu.data, 100, 0, ignored), kInvalidArgument);
  EXPECT_EQ(device->registerMemory(gpu.data, 100, ignored), kInvalidArgument);
  EXPECT_EQ(device->registerDeviceMemory(gpu.data + 8, 0, 0, ignored), kInvalidArgument);
  // GPU memory of device 0 is not that of another ordinal (one that does
  // not exist, where there is a single GPU).
  EXPECT_EQ(device->registerDeviceMemory(gpu.data + 8, 64, gpuCount(), ignored), kInvalidArgument);
  EXPECT_EQ(device->registerDeviceMemory(gpu.data + 8, 64, -1, ignored), kInvalidArgument);
  // Inside another registration at another base: allowed, as with ibv_reg_mr.
  MemoryKeys inner;
  EXPECT_EQ(device->registerDeviceMemory(gpu.data + 64, 128, 0, inner), kOk);
  EXPECT_EQ(device->deregisterMemory(gpu.data + 64), kOk);

  EXPECT_EQ(gpu.deregister(), kOk);
  EXPECT_EQ(device->deregisterMemory(gpu.data), kInvalidArgument);  // once
  MemoryKeys again;
  EXPECT_EQ(device->registerDeviceMemory(gpu.data, kSize, 0, again), kOk);  // registrable again
  EXPECT_EQ(device->deregisterMemory(gpu.data), kOk);
}

TEST(SoftVerbsGpu, WritesAndReadsBetweenHostAndGpuMemoryMixedOnOneQueuePair) {
  REQUIRE_GPU();
  auto a = openDevice(), b = openDevice();
  constexpr size_t kHalf = 4 << 20;
  // a: the sources and the READ targets; b: the WRITE targets, each in two
  // halves (host and GPU sources), and the READ sources.
  Memory host_source(*a, Memory::kHost, kHalf, 201), gpu_source(*a, Memory::kGpu, kHalf, 202);
  Memory host_back(*a, Memory::kHost, 2 * kHalf, 203), gpu_back(*a, Memory::kGpu, 2 * kHalf, 204);
  Memory host_target(*b, Memory::kHost, 2 * kHalf, 205), gpu_target(*b, Memory::kGpu, 2 * kHalf, 206);
  ASSERT_FALSE(::testing::Test::HasFailure());
  Pair pair = connectedPair(*a, *b);
  ASSERT_TRUE(pair.requester && pair.responder);

  // 1 B, 4097 B (a page and a byte) and 3 MiB + 5 (a dozen staging chunks
  // and a piece), at odd offsets 13 bytes apart; the remote side 5 bytes
  // further on.
  std::vector<Transfer> chain;
  size_t offset = 0;
  for (uint32_t length : {1u, 4097u, (3u << 20) + 5}) {
    offset += 13;
    const size_t o = offset, r = offset + 5;
    chain.push_back(Transfer::write(host_source, o, gpu_target, r, length));           // host -> GPU
    chain.push_back(Transfer::write(gpu_source, o, gpu_target, kHalf + r, length));    // GPU -> GPU
    chain.push_back(Transfer::write(gpu_source, o, host_target, r, length));           // GPU -> host
    chain.push_back(Transfer::write(host_source, o, host_target, kHalf + r, length));  // host -> host
    offset += length;
  }
  // READ each back, behind the WRITEs on the same QP: what they read is
  // what the WRITEs left.
  const size_t writes = chain.size();
  for (size_t i = 0; i < writes; ++i) {
    const Transfer& w = chain[i];
    // Into GPU memory what came from the host and the other way round.
    const bool into_gpu = w.local == &host_source;
    Memory& back = into_gpu ? gpu_back : host_back;
    const size_t back_offset = w.local_offset + (w.remote == &host_target ? kHalf : 0);
    chain.push_back(Transfer::read(back, back_offset, *w.remote, w.remote_offset, w.length));
  }
  ASSERT_NO_FATAL_FAILURE(runAll(*a, *pair.requester, chain));
  expectHolds(gpu_target, "gpu_target");
  expectHolds(host_target, "host_target");
  expectHolds(gpu_back, "gpu_back");
  expectHolds(host_back, "host_back");
  expectHolds(gpu_source, "gpu_source");  // the sources as they were
  expectHolds(host_source, "host_source");
  EXPECT_TRUE(noCompletionWithin(*b, 20ms));
}

TEST(SoftVerbsGpu, WrongKeysAndRangesOfGpuMemoryAreRefused) {
  REQUIRE_GPU();
  auto a = openDevice(), b = openDevice();
  constexpr uint32_t kSize = 65536;
  Memory source(*a, Memory::kHost, kSize, 211), gpu_local(*a, Memory::kGpu, kSize, 212);
  Memory target(*b, Memory::kGpu, kSize, 213);
  ASSERT_FALSE(::testing::Test::HasFailure());
  {
    Pair pair = connectedPair(*a, *b);
    const uint32_t qp = pair.requester->number();
    const Transfer good = Transfer::write(source, 0, target, 0, 4096);
    WorkRequest wrong = Transfer::write(source, 0, target, 4096, 4096).request(2, false);
    wrong.rkey ^= 0x5a5a5a5a;
    const WorkRequest chain[] = {good.request(1, true), wrong,
                                 Transfer::write(source, 0, target, 8192, 4096).request(3, true)};
    size_t posted = 0;
    ASSERT_EQ(pair.requester->post(chain, 3, posted), kOk);
    ASSERT_NO_FATAL_FAILURE(expectCompletions(
        *a, qp,
        {{1, Completion::kSuccess}, {2, Completion::kRemoteAccess, soft::kUnknownRkey}, {3, Completion::kFlushed}}));
    good.apply();
    expectHolds(target, "target");  // the first landed, nothing after it
  }
  {
    // A READ running one byte past the end of the GPU registration.
    Pair pair = connectedPair(*a, *b);
    ASSERT_NO_FATAL_FAILURE(postExpecting(*a, *pair.requester,
                                          Transfer::read(source, 0, target, kSize - 100, 101).request(4, false),
                                          Completion::kRemoteAccess, soft::kRemoteOutOfRange));
    expectHolds(source, "source");
  }
  {
    // A local GPU range under a key that is not its lkey.
    Pair pair = connectedPair(*a, *b);
    WorkRequest wr = Transfer::write(gpu_local, 0, target, 0, 4096).request(5, false);
    wr.lkey = gpu_local.keys.rkey;
    ASSERT_NO_FATAL_FAILURE(postExpecting(*a, *pair.requester, wr, Completion::kLocalProtection, soft::kBadLkey));
    expectHolds(target, "target");
  }
}

TEST(SoftVerbsGpu, DeregisteredGpuMemoryIsNoLongerServedOrTouched) {
  REQUIRE_GPU();
  auto a = openDevice(), b = openDevice();
  constexpr uint32_t kPiece = 64 * 1024;
  constexpr size_t kPieces = 64;
  Memory source(*a, Memory::kHost, kPiece * kPieces, 221), target(*b, Memory::kGpu, kPiece * kPieces);
  Memory gpu_back(*a, Memory::kGpu, kPiece, 222);
  ASSERT_FALSE(::testing::Test::HasFailure());
  {
    Pair pair = connectedPair(*a, *b);
    ASSERT_NO_FATAL_FAILURE(runAll(*a, *pair.requester, {Transfer::write(source, 0, target, 0, kPiece)}));
    expectHolds(target, "target");
    // Deregistered locally: a READ into it fails at the requester.
    ASSERT_EQ(gpu_back.deregister(), kOk);
    ASSERT_NO_FATAL_FAILURE(postExpecting(*a, *pair.requester,
                                          Transfer::read(gpu_back, 0, target, 0, 64).request(2, false),
                                          Completion::kLocalProtection));
    expectHolds(gpu_back, "gpu_back");
  }

  // Deregistered remotely while WRITEs stream into it: refused from then on,
  // and no byte of it touched once deregisterMemory() returned.
  Pair pair = connectedPair(*a, *b, 64);
  bool refused = false;
  ASSERT_NO_FATAL_FAILURE(streamWhileDeregistering(
      *a, *pair.requester, target, 2s,
      [&](size_t next) {
        const size_t piece = next % kPieces;
        return Transfer::write(source, piece * kPiece, target, piece * kPiece, kPiece).request(100 + next, true);
      },
      refused));
  EXPECT_TRUE(refused);
  std::this_thread::sleep_for(50ms);
  expectHolds(target, "target");  // all 0xEE
}

TEST(SoftVerbsGpu, FailedCudaCopiesFailTheirRequests) {
  REQUIRE_GPU();
  auto a = openDevice(), b = openDevice();
  constexpr uint32_t kSize = 65536;
  Memory host_source(*a, Memory::kHost, kSize, 231), gpu_source(*a, Memory::kGpu, kSize, 232);
  Memory host_back(*a, Memory::kHost, kSize), gpu_back(*a, Memory::kGpu, kSize);
  Memory host_target(*b, Memory::kHost, kSize, 233), gpu_target(*b, Memory::kGpu, kSize, 234);
  ASSERT_FALSE(::testing::Test::HasFailure());
  {
    DeviceCopyFailureGuard failing;
    // At the responder: a WRITE landing in GPU memory, a READ out of it.
    // Host memory before it on the same QP is unaffected; what follows is
    // flushed; the responder's QP is in the error state too.
    for (bool read : {false, true}) {
      SCOPED_TRACE(read ? "READ" : "WRITE");
      Pair pair = connectedPair(*a, *b);
      const uint32_t qp = pair.requester->number();
      const Transfer host_ok = Transfer::write(host_source, 0, host_target, 0, 4096);
      const Transfer gpu_failing = read ? Transfer::read(host_back, 0, gpu_target, 0, 4096)
                                        : Transfer::write(host_source, 0, gpu_target, 0, 4096);
      const WorkRequest chain[] = {host_ok.request(1, true), gpu_failing.request(2, false), host_ok.request(3, true)};
      size_t posted = 0;
      ASSERT_EQ(pair.requester->post(chain, 3, posted), kOk);
      ASSERT_NO_FATAL_FAILURE(expectCompletions(*a, qp,
                                                {{1, Completion::kSuccess},
                                                 {2, Completion::kRemoteOperation, soft::kRemoteCopyFailed},
                                                 {3, Completion::kFlushed}}));
      host_ok.apply();
      expectHolds(host_target, "host_target");
      if (read) expectHolds(host_back, "host_back");  // nothing came back
      ASSERT_NO_FATAL_FAILURE(postExpecting(*b, *pair.responder,
                                            Transfer::write(host_target, 0, host_back, 0, 64).request(4, true),
                                            Completion::kFlushed));
    }
    // At the requester: a WRITE out of GPU memory, a READ into it.
    for (bool read : {false, true}) {
      SCOPED_TRACE(read ? "READ" : "WRITE");
      Pair pair = connectedPair(*a, *b);
      const Transfer gpu_failing = read ? Transfer::read(gpu_back, 0, host_target, 0, 4096)
                                        : Transfer::write(gpu_source, 0, host_target, 8192, 4096);
      ASSERT_NO_FATAL_FAILURE(postExpecting(*a, *pair.requester, gpu_failing.request(5, false),
                                            Completion::kLocalProtection, soft::kLocalCopyFailed));
    }
  }
  // The copies work again: every direction once more, on a fresh pair.
  gpu_back.fill(0);
  host_target.expected = host_target.contents();  // what the failed WRITE left is undefined
  Pair pair = connectedPair(*a, *b);
  const std::vector<Transfer> again = {
      Transfer::write(host_source, 0, gpu_target, 0, 4096),
      Transfer::write(gpu_source, 0, host_target, 0, 4096),
      Transfer::read(gpu_back, 0, gpu_target, 0, 4096),
  };
  ASSERT_NO_FATAL_FAILURE(runAll(*a, *pair.requester, again));
  expectHolds(gpu_target, "gpu_target");
  expectHolds(host_target, "host_target");
  expectHolds(gpu_back, "gpu_back");
}

}  // namespace
}  // namespace mooncake::te::rdma
