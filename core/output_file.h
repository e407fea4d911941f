// Output files written whole or not at all. Every file ptdp writes (plans, machine files,
// traces, SVGs, token files, checkpoints) goes to a temporary file beside its target, unique to
// the process, and is renamed over the target only once complete; a failure or an interrupted
// run leaves the target as it was and no temporary file. A symbolic link is followed (its target
// is replaced, the link kept), and an existing path that is not a regular file (a directory, a
// device such as /dev/full, a FIFO, a socket) is refused: renaming over it would replace it.
#pragma once

#include <ostream>
#include <string>

namespace ptdp {

// The regular file that an output named `path` replaces (a symbolic link resolved). Throws
// InputError(flag, ...) for an empty path or an existing non-regular file.
std::string resolve_output(const std::string& path, const std::string& flag);

// Checks up front, before long work, that `path` can be written: resolve_output, then a probe
// file created and removed in its directory.
void check_writable(const std::string& path, const std::string& flag);

// A file being written: stream() takes the contents, commit() flushes them to disk and renames
// them over the target. Destroyed without commit(), it removes the temporary file.
class AtomicOutputFile {
 public:
  AtomicOutputFile(const std::string& path, const std::string& flag);
  ~AtomicOutputFile();
  AtomicOutputFile(const AtomicOutputFile&) = delete;
  AtomicOutputFile& operator=(const AtomicOutputFile&) = delete;

  std::ostream& stream();
  // Throws InputError(flag, "cannot write 'path': <the system's reason>") when the data could
  // not all be written (a full disk, a file-size limit) or renamed.
  void commit();
  const std::string& temporary_path() const { return tmp_; }

 private:
  struct Impl;
  std::string path_, target_, tmp_, flag_;
  Impl* impl_;
};

// Writes `bytes` to `path` through an AtomicOutputFile.
void write_file_atomically(const std::string& path, const std::string& bytes,
                           const std::string& flag);

}  // namespace ptdp
