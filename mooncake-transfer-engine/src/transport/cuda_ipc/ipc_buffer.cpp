#include "transport/cuda_ipc/ipc_buffer.h"

#include <cstdlib>

namespace mooncake::te {
namespace {

constexpr const char* kAttrHandle = "cuda_ipc.handle";
constexpr const char* kAttrBase = "cuda_ipc.allocation_base";
constexpr const char* kAttrSize = "cuda_ipc.allocation_size";
constexpr const char* kAttrDevice = "cuda_ipc.device";
constexpr const char* kAttrUuid = "cuda_ipc.device_uuid";

// Binary fields travel as hex: descriptors stay printable when debugging.
std::string toHex(const std::string& bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

bool fromHex(const std::string& hex, size_t bytes, std::string& out) {
  if (hex.size() != bytes * 2) return false;
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  out.assign(bytes, '\0');
  for (size_t i = 0; i < bytes; ++i) {
    int hi = digit(hex[2 * i]), lo = digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<char>(hi << 4 | lo);
  }
  return true;
}

bool number(const BufferDescriptor& b, const char* key, uint64_t& out) {
  auto it = b.attrs.find(key);
  if (it == b.attrs.end() || it->second.empty()) return false;
  char* end = nullptr;
  out = std::strtoull(it->second.c_str(), &end, 10);
  return *end == '\0';
}

bool text(const BufferDescriptor& b, const char* key, std::string& out) {
  auto it = b.attrs.find(key);
  if (it == b.attrs.end()) return false;
  out = it->second;
  return true;
}

}  // namespace

void CudaIpcBuffer::store(BufferDescriptor& buffer) const {
  buffer.attrs[kAttrHandle] = toHex(handle);
  buffer.attrs[kAttrBase] = std::to_string(allocation_base);
  buffer.attrs[kAttrSize] = std::to_string(allocation_size);
  buffer.attrs[kAttrDevice] = std::to_string(device);
  buffer.attrs[kAttrUuid] = toHex(device_uuid);
}

bool CudaIpcBuffer::load(const BufferDescriptor& buffer, CudaIpcBuffer& out) {
  CudaIpcBuffer b;
  std::string handle_hex, uuid_hex;
  uint64_t device = 0;
  if (!text(buffer, kAttrHandle, handle_hex) || !fromHex(handle_hex, kHandleBytes, b.handle)) return false;
  if (!text(buffer, kAttrUuid, uuid_hex) || !fromHex(uuid_hex, kUuidBytes, b.device_uuid)) return false;
  if (!number(buffer, kAttrBase, b.allocation_base) || !number(buffer, kAttrSize, b.allocation_size) ||
      !number(buffer, kAttrDevice, device) || device > 1023) {
    return false;
  }
  b.device = static_cast<int32_t>(device);
  // The buffer must lie inside the allocation, without overflow.
  if (b.allocation_base + b.allocation_size < b.allocation_base || buffer.addr < b.allocation_base ||
      buffer.length > b.allocation_size || buffer.addr - b.allocation_base > b.allocation_size - buffer.length) {
    return false;
  }
  out = std::move(b);
  return true;
}

}  // namespace mooncake::te
