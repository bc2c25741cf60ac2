// Expert-parallel low-latency dispatch and combine between the processes of
// one host, over CUDA IPC, ordered on the caller's stream. Torch-free: every
// tensor is a device pointer with the layout written next to it. Several
// ranks may share one GPU (the tests run that way).
//
// Semantics are those of the collective path (docs/ep.md): rows of a local
// expert are ordered by source rank, then token index at the source; FP8 is
// e4m3 with one float32 scale per token per 128 channels; combine weights at
// the token's rank in float32, one pick after another in top-k order, and
// rounds to bf16 once. The two paths agree bit for bit. Design, layouts and
// signals: docs/ep-kernels.md.
//
// Every rank owns one receive region in device memory, exported with CUDA
// IPC and mapped by every peer; senders write rows straight into the
// destination's region and then raise a signal word that carries the call's
// sequence number (release); receivers wait for it (acquire), bounded by the
// call's timeout, and mask a source that does not come in time.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "mooncake/ep/cuda/elastic_layout.h"

namespace mooncake::ep::cuda {

constexpr int kMaxEpRanks = 32;  // ranks of one group on one host (kernel arguments hold a pointer per rank)

struct EpIpcGroupOptions {
  int max_tokens_per_rank = 0;  // T: the most tokens one rank dispatches in one call
  int hidden = 0;               // H: a multiple of 128
  int num_experts = 0;          // E: a multiple of the number of ranks
  int device = -1;              // CUDA ordinal in this process; -1: the current device
  // How long open() and the destructor wait for the peers.
  std::chrono::milliseconds attach_timeout{std::chrono::seconds(60)};
  // Bit r: rank r takes no part (its process is gone before the group was
  // opened). The others neither wait for it nor map its region, and it is
  // departed from the start, so every call leaves it out. Every rank that
  // opens must pass the same bits; its own may not be among them.
  uint32_t absent = 0;
  // Output slots in the receive region (DirectHeads): buffers of R * T rows
  // of up to 2 H bytes that the caller hands out as dispatch outputs, and
  // into which the senders write each row's head in its final place, so a
  // row crosses once instead of twice. Only with one local expert per rank
  // (num_experts == number of ranks). Every rank must pass the same count.
  int output_slots = 0;
};

// Device bytes of one rank's receive region for these sizes (both parities).
size_t epReceiveRegionBytes(int max_tokens_per_rank, int hidden, int num_experts, int num_ranks, int output_slots = 0);

// Rows as bytes in two parts, instead of bf16 [H] tokens from x: a caller
// whose rows carry more than a token (ElasticBuffer's: payload, then FP8
// scales, top-k ids and weights) sends each part from where it already is,
// with no staging copy of the payload, and receives each part at its own row
// stride. A message holds head then tail; bytes past them are not moved.
struct ByteRows {
  bool enabled = false;
  size_t head_bytes = 0;       // of each row of x, which is also x's row stride; may be 0 (no x)
  const void* tail = nullptr;  // [num_tokens, tail_bytes]
  size_t tail_bytes = 0;       // both sizes multiples of 16, head_bytes + tail_bytes <= 2 H
  void* recv_tail = nullptr;   // [L, S, tail_bytes]; recv_x is then [L, S, head_bytes]
  // Rows [count, zeroed_rows) of each local expert are zeroed in recv_x and
  // recv_tail (the rows of a caller's output past those received; 0: none).
  int zeroed_rows = 0;
};

// Heads straight into the destination's output slot (one local expert per
// rank, byte rows): each destination d published the slot its rows go to,
// and every rank its counts per destination, in the row the caller gathered
// to every rank before this call (ElasticBuffer's counts row: int32 words,
// counts[0, R), the slot at `slot_word`). A sender places its n-th row to d at
// row begin + n of d's slot, begin = the rows of the sources before it (each
// count clamped to T), which is where d's layout puts it, and says so in the
// row's header: the copy phase then moves only the tails of such rows. It
// does so only while every rank's counts reached it and it gives up on no
// rank; a destination offers its slot only while it hears every rank (else
// publishes -1, as when it has no free slot), and then gets its rows through
// its region as before. docs/ep-kernels.md says what a loss within a call
// still does.
struct DirectHeads {
  const int32_t* gathered = nullptr;         // null: no direct heads this call
  int gathered_stride = 0;                   // int32 words per gathered row
  const int64_t* gathered_ranges = nullptr;  // [R]: (row << 32) | count of each source's gathered row
  int slot_word = 0;                         // word of a gathered row holding that rank's slot (or -1)
  int own_slot = -1;                         // this rank's published slot: recv_x is that slot (-1: none)
};

// A small row (a multiple of 16 bytes, at most kCarriedRowBytes) that a
// dispatch carries to every rank with its signals, and every rank's as this
// rank received it: ElasticBuffer's counts per rank and the call's shape,
// which then need no gather of their own before the call, a cross-rank round
// trip fewer (as DeepEP's low-latency mode sends its counts with the data).
// Not with DirectHeads, whose senders need the counts before they send.
// A call enqueued in halves (EpStages) passes the same `carried` to both:
// the send half sends `mine`, the receive half fills `received` and `ranges`.
struct CarriedRows {
  const void* mine = nullptr;  // null: the call carries no row
  int bytes = 0;
  void* received = nullptr;   // [R][bytes]: source s's row at row s, zeros where s was not heard
  int64_t* ranges = nullptr;  // [R]: (s << 32) | 1 where s was heard, (s << 32) | 0 where not
};

// ElasticBuffer's byte rows built by the send blocks from the caller's own
// inputs rather than from layoutSend's outputs (dest, pick_slots, the staged
// tails): each block finds the tokens that go to its rank in the picks (a
// pick's rank is its id / picks_per_rank), counts their slots itself and
// writes each row's tail from `tail`'s sources as it sends it. Its rows then
// need nothing of layoutSend, which a call that follows it
// (DispatchArgs::follows_layout_send) runs beside; the send blocks wait for
// it before the carried row (its counts row) and their signals. One local
// expert per rank (E = R) only; not with DirectHeads.
struct OwnSendInputs {
  const int64_t* picks = nullptr;  // [num_tokens, num_topk] global expert ids (-1: none); null: not used
  int picks_per_rank = 0;          // experts per rank of those ids
  SendTailArgs tail;               // the tail's sources; its `tail` (the staged copy) is not read
};

// Inputs and outputs of dispatch, all in device memory of the group's device.
// L = E / R local experts, S = R * T rows per local expert.
struct DispatchArgs {
  const void* x = nullptr;            // bf16 [num_tokens, H]
  const int64_t* topk_idx = nullptr;  // [num_tokens, num_topk], entries in [-1, E); -1 = no expert
  int num_tokens = 0;                 // <= T
  int num_topk = 0;
  int32_t* active_ranks = nullptr;  // [R], read and updated: a source that times out is set to 0
  int64_t timeout_us = -1;          // -1: wait as long as the peer process lives
  bool use_fp8 = false;
  void* recv_x = nullptr;          // bf16 [L, S, H], or with use_fp8 e4m3 bytes [L, S, H]
  float* recv_scales = nullptr;    // use_fp8 only: float32 stored as [L, H / 128, S]
  int32_t* recv_count = nullptr;   // [L]
  int32_t* src_info = nullptr;     // [L, S]: token index at the source rank; -1 past the count
  int64_t* layout_range = nullptr;  // [L, R]: (begin << 32) | count of each source's rows
  ByteRows bytes;                   // enabled: x and recv_x as its fields say (not with use_fp8)
  // [num_tokens, num_topk] or null: each pick's slot at its expert, the
  // token's index among this rank's tokens that picked the expert, in token
  // order (-1 for a -1 pick). A caller that has them (ElasticBuffer's layout
  // kernels) spares the send blocks counting the tokens before their own.
  const int32_t* pick_slots = nullptr;
  DirectHeads direct;  // with bytes and pick_slots only
  CarriedRows carried;
  // ElasticBuffer's layout of the rows received (elastic_layout.h), made by
  // the call's copy blocks as they copy each row instead of by a
  // layoutReceive launch after the call. Byte rows with one local expert
  // per rank only; its capacity at most R * T (the rows past it are not
  // laid out), its tail_bytes bytes.tail_bytes. Its ranges, src_token, recv_tail and rank
  // are this call's (layout_range, src_info, bytes.recv_tail, the group's
  // rank): the group sets them.
  bool with_receive_layout = false;
  ReceiveLayoutArgs receive_layout;
  // The call is enqueued straight after ElasticBuffer's layoutSend on the
  // same stream, nothing between them: its first launch may then start while
  // that kernel ends (programmatic dependent launch, on sm_90 and later),
  // its blocks taking the call's number before they wait for the layout.
  // Never after another call of the group: that number is what such a call
  // leaves when it completes.
  bool follows_layout_send = false;
  OwnSendInputs own_send;  // with byte rows and carried counts only
};

// Inputs and outputs of combine. y, src_info and layout_range are in the row
// order of the dispatch they answer; topk_idx is the one that dispatch sent.
struct CombineArgs {
  const void* y = nullptr;  // bf16 [L, S, H]: expert outputs (rows past each count are never read)
  const int32_t* src_info = nullptr;
  const int64_t* layout_range = nullptr;
  const int64_t* topk_idx = nullptr;      // [num_tokens, num_topk]
  const float* topk_weights = nullptr;    // [num_tokens, num_topk]
  int num_tokens = 0;
  int num_topk = 0;
  int32_t* active_ranks = nullptr;
  int64_t timeout_us = -1;
  void* out = nullptr;  // bf16 [num_tokens, H]
  // bf16 channels of y's and out's rows, which are also their row strides (a
  // multiple of 8, at most H): a caller whose tokens are narrower than the
  // group's H moves and adds only those. 0: H.
  int channels = 0;
};

// Which kernels of a call to enqueue. kAll: the whole call. kSendOnly then,
// later, kReceiveOnly with the same arguments: the call in two halves, so
// that computation can run while the rows travel (the reference's
// return_recv_hook). At most two calls of a kind may be sent and not yet
// received (the region has two halves, by call parity).
enum class EpStages { kAll, kSendOnly, kReceiveOnly };

class EpIpcGroup {
 public:
  // Collective: rank 0 creates the control block `name` (a POSIX shm name,
  // "/..."), every rank allocates and exports its receive region and maps
  // every peer's. Returns null and sets *error when that fails. Every rank
  // must pass the same sizes.
  static std::unique_ptr<EpIpcGroup> open(const std::string& name, int rank, int num_ranks,
                                          const EpIpcGroupOptions& options, std::string* error);
  // Collective when the peers are alive (bounded by attach_timeout): waits
  // for this rank's work on the device, then for every live peer, so that no
  // peer writes into a region being freed.
  ~EpIpcGroup();
  EpIpcGroup(const EpIpcGroup&) = delete;
  EpIpcGroup& operator=(const EpIpcGroup&) = delete;

  int rank() const;
  int numRanks() const;
  int device() const;
  const EpIpcGroupOptions& options() const;

  // Enqueue on `stream`; nothing blocks the host, and nothing the host
  // passes changes from call to call but the arguments: the kernels number
  // the calls themselves, in device memory, so a captured CUDA graph can be
  // replayed. Every rank must issue the same sequence of dispatch and
  // combine calls (the n-th calls of all ranks pair up). Returns false with
  // *error when the arguments are invalid (nothing is enqueued then) or a
  // launch failed.
  bool dispatch(const DispatchArgs& args, cudaStream_t stream, std::string* error,
                EpStages stages = EpStages::kAll);
  bool combine(const CombineArgs& args, cudaStream_t stream, std::string* error, EpStages stages = EpStages::kAll);

  // Releases every wait of this rank's kernels, now and later: they treat
  // every peer they still wait for as timed out. For a caller that gives up
  // on a call with timeout_us = -1.
  void abortWaits();

  // The output slots (EpIpcGroupOptions::output_slots): slot i's device
  // address, and its bytes. `lease()` keeps the region's memory allocated
  // after the group closes, as long as a copy lives: outputs handed out in
  // slots may outlive the group (the peers' mappings still close with it).
  int outputSlots() const;
  size_t outputSlotBytes() const;
  void* outputSlot(int slot) const;
  std::shared_ptr<void> lease() const;

  struct State;

 private:
  explicit EpIpcGroup(std::unique_ptr<State> state);
  // Runs `launch` (one call's kernels) unless the group is broken; a failed
  // launch breaks it. Returns "" or why not.
  std::string enqueueCall(const std::function<cudaError_t()>& launch);
  std::unique_ptr<State> state_;
};

}  // namespace mooncake::ep::cuda
