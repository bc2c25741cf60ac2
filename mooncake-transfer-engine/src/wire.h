// Little-endian byte codec for the handshake messages. Readers check every
// length against what is left, so a truncated or hostile message fails to
// decode instead of reading past the end.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace mooncake::te::wire {

class Writer {
 public:
  void u8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void u32(uint32_t v) { fixed(v); }
  void u64(uint64_t v) { fixed(v); }
  void i32(int32_t v) { fixed(static_cast<uint32_t>(v)); }
  void str(const std::string& s) {
    u32(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  std::string take() { return std::move(out_); }

 private:
  template <typename T>
  void fixed(T v) {
    for (size_t i = 0; i < sizeof(T); ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& in) : data_(in.data()), left_(in.size()) {}
  // A Reader points into its input: a temporary would be gone before the
  // first read (the fuzz harness found it that way).
  explicit Reader(std::string&&) = delete;

  bool u8(uint8_t& v) { return fixed(v); }
  bool u32(uint32_t& v) { return fixed(v); }
  bool u64(uint64_t& v) { return fixed(v); }
  bool i32(int32_t& v) {
    uint32_t u = 0;
    if (!fixed(u)) return false;
    v = static_cast<int32_t>(u);
    return true;
  }
  bool str(std::string& s) {
    uint32_t n = 0;
    if (!u32(n) || n > left_) return false;
    s.assign(data_, n);
    data_ += n;
    left_ -= n;
    return true;
  }
  // A count of elements that each take at least `min_bytes`: rejects counts
  // the remaining input cannot hold, before anything is allocated for them.
  bool count(uint32_t& n, size_t min_bytes) { return u32(n) && static_cast<uint64_t>(n) * min_bytes <= left_; }
  bool done() const { return left_ == 0; }

 private:
  template <typename T>
  bool fixed(T& v) {
    if (left_ < sizeof(T)) return false;
    T out = 0;
    for (size_t i = 0; i < sizeof(T); ++i) out |= static_cast<T>(static_cast<uint8_t>(data_[i])) << (8 * i);
    v = out;
    data_ += sizeof(T);
    left_ -= sizeof(T);
    return true;
  }
  const char* data_;
  size_t left_;
};

}  // namespace mooncake::te::wire
