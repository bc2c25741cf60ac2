// The remote side of the multi-process tests: an engine with one registered
// buffer, driven over stdin/stdout.
//
//   te_test_peer <bytes> <seed> [gpu <offset>]
//   With "gpu", the buffer is `bytes` at `offset` inside a larger cudaMalloc
//   allocation (a sub-allocation, as torch's caching allocator hands out),
//   registered with location "*".
//   stdout: "READY <segment> <buffer address>"
//   stdin commands, one per line, each answered with one line:
//     DIGEST <offset> <length>  -> "<fnv-1a digest of that range>"
//     FILL <seed>               -> "OK" after refilling the buffer
//     REALLOC <seed>            -> "OK <buffer address>" after unregistering
//                                  the buffer, freeing its allocation, and
//                                  registering a new one filled from <seed>
//                                  (GPU only: the address may come back)
//     QUIT                      -> exits (so does end of input)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#if MOONCAKE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "mooncake/te/transfer_engine.h"
#include "test_pattern.h"

using namespace mooncake::te;

namespace {

// The peer's buffer, in host or GPU memory. GPU contents are staged through
// host memory for filling and digesting.
class Buffer {
 public:
  Buffer(size_t bytes, bool gpu, size_t offset) : bytes_(bytes), gpu_(gpu), offset_(offset) { allocate(); }
  ~Buffer() { release(); }

  char* data() const { return data_; }
  bool ok() const { return data_ != nullptr; }

  void fill(uint64_t seed) {
    if (!gpu_) return testing::fillPattern(data_, bytes_, seed);
    std::vector<char> host(bytes_);
    testing::fillPattern(host.data(), bytes_, seed);
    copyIn(host.data());
  }

  uint64_t digest(size_t offset, size_t length) const {
    if (!gpu_) return testing::digest(data_ + offset, length);
    std::vector<char> host(length);
#if MOONCAKE_WITH_CUDA
    if (length > 0) cudaMemcpy(host.data(), data_ + offset, length, cudaMemcpyDeviceToHost);
#endif
    return testing::digest(host.data(), length);
  }

  void reallocate() {
    release();
    allocate();
  }

 private:
  void allocate() {
    if (!gpu_) {
      host_.assign(bytes_, 0);
      data_ = host_.data();
      return;
    }
#if MOONCAKE_WITH_CUDA
    void* p = nullptr;
    if (cudaMalloc(&p, offset_ + bytes_ + 4096) == cudaSuccess) data_ = static_cast<char*>(p) + offset_;
#endif
  }
  void release() {
#if MOONCAKE_WITH_CUDA
    if (gpu_ && data_ != nullptr) cudaFree(data_ - offset_);
#endif
    data_ = nullptr;
  }
  void copyIn(const char* host) {
#if MOONCAKE_WITH_CUDA
    cudaMemcpy(data_, host, bytes_, cudaMemcpyHostToDevice);
#else
    (void)host;
#endif
  }

  const size_t bytes_;
  const bool gpu_;
  const size_t offset_;
  std::vector<char> host_;
  char* data_ = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 && !(argc == 5 && std::strcmp(argv[3], "gpu") == 0)) {
    std::fprintf(stderr, "usage: %s <bytes> <seed> [gpu <offset>]\n", argv[0]);
    return 2;
  }
  const size_t bytes = std::strtoull(argv[1], nullptr, 10);
  const bool gpu = argc == 5;
  Buffer buffer(bytes, gpu, gpu ? std::strtoull(argv[4], nullptr, 10) : 0);
  if (!buffer.ok()) return 1;
  buffer.fill(std::strtoull(argv[2], nullptr, 10));
  TransferEngine engine;
  if (engine.init("P2PHANDSHAKE", "127.0.0.1") != kOk) return 1;
  if (engine.registerLocalMemory(buffer.data(), bytes) != kOk) return 1;
  std::cout << "READY " << engine.segmentName() << " " << reinterpret_cast<uint64_t>(buffer.data()) << std::endl;
  std::string command;
  while (std::cin >> command) {
    if (command == "DIGEST") {
      size_t offset = 0, length = 0;
      std::cin >> offset >> length;
      std::cout << buffer.digest(offset, length) << std::endl;
    } else if (command == "FILL") {
      uint64_t seed = 0;
      std::cin >> seed;
      buffer.fill(seed);
      std::cout << "OK" << std::endl;
    } else if (command == "WRITE") {  // its buffer's first <length> bytes into a peer's receive window
      std::string segment;
      uint64_t remote = 0;
      size_t length = 0;
      std::cin >> segment >> remote >> length;
      const SegmentHandle peer = engine.openSegment(segment);
      TransferRequest write{Opcode::kWrite, buffer.data(), peer, remote, length};
      write.remote_window = true;
      const int rc = peer == kInvalidSegment ? kInvalidArgument : engine.transferSync({write}, "tcp");
      std::cout << "DONE " << rc << std::endl;
    } else if (command == "REALLOC") {
      uint64_t seed = 0;
      std::cin >> seed;
      engine.unregisterLocalMemory(buffer.data());
      buffer.reallocate();
      if (!buffer.ok()) return 1;
      buffer.fill(seed);
      if (engine.registerLocalMemory(buffer.data(), bytes) != kOk) return 1;
      std::cout << "OK " << reinterpret_cast<uint64_t>(buffer.data()) << std::endl;
    } else {
      break;
    }
  }
  return 0;
}
