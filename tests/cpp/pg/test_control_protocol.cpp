// The control plane without sockets: the wire protocol (every message
// round-trips, frames split anywhere, malformed input is an error), the
// reconciliation of failure evidence, and the Coordinator's state machine
// driven directly (no sockets, no threads, no clock), link evidence included.
#include "control_fixture.h"

namespace mooncake::pg {
namespace {

// ---------------------------------------------------------------- protocol

GroupView sampleView() {
  GroupView view;
  view.key = "cpu:7";
  view.uid = "pg1234-3";
  view.epoch = 42;
  view.members = {MemberState::kActive, MemberState::kInactive, MemberState::kAwaitingActivation, MemberState::kLeft,
                  MemberState::kNone};
  view.global_ranks = {0, 5, 2, 9, -1};
  view.endpoints = {"a:1", "", "c:3", "", ""};
  view.hosts = {"h0", "h1", "", "h3", ""};
  view.online = {true, false, true, false, false};
  return view;
}

std::vector<control::Message> sampleMessages() {
  ProposeViewUpdateResponse proposed;
  proposed.status = ProposalStatus::AppliedWithDroppedRanks;
  proposed.new_epoch = 17;
  proposed.dropped_ranks = {2, 3};
  return {
      helloFrom(3, 1234),
      control::Reply{9, "nope", sampleView()},
      control::Heartbeat{},
      control::RegisterGroupRequest{5,
                                    [] {
                                      GroupRegistration r = registration("k", 1, {4, 6, 8}, 4, true, false);
                                      r.reports_links = true;
                                      return r;
                                    }()},
      control::UnregisterGroupRequest{6, "k"},
      control::FailureReport{"k", {1, 2}},
      control::SyncRequest{7, "k", {}},
      control::SyncReply{7, {SyncAfterFailureStatus::Reconciled, ""}, sampleView()},
      control::JoinRequest{8, "k"},
      control::ProposeRequest{10, "k", true, {3}},
      control::ProposeReply{10, proposed},
      control::ViewPush{sampleView()},
      control::ViewAck{"k", 42},
      control::LinkReport{"k", {0, 2}, {1}},
      control::Hello{4, 99, "h:7", true, 2},
      control::Rejoin{registration("k", 1, {4, 6, 8}, 4), sampleView()},
      control::Standbys{2, {3, 5}, {"a:1", "b:2"}},
      control::Goodbye{},
  };
}

TEST(ControlProtocol, EveryMessageRoundTrips) {
  for (const control::Message& original : sampleMessages()) {
    std::vector<uint8_t> frame = control::encodeFrame(original);
    control::Message decoded;
    size_t used = 0;
    std::string error;
    ASSERT_EQ(control::decodeFrame(frame.data(), frame.size(), &decoded, &used, &error), control::DecodeResult::kFrame)
        << control::messageName(original) << ": " << error;
    EXPECT_EQ(used, frame.size());
    EXPECT_EQ(decoded.index(), original.index());
    // Encoding is deterministic: equal bytes mean equal fields.
    EXPECT_EQ(control::encodeFrame(decoded), frame) << control::messageName(original);
  }
  control::Message push = control::ViewPush{sampleView()};
  std::vector<uint8_t> frame = control::encodeFrame(push);
  control::Message decoded;
  size_t used = 0;
  std::string error;
  ASSERT_EQ(control::decodeFrame(frame.data(), frame.size(), &decoded, &used, &error), control::DecodeResult::kFrame);
  const GroupView& view = std::get<control::ViewPush>(decoded).view;
  EXPECT_EQ(view.key, "cpu:7");
  EXPECT_EQ(view.epoch, 42u);
  EXPECT_EQ(view.members[2], MemberState::kAwaitingActivation);
  EXPECT_EQ(view.global_ranks[4], -1);
  EXPECT_EQ(view.online, (std::vector<bool>{true, false, true, false, false}));
  EXPECT_EQ(view.activeRanks(), std::vector<int>{0});
}

TEST(ControlProtocol, StreamDecoderSplitsFramesFedByteByByte) {
  std::vector<uint8_t> stream;
  auto messages = sampleMessages();
  for (const auto& m : messages) {
    auto frame = control::encodeFrame(m);
    stream.insert(stream.end(), frame.begin(), frame.end());
  }
  control::FrameDecoder decoder;
  size_t decoded = 0;
  for (uint8_t byte : stream) {
    decoder.append(&byte, 1);
    control::Message m;
    std::string error;
    for (;;) {
      auto result = decoder.next(&m, &error);
      ASSERT_NE(result, control::DecodeResult::kError) << error;
      if (result == control::DecodeResult::kNeedMore) break;
      EXPECT_EQ(m.index(), messages[decoded].index());
      ++decoded;
    }
  }
  EXPECT_EQ(decoded, messages.size());
}

TEST(ControlProtocol, MalformedFramesAreErrorsNeverCrashes) {
  control::Message m;
  size_t used = 0;
  std::string error;
  auto decode = [&](const std::vector<uint8_t>& bytes) {
    error.clear();
    return control::decodeFrame(bytes.data(), bytes.size(), &m, &used, &error);
  };
  auto setU32 = [](std::vector<uint8_t>& bytes, size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) bytes[at + i] = static_cast<uint8_t>(v >> (8 * i));
  };

  for (const control::Message& original : sampleMessages()) {
    std::vector<uint8_t> frame = control::encodeFrame(original);
    // Every truncation is incomplete, never a frame and never an error.
    for (size_t n = 0; n < frame.size(); ++n) {
      std::vector<uint8_t> prefix(frame.begin(), frame.begin() + n);
      EXPECT_EQ(decode(prefix), control::DecodeResult::kNeedMore) << n;
    }
    // A payload cut short but announced as complete (the length field
    // shrunk) is malformed.
    if (frame.size() > control::kFrameHeaderBytes) {
      for (size_t cut = 1; cut <= frame.size() - control::kFrameHeaderBytes; ++cut) {
        std::vector<uint8_t> shortened(frame.begin(), frame.end() - cut);
        setU32(shortened, 8, static_cast<uint32_t>(shortened.size() - control::kFrameHeaderBytes));
        auto result = decode(shortened);
        EXPECT_NE(result, control::DecodeResult::kNeedMore);
        if (result == control::DecodeResult::kFrame) {
          EXPECT_EQ(used, shortened.size());
        }
      }
    }
    // Trailing bytes inside the announced payload are an error.
    std::vector<uint8_t> padded = frame;
    padded.push_back(0);
    setU32(padded, 8, static_cast<uint32_t>(padded.size() - control::kFrameHeaderBytes));
    EXPECT_EQ(decode(padded), control::DecodeResult::kError);
  }

  std::vector<uint8_t> frame = control::encodeFrame(control::ViewPush{sampleView()});
  std::vector<uint8_t> bad = frame;
  bad[0] ^= 0xff;
  EXPECT_EQ(decode(bad), control::DecodeResult::kError);
  EXPECT_NE(error.find("magic"), std::string::npos);
  bad = frame;
  bad[4] = 99;  // version
  EXPECT_EQ(decode(bad), control::DecodeResult::kError);
  EXPECT_NE(error.find("version"), std::string::npos);
  bad = frame;
  bad[6] = 200;  // tag
  EXPECT_EQ(decode(bad), control::DecodeResult::kError);
  bad = frame;
  setU32(bad, 8, control::kMaxPayloadBytes + 1);
  EXPECT_EQ(decode(bad), control::DecodeResult::kError);
  // A count of seats the payload cannot hold is refused before allocating.
  std::vector<uint8_t> huge_count = control::encodeFrame(control::FailureReport{"", {}});
  setU32(huge_count, control::kFrameHeaderBytes + 4, 0xffffffffu);
  EXPECT_EQ(decode(huge_count), control::DecodeResult::kError);
  // An enum out of range, a bool that is neither 0 nor 1.
  std::vector<uint8_t> ack = control::encodeFrame(control::ProposeRequest{1, "", false, {}});
  ack[control::kFrameHeaderBytes + 8 + 4] = 2;  // activate
  EXPECT_EQ(decode(ack), control::DecodeResult::kError);
  std::vector<uint8_t> push = control::encodeFrame(control::SyncReply{1, {}, std::nullopt});
  push[control::kFrameHeaderBytes + 8] = 7;  // status
  EXPECT_EQ(decode(push), control::DecodeResult::kError);

  // Random mutations and random bytes: any outcome but a crash; a frame
  // never claims more bytes than it was given.
  std::mt19937 random(12345);
  auto messages = sampleMessages();
  for (int round = 0; round < 20000; ++round) {
    std::vector<uint8_t> bytes = control::encodeFrame(messages[round % messages.size()]);
    int flips = 1 + static_cast<int>(random() % 4);
    for (int f = 0; f < flips; ++f) bytes[random() % bytes.size()] = static_cast<uint8_t>(random());
    if (random() % 3 == 0) bytes.resize(random() % (bytes.size() + 1));
    if (decode(bytes) == control::DecodeResult::kFrame) {
      EXPECT_LE(used, bytes.size());
    }
  }
  for (int round = 0; round < 20000; ++round) {
    std::vector<uint8_t> bytes(random() % 96);
    for (auto& b : bytes) b = static_cast<uint8_t>(random());
    if (round % 2 == 0 && bytes.size() >= control::kFrameHeaderBytes) {
      // A valid header over a random payload: exercises every message's reader.
      setU32(bytes, 0, control::kFrameMagic);
      setU32(bytes, 4, control::kProtocolVersion | static_cast<uint32_t>(random() % 13) << 16);
      setU32(bytes, 8, static_cast<uint32_t>(bytes.size() - control::kFrameHeaderBytes));
    }
    if (decode(bytes) == control::DecodeResult::kFrame) {
      EXPECT_LE(used, bytes.size());
    }
  }
  // A stream decoder stays failed after an error.
  control::FrameDecoder decoder;
  std::vector<uint8_t> junk = {1, 2, 3, 4, 5};
  decoder.append(junk.data(), junk.size());
  EXPECT_EQ(decoder.next(&m, &error), control::DecodeResult::kError);
  decoder.append(frame.data(), frame.size());
  EXPECT_EQ(decoder.next(&m, &error), control::DecodeResult::kError);
}

// ---------------------------------------------------------- reconciliation

std::vector<control::SeatHealth> allActiveOnline(int n) {
  return std::vector<control::SeatHealth>(static_cast<size_t>(n), control::SeatHealth{true, true});
}

TEST(ControlReconciliation, WitnessedSeatsGoMutualAccusationsCostOneSeat) {
  // 0 reports 2: 0 is not reported, so 2 goes.
  EXPECT_EQ(control::seatsToDeactivate(allActiveOnline(4), {{0, {2}}}), std::vector<int>{2});
  // 1 and 2 report each other: only the higher goes.
  EXPECT_EQ(control::seatsToDeactivate(allActiveOnline(4), {{1, {2}}, {2, {1}}}), std::vector<int>{2});
  // A cycle 0 -> 1 -> 2 -> 0: the highest.
  EXPECT_EQ(control::seatsToDeactivate(allActiveOnline(4), {{0, {1}}, {1, {2}}, {2, {0}}}), std::vector<int>{2});
  // 1 <-> 2 and 3 (a clean witness) reports 2: 2 goes, 1 stays.
  EXPECT_EQ(control::seatsToDeactivate(allActiveOnline(4), {{1, {2}}, {2, {1}}, {3, {2}}}), std::vector<int>{2});
  // 0 and 1 both report 3: 3 goes alone.
  EXPECT_EQ(control::seatsToDeactivate(allActiveOnline(4), {{0, {3}}, {1, {3}}}), std::vector<int>{3});
  // Offline Active seats go even without reports; reports from Inactive
  // reporters and about Inactive seats count for nothing.
  auto seats = allActiveOnline(4);
  seats[1].online = false;
  seats[3].active = false;
  EXPECT_EQ(control::seatsToDeactivate(seats, {{3, {0}}, {0, {3}}}), std::vector<int>{1});
  EXPECT_TRUE(control::seatsToDeactivate(allActiveOnline(2), {}).empty());
}

// ---------------------------------------------- the state machine alone


TEST(ControlCoordinatorState, ProposalsQueueBehindTheBarrierInFlight) {
  StateMachine machine;
  machine.found("q", 3);
  // Seat 1 proposes to deactivate seat 2: epoch 2 goes to all three, and
  // the answer waits for their acknowledgements.
  auto first = machine.send(2, control::ProposeRequest{10, "q", false, {2}});
  auto pushes = StateMachine::sent<control::ViewPush>(first);
  ASSERT_EQ(pushes.size(), 3u);
  EXPECT_EQ(pushes[0].second.view.epoch, 2u);
  EXPECT_TRUE(StateMachine::sent<control::ProposeReply>(first).empty());
  // A second proposal waits its turn: nothing happens yet.
  auto second = machine.send(1, control::ProposeRequest{11, "q", false, {1}});
  EXPECT_TRUE(second.sends.empty());
  machine.send(1, control::ViewAck{"q", 2});
  machine.send(2, control::ViewAck{"q", 2});
  // The last acknowledgement answers the first and admits the second.
  auto next = machine.send(3, control::ViewAck{"q", 2});
  auto replies = StateMachine::sent<control::ProposeReply>(next);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].first, 2u);
  EXPECT_EQ(replies[0].second.request_id, 10u);
  EXPECT_EQ(replies[0].second.response.status, ProposalStatus::Applied);
  EXPECT_EQ(replies[0].second.response.new_epoch, 2);
  pushes = StateMachine::sent<control::ViewPush>(next);
  ASSERT_EQ(pushes.size(), 3u);  // seat 2 is Inactive but still hears about the group
  EXPECT_EQ(pushes[0].second.view.epoch, 3u);
  EXPECT_EQ(pushes[0].second.view.activeRanks(), std::vector<int>{0});
  // Its barrier covers the old and new active sets (seats 0 and 1), not seat 2.
  machine.send(1, control::ViewAck{"q", 3});
  auto done = machine.send(2, control::ViewAck{"q", 3});
  replies = StateMachine::sent<control::ProposeReply>(done);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].second.request_id, 11u);
  EXPECT_EQ(replies[0].second.response.new_epoch, 3);
}

// Link evidence: seats 0 and 1 found the group (3 seats), global rank 2
// joins seat 2; everyone reports links. Session 1 proposes the activation.
class LinkEvidence : public ::testing::Test {
 protected:
  void SetUp() override {
    machine.found("l", 2, 3, /*reports_links=*/true);
    machine.join("l", 2, 3, /*reports_links=*/true);
  }
  control::Effects report(int global_rank, std::vector<int32_t> reached, std::vector<int32_t> unreached = {}) {
    return machine.send(global_rank + 1, control::LinkReport{"l", std::move(reached), std::move(unreached)});
  }
  static std::optional<control::ProposeReply> answer(const control::Effects& effects) {
    auto replies = StateMachine::sent<control::ProposeReply>(effects);
    if (replies.empty()) return std::nullopt;
    return replies[0].second;
  }
  static bool activated(const control::Effects& effects) {
    for (const auto& [to, push] : StateMachine::sent<control::ViewPush>(effects)) {
      if (push.view.isActive(2)) return true;
    }
    return false;
  }
  StateMachine machine;
};

TEST_F(LinkEvidence, ActivationWaitsUntilTheJoinerIsConnectedBothWays) {
  EXPECT_EQ(machine.rankState(2), RankState::kSynced);  // AwaitingActivation, no evidence yet
  EXPECT_EQ(machine.rankState(0), RankState::kHealthy);
  EXPECT_EQ(machine.rankState(7), RankState::kOffline);
  auto proposed = machine.send(1, control::ProposeRequest{10, "l", true, {2}});
  EXPECT_FALSE(answer(proposed) || activated(proposed));
  // One direction of each pair is not enough.
  auto half = report(2, {0, 1});
  EXPECT_FALSE(answer(half) || activated(half));
  EXPECT_EQ(machine.rankState(2), RankState::kSynced);
  auto three_quarters = report(0, {2});
  EXPECT_FALSE(answer(three_quarters) || activated(three_quarters));
  // The last missing link admits it: the new view shows seat 2 Active.
  auto complete = report(1, {2});
  EXPECT_TRUE(activated(complete));
  EXPECT_EQ(machine.rankState(2), RankState::kHealthy);
}

TEST_F(LinkEvidence, ALinkReportedUnreachableRejectsTheActivationAtOnceWithTheReason) {
  report(2, {0, 1});
  report(0, {2});
  report(1, {}, {2});  // seat 1 cannot reach the joiner's endpoint
  auto proposed = machine.send(1, control::ProposeRequest{10, "l", true, {2}});
  auto reply = answer(proposed);
  ASSERT_TRUE(reply.has_value());
  EXPECT_FALSE(activated(proposed));
  EXPECT_EQ(reply->response.status, ProposalStatus::Rejected);
  const std::string& why = reply->response.reject_reason;
  EXPECT_NE(why.find("not be connected both ways"), std::string::npos) << why;
  EXPECT_NE(why.find("unreachable: 1->2"), std::string::npos) << why;
  EXPECT_NE(why.find("seat 2 (global rank 2) is Synced"), std::string::npos) << why;
}

TEST_F(LinkEvidence, MissingEvidenceRejectsTheActivationAtTheLinkTimeout) {
  report(2, {0, 1});
  report(0, {2});  // seat 1 never reports
  auto proposed = machine.send(1, control::ProposeRequest{10, "l", true, {2}});
  EXPECT_FALSE(answer(proposed));
  EXPECT_FALSE(answer(machine.advance(400ms)));  // link_timeout is 500 ms
  auto expired = machine.advance(200ms);
  auto reply = answer(expired);
  ASSERT_TRUE(reply.has_value());
  EXPECT_FALSE(activated(expired));
  EXPECT_EQ(reply->response.status, ProposalStatus::Rejected);
  EXPECT_NE(reply->response.reject_reason.find("no link evidence within link_timeout (500 ms) for 1->2"),
            std::string::npos)
      << reply->response.reject_reason;
}

TEST_F(LinkEvidence, EvidenceAboutASeatIsForgottenWhenAnotherProcessTakesIt) {
  report(2, {0, 1});
  report(0, {2});
  report(1, {2});
  EXPECT_EQ(machine.rankState(2), RankState::kHealthy);
  machine.disconnect(3);  // the joiner dies before anyone activates it
  EXPECT_EQ(machine.rankState(2), RankState::kOffline);
  machine.join("l", 2, 3, /*reports_links=*/true, /*session=*/4);  // its replacement
  EXPECT_EQ(machine.rankState(2), RankState::kSynced);
  auto proposed = machine.send(1, control::ProposeRequest{10, "l", true, {2}});
  EXPECT_FALSE(answer(proposed) || activated(proposed));  // the old process's links prove nothing
  machine.send(4, control::LinkReport{"l", {0, 1}, {}});     // the replacement's own
  report(0, {2});
  EXPECT_TRUE(activated(report(1, {2})));
}

TEST_F(LinkEvidence, ProcessesThatDoNotReportLinksAreActivatedWithoutEvidence) {
  StateMachine plain;
  plain.found("p", 2, 3);
  plain.join("p", 2, 3, /*reports_links=*/false);
  auto proposed = plain.send(1, control::ProposeRequest{10, "p", true, {2}});
  EXPECT_TRUE(activated(proposed));
}

}  // namespace
}  // namespace mooncake::pg
