#include "mooncake/te/segment_descriptor.h"

#include <algorithm>

#include "mooncake/te/status.h"
#include "wire.h"

namespace mooncake::te {
namespace {

constexpr uint32_t kDescriptorMagic = 0x4d434432;  // "MCD2": bump on any layout change

void writeAttrs(wire::Writer& w, const std::map<std::string, std::string>& attrs) {
  w.u32(static_cast<uint32_t>(attrs.size()));
  for (const auto& [k, v] : attrs) {
    w.str(k);
    w.str(v);
  }
}

bool readAttrs(wire::Reader& r, std::map<std::string, std::string>& attrs) {
  uint32_t n = 0;
  if (!r.count(n, 8)) return false;
  for (uint32_t i = 0; i < n; ++i) {
    std::string k, v;
    if (!r.str(k) || !r.str(v)) return false;
    attrs.emplace(std::move(k), std::move(v));
  }
  return true;
}

}  // namespace

const BufferDescriptor* SegmentDescriptor::findBuffer(uint64_t addr, uint64_t length) const {
  if (by_addr_.size() != buffers.size()) {
    for (const auto& b : buffers) {
      if (b.contains(addr, length)) return &b;
    }
    return nullptr;
  }
  // Last buffer starting at or below addr: registered buffers never overlap.
  auto it = std::upper_bound(by_addr_.begin(), by_addr_.end(), addr,
                             [this](uint64_t a, uint32_t i) { return a < buffers[i].addr; });
  if (it == by_addr_.begin()) return nullptr;
  const BufferDescriptor& b = buffers[*std::prev(it)];
  return b.contains(addr, length) ? &b : nullptr;
}

void SegmentDescriptor::index() {
  by_addr_.resize(buffers.size());
  for (uint32_t i = 0; i < by_addr_.size(); ++i) by_addr_[i] = i;
  std::sort(by_addr_.begin(), by_addr_.end(),
            [this](uint32_t a, uint32_t b) { return buffers[a].addr < buffers[b].addr; });
}

bool SegmentDescriptor::servesTransport(const std::string& transport) const {
  return std::find(transports.begin(), transports.end(), transport) != transports.end();
}

std::string SegmentDescriptor::encode() const {
  wire::Writer w;
  w.u32(kDescriptorMagic);
  w.str(name);
  w.str(host_id);
  w.i32(pid);
  w.u64(process_start_ticks);
  w.u64(stamp_addr);
  w.u64(engine_nonce);
  w.u64(registration_version);
  w.u32(static_cast<uint32_t>(transports.size()));
  for (const auto& t : transports) w.str(t);
  writeAttrs(w, attrs);
  w.u32(static_cast<uint32_t>(buffers.size()));
  for (const auto& b : buffers) {
    w.u64(b.addr);
    w.u64(b.length);
    w.str(b.location);
    writeAttrs(w, b.attrs);
  }
  return w.take();
}

int SegmentDescriptor::decode(const std::string& bytes, SegmentDescriptor& out) {
  wire::Reader r(bytes);
  SegmentDescriptor d;
  uint32_t magic = 0, n = 0;
  if (!r.u32(magic) || magic != kDescriptorMagic) return kMalformedMessage;
  if (!r.str(d.name) || !r.str(d.host_id) || !r.i32(d.pid) || !r.u64(d.process_start_ticks) ||
      !r.u64(d.stamp_addr) || !r.u64(d.engine_nonce) || !r.u64(d.registration_version)) {
    return kMalformedMessage;
  }
  if (!r.count(n, 4)) return kMalformedMessage;
  for (uint32_t i = 0; i < n; ++i) {
    std::string t;
    if (!r.str(t)) return kMalformedMessage;
    d.transports.push_back(std::move(t));
  }
  if (!readAttrs(r, d.attrs)) return kMalformedMessage;
  if (!r.count(n, 24)) return kMalformedMessage;
  d.buffers.resize(n);
  for (auto& b : d.buffers) {
    if (!r.u64(b.addr) || !r.u64(b.length) || !r.str(b.location) || !readAttrs(r, b.attrs)) {
      return kMalformedMessage;
    }
  }
  if (!r.done()) return kMalformedMessage;
  d.index();
  out = std::move(d);
  return kOk;
}

}  // namespace mooncake::te
