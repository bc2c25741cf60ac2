// The remote side of the multi-process tests: an engine with one registered
// buffer, driven over stdin/stdout.
//
//   te_test_peer <bytes> <seed>
//   stdout: "READY <segment> <buffer address>"
//   stdin commands, one per line, each answered with one line:
//     DIGEST <offset> <length>  -> "<fnv-1a digest of that range>"
//     FILL <seed>               -> "OK" after refilling the buffer
//     QUIT                      -> exits (so does end of input)
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "mooncake/te/transfer_engine.h"
#include "test_pattern.h"

using namespace mooncake::te;

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <bytes> <seed>\n", argv[0]);
    return 2;
  }
  size_t bytes = std::strtoull(argv[1], nullptr, 10);
  std::vector<char> buffer(bytes);
  testing::fillPattern(buffer.data(), bytes, std::strtoull(argv[2], nullptr, 10));
  TransferEngine engine;
  if (engine.init("P2PHANDSHAKE", "127.0.0.1") != kOk) return 1;
  if (engine.registerLocalMemory(buffer.data(), bytes) != kOk) return 1;
  std::cout << "READY " << engine.segmentName() << " " << reinterpret_cast<uint64_t>(buffer.data()) << std::endl;
  std::string command;
  while (std::cin >> command) {
    if (command == "DIGEST") {
      size_t offset = 0, length = 0;
      std::cin >> offset >> length;
      std::cout << testing::digest(buffer.data() + offset, length) << std::endl;
    } else if (command == "FILL") {
      uint64_t seed = 0;
      std::cin >> seed;
      testing::fillPattern(buffer.data(), bytes, seed);
      std::cout << "OK" << std::endl;
    } else {
      break;
    }
  }
  return 0;
}
