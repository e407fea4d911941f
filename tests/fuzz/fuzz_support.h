// Shared by the libFuzzer harnesses of tests/fuzz/: the loaders' contract and temporary files.
//
// The contract every harness checks: given any bytes, a loader returns a value or throws
// ptdp::InputError whose message is one line starting with a non-empty field. Anything else
// (another exception, a crash, a sanitizer report, a hang, an allocation past -rss_limit_mb)
// is a finding: an escaping exception reaches std::terminate, which libFuzzer reports.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "core/error.h"

namespace ptdp::fuzz {

// Aborts (a libFuzzer finding) with a note on stderr.
[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "contract broken: %s\n", what.c_str());
  std::abort();
}

// An InputError must name a field and say its problem on one line.
inline void check_input_error(const InputError& e) {
  const std::string_view what = e.what();
  if (e.field().empty()) fail("InputError without a field: " + std::string(what));
  if (what.find('\n') != std::string_view::npos || what.find('\r') != std::string_view::npos)
    fail("InputError message is not one line: " + std::string(what));
  if (what.substr(0, e.field().size()) != e.field())
    fail("InputError message does not start with its field: " + std::string(what));
}

// Runs f; an InputError is the accepted way to refuse input, and is checked.
template <class F>
void expect_value_or_input_error(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    check_input_error(e);
  }
}

// A directory of this process's own, created on first use under $TMPDIR, else /dev/shm (files
// in memory: twenty times the executions per second of a disk), else /tmp.
// Removed at exit.
inline const std::filesystem::path& scratch_dir() {
  // Never destroyed, so that the exit handler may still read it.
  static const std::filesystem::path* dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::error_code ec;
    const std::string base = tmp && *tmp                                     ? tmp
                             : std::filesystem::is_directory("/dev/shm", ec) ? "/dev/shm"
                                                                             : "/tmp";
    std::string pattern = base + "/ptdp_fuzz_XXXXXX";
    if (!::mkdtemp(pattern.data())) fail("cannot create a scratch directory");
    auto* path = new std::filesystem::path(pattern);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(scratch_dir(), ec);
    });
    return path;
  }();
  return *dir;
}

// Writes bytes to scratch_dir()/name, replacing what was there; returns the path.
inline std::string write_scratch_file(const std::string& name, const uint8_t* data, size_t size) {
  const std::filesystem::path path = scratch_dir() / name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out.flush()) fail("cannot write " + path.string());
  return path.string();
}

// The layout the checkpoint harness expects, which its seeds (tests/fuzz/write_seeds.cc) have.
inline constexpr const char* kCheckpointLayout = R"({"d":1,"p":1,"t":1,"v":1})";

}  // namespace ptdp::fuzz
