#include "core/output_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace ptdp {
namespace fs = std::filesystem;

namespace {

std::string reason(int err) {
  return std::strerror(err != 0 ? err : EIO);
}

// A std::streambuf over a FILE*, so that commit() can fsync what the stream wrote.
class FileBuf : public std::streambuf {
 public:
  explicit FileBuf(FILE* f) : f_(f) { setp(buf_, buf_ + sizeof buf_); }
  bool drain() {
    const std::ptrdiff_t n = pptr() - pbase();
    if (n > 0 && std::fwrite(pbase(), 1, static_cast<size_t>(n), f_) != static_cast<size_t>(n)) {
      err_ = errno ? errno : EIO;
      return false;
    }
    setp(buf_, buf_ + sizeof buf_);
    return true;
  }
  int error() const { return err_; }

 protected:
  int overflow(int c) override {
    if (!drain()) return traits_type::eof();
    if (c != traits_type::eof()) {
      *pptr() = static_cast<char>(c);
      pbump(1);
    }
    return traits_type::not_eof(c);
  }
  int sync() override { return drain() ? 0 : -1; }

 private:
  FILE* f_;
  char buf_[1 << 16];
  int err_ = 0;
};

// The temporary files being written, so that SIGINT, SIGTERM or SIGHUP (Ctrl-C, mpirun passing
// on a stop, a closed terminal) removes them before the process ends as the signal says: a
// checkpoint shard of hundreds of MB is otherwise left under a name no later run reuses. The
// handler only reads the slots and calls unlink(), both safe in a signal handler.
constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP};
std::atomic<const char*> g_temporaries[64];

extern "C" void remove_temporaries_and_stop(int sig) {
  for (auto& slot : g_temporaries)
    if (const char* path = slot.load()) ::unlink(path);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// Installs the handler for the signals whose disposition is the default (one ignored, as under
// nohup, or handled by someone else, is left so), once.
void install_handler() {
  static const bool installed = [] {
    for (int sig : kSignals) {
      struct sigaction old {};
      if (::sigaction(sig, nullptr, &old) != 0 || old.sa_handler != SIG_DFL ||
          (old.sa_flags & SA_SIGINFO))
        continue;
      struct sigaction sa {};
      sa.sa_handler = remove_temporaries_and_stop;
      sigemptyset(&sa.sa_mask);
      for (int other : kSignals) sigaddset(&sa.sa_mask, other);
      ::sigaction(sig, &sa, nullptr);
    }
    return true;
  }();
  (void)installed;
}

// The slot holding `path`, or -1 when all are taken (the file is then only removed by the
// destructor, as before).
int register_temporary(const char* path) {
  install_handler();
  for (int i = 0; i < static_cast<int>(std::size(g_temporaries)); ++i) {
    const char* empty = nullptr;
    if (g_temporaries[i].compare_exchange_strong(empty, path)) return i;
  }
  return -1;
}

void unregister_temporary(int slot) {
  if (slot >= 0) g_temporaries[slot].store(nullptr);
}

}  // namespace

struct AtomicOutputFile::Impl {
  FILE* f = nullptr;
  FileBuf buf;
  std::ostream out;
  int slot = -1;  // in g_temporaries
  explicit Impl(FILE* file) : f(file), buf(file), out(&buf) {}
};

std::string resolve_output(const std::string& path, const std::string& flag) {
  if (path.empty()) throw InputError(flag, "needs a file name");
  std::error_code ec;
  fs::path target = path;
  // A process's open descriptors (/dev/stdout, /dev/fd/N, /proc/self/fd/N) are links whose
  // targets are a pipe, a socket or a file opened for appending: renaming over the file would
  // drop what it held, so they are refused as the streams they are.
  auto descriptor = [](const fs::path& p) {
    const std::string s = p.lexically_normal().string();
    return s.rfind("/proc/", 0) == 0 || s.rfind("/dev/fd/", 0) == 0 ||
           s.rfind("/dev/std", 0) == 0 || s.find(":[") != std::string::npos;
  };
  // Follow a chain of links (a bounded number, as the system does) to the file they name.
  for (int hops = 0; fs::is_symlink(fs::symlink_status(target, ec)); ++hops) {
    if (hops == 40) throw InputError(flag, "'" + path + "': too many levels of symbolic links");
    if (descriptor(target))
      throw InputError(flag, "'" + path + "' is a stream, not a regular file; give a file name");
    const fs::path next = fs::read_symlink(target, ec);
    if (ec) throw InputError(flag, "'" + path + "': " + ec.message());
    target = next.is_absolute() ? next : target.parent_path() / next;
  }
  const fs::file_status st = fs::status(target, ec);
  if (fs::exists(st) && !fs::is_regular_file(st))
    throw InputError(flag, "'" + path + "' is " +
                               (fs::is_directory(st) ? "a directory" : "not a regular file") +
                               "; give a file name");
  return target.string();
}

void check_writable(const std::string& path, const std::string& flag) {
  AtomicOutputFile probe(path, flag);  // creates the temporary file, removed when it goes
}

AtomicOutputFile::AtomicOutputFile(const std::string& path, const std::string& flag)
    : path_(path), target_(resolve_output(path, flag)), flag_(flag), impl_(nullptr) {
  tmp_ = target_ + "." + std::to_string(::getpid()) + ".tmp";
  // Registered before it exists, so that no moment leaves it unknown to the signal handler.
  const int slot = register_temporary(tmp_.c_str());
  FILE* f = std::fopen(tmp_.c_str(), "wb");
  if (!f) {
    const int err = errno;
    unregister_temporary(slot);
    throw InputError(flag_, "cannot write '" + path_ + "': " + reason(err));
  }
  // A file replaced keeps its permissions (a private machine file or checkpoint stays private)
  // and, where the process may give it, its owner.
  struct stat st {};
  if (::stat(target_.c_str(), &st) == 0) {
    (void)::fchmod(fileno(f), st.st_mode & 07777);
    (void)!::fchown(fileno(f), st.st_uid, st.st_gid);
  }
  try {
    impl_ = new Impl(f);
  } catch (...) {  // out of memory: nothing of the file may outlive the failed constructor
    std::fclose(f);
    std::remove(tmp_.c_str());
    unregister_temporary(slot);
    throw;
  }
  impl_->slot = slot;
}

AtomicOutputFile::~AtomicOutputFile() {
  if (!impl_) return;
  std::fclose(impl_->f);
  std::remove(tmp_.c_str());
  unregister_temporary(impl_->slot);
  delete impl_;
}

std::ostream& AtomicOutputFile::stream() {
  return impl_->out;
}

void AtomicOutputFile::commit() {
  int err = 0;
  impl_->out.flush();
  if (!impl_->buf.drain() || !impl_->out) err = impl_->buf.error() ? impl_->buf.error() : EIO;
  if (err == 0 && (std::fflush(impl_->f) != 0 || ::fsync(fileno(impl_->f)) != 0))
    err = errno ? errno : EIO;
  if (std::fclose(impl_->f) != 0 && err == 0) err = errno ? errno : EIO;
  const int slot = impl_->slot;
  delete impl_;
  impl_ = nullptr;
  if (err == 0 && std::rename(tmp_.c_str(), target_.c_str()) != 0) err = errno ? errno : EIO;
  if (err != 0) std::remove(tmp_.c_str());
  unregister_temporary(slot);
  if (err != 0) throw InputError(flag_, "cannot write '" + path_ + "': " + reason(err));
}

void write_file_atomically(const std::string& path, const std::string& bytes,
                           const std::string& flag) {
  AtomicOutputFile out(path, flag);
  out.stream().write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.commit();
}

}  // namespace ptdp
