// The MPI watchdog of runtime/watchdog.h. Messages are fixed arrays of int64 on the watchdog's
// own duplicate of COMM_WORLD: {kPing, round} and {kLost, count, ranks...} go to a rank's
// watchdog thread (tag kToWatchdog); {kPong, round} comes back to the rank that pinged (tag
// kToProber), whose main thread waits for it. Every wait here is bounded.
#include "runtime/watchdog.h"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <list>
#include <mutex>
#include <sstream>
#include <thread>

namespace ptdp {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int kToWatchdog = 1, kToProber = 2;
constexpr auto kGrace = 1s;  // between a lost-rank notice and MPI_Abort
constexpr int64_t kPing = 1, kPong = 2, kLost = 3;
constexpr int kMaxNamed = 14;  // lost ranks a notice names
constexpr int kMsg = 2 + kMaxNamed;
using Msg = std::array<int64_t, kMsg>;

struct State {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  std::thread thread;
  std::atomic<bool> stop{false};
  std::mutex probe;  // one probe at a time
  int64_t round = 0;
};

void claim_abort(const std::string& line);
[[noreturn]] void finish_abort();

State* g_state = nullptr;  // set while the watchdog runs
std::atomic<int64_t> g_checks{0};

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream s;
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? ", " : "") << ranks[i];
  return s.str();
}

std::string ranks_phrase(const std::vector<int>& ranks) {
  return std::string(ranks.size() > 1 ? "world ranks " : "world rank ") + rank_list(ranks);
}

// Tests `r` until it completes or `deadline`; true if it completed.
bool wait_until(MPI_Request& r, Clock::time_point deadline) {
  for (;;) {
    int done = 0;
    if (MPI_Test(&r, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
    if (done) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
}

// The watchdog thread: answers pings, acts on lost-rank notices.
void serve(State* s) {
  struct Reply {
    MPI_Request req = MPI_REQUEST_NULL;
    Msg msg{};
  };
  std::list<Reply> replies;  // pongs in flight (their buffers must live until sent)
  Msg in{};
  MPI_Request recv = MPI_REQUEST_NULL;
  while (!s->stop.load()) {
    if (recv == MPI_REQUEST_NULL && MPI_Irecv(in.data(), kMsg, MPI_INT64_T, MPI_ANY_SOURCE,
                                              kToWatchdog, s->comm, &recv) != MPI_SUCCESS) {
      std::this_thread::sleep_for(100ms);
      continue;
    }
    int got = 0;
    MPI_Status st;
    if (MPI_Test(&recv, &got, &st) == MPI_SUCCESS && got) {
      recv = MPI_REQUEST_NULL;
      if (in[0] == kPing) {
        replies.emplace_back();
        Reply& r = replies.back();
        r.msg[0] = kPong;
        r.msg[1] = in[1];
        MPI_Isend(r.msg.data(), kMsg, MPI_INT64_T, st.MPI_SOURCE, kToProber, s->comm, &r.req);
      } else if (in[0] == kLost) {
        std::vector<int> lost;
        for (int64_t i = 0; i < std::min<int64_t>(in[1], kMaxNamed); ++i)
          lost.push_back(static_cast<int>(in[static_cast<size_t>(2 + i)]));
        claim_abort("ptdp: watchdog: world rank " + std::to_string(s->rank) +
                    " stops: world rank " + std::to_string(st.MPI_SOURCE) + " found " +
                    ranks_phrase(lost) + " lost (no answer); aborting the job");
        // As the rank that sent the notice: time for every notified rank to print its line
        // before the first MPI_Abort makes the launcher kill the others.
        std::this_thread::sleep_for(kGrace);
        finish_abort();
      }
      continue;
    }
    for (auto it = replies.begin(); it != replies.end();) {
      int done = 0;
      MPI_Test(&it->req, &done, MPI_STATUS_IGNORE);
      it = done ? replies.erase(it) : std::next(it);
    }
    std::this_thread::sleep_for(5ms);
  }
  if (recv != MPI_REQUEST_NULL) {
    MPI_Cancel(&recv);
    wait_until(recv, Clock::now() + 1s);
  }
  for (Reply& r : replies)
    if (!wait_until(r.req, Clock::now() + 1s)) MPI_Request_free(&r.req);
}

// The ranks that do not answer a ping within `answer`.
std::vector<int> silent_ranks(State* s, CommDuration answer) {
  std::lock_guard<std::mutex> lock(s->probe);
  const int64_t round = ++s->round;
  const auto n = static_cast<size_t>(s->size);
  // Leaked if a transfer is still pending when the probe gives up (the job is then aborted).
  auto* ping = new std::vector<Msg>(n);
  auto* pong = new std::vector<Msg>(n);
  std::vector<MPI_Request> sends(n, MPI_REQUEST_NULL), recvs(n, MPI_REQUEST_NULL);
  std::vector<bool> answered(n, false);
  answered[static_cast<size_t>(s->rank)] = true;
  for (int r = 0; r < s->size; ++r) {
    if (r == s->rank) continue;
    const auto i = static_cast<size_t>(r);
    (*ping)[i][0] = kPing;
    (*ping)[i][1] = round;
    if (MPI_Irecv((*pong)[i].data(), kMsg, MPI_INT64_T, r, kToProber, s->comm, &recvs[i]) !=
        MPI_SUCCESS)
      recvs[i] = MPI_REQUEST_NULL;
    else if (MPI_Isend((*ping)[i].data(), kMsg, MPI_INT64_T, r, kToWatchdog, s->comm, &sends[i]) !=
             MPI_SUCCESS)
      sends[i] = MPI_REQUEST_NULL;
  }
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(answer);
  for (;;) {
    bool all = true;
    for (size_t i = 0; i < n; ++i) {
      if (answered[i] || recvs[i] == MPI_REQUEST_NULL) {
        all = all && answered[i];
        continue;
      }
      int done = 0;
      if (MPI_Test(&recvs[i], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        recvs[i] = MPI_REQUEST_NULL;  // an error: counts as no answer
      } else if (done) {
        if ((*pong)[i][1] == round) {
          answered[i] = true;
        } else {  // a late answer to an earlier round: wait for this one's
          MPI_Irecv((*pong)[i].data(), kMsg, MPI_INT64_T, static_cast<int>(i), kToProber, s->comm,
                    &recvs[i]);
        }
      }
      all = all && answered[i];
    }
    if (all || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(2ms);
  }
  std::vector<int> silent;
  bool pending = false;
  for (size_t i = 0; i < n; ++i) {
    if (!answered[i]) silent.push_back(static_cast<int>(i));
    if (recvs[i] != MPI_REQUEST_NULL) {
      MPI_Cancel(&recvs[i]);
      MPI_Request_free(&recvs[i]);
      pending = true;
    }
    if (sends[i] != MPI_REQUEST_NULL) {
      int done = 0;
      MPI_Test(&sends[i], &done, MPI_STATUS_IGNORE);
      if (!done) {
        MPI_Request_free(&sends[i]);
        pending = true;
      }
    }
  }
  if (!pending) {
    delete ping;
    delete pong;
  }
  return silent;
}

// Tells every rank that answered which ranks are lost (each then aborts); bounded by 1 s.
void notify(State* s, const std::vector<int>& lost) {
  auto* msg = new Msg{};  // leaked: the job ends next
  (*msg)[0] = kLost;
  (*msg)[1] = static_cast<int64_t>(std::min<size_t>(lost.size(), kMaxNamed));
  for (size_t i = 0; i < lost.size() && i < static_cast<size_t>(kMaxNamed); ++i)
    (*msg)[2 + i] = lost[i];
  std::vector<MPI_Request> sends;
  for (int r = 0; r < s->size; ++r) {
    if (r == s->rank || std::count(lost.begin(), lost.end(), r)) continue;
    sends.push_back(MPI_REQUEST_NULL);
    if (MPI_Isend(msg->data(), kMsg, MPI_INT64_T, r, kToWatchdog, s->comm, &sends.back()) !=
        MPI_SUCCESS)
      sends.back() = MPI_REQUEST_NULL;
  }
  const auto deadline = Clock::now() + 1s;
  for (MPI_Request& r : sends)
    if (r != MPI_REQUEST_NULL) wait_until(r, deadline);
  // Time for the notified ranks to print their own line before MPI_Abort makes the launcher
  // kill them.
  std::this_thread::sleep_for(kGrace);
}

// How long a ping waits for its answer: the stall timeout, within [2 s, 5 s].
CommDuration answer_time() {
  return std::clamp(stall_timeout(), CommDuration(2.0), CommDuration(5.0));
}

}  // namespace

bool watchdog_active() {
  return g_state != nullptr;
}

int64_t watchdog_checks() {
  return g_checks.load();
}

void watchdog_check_peers(const std::string& group, const std::string& operation,
                          CommDuration waited, const std::string& cause) {
  State* s = g_state;
  if (!s) return;
  ++g_checks;
  const std::vector<int> lost = silent_ranks(s, answer_time());
  if (lost.empty()) return;
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.1f", waited.count());
  // This rank's line first: a notice from a peer that found the same loss is then ignored.
  claim_abort("ptdp: watchdog: world rank " + std::to_string(s->rank) + ": " + operation +
              " in group '" + group + "' waited " + seconds + " s" +
              (cause.empty() ? "" : " (" + cause + ")") + "; " + ranks_phrase(lost) +
              (lost.size() > 1 ? " do" : " does") + " not answer: lost; aborting the job");
  notify(s, lost);
  finish_abort();
}

[[noreturn]] void abort_job(const std::string& line) {
  claim_abort(line);
  finish_abort();
}

namespace {

// Prints `line` if this is the first thread to stop the process; any later caller parks here
// while the first one ends the process.
void claim_abort(const std::string& line) {
  static std::atomic<bool> aborting{false};
  if (aborting.exchange(true))
    for (;;) std::this_thread::sleep_for(1s);
  std::fflush(stdout);
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

[[noreturn]] void finish_abort() {
  std::thread([] {
    std::this_thread::sleep_for(10s);
    std::_Exit(3);
  }).detach();
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 3);
  std::_Exit(3);
}

}  // namespace

void start_watchdog(bool thread_multiple) {
  const char* off = std::getenv("PTDP_WATCHDOG");
  if (g_state || !thread_multiple || (off && std::string(off) == "off")) return;
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size < 2) return;
  auto* s = new State;
  MPI_Comm_dup(MPI_COMM_WORLD, &s->comm);
  MPI_Comm_set_errhandler(s->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(s->comm, &s->rank);
  s->size = size;
  s->thread = std::thread(serve, s);
  g_state = s;
}

void stop_watchdog() {
  State* s = g_state;
  if (!s) return;
  g_state = nullptr;
  s->stop = true;
  s->thread.join();
  MPI_Comm_free(&s->comm);
  delete s;
}

}  // namespace ptdp
