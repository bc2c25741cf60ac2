// What the RDMA transport puts in descriptors and exchanges to connect:
// - segment attribute "rdma.devices": the devices a segment serves, in
//   order (a peer's device i is named by its position);
// - buffer attribute "rdma.rkeys": the buffer's rkey on each of them;
// - the kRdmaConnect handshake: a requester's queue pair address, answered
//   with the responder's.
// Decoders take untrusted bytes (a peer's descriptor, a handshake) and
// refuse anything malformed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "transport/rdma/verbs.h"

namespace mooncake::te::rdma {

constexpr const char* kDevicesAttr = "rdma.devices";
constexpr const char* kRkeysAttr = "rdma.rkeys";
// The devices nearest the buffer's memory (rdma/nic_affinity.h), by index;
// absent: all of them.
constexpr const char* kNicsAttr = "rdma.nics";
constexpr size_t kMaxDevices = 64;

struct DeviceAddress {
  std::string name;
  bool ethernet = true;
  uint16_t lid = 0;
  Gid gid;          // the GID its queue pairs use as source
  uint32_t mtu = 1024;
};

std::string encodeDevices(const std::vector<DeviceAddress>& devices);
bool decodeDevices(const std::string& bytes, std::vector<DeviceAddress>& out);

std::string encodeRkeys(const std::vector<uint32_t>& rkeys);
bool decodeRkeys(const std::string& bytes, std::vector<uint32_t>& out);
// Device indices: each below kMaxDevices, at least one.
std::string encodeNics(const std::vector<uint32_t>& nics);
bool decodeNics(const std::string& bytes, std::vector<uint32_t>& out);

struct ConnectRequest {
  std::string requester;       // segment name of the requesting engine
  uint64_t requester_nonce = 0;
  uint32_t requester_device = 0;  // index in the requester's device list
  uint32_t responder_device = 0;  // index in the responder's device list
  QpAddress address;              // the requester's queue pair
};

std::string encodeConnectRequest(const ConnectRequest& request);
bool decodeConnectRequest(const std::string& bytes, ConnectRequest& out);
std::string encodeQpAddress(const QpAddress& address);
bool decodeQpAddress(const std::string& bytes, QpAddress& out);

}  // namespace mooncake::te::rdma
