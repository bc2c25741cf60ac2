#include "transport/rdma/rdma_wire.h"

#include "wire.h"

namespace mooncake::te::rdma {
namespace {

void writeGid(wire::Writer& w, const Gid& gid) { w.str(std::string(gid.raw.begin(), gid.raw.end())); }

bool readGid(wire::Reader& r, Gid& gid) {
  std::string bytes;
  if (!r.str(bytes) || bytes.size() != gid.raw.size()) return false;
  std::copy(bytes.begin(), bytes.end(), gid.raw.begin());
  return true;
}

void writeAddress(wire::Writer& w, const QpAddress& a) {
  w.u32(a.qp_num);
  w.u32(a.psn);
  w.u32(a.lid);
  writeGid(w, a.gid);
  w.u32(a.mtu);
}

bool readAddress(wire::Reader& r, QpAddress& a) {
  uint32_t lid = 0;
  if (!r.u32(a.qp_num) || !r.u32(a.psn) || !r.u32(lid) || !readGid(r, a.gid) || !r.u32(a.mtu)) return false;
  a.lid = static_cast<uint16_t>(lid);
  // 24-bit numbers, 16-bit LIDs, an MTU a port can have.
  return a.qp_num != 0 && a.qp_num < (1u << 24) && a.psn < (1u << 24) && lid <= 0xffff && a.mtu >= 256 &&
         a.mtu <= 4096 && (a.mtu & (a.mtu - 1)) == 0;
}

}  // namespace

std::string encodeDevices(const std::vector<DeviceAddress>& devices) {
  wire::Writer w;
  w.u32(static_cast<uint32_t>(devices.size()));
  for (const DeviceAddress& d : devices) {
    w.str(d.name);
    w.u8(d.ethernet ? 1 : 0);
    w.u32(d.lid);
    writeGid(w, d.gid);
    w.u32(d.mtu);
  }
  return w.take();
}

bool decodeDevices(const std::string& bytes, std::vector<DeviceAddress>& out) {
  wire::Reader r(bytes);
  uint32_t count = 0;
  if (!r.count(count, 1) || count > kMaxDevices) return false;
  std::vector<DeviceAddress> devices(count);
  for (DeviceAddress& d : devices) {
    uint8_t ethernet = 0;
    uint32_t lid = 0;
    if (!r.str(d.name) || !r.u8(ethernet) || ethernet > 1 || !r.u32(lid) || lid > 0xffff || !readGid(r, d.gid) ||
        !r.u32(d.mtu)) {
      return false;
    }
    d.ethernet = ethernet == 1;
    d.lid = static_cast<uint16_t>(lid);
  }
  if (!r.done()) return false;
  out = std::move(devices);
  return true;
}

namespace {

std::string encodeWords(const std::vector<uint32_t>& words) {
  wire::Writer w;
  w.u32(static_cast<uint32_t>(words.size()));
  for (uint32_t k : words) w.u32(k);
  return w.take();
}

bool decodeWords(const std::string& bytes, std::vector<uint32_t>& out) {
  wire::Reader r(bytes);
  uint32_t count = 0;
  if (!r.count(count, 4) || count > kMaxDevices) return false;
  std::vector<uint32_t> words(count);
  for (uint32_t& k : words) {
    if (!r.u32(k)) return false;
  }
  if (!r.done()) return false;
  out = std::move(words);
  return true;
}

}  // namespace

std::string encodeRkeys(const std::vector<uint32_t>& rkeys) { return encodeWords(rkeys); }
bool decodeRkeys(const std::string& bytes, std::vector<uint32_t>& out) { return decodeWords(bytes, out); }

std::string encodeNics(const std::vector<uint32_t>& nics) { return encodeWords(nics); }

bool decodeNics(const std::string& bytes, std::vector<uint32_t>& out) {
  std::vector<uint32_t> nics;
  if (!decodeWords(bytes, nics) || nics.empty()) return false;
  for (uint32_t n : nics) {
    if (n >= kMaxDevices) return false;
  }
  out = std::move(nics);
  return true;
}

std::string encodeConnectRequest(const ConnectRequest& q) {
  wire::Writer w;
  w.str(q.requester);
  w.u64(q.requester_nonce);
  w.u32(q.requester_device);
  w.u32(q.responder_device);
  writeAddress(w, q.address);
  return w.take();
}

bool decodeConnectRequest(const std::string& bytes, ConnectRequest& out) {
  wire::Reader r(bytes);
  ConnectRequest q;
  if (!r.str(q.requester) || !r.u64(q.requester_nonce) || !r.u32(q.requester_device) || !r.u32(q.responder_device) ||
      !readAddress(r, q.address) || !r.done()) {
    return false;
  }
  if (q.requester_device >= kMaxDevices || q.responder_device >= kMaxDevices) return false;
  out = std::move(q);
  return true;
}

std::string encodeQpAddress(const QpAddress& address) {
  wire::Writer w;
  writeAddress(w, address);
  return w.take();
}

bool decodeQpAddress(const std::string& bytes, QpAddress& out) {
  wire::Reader r(bytes);
  QpAddress a;
  if (!readAddress(r, a) || !r.done()) return false;
  out = a;
  return true;
}

}  // namespace mooncake::te::rdma
