// The watchdog: names a lost rank (frozen, killed, unreachable) and stops every rank of the job
// within a bound, instead of leaving the live ranks blocked in a collective for ever.
//
// Each rank of a multi-rank MPI job runs a watchdog thread on its own duplicate of COMM_WORLD
// (so MPI must provide MPI_THREAD_MULTIPLE). The thread answers "are you alive" pings while the
// rank's main thread computes, writes a checkpoint or waits, and acts on "rank L is lost"
// notices from peers. When a wait of the data or control plane has lasted the stall timeout
// (PTDP_STALL_TIMEOUT_S, default 30 s), the waiting rank pings every other rank and gives each a
// few seconds to answer. If all answer, the wait goes on (a slow peer is not a lost one), up to
// PTDP_COMM_TIMEOUT_S; otherwise it tells the live ranks which ranks are lost, prints one line
// naming itself, the group, the operation and the lost ranks, and calls MPI_Abort. Each rank
// that gets the notice prints its own line and aborts too, so no rank depends on the launcher
// to be stopped.
//
// Without MPI_THREAD_MULTIPLE (or without MPI, or with PTDP_WATCHDOG=off in the environment of
// every rank) there is no watchdog thread: waits then end at
// PTDP_COMM_TIMEOUT_S with CommTimeout, as before.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/communicator.h"

namespace ptdp {

// PTDP_STALL_TIMEOUT_S (seconds, > 0) if set, else 30 s; std::invalid_argument when set to
// anything but a positive number.
CommDuration stall_timeout();

// True when this process runs a watchdog thread (MPI, several ranks, MPI_THREAD_MULTIPLE).
bool watchdog_active();

// For a wait of `operation` in `group` that has lasted `waited`: pings every other world rank;
// returns when every one answers, else reports the lost ranks and aborts the job (never
// returns). `cause` (e.g. an MPI error string) is added to the message. Without a watchdog it
// returns at once.
void watchdog_check_peers(const std::string& group, const std::string& operation,
                          CommDuration waited, const std::string& cause = {});

// How many times this process has checked its peers (for tests).
int64_t watchdog_checks();

// Prints `line` (one line, on stderr, with this world rank's prefix added by the caller) and
// stops the whole job: MPI_Abort, or _exit if that does not end this process within 10 s.
[[noreturn]] void abort_job(const std::string& line);

// The MPI backend's hooks: after MPI_Init_thread (with whether MPI_THREAD_MULTIPLE was
// provided), and before MPI_Finalize.
void start_watchdog(bool thread_multiple);
void stop_watchdog();

}  // namespace ptdp
