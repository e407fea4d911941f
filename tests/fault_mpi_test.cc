// The faults of long jobs, on `ptdp run` under mpirun as users launch it (docs/reliability.md):
// a rank frozen (SIGSTOP) or killed (SIGKILL) with the launcher's own abort-on-failure turned
// off stops every other rank within 60 s, each naming the lost rank; a rank killed while it
// writes a checkpoint leaves the previous one, which resumes the uninterrupted loss curve; a
// damaged shard is refused before any training; a full disk at save time fails with one line
// naming the file and keeps the last good checkpoint; --keep-checkpoints prunes; a non-finite
// loss stops every rank at that step; and every output file survives its writer failing
// mid-write.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "tests/support/launch.h"
#include "tests/support/run_json.h"

namespace ptdp {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
using test::Outcome;
using test::read_file;

const std::string kTiny =
    " --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 128"
    " --global-batch-size 8 --micro-batch-size 2";
const std::string kMpirun = std::string(PTDP_MPIEXEC) + " --allow-run-as-root --oversubscribe";
// Open MPI's launcher, told not to end the job when a rank exits with an error: the ranks
// must stop by themselves.
const std::string kNoLauncherAbort = " --mca orte_abort_on_non_zero_status 0";

fs::path fresh_dir(const std::string& name) {
  const fs::path d = test::scratch_dir("ptdp_fault_mpi_test") / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

int lines_with(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// `ptdp args` on np ranks (np = 0: directly), after the shell commands `shell_prefix`.
Outcome ptdp(int np, const std::string& args, const std::string& shell_prefix = "") {
  return np > 0 ? test::launch(shell_prefix + PTDP_MPIEXEC, PTDP_BINARY, np, args,
                               "ptdp_fault_mpi_test")
                : test::launch(PTDP_MPIEXEC, shell_prefix + PTDP_BINARY, 0, args,
                               "ptdp_fault_mpi_test");
}

// A shell prefix under which every file a process writes is limited to `kib` KiB: writing past
// it fails (EFBIG), as on a full disk; ptdp ignores SIGXFSZ itself (cli/main.cc).
std::string file_size_limit(uintmax_t kib) {
  return "ulimit -f " + std::to_string(kib) + "; ";
}

// The same limit on the ranks only (the launcher's own files stay unlimited): a prefix for the
// binary.
std::string ranks_file_size_limit(uintmax_t kib) {
  return "/bin/sh -c 'ulimit -f " + std::to_string(kib) + "; exec \"$0\" \"$@\"' ";
}
// The one error line ptdp printed (mpirun may add its own report after it).
void expect_one_error(const Outcome& r, const std::vector<std::string>& names) {
  EXPECT_NE(r.status, 0);
  EXPECT_EQ(lines_with(r.err, "ptdp: "), 1) << r.err;
  const size_t at = r.err.find("ptdp: ");
  const std::string line =
      at == std::string::npos ? "" : r.err.substr(at, r.err.find('\n', at) - at);
  for (const std::string& n : names)
    EXPECT_NE(line.find(n), std::string::npos) << n << ": " << r.err;
}

nlohmann::json run_json(int np, const std::string& args) {
  return test::json_of(ptdp(np, "run " + args + " --json"), args);
}

using test::losses;

int64_t latest_step(const fs::path& ckpt) {
  std::ifstream in(ckpt / "latest");
  int64_t step = -1;
  in >> step;
  return step;
}

// A shell command run in the background in a process group of its own. Whatever happens, the
// destructor kills what it started: the group, and the ranks (found by `marker` in their
// command line) should the launcher have moved them elsewhere.
class Job {
 public:
  Job(const std::string& command, std::string marker) : marker_(std::move(marker)) {
    pid_ = fork();
    if (pid_ == 0) {
      setpgid(0, 0);
      execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    setpgid(pid_, pid_);
  }
  ~Job() { kill_all(); }
  // The job's exit status once it has ended within `limit`, else -1.
  int wait_for(Clock::duration limit) {
    const auto deadline = Clock::now() + limit;
    while (status_ < 0 && Clock::now() < deadline) {
      int raw = 0;
      if (waitpid(pid_, &raw, WNOHANG) == pid_)
        status_ = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
      else
        std::this_thread::sleep_for(20ms);
    }
    return status_;
  }
  std::vector<pid_t> rank(int r) const {
    return test::ranks_of(marker_, std::to_string(r), PTDP_MPIEXEC);
  }
  void kill_all() {
    for (int r = 0; r < 8; ++r)
      for (pid_t p : rank(r)) kill(p, SIGKILL);
    if (status_ < 0) {
      kill(-pid_, SIGKILL);
      wait_for(10s);
    }
  }

 private:
  std::string marker_;
  pid_t pid_ = -1;
  int status_ = -1;
};

// Polls `done` every 20 ms for at most `limit`; true once it holds.
template <class F>
bool eventually(F done, Clock::duration limit) {
  const auto deadline = Clock::now() + limit;
  while (!done()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

// Starts a long 4-rank run (t=2, p=2) with the environment `env`, lets it train a few steps,
// stops rank `victim` with `signal`, and returns the seconds until every other rank has exited
// (at most 60 s; then everything is killed) and the job's output in `log_text`.
double stop_a_rank(const std::string& name, const std::string& env, int victim, int signal,
                   std::string* log_text) {
  const fs::path dir = fresh_dir(name), log = dir / "log";
  const std::string marker = (dir / "never").string();  // in the ranks' command line
  const std::string cmd = env + " exec " + kMpirun + kNoLauncherAbort + " -np 4 " + PTDP_BINARY +
                          " run" + kTiny +
                          " --steps 1000000 --tensor-model-parallel-size 2"
                          " --pipeline-model-parallel-size 2 --save " +
                          marker + " --save-interval 1000000 > " + log.string() + " 2>&1";
  Job job(cmd, marker);
  const bool training = eventually([&] { return lines_with(read_file(log), "step ") >= 3; }, 60s);
  EXPECT_TRUE(training) << read_file(log);
  if (!training) return -1;
  const std::vector<pid_t> pids = job.rank(victim);
  EXPECT_EQ(pids.size(), 1u);
  if (pids.size() != 1) return -1;
  kill(pids[0], signal);
  const auto t0 = Clock::now();
  std::vector<int> others;
  for (int r = 0; r < 4; ++r)
    if (r != victim) others.push_back(r);
  const bool stopped = eventually(
      [&] {
        for (int r : others)
          if (!job.rank(r).empty()) return false;
        return true;
      },
      60s);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  job.kill_all();
  *log_text = read_file(log);
  EXPECT_TRUE(stopped) << "ranks still running 60 s after losing rank " << victim << "\n"
                       << *log_text;
  std::printf("[ measured ] %s: %.1f s from the signal to every other rank's exit\n", name.c_str(),
              seconds);
  return stopped ? seconds : -1;
}

// With the watchdog: every other rank exits by itself, each with a line naming the lost rank,
// the first also naming the group and the operation.
double lose_a_rank(const std::string& name, int victim, int signal) {
  std::string text;
  const double seconds = stop_a_rank(name, "PTDP_STALL_TIMEOUT_S=3", victim, signal, &text);
  const std::string lost = "world rank " + std::to_string(victim) + " does not answer: lost";
  EXPECT_NE(text.find(lost), std::string::npos) << text;
  EXPECT_NE(text.find("in group '"), std::string::npos) << text;
  // Each live rank printed its own line: it stopped by itself, not by the launcher.
  for (int r = 0; r < 4; ++r) {
    if (r == victim) continue;
    EXPECT_NE(text.find("ptdp: watchdog: world rank " + std::to_string(r)), std::string::npos)
        << "rank " << r << "\n"
        << text;
  }
  return seconds;
}

TEST(Watchdog, FrozenRankStopsEveryOtherRankWithinAMinuteNamingIt) {
  EXPECT_LT(lose_a_rank("sigstop", 2, SIGSTOP), 60.0);
}

TEST(Watchdog, KilledRankStopsEveryOtherRankWithoutTheLauncher) {
  EXPECT_LT(lose_a_rank("sigkill", 1, SIGKILL), 60.0);
}

// Without the watchdog thread (as without MPI_THREAD_MULTIPLE) the communication timeout still
// ends the job: the first rank to time out prints it and aborts.
TEST(Watchdog, WithoutItTheCommunicationTimeoutStillEndsTheJob) {
  std::string text;
  const double seconds =
      stop_a_rank("no_watchdog", "PTDP_WATCHDOG=off PTDP_COMM_TIMEOUT_S=3", 2, SIGSTOP, &text);
  EXPECT_GE(seconds, 0.0);
  EXPECT_LT(seconds, 60.0);
  EXPECT_NE(text.find("communication timed out after 3 s"), std::string::npos) << text;
  EXPECT_NE(text.find("in group '"), std::string::npos) << text;
  EXPECT_EQ(text.find("ptdp: watchdog"), std::string::npos) << text;
}

// ---- checkpoints ----

const std::string kPipeline2 = " --pipeline-model-parallel-size 2";

// Two ranks (p = 2) of a model whose shards take a while to write (about 25 MB each).
const std::string kWide =
    " --num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 16 --vocab-size 128"
    " --global-batch-size 4 --micro-batch-size 2 --pipeline-model-parallel-size 2";

TEST(CheckpointFaults, RankKilledWhileWritingLeavesThePreviousCheckpointWhichResumesTheCurve) {
  const fs::path dir = fresh_dir("killed_save"), ckpt = dir / "ckpt", log = dir / "log";
  Job job("exec " + kMpirun + " -np 2 " + PTDP_BINARY + " run" + kWide + " --steps 1000 --save " +
              ckpt.string() + " --save-interval 1 --keep-checkpoints 2 > " + log.string() + " 2>&1",
          ckpt.string());
  // Once a checkpoint exists, SIGKILL the first rank seen writing a later one.
  int64_t killed_step = -1;
  fs::path killed_file;
  // The bound on looking for a save in flight (a loaded machine writes and polls slowly).
  const auto deadline = Clock::now() + 180s;
  while (killed_step < 0 && Clock::now() < deadline) {
    const int64_t latest = latest_step(ckpt);
    std::error_code ec;
    for (const auto& d : fs::directory_iterator(ckpt, ec)) {
      if (latest < 1 || d.path().filename().string() <= "step_" + std::string(7, '0')) break;
      const int64_t step = std::atoll(d.path().filename().string().substr(5).c_str());
      if (step <= latest) continue;
      for (const auto& f : fs::directory_iterator(d.path(), ec)) {
        const std::string name = f.path().filename().string();  // rank_NNNNN.bin.tmp
        if (name.size() < 14 || name.substr(name.size() - 4) != ".tmp" ||
            fs::file_size(f.path(), ec) == 0)
          continue;
        const std::vector<pid_t> pids = job.rank(std::atoi(name.substr(5, 5).c_str()));
        if (pids.size() != 1) continue;
        kill(pids[0], SIGKILL);
        killed_step = step;
        killed_file = f.path();
        break;
      }
      if (killed_step >= 0) break;
    }
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_GE(killed_step, 2) << read_file(log);
  EXPECT_GT(job.wait_for(30s), 0) << read_file(log);
  job.kill_all();
  // The rank died before its file was complete, so `latest` still names an earlier step.
  const std::string shard = killed_file.string().substr(0, killed_file.string().size() - 4);
  EXPECT_FALSE(fs::exists(shard)) << "killed too late to interrupt the write of " << shard;
  const int64_t saved = latest_step(ckpt);
  ASSERT_GE(saved, 1);
  EXPECT_LT(saved, killed_step);

  const std::string base = kWide + " --steps " + std::to_string(saved + 2);
  const nlohmann::json resumed = run_json(2, base + " --load " + ckpt.string());
  const nlohmann::json reference = run_json(2, base);
  EXPECT_EQ(resumed["first_step"], saved);
  const auto tail = losses(resumed), all = losses(reference);
  ASSERT_EQ(tail.size(), 2u);
  ASSERT_EQ(all.size(), static_cast<size_t>(saved + 2));
  for (size_t i = 0; i < 2; ++i)
    EXPECT_EQ(tail[i], all[static_cast<size_t>(saved) + i]) << "step " << saved + 1 + i;
  fs::remove_all(dir);  // large files
}

TEST(CheckpointFaults, DamagedShardIsRefusedNamingTheFileBeforeAnyStep) {
  const fs::path ckpt = fresh_dir("damaged") / "ckpt";
  ASSERT_EQ(ptdp(2, "run" + kTiny + kPipeline2 + " --steps 2 --save " + ckpt.string()).status, 0);
  const std::string resume = "run" + kTiny + kPipeline2 + " --steps 4 --load " + ckpt.string();
  const fs::path shard = ckpt / "step_0000002" / "rank_00001.bin";
  const std::string good = read_file(shard);
  ASSERT_GT(good.size(), 1000u);
  auto write = [&](const std::string& bytes) {
    std::ofstream(shard, std::ios::binary | std::ios::trunc) << bytes;
  };
  write(good.substr(0, good.size() - 100));  // truncated
  Outcome r = ptdp(2, resume);
  expect_one_error(r, {"--load", shard.string()});
  EXPECT_EQ(r.out.find("step "), std::string::npos) << r.out;
  std::string flipped = good;
  flipped[flipped.size() / 2] ^= 0x10;  // one bit in the middle of the parameters
  write(flipped);
  r = ptdp(2, resume);
  expect_one_error(r, {"--load", shard.string(), "corrupt"});
  EXPECT_EQ(r.out.find("step "), std::string::npos) << r.out;
}

TEST(CheckpointFaults, FullDiskAtSaveTimeFailsNamingTheFileAndKeepsTheLastCheckpoint) {
  const fs::path ckpt = fresh_dir("full_disk") / "ckpt";
  ASSERT_EQ(ptdp(2, "run" + kTiny + kPipeline2 + " --steps 2 --save " + ckpt.string()).status, 0);
  const uintmax_t shard = fs::file_size(ckpt / "step_0000002" / "rank_00000.bin");
  // Room for half a shard: the next save fails in the middle of each rank's file.
  const Outcome r =
      test::launch(PTDP_MPIEXEC, ranks_file_size_limit(shard / 2048) + PTDP_BINARY, 2,
                   "run" + kTiny + kPipeline2 + " --steps 4 --save-interval 1 --load " +
                       ckpt.string() + " --save " + ckpt.string(),
                   "ptdp_fault_mpi_test");
  expect_one_error(r, {"--save", (ckpt / "step_0000003" / "rank_0000").string(), "File too large"});
  EXPECT_EQ(lines_with(r.out, "step "), 1) << r.out;  // step 3 trained, its save failed
  EXPECT_EQ(latest_step(ckpt), 2);
  for (const auto& f : fs::directory_iterator(ckpt / "step_0000003"))
    ADD_FAILURE() << "left behind: " << f.path();
  const nlohmann::json resumed =
      run_json(2, kTiny + kPipeline2 + " --steps 3 --load " + ckpt.string());
  EXPECT_EQ(resumed["first_step"], 2);
  EXPECT_EQ(losses(resumed).size(), 1u);
}

TEST(CheckpointFaults, KeepCheckpointsPrunesAllButTheNewest) {
  const fs::path ckpt = fresh_dir("keep") / "ckpt";
  const Outcome r = ptdp(0, "run" + kTiny + " --steps 5 --save " + ckpt.string() +
                                " --save-interval 1 --keep-checkpoints 2");
  ASSERT_EQ(r.status, 0) << r.err;
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(ckpt)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_0000004", "step_0000005"}));
  EXPECT_EQ(latest_step(ckpt), 5);
  EXPECT_EQ(run_json(0, kTiny + " --steps 6 --load " + ckpt.string())["first_step"], 5);
  for (const char* n : {"0", "-1"}) {
    const Outcome bad =
        ptdp(0, "run" + kTiny + " --steps 2 --save " + ckpt.string() + " --keep-checkpoints " + n);
    EXPECT_EQ(bad.status, 2);
    expect_one_error(bad, {"--keep-checkpoints"});
  }
}

// ---- a loss that is not finite ----

TEST(NonFiniteLoss, StopsEveryRankAtThatStepWithoutSavingItsWeights) {
  const fs::path ckpt = fresh_dir("nan") / "ckpt";
  // A learning rate of 1e30 sends the weights, then the loss, to infinity within a few steps.
  const Outcome r = ptdp(2, "run" + kTiny + kPipeline2 + " --steps 20 --lr 1e30 --save " +
                                ckpt.string() + " --save-interval 1");
  EXPECT_EQ(r.status, 3) << r.err;
  expect_one_error(r, {"the loss is", "not finite"});
  const size_t at = r.err.find("ptdp: step ");
  ASSERT_NE(at, std::string::npos) << r.err;
  const int64_t bad_step = std::atoll(r.err.c_str() + at + 11);
  ASSERT_GT(bad_step, 1);
  EXPECT_EQ(lines_with(r.out, "step "), bad_step - 1) << r.out;  // the steps before it
  EXPECT_EQ(latest_step(ckpt), bad_step - 1);  // saved after each finite step, not after it
  for (const auto& e : fs::directory_iterator(ckpt))
    EXPECT_LT(
        e.path().filename().string(),
        "step_" + std::string(7 - std::to_string(bad_step).size(), '0') + std::to_string(bad_step));
}

// ---- output files: the destination keeps its content when the writer fails mid-write ----

// Writes "previous" to `path`, runs `args` with writes limited to 1 KiB (each output below is
// larger), and checks that the command failed naming `flag`, `path` still holds "previous",
// and no temporary file is left; then runs `args` unlimited and checks it replaces `path`.
void expect_atomic(const fs::path& path, const std::string& args, const std::string& flag) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << "previous";
  const Outcome cut = ptdp(0, args, file_size_limit(1));
  EXPECT_EQ(cut.status, 2) << args << "\n" << cut.err;
  expect_one_error(cut, {flag});
  EXPECT_EQ(read_file(path), "previous") << args;
  EXPECT_FALSE(fs::exists(path.string() + ".tmp")) << args;
  const Outcome whole = ptdp(0, args);
  EXPECT_EQ(whole.status, 0) << args << "\n" << whole.err;
  EXPECT_GT(fs::file_size(path), 1024u) << args;
}

TEST(AtomicWrites, PlanOut) {
  const fs::path f = fresh_dir("plan_out") / "plans.json";
  expect_atomic(f,
                "plan --model gpt-1.7b --num-gpus 32 --global-batch-size 512 --out " + f.string(),
                "--out");
}

TEST(AtomicWrites, RunTraceAndSvg) {
  const fs::path d = fresh_dir("run_trace");
  expect_atomic(d / "t.json", "run" + kTiny + " --steps 1 --trace " + (d / "t.json").string(),
                "--trace");
  expect_atomic(d / "t.svg", "run" + kTiny + " --steps 1 --svg " + (d / "t.svg").string(), "--svg");
}

TEST(AtomicWrites, SimulateTraceAndSvg) {
  const fs::path d = fresh_dir("simulate_trace");
  const std::string sim =
      "simulate --model gpt-1.7b --num-gpus 8 --global-batch-size 16 "
      "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 1";
  expect_atomic(d / "s.json", sim + " --trace " + (d / "s.json").string(), "--trace");
  expect_atomic(d / "s.svg", sim + " --svg " + (d / "s.svg").string(), "--svg");
}

// The machine file: a write cut short keeps the previous file, and so does a calibration
// interrupted while it measures (SIGINT after 2 s; a quick calibration takes longer).
TEST(AtomicWrites, CalibrateOut) {
  const fs::path f = fresh_dir("calibrate_out") / "machine.json";
  const std::string calibrate =
      "calibrate --quick --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
      "--vocab-size 128 --out " +
      f.string();
  expect_atomic(f, calibrate + " --time-limit-s 2", "--out");
  std::ofstream(f, std::ios::binary | std::ios::trunc) << "previous";
  const Outcome interrupted = ptdp(0, calibrate, "timeout -s INT 2 ");
  EXPECT_NE(interrupted.status, 0) << interrupted.out;
  EXPECT_EQ(read_file(f), "previous");
  EXPECT_FALSE(fs::exists(f.string() + ".tmp"));
}

TEST(AtomicWrites, TokenizeOutput) {
  const fs::path d = fresh_dir("tokenize");
  std::ofstream(d / "in.txt") << std::string(4096, 'x');
  expect_atomic(d / "tokens.bin",
                "tokenize " + (d / "in.txt").string() + " " + (d / "tokens.bin").string(),
                (d / "tokens.bin").string());
}

}  // namespace
}  // namespace ptdp
