// Transfer engine benchmark: one initiator process and one target process
// (this program started again with --target). For each size it times
// synchronous writes through each transport and, in the same run, the bound
// each transport is judged by:
//   shm: a single-thread memcpy between two pre-faulted buffers of this process,
//        for both ways the shm transport copies: into a target buffer in
//        shared memory (mapped, a memcpy) and into ordinary memory (attached,
//        process_vm_writev)
//   tcp: a raw TCP stream to the target (send the bytes, wait for a 1-byte ack),
//        the same request/acknowledge pattern as a synchronous engine write.
// Prints a markdown table (and CSV with --csv FILE) with the ratios.
//
//   build/benchmarks/te_bench [--max-mib 64] [--seconds 0.3] [--csv docs/benchmarks/te.csv]
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mooncake/te/shared_memory.h"
#include "mooncake/te/transfer_engine.h"

extern char** environ;
using namespace mooncake::te;
using Clock = std::chrono::steady_clock;

namespace {

char* allocTouched(size_t n) {
  auto* p = static_cast<char*>(std::aligned_alloc(4096, (n + 4095) & ~size_t{4095}));
  std::memset(p, 1, n);  // fault every page in before timing
  return p;
}

bool readAll(int fd, char* p, size_t n) {
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool writeAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t r = ::send(fd, p, n, MSG_NOSIGNAL);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// Target side: an engine with one registered buffer, plus a raw TCP sink
// that reads [u64 length][payload] and answers one byte per message.
int runTarget(size_t bytes) {
  char* buffer = allocTouched(bytes);
  char* shared = static_cast<char*>(allocateSharedMemory(bytes));
  if (shared == nullptr) return 1;
  std::memset(shared, 1, bytes);
  TransferEngine engine;
  if (engine.init("P2PHANDSHAKE", "127.0.0.1") != kOk || engine.registerLocalMemory(buffer, bytes) != kOk ||
      engine.registerLocalMemory(shared, bytes) != kOk) {
    return 1;
  }
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  ::listen(listener, 4);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len);
  std::cout << engine.segmentName() << " " << reinterpret_cast<uint64_t>(buffer) << " "
            << reinterpret_cast<uint64_t>(shared) << " " << ntohs(a.sin_port) << std::endl;
  std::thread sink([&] {
    int fd = ::accept(listener, nullptr, nullptr);
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, 1 /*TCP_NODELAY*/, &one, sizeof(one));
    uint64_t n = 0;
    char ack = 1;
    while (readAll(fd, reinterpret_cast<char*>(&n), sizeof(n)) && n <= bytes && readAll(fd, buffer, n) &&
           writeAll(fd, &ack, 1)) {
    }
    ::close(fd);
  });
  std::string line;
  std::getline(std::cin, line);  // until the initiator closes our stdin
  ::shutdown(listener, SHUT_RDWR);
  sink.join();
  return 0;
}

struct Timing {
  double us_per_op = 0;
  double gbps = 0;  // 1e9 bytes per second
};

// Repeats `op` for about `seconds` (at least 5 times) after two warm-ups.
Timing timeIt(size_t bytes, double seconds, const std::function<bool()>& op) {
  for (int i = 0; i < 2; ++i) {
    if (!op()) return {};
  }
  int iters = 0;
  auto start = Clock::now();
  double elapsed = 0;
  do {
    if (!op()) return {};
    ++iters;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < seconds || iters < 5);
  return Timing{elapsed / iters * 1e6, bytes * static_cast<double>(iters) / elapsed / 1e9};
}

std::string fmt(double v, int precision = 2) {
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(precision);
  s << v;
  return s.str();
}

std::string sizeLabel(size_t n) {
  if (n >= (1u << 20)) return std::to_string(n >> 20) + " MiB";
  if (n >= (1u << 10)) return std::to_string(n >> 10) + " KiB";
  return std::to_string(n) + " B";
}

}  // namespace

int main(int argc, char** argv) {
  size_t max_bytes = 64u << 20;
  double seconds = 0.3;
  std::string csv_path;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--target" && i + 1 < argc) return runTarget(std::strtoull(argv[i + 1], nullptr, 10));
    if (arg == "--max-mib" && i + 1 < argc) max_bytes = std::strtoull(argv[++i], nullptr, 10) << 20;
    else if (arg == "--seconds" && i + 1 < argc) seconds = std::atof(argv[++i]);
    else if (arg == "--csv" && i + 1 < argc) csv_path = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--max-mib N] [--seconds S] [--csv FILE]\n", argv[0]);
      return 2;
    }
  }

  // Start the target: this program again, talking over a pipe.
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) return 1;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
  posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
  std::string bytes_arg = std::to_string(max_bytes);
  char* child_argv[] = {argv[0], const_cast<char*>("--target"), bytes_arg.data(), nullptr};
  pid_t child = 0;
  if (posix_spawn(&child, "/proc/self/exe", &actions, nullptr, child_argv, environ) != 0) return 1;
  close(to_child[0]);
  close(from_child[1]);
  FILE* child_out = fdopen(from_child[0], "r");
  char line[512];
  if (!fgets(line, sizeof(line), child_out)) return 1;
  std::istringstream ready(line);
  std::string segment;
  uint64_t remote_addr = 0, remote_shared = 0;
  int sink_port = 0;
  ready >> segment >> remote_addr >> remote_shared >> sink_port;

  char* src = allocTouched(max_bytes);
  char* dst = allocTouched(max_bytes);
  TransferEngine engine;
  if (engine.init("P2PHANDSHAKE", "127.0.0.1") != kOk || engine.registerLocalMemory(src, max_bytes) != kOk) return 1;
  SegmentHandle peer = engine.openSegment(segment);
  if (peer == kInvalidSegment) return 1;

  int raw = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(sink_port));
  if (::connect(raw, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return 1;
  int one = 1;
  ::setsockopt(raw, IPPROTO_TCP, 1 /*TCP_NODELAY*/, &one, sizeof(one));

  auto engineWrite = [&](const char* transport, uint64_t target, size_t n) {
    return [&, transport, target, n] {
      return engine.transferSync({TransferRequest{Opcode::kWrite, src, peer, target, n}}, transport) == kOk;
    };
  };
  auto rawStream = [&](size_t n) {
    return [&, n] {
      uint64_t len = n;
      char ack = 0;
      return writeAll(raw, reinterpret_cast<char*>(&len), sizeof(len)) && writeAll(raw, src, n) &&
             readAll(raw, &ack, 1);
    };
  };

  std::vector<size_t> sizes;
  for (size_t n = 64; n <= max_bytes; n *= 4) sizes.push_back(n);
  FILE* csv = csv_path.empty() ? nullptr : std::fopen(csv_path.c_str(), "w");
  if (csv) {
    std::fprintf(csv,
                 "bytes,shm_mapped_us,shm_attached_us,memcpy_us,shm_mapped_gbps,shm_attached_gbps,memcpy_gbps,"
                 "tcp_us,rawtcp_us,tcp_gbps,rawtcp_gbps\n");
  }
  std::printf("| size | shm mapped µs | shm attached µs | memcpy µs | shm mapped GB/s | shm attached GB/s | memcpy GB/s | "
              "mapped/memcpy | attached/memcpy | tcp µs | raw TCP µs | tcp GB/s | raw TCP GB/s | tcp/raw |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (size_t n : sizes) {
    Timing mapped = timeIt(n, seconds, engineWrite("shm", remote_shared, n));
    Timing shm = timeIt(n, seconds, engineWrite("shm", remote_addr, n));
    Timing mem = timeIt(n, seconds, [&] {
      std::memcpy(dst, src, n);
      asm volatile("" ::: "memory");  // keep the copy
      return true;
    });
    Timing tcp = timeIt(n, seconds, engineWrite("tcp", remote_addr, n));
    Timing rawt = timeIt(n, seconds, rawStream(n));
    std::printf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", sizeLabel(n).c_str(),
                fmt(mapped.us_per_op).c_str(), fmt(shm.us_per_op).c_str(), fmt(mem.us_per_op, 3).c_str(),
                fmt(mapped.gbps).c_str(), fmt(shm.gbps).c_str(), fmt(mem.gbps).c_str(),
                fmt(mapped.gbps / mem.gbps).c_str(), fmt(shm.gbps / mem.gbps).c_str(), fmt(tcp.us_per_op).c_str(),
                fmt(rawt.us_per_op).c_str(), fmt(tcp.gbps).c_str(), fmt(rawt.gbps).c_str(),
                fmt(tcp.gbps / rawt.gbps).c_str());
    std::fflush(stdout);
    if (csv) {
      std::fprintf(csv, "%zu,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f\n", n, mapped.us_per_op,
                   shm.us_per_op, mem.us_per_op, mapped.gbps, shm.gbps, mem.gbps, tcp.us_per_op, rawt.us_per_op,
                   tcp.gbps, rawt.gbps);
    }
  }
  if (csv) std::fclose(csv);
  ::close(raw);
  close(to_child[1]);  // the target exits at end of input
  waitpid(child, nullptr, 0);
  return 0;
}
