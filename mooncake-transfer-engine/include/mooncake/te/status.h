// Return codes of the transfer engine and the per-request transfer states.
//
// The numbering follows the reference engine's public convention (0 success,
// small negative numbers for argument and registration errors, -10x for
// network and handshake errors, -20x for metadata) so that callers written
// against it interpret our results the same way.
#pragma once

#include <cstdint>

namespace mooncake::te {

enum ErrorCode : int {
  kOk = 0,
  kInvalidArgument = -1,
  kTooManyRequests = -2,
  kAddressNotRegistered = -3,
  kBatchBusy = -4,
  kDeviceNotFound = -6,
  kAddressOverlapped = -7,
  kNotInitialized = -9,          // a call that needs initialize() came first
  kDnsFailed = -100,
  kSocketFailed = -101,
  kMalformedMessage = -102,
  kHandshakeRejected = -103,
  kTimeout = -104,               // a bounded wait expired
  kPeerUnreachable = -105,       // connect refused / peer process gone
  kCanceled = -106,              // ours: the submitter canceled the request (cancelBatch)
  kMetadataError = -200,
  kEndpointError = -201,
  kNotImplemented = -303,
};

const char* errorName(int code);

// State of one request (task) or of a whole batch.
enum class TransferState : uint8_t {
  kWaiting = 0,   // allocated, not yet submitted
  kPending = 1,   // submitted, in flight
  kInvalid = 2,
  kCanceled = 3,
  kCompleted = 4,
  kTimeout = 5,
  kFailed = 6,
};

inline bool isTerminal(TransferState s) {
  return s == TransferState::kCompleted || s == TransferState::kTimeout ||
         s == TransferState::kFailed || s == TransferState::kCanceled ||
         s == TransferState::kInvalid;
}

struct TransferStatus {
  TransferState state = TransferState::kWaiting;
  uint64_t transferred_bytes = 0;
  int error = kOk;  // why a task failed (ErrorCode), kOk otherwise
  // Ours: every byte of the request (its trailer included) was handed to the
  // network, while the peer's answer may still be due (state kPending). Only
  // tcp says so before the end; elsewhere it comes with kCompleted. A caller
  // that needs the bytes out but not their landing (a message whose loss is
  // learned later anyway) may go on here instead of waiting a round trip for
  // the answer; it must still keep the source valid and reap the request,
  // whose failure is reported as before.
  bool sent = false;
};

}  // namespace mooncake::te
