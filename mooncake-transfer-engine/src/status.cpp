#include "mooncake/te/status.h"

namespace mooncake::te {

const char* errorName(int code) {
  switch (code) {
    case kOk: return "ok";
    case kInvalidArgument: return "invalid argument";
    case kTooManyRequests: return "too many requests for the batch";
    case kAddressNotRegistered: return "address not registered";
    case kBatchBusy: return "batch busy";
    case kDeviceNotFound: return "device not found";
    case kAddressOverlapped: return "address overlaps a registered region";
    case kNotInitialized: return "engine not initialized";
    case kDnsFailed: return "host name resolution failed";
    case kSocketFailed: return "socket error";
    case kMalformedMessage: return "malformed message";
    case kHandshakeRejected: return "handshake rejected";
    case kTimeout: return "timed out";
    case kPeerUnreachable: return "peer unreachable";
    case kCanceled: return "canceled";
    case kMetadataError: return "metadata error";
    case kEndpointError: return "endpoint error";
    case kNotImplemented: return "not implemented";
    default: return "unknown error";
  }
}

}  // namespace mooncake::te
