// Wire format of TCP transport data connections (opened with kTcpDataMagic).
// A connection carries any number of requests, one at a time:
//
//   WRITE: client sends DataHeader + `length` payload bytes; server applies
//          them and answers DataStatus (after the last byte is in place, so
//          success means the data is in the target's memory).
//   READ:  client sends DataHeader; server answers DataStatus and, when it is
//          kOk, `length` payload bytes.
//
// The server checks every range against its registered regions; a rejected
// WRITE's payload is still consumed so the connection stays usable.
#pragma once

#include <cstdint>

namespace mooncake::te::tcp {

constexpr uint32_t kRequestMagic = 0x3144434d;  // "MCD1"
constexpr uint32_t kStatusMagic = 0x3153434d;   // "MCS1"

struct DataHeader {
  uint32_t magic = kRequestMagic;
  uint8_t opcode = 0;  // Opcode
  uint8_t reserved[3] = {0, 0, 0};
  uint64_t addr = 0;    // target virtual address
  uint64_t length = 0;  // bytes
};
static_assert(sizeof(DataHeader) == 24);

struct DataStatus {
  uint32_t magic = kStatusMagic;
  int32_t code = 0;  // ErrorCode
};
static_assert(sizeof(DataStatus) == 8);

}  // namespace mooncake::te::tcp
