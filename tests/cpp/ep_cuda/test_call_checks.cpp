// The host-side rules of a dispatch that lays out the rows it receives
// (DispatchArgs::receive_layout, call_checks.cpp), on the host: a call as
// ElasticBuffer makes it passes, an empty one too, and each rule broken on
// its own is refused, naming receive_layout.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>

#include "call_checks.h"

namespace mooncake::ep::cuda {
namespace {

// Addresses are never dereferenced by the checks: distinct aligned stand-ins.
template <typename T>
T* fake(uintptr_t n) {
  return reinterpret_cast<T*>(n * 256);
}

// ElasticBuffer's rows call at world 2, 128 tokens (T) of 8 picks at H = 4096, 128 local experts, 64-byte tails.
struct ElasticCall {
  RegionLayout layout = RegionLayout::make(128, 4224, 2, 2, 2);  // rows of up to 2 H bytes: 8192 + 64
  DispatchArgs args;

  ElasticCall() {
    args.num_tokens = 128;
    args.num_topk = 8;
    args.x = fake<const void>(1);
    args.topk_idx = fake<const int64_t>(2);
    args.active_ranks = fake<int32_t>(3);
    args.recv_x = fake<void>(4);
    args.recv_count = fake<int32_t>(5);
    args.src_info = fake<int32_t>(6);
    args.layout_range = fake<int64_t>(7);
    args.bytes = ByteRows{true, 8192, fake<const void>(8), 64, fake<void>(9), 256};
    args.pick_slots = fake<const int32_t>(10);
    args.with_receive_layout = true;
    ReceiveLayoutArgs& r = args.receive_layout;
    r.topk_idx = fake<const int64_t>(11);
    r.token_index = fake<const int32_t>(12);
    r.gathered = fake<const int32_t>(13);
    r.gathered_stride = 12;
    r.gathered_ranges = fake<const int64_t>(14);
    r.num_tokens = 128;
    r.tail_bytes = 64;
    r.ids_at = 0;
    r.weights_at = 32;
    r.capacity = 256;
    r.num_topk = 8;
    r.num_local = 128;
    r.num_ranks = 2;
    r.tokens_per_rank = 128;
    r.slots = fake<int32_t>(15);
    r.real = fake<bool>(16);
    r.local = fake<int64_t>(17);
    r.weights = fake<float>(18);
    r.metadata = fake<int32_t>(19);
    r.per_expert = fake<int64_t>(20);
    r.expert_psum = fake<int32_t>(21);
    r.scaleup_psum = fake<int32_t>(22);
    r.finished_blocks = fake<unsigned long long>(23);
  }

  std::string check() const { return checkDispatchCall(args, layout); }
};

// The call `setUp` makes (null: the plain ElasticCall), then `breaks`, is
// refused, with `words` in the reason; `what` names the case in a failure.
void expectRefused(void (*setUp)(ElasticCall&), const char* what, const std::function<void(ElasticCall&)>& breaks,
                   const char* words) {
  ElasticCall call;
  if (setUp != nullptr) setUp(call);
  breaks(call);
  const std::string why = call.check();
  EXPECT_NE(why.find(words), std::string::npos) << what << ": " << why;
}

TEST(EpCallChecks, AnElasticBufferRowsCallThatLaysOutItsRowsPasses) {
  ElasticCall call;
  EXPECT_EQ(call.check(), "");
  call.args.receive_layout.capacity = 2 * 100;  // a call of fewer tokens than the group's
  EXPECT_EQ(call.check(), "");
}

TEST(EpCallChecks, ARankWithNoTokensPassesWithoutSlots) {
  // Its slots tensor has no elements, so its address is null.
  ElasticCall call;
  call.args.num_tokens = 0;
  call.args.receive_layout.num_tokens = 0;
  call.args.receive_layout.slots = nullptr;
  call.args.receive_layout.topk_idx = nullptr;
  call.args.receive_layout.token_index = nullptr;
  EXPECT_EQ(call.check(), "");
}

TEST(EpCallChecks, EachReceiveLayoutRuleBrokenAloneIsRefused) {
  auto refused = [](const char* what, const std::function<void(ElasticCall&)>& breaks) {
    expectRefused(nullptr, what, breaks, "receive_layout");
  };
  refused("several local experts", [](ElasticCall& c) { c.layout = RegionLayout::make(128, 4224, 4, 2); });
  refused("capacity past R * T", [](ElasticCall& c) { c.args.receive_layout.capacity = 257; });
  refused("another tail", [](ElasticCall& c) { c.args.receive_layout.tail_bytes = 48; });
  refused("another token count", [](ElasticCall& c) { c.args.receive_layout.num_tokens = 127; });
  refused("another rank count", [](ElasticCall& c) { c.args.receive_layout.num_ranks = 3; });
  refused("no slots for picks", [](ElasticCall& c) { c.args.receive_layout.slots = nullptr; });
  refused("no metadata", [](ElasticCall& c) { c.args.receive_layout.metadata = nullptr; });
  refused("no gathered counts", [](ElasticCall& c) { c.args.receive_layout.gathered = nullptr; });
  refused("no per_expert", [](ElasticCall& c) { c.args.receive_layout.per_expert = nullptr; });
  refused("ids past the tail", [](ElasticCall& c) { c.args.receive_layout.ids_at = 40; });
  refused("more picks than a warp", [](ElasticCall& c) {
    c.args.num_topk = 33;
    c.args.receive_layout.num_topk = 33;
  });
  refused("not byte rows", [](ElasticCall& c) {
    c.args.bytes = ByteRows{};
    c.args.pick_slots = nullptr;
  });
}

// The call as ElasticBuffer makes it when its counts ride with the rows: a
// 16-word row (two ranks' counts, then the shape) in place of a gather.
void carryCounts(ElasticCall& call) {
  call.args.carried = CarriedRows{fake<const void>(24), 64, fake<void>(25), fake<int64_t>(26)};
}

TEST(EpCallChecks, ACallThatCarriesItsCountsPasses) {
  ElasticCall call;
  carryCounts(call);
  EXPECT_EQ(call.check(), "");
  call.args.carried.bytes = static_cast<int>(kCarriedRowBytes);  // the most a row holds
  EXPECT_EQ(call.check(), "");
}

TEST(EpCallChecks, EachRuleOfACarriedRowBrokenAloneIsRefused) {
  auto refused = [](const char* what, const std::function<void(ElasticCall&)>& breaks, const char* words) {
    expectRefused(carryCounts, what, breaks, words);
  };
  refused(
      "no bytes", [](ElasticCall& c) { c.args.carried.bytes = 0; }, "carried_bytes");
  refused(
      "not whole vectors", [](ElasticCall& c) { c.args.carried.bytes = 40; }, "carried_bytes");
  refused(
      "over the region's room", [](ElasticCall& c) { c.args.carried.bytes = kCarriedRowBytes + 16; }, "carried_bytes");
  refused(
      "nowhere to receive", [](ElasticCall& c) { c.args.carried.received = nullptr; }, "carried_received");
  refused(
      "no ranges", [](ElasticCall& c) { c.args.carried.ranges = nullptr; }, "carried_ranges");
  refused(
      "misaligned", [](ElasticCall& c) { c.args.carried.mine = reinterpret_cast<const void*>(24 * 256 + 4); },
      "aligned");
  refused(
      "misaligned received rows",
      [](ElasticCall& c) { c.args.carried.received = reinterpret_cast<void*>(25 * 256 + 8); }, "aligned");
  refused(
      "misaligned ranges", [](ElasticCall& c) { c.args.carried.ranges = reinterpret_cast<int64_t*>(26 * 256 + 4); },
      "aligned");
  refused(
      "outputs without a row", [](ElasticCall& c) { c.args.carried.mine = nullptr; }, "go with a carried row");
  refused(
      "with direct heads",
      [](ElasticCall& c) {
        c.args.direct = DirectHeads{fake<const int32_t>(27), 16, fake<const int64_t>(28), 2, -1};
      },
      "exclude each other");
}

// The call as ElasticBuffer makes it for a carried call of one layout tile:
// the send blocks build the rows from its picks and tail sources.
void sendFromOwnInputs(ElasticCall& call) {
  carryCounts(call);
  OwnSendInputs& o = call.args.own_send;
  o.picks = fake<const int64_t>(29);
  o.picks_per_rank = 128;
  o.tail.payload = fake<const void>(30);
  o.tail.payload_bytes = 8192;
  o.tail.head_bytes = 8192;
  o.tail.tail_bytes = 64;
  o.tail.ids_at = 8192;  // the 8 ids, then the 8 weights: the 64-byte tail
  o.tail.topk_idx = o.picks;
  o.tail.weights = fake<const float>(31);
  o.tail.num_tokens = 128;
  o.tail.num_topk = 8;
}

TEST(EpCallChecks, ACallThatSendsFromItsOwnInputsPasses) {
  ElasticCall call;
  sendFromOwnInputs(call);
  EXPECT_EQ(call.check(), "");
}

TEST(EpCallChecks, EachRuleOfOwnSendInputsBrokenAloneIsRefused) {
  auto refused = [](const char* what, const std::function<void(ElasticCall&)>& breaks, const char* words) {
    expectRefused(sendFromOwnInputs, what, breaks, words);
  };
  refused(
      "no ranks for the picks", [](ElasticCall& c) { c.args.own_send.picks_per_rank = 0; }, "picks_per_rank");
  refused(
      "another tail", [](ElasticCall& c) { c.args.own_send.tail.tail_bytes = 48; }, "tail_bytes");
  refused(
      "other picks", [](ElasticCall& c) { c.args.own_send.tail.num_topk = 7; }, "num_topk");
  refused(
      "ids past the tail", [](ElasticCall& c) { c.args.own_send.tail.ids_at = 8208; }, "out of range");
  refused(
      "no payload in a tail that holds it",
      [](ElasticCall& c) {
        c.args.own_send.tail.payload = nullptr;
        c.args.own_send.tail.head_bytes = 0;
        c.args.bytes.head_bytes = 0;
        c.args.bytes.tail_bytes = 8192 + 64;
        c.args.own_send.tail.tail_bytes = 8192 + 64;
        c.args.receive_layout.tail_bytes = 8192 + 64;
      },
      "payload");
  refused(
      "several local experts",
      [](ElasticCall& c) {
        c.layout = RegionLayout::make(128, 4224, 4, 2);
        c.args.with_receive_layout = false;  // which has the same rule
      },
      "one local expert per rank");
  refused(
      "not byte rows",
      [](ElasticCall& c) {
        c.args.bytes = ByteRows{};
        c.args.pick_slots = nullptr;
        c.args.with_receive_layout = false;
      },
      "byte rows");
}

}  // namespace
}  // namespace mooncake::ep::cuda
