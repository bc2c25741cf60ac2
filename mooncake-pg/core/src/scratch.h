// Scratch memory for collectives: like std::vector<char> but not zero-filled,
// since every scratch buffer is written before it is read (zeroing a 16 MiB
// staging buffer on each call would cost a memset of that size).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

namespace mooncake::pg {

class Scratch {
 public:
  explicit Scratch(size_t bytes = 0) { resize(bytes); }
  void resize(size_t bytes) {
    bytes_.reset(bytes > 0 ? new char[bytes] : nullptr);
    size_ = bytes;
  }
  char* data() { return bytes_.get(); }
  const char* data() const { return bytes_.get(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  std::unique_ptr<char[]> bytes_;
  size_t size_ = 0;
};

// `buffer`, grown to at least `bytes`: for buffers kept across calls, so that
// large calls do not fault in fresh pages each time.
inline char* atLeast(std::vector<char>& buffer, size_t bytes) {
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

}  // namespace mooncake::pg
