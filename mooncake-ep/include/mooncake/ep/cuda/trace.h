// Device-side timestamps of the EP kernels' steps, for finding where a
// call's time goes (src/trace_points.cuh says which kernels stamp where).
// Compiled in only with cmake -DMOONCAKE_EP_TRACE=ON, a build for measuring:
// otherwise enabled() is false and the kernels stamp nothing.
//   benchmarks/ep_graph_probe.py 128 4096 256 8 --trace
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mooncake::ep::cuda::trace {

enum Point : int {
  kLayoutStart,   // layoutSend's blocks begin
  kLayoutEnd,     // ... and end
  kRowsStart,     // the dispatch's (first) launch: its blocks begin
  kRowsSent,      // a send block wrote its rows (thread 0's share)
  kLayoutWaited,  // ... met the end of layoutSend (griddepcontrol.wait)
  kSignalled,     // ... counted itself into the signal (and published, if last)
  kWaitStart,     // the wait (block 0 of a one-launch call) took its number
  kSignalsHeard,  // ... every source's signal came (or was given up on)
  kLaidOut,       // ... the layout is written and handed on
  kHandedOver,    // a block of a one-launch call saw the hand-over
  kCopied,        // a block copied its rows (thread 0's warp)
  kRowsEnd,       // a block of the rows' call ends (its receive layout finished)
  kPoints
};

// Per point, the first and the last block that reached it (thread 0's
// %globaltimer, in ns; first ~0 and last 0 where none did).
struct Stamps {
  unsigned long long first[kPoints];
  unsigned long long last[kPoints];
};

// Whether this build stamps.
bool enabled();

// The points' names, in Point order.
std::vector<std::string> pointNames();

// Clears the stamps (before the call to look at; synchronous). False where
// the build does not stamp or CUDA fails.
bool reset();

// The stamps since the last reset (after the call finished; synchronous).
bool read(Stamps* out);

}  // namespace mooncake::ep::cuda::trace
