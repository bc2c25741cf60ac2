// TEST ONLY: fault injection for this project's own tests. Nothing here is
// on unless a test turns it on, and where it is checked it costs one relaxed
// atomic load.
//
// cutTraffic() cuts this process off as a pulled cable would, for good: its
// control-plane Agent sends nothing more (no heartbeats, no requests, no
// acknowledgements) and ignores what arrives (also the Coordinator closing
// the connection), and its P2P channels neither write to peers nor read what
// peers write into their slots. The process itself keeps running: its
// threads, its collectives and its P2P calls go on and must fail cleanly.
// Shared memory between processes of one host is not a network and stays
// mapped (as with a real cut): what keeps a cut rank from spoiling the
// others' arenas is the membership, not this switch.
//
// cutTraffic(/*control=*/false) cuts the data plane only (P2P channels and
// their probes): the process stays a connected member that cannot reach its
// peers' endpoints, as behind a broken data network.
//
// loseAckReplies() makes every acknowledgement a P2P sender writes land and
// then report the peer unreachable, as when the receiver reads the ack and
// exits before the write's reply leaves it.
#pragma once

#include <atomic>

namespace mooncake::pg::test_faults {

namespace detail {
extern std::atomic<bool> traffic_cut;  // the data plane's (P2P channels)
extern std::atomic<bool> control_cut;  // the control plane's (the Agent's connection)
extern std::atomic<bool> ack_replies_lost;
}  // namespace detail

void cutTraffic(bool control = true);
inline bool trafficCut() { return detail::traffic_cut.load(std::memory_order_relaxed); }
inline bool controlCut() { return detail::control_cut.load(std::memory_order_relaxed); }
inline void loseAckReplies(bool on = true) { detail::ack_replies_lost.store(on); }
inline bool ackRepliesLost() { return detail::ack_replies_lost.load(std::memory_order_relaxed); }

}  // namespace mooncake::pg::test_faults
