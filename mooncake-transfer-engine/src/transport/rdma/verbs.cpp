#include "transport/rdma/verbs.h"

#include <cstdio>

namespace mooncake::te::rdma {

bool Gid::empty() const {
  for (uint8_t b : raw) {
    if (b != 0) return false;
  }
  return true;
}

std::string Gid::str() const {
  char text[40];
  char* p = text;
  for (size_t i = 0; i < raw.size(); i += 2) {
    p += std::snprintf(p, 6, "%s%02x%02x", i == 0 ? "" : ":", raw[i], raw[i + 1]);
  }
  return std::string(text, p);
}

bool Gid::parse(const std::string& text, Gid& out) {
  // Exactly the form str() writes: 8 groups of 4 hex digits.
  if (text.size() != 39) return false;
  Gid gid;
  for (size_t group = 0; group < 8; ++group) {
    const size_t at = group * 5;
    if (group > 0 && text[at - 1] != ':') return false;
    unsigned value = 0;
    for (size_t k = 0; k < 4; ++k) {
      const char c = text[at + k];
      unsigned digit;
      if (c >= '0' && c <= '9') {
        digit = static_cast<unsigned>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        digit = static_cast<unsigned>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        digit = static_cast<unsigned>(c - 'A' + 10);
      } else {
        return false;
      }
      value = value * 16 + digit;
    }
    gid.raw[group * 2] = static_cast<uint8_t>(value >> 8);
    gid.raw[group * 2 + 1] = static_cast<uint8_t>(value & 0xff);
  }
  out = gid;
  return true;
}

const char* completionName(Completion c) {
  switch (c) {
    case Completion::kSuccess:
      return "success";
    case Completion::kLocalLength:
      return "local length error";
    case Completion::kLocalProtection:
      return "local protection error (lkey)";
    case Completion::kRemoteAccess:
      return "remote access error (rkey or range refused)";
    case Completion::kRemoteOperation:
      return "remote operation error";
    case Completion::kRetryExceeded:
      return "retry exceeded (peer gone or unreachable)";
    case Completion::kFlushed:
      return "flushed (queue pair in error)";
    case Completion::kOther:
      break;
  }
  return "other error";
}

}  // namespace mooncake::te::rdma
