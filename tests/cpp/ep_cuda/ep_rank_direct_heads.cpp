// Direct heads (DirectHeads, ep_ipc_group.h) in the call in which a source is
// given up on: the senders place their heads counting every source before
// them, the receiver lays out only those it still hears, and must still
// return every row of theirs in its place; and a source that comes late
// must not write into the outputs of the ranks that gave up on it.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "common/cuda_rank_helpers.h"
#include "ep_rank_scenarios.h"
#include "region_layout.h"

namespace mooncake::ep::cuda::testing {
namespace {

using mooncake::testing::DeviceBuffer;
using mooncake::testing::Stream;

constexpr int kTailBytes = 16;  // per row: int32 {source rank, token, call, marker}
constexpr int32_t kTailMarker = 0x7a11;

// counts[src][dest]: rows src sends dest (one expert per rank: tokens that picked dest).
std::vector<std::vector<int>> sendCounts(const Sizes& s, const std::vector<RankInputs>& all) {
  std::vector<std::vector<int>> counts(s.R, std::vector<int>(s.R, 0));
  for (int src = 0; src < s.R; ++src) {
    for (int t = 0; t < all[src].num_tokens; ++t) {
      for (int d = 0; d < s.R; ++d) counts[src][d] += picks(all[src], s, t, d);
    }
  }
  return counts;
}

// One dispatch of call `call` with heads straight into this rank's output
// slot 0, every rank's counts and slot given as if gathered from all of them
// (the victim's too: it published them, then died before sending). Checks
// the outputs against the rows of the ranks `heard` keeps.
// With `recheck`, the output slot is read again once it returns true.
int directCall(EpIpcGroup& g, const Sizes& s, uint64_t seed, int call, const std::vector<int>& heard,
               DeviceBuffer& active, cudaStream_t stream, const std::function<bool()>& recheck = nullptr) {
  int failures = 0;
  const int me = g.rank();
  std::vector<RankInputs> all;
  for (int r = 0; r < s.R; ++r) all.push_back(makeInputs(s, seed, r, call));
  const RankInputs& mine = all[me];
  const std::vector<std::vector<int>> counts = sendCounts(s, all);

  // Each pick's row among this rank's rows to its destination, in token order.
  std::vector<int32_t> pick_slots(mine.idx.size(), -1);
  std::vector<int> sent(s.R, 0);
  for (size_t p = 0; p < mine.idx.size(); ++p) {
    if (mine.idx[p] >= 0) pick_slots[p] = sent[mine.idx[p]]++;
  }
  std::vector<int32_t> tail(static_cast<size_t>(mine.num_tokens) * 4);
  for (int t = 0; t < mine.num_tokens; ++t) {
    const int32_t words[4] = {me, t, call, kTailMarker};
    std::memcpy(&tail[static_cast<size_t>(t) * 4], words, sizeof(words));
  }
  const int stride = s.R + 1;  // counts to each rank, then the rank's slot
  std::vector<int32_t> gathered(static_cast<size_t>(s.R) * stride, 0);
  std::vector<int64_t> ranges(s.R);
  for (int r = 0; r < s.R; ++r) {
    for (int d = 0; d < s.R; ++d) gathered[static_cast<size_t>(r) * stride + d] = counts[r][d];
    ranges[r] = static_cast<int64_t>(r) << 32 | stride;
  }

  // A row is at most 2H bytes: the head is the first head_bytes of each token's x.
  const size_t head_bytes = static_cast<size_t>(s.H) * 2 - 2 * kTailBytes;
  std::vector<uint8_t> x_heads(static_cast<size_t>(mine.num_tokens) * head_bytes);
  for (int t = 0; t < mine.num_tokens; ++t) {
    std::memcpy(&x_heads[t * head_bytes], &mine.x[static_cast<size_t>(t) * s.H], head_bytes);
  }
  DeviceBuffer x(static_cast<size_t>(s.T) * head_bytes), idx(static_cast<size_t>(s.T) * s.K * 8),
      slots(static_cast<size_t>(s.T) * s.K * 4), tail_in(static_cast<size_t>(s.T) * kTailBytes),
      recv_tail(static_cast<size_t>(s.S()) * kTailBytes), recv_count(4), src_info(static_cast<size_t>(s.S()) * 4),
      layout_range(static_cast<size_t>(s.R) * 8), gathered_dev(gathered.size() * 4), ranges_dev(ranges.size() * 8);
  if (mine.num_tokens > 0) {
    x.upload(x_heads, stream);
    idx.upload(mine.idx, stream);
    slots.upload(pick_slots, stream);
    tail_in.upload(tail, stream);
  }
  gathered_dev.upload(gathered, stream);
  ranges_dev.upload(ranges, stream);
  // Garbage where the kernels must write: a row left unwritten shows. The
  // slot is not cleared (a peer may already be placing heads there); it holds
  // the last call's rows, of other tokens.
  char* slot = static_cast<char*>(g.outputSlot(0));
  cudaMemsetAsync(recv_tail.get(), 0x5a, recv_tail.bytes(), stream);
  cudaMemsetAsync(src_info.get(), 0x5a, src_info.bytes(), stream);

  DispatchArgs d;
  d.x = x.get();
  d.topk_idx = reinterpret_cast<const int64_t*>(idx.get());
  d.num_tokens = mine.num_tokens;
  d.num_topk = s.K;
  d.active_ranks = reinterpret_cast<int32_t*>(active.get());
  d.timeout_us = 1'000'000;  // far above the ranks' start skew
  d.recv_count = reinterpret_cast<int32_t*>(recv_count.get());
  d.src_info = reinterpret_cast<int32_t*>(src_info.get());
  d.layout_range = reinterpret_cast<int64_t*>(layout_range.get());
  d.bytes.enabled = true;
  d.bytes.head_bytes = head_bytes;
  d.bytes.tail = tail_in.get();
  d.bytes.tail_bytes = kTailBytes;
  d.bytes.recv_tail = recv_tail.get();
  d.pick_slots = reinterpret_cast<const int32_t*>(slots.get());
  d.direct.gathered = reinterpret_cast<const int32_t*>(gathered_dev.get());
  d.direct.gathered_stride = stride;
  d.direct.gathered_ranges = reinterpret_cast<const int64_t*>(ranges_dev.get());
  d.direct.slot_word = s.R;
  d.direct.own_slot = 0;
  std::string error;
  RANK_CHECK(g.dispatch(d, stream, &error), "dispatch: %s", error.c_str());
  RANK_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "dispatch ran: %s", cudaGetErrorString(cudaGetLastError()));
  if (failures) return failures;

  const auto mask = active.download<int32_t>(s.R, stream);
  for (int r = 0; r < s.R; ++r) {
    RANK_CHECK((mask[r] != 0) == (heard[r] != 0), "call %d: active_ranks[%d] = %d", call, r, mask[r]);
  }
  const std::vector<Row> rows = expectedRows(s, all, heard, me, 0);
  const auto count = recv_count.download<int32_t>(1, stream);
  const auto info = src_info.download<int32_t>(s.S(), stream);
  const auto range = layout_range.download<int64_t>(s.R, stream);
  std::vector<uint8_t> heads(g.outputSlotBytes());
  cudaMemcpy(heads.data(), slot, heads.size(), cudaMemcpyDeviceToHost);
  const auto tails = recv_tail.download<int32_t>(static_cast<size_t>(s.S()) * 4, stream);
  RANK_CHECK(count[0] == static_cast<int>(rows.size()), "call %d: recv_count = %d, expected %zu", call, count[0],
             rows.size());
  int64_t begin = 0;
  for (int src = 0; src < s.R; ++src) {
    const int64_t n = heard[src] ? counts[src][me] : 0;
    RANK_CHECK(range[src] == (begin << 32 | n), "call %d: layout_range[%d] = %#llx, expected %#llx", call, src,
               static_cast<unsigned long long>(range[src]), static_cast<unsigned long long>(begin << 32 | n));
    begin += n;
  }
  auto check_heads = [&](const char* when) {
    for (size_t j = 0; j < rows.size() && failures < 20; ++j) {
      const Row& row = rows[j];
      const uint16_t* want = &all[row.src].x[static_cast<size_t>(row.token) * s.H];
      RANK_CHECK(std::memcmp(&heads[j * head_bytes], want, head_bytes) == 0,
                 "call %d: head of row %zu (rank %d token %d) differs %s", call, j, row.src, row.token, when);
    }
  };
  check_heads("when the dispatch returned");
  for (size_t j = 0; j < rows.size() && failures < 20; ++j) {
    const Row& row = rows[j];
    RANK_CHECK(info[j] == row.token, "call %d: src_info[%zu] = %d, expected %d", call, j, info[j], row.token);
    const int32_t want_tail[4] = {row.src, row.token, call, kTailMarker};
    RANK_CHECK(std::memcmp(&tails[j * 4], want_tail, sizeof(want_tail)) == 0,
               "call %d: tail of row %zu (rank %d token %d) is {%d, %d, %d, %#x}", call, j, row.src, row.token,
               tails[j * 4], tails[j * 4 + 1], tails[j * 4 + 2], tails[j * 4 + 3]);
  }
  // Evidence that the heads were placed directly: past the rows returned,
  // the slot still holds heads a sender placed counting the lost source.
  int placed_past_count = 0;
  int64_t sender_begin = 0;
  for (int src = 0; src < s.R; ++src) {
    const bool placed = heard[src] && src != me && call == 0;  // self rows go by reference; after the loss, none
    for (int n = 0; placed && n < counts[src][me]; ++n) {
      const int64_t at = sender_begin + n;
      if (at < static_cast<int64_t>(rows.size())) continue;
      int token = -1;  // the n-th of src's tokens that picked this rank
      for (int t = 0, seen = 0; t < all[src].num_tokens && token < 0; ++t) {
        if (picks(all[src], s, t, me) && seen++ == n) token = t;
      }
      const uint16_t* want = &all[src].x[static_cast<size_t>(token) * s.H];
      RANK_CHECK(std::memcmp(&heads[at * head_bytes], want, head_bytes) == 0,
                 "call %d: slot row %lld should hold rank %d's head %d, placed counting every source", call,
                 static_cast<long long>(at), src, n);
      ++placed_past_count;
    }
    sender_begin += counts[src][me];
  }
  std::fprintf(stderr, "rank %d: call %d: %zu rows, %d heads placed past them\n", me, call, rows.size(),
               placed_past_count);
  // The middle rank's later source placed its heads after the lost source's rows.
  const bool must_see_placed = call == 0 && me == 1 && counts[0][1] > 0 && counts[2][1] > 0;
  RANK_CHECK(!must_see_placed || placed_past_count > 0, "call %d: no head was placed directly", call);
  if (recheck) {  // the output, held, must not change while a late rank sends
    RANK_CHECK(recheck(), "call %d: the late rank's signal never came", call);
    cudaMemcpy(heads.data(), slot, heads.size(), cudaMemcpyDeviceToHost);
    check_heads("after the late rank's call");
  }
  return failures;
}

}  // namespace

// Rank 0 publishes its counts (as given to every rank) but never sends: the
// others give up on it within the call, while they placed their heads in
// each other's slot counting its rows. Every row must still land in its
// place (the middle rank also checks a head placed past its rows, the proof
// that heads were placed directly); the next call, with rank 0 given up on,
// goes through the region.
int directHeadsLossScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed) {
  int failures = 0;
  if (s.L != 1 || g.outputSlots() < 1) {
    std::fprintf(stderr, "direct_loss needs local_experts=1 and output_slots=1\n");
    return 1;
  }
  if (g.rank() == 0) return 0;  // closing waits for the others (no region freed under their writes)
  Stream stream;
  DeviceBuffer active(static_cast<size_t>(s.R) * 4);
  active.upload(std::vector<int32_t>(s.R, 1), stream);
  std::vector<int> heard(s.R, 1);
  heard[0] = 0;
  for (int call = 0; call < 2 && failures == 0; ++call) failures += directCall(g, s, seed, call, heard, active, stream);
  return failures;
}

// Rank 0 calls 2.5 s late: the others give up on it after 1 s and return
// their outputs without its rows. When it comes, it finds every rank's rows
// and counts row (their slots offered in them) as they sent them while it
// was active, but must not place its heads in their slots, where their
// outputs are: each still holds what it returned once rank 0's call raised
// its signal in their region (its rows, all sent, are before it).
int directHeadsLateScenario(EpIpcGroup& g, const Sizes& s, uint64_t seed) {
  if (s.L != 1 || g.outputSlots() < 1) {
    std::fprintf(stderr, "direct_late needs local_experts=1 and output_slots=1\n");
    return 1;
  }
  Stream stream;
  DeviceBuffer active(static_cast<size_t>(s.R) * 4);
  active.upload(std::vector<int32_t>(s.R, 1), stream);
  std::vector<int> heard(s.R, 1);
  if (g.rank() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    return directCall(g, s, seed, 0, heard, active, stream);
  }
  heard[0] = 0;
  // Rank 0's signal of call 0 in this rank's region (parity 1: the first sequence is 1).
  const RegionLayout lay = RegionLayout::make(s.T, s.H, s.E(), s.R, g.outputSlots());
  const char* region = static_cast<const char*>(g.outputSlot(0)) - lay.outputSlot(0);
  auto late_rank_sent = [&] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    uint64_t signal = 0;
    while (signal == 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      cudaMemcpy(&signal, region + lay.dispatchSignal(1, 0, 0), sizeof(signal), cudaMemcpyDeviceToHost);
    }
    // Its copies into the slot, if any, were ordered before that signal; a
    // little longer for a write that would race it anyway.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    return signal != 0;
  };
  return directCall(g, s, seed, 0, heard, active, stream, late_rank_sent);
}

}  // namespace mooncake::ep::cuda::testing
