// Wire format of TCP transport data connections (opened with kTcpDataMagic).
// A connection carries any number of requests, one at a time:
//
//   WRITE: client sends DataHeader + `length` payload bytes; server applies
//          them and answers DataStatus (after the last byte is in place, so
//          success means the data is in the target's memory).
//   READ:  client sends DataHeader; server answers DataStatus and, when it is
//          kOk, `length` payload bytes.
//   WRITE with a trailer (opcode kWireWriteWithTrailer): as WRITE, the
//          payload followed by TrailerHeader + its bytes; once the payload
//          is in place the server answers, and then (if it answered kOk)
//          writes the trailer.
//
// The server checks every range against its registered regions; a rejected
// WRITE's payload is still consumed so the connection stays usable.
#pragma once

#include <cstdint>

namespace mooncake::te::tcp {

constexpr uint32_t kRequestMagic = 0x3144434d;  // "MCD1"
constexpr uint32_t kStatusMagic = 0x3153434d;   // "MCS1"

// Opcodes on the wire: Opcode's values, and this one.
constexpr uint8_t kWireWriteWithTrailer = 2;

struct DataHeader {
  uint32_t magic = kRequestMagic;
  uint8_t opcode = 0;  // Opcode, or kWireWriteWithTrailer
  uint8_t reserved[3] = {0, 0, 0};
  uint64_t addr = 0;    // target virtual address
  uint64_t length = 0;  // bytes
};
static_assert(sizeof(DataHeader) == 24);

struct TrailerHeader {
  uint64_t addr = 0;    // target virtual address of the trailer
  uint32_t length = 0;  // at most kMaxTrailerBytes
  uint32_t reserved = 0;
};
static_assert(sizeof(TrailerHeader) == 16);

struct DataStatus {
  uint32_t magic = kStatusMagic;
  int32_t code = 0;  // ErrorCode
};
static_assert(sizeof(DataStatus) == 8);

}  // namespace mooncake::te::tcp
