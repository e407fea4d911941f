#include "calibration/machine_info.h"

#include <unistd.h>

#include <Eigen/Core>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#ifdef PTDP_CALIBRATION_MPI
#include <mpi.h>
#endif

namespace ptdp {

namespace {

// The value after ':' of the first line of `path` starting with `key`.
std::string proc_field(const char* path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string v = line.substr(colon + 1);
    const size_t b = v.find_first_not_of(" \t");
    return b == std::string::npos ? "" : v.substr(b);
  }
  return "";
}

}  // namespace

std::string cpu_model_name() {
  const std::string m = proc_field("/proc/cpuinfo", "model name");
  return m.empty() ? "unknown CPU" : m;
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

double host_memory_bytes() {
  std::istringstream s(proc_field("/proc/meminfo", "MemTotal"));
  double kib = 0;
  s >> kib;
  return kib * 1024.0;
}

namespace {

std::string first_line(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::string line;
  std::getline(in, line);
  return line;
}

}  // namespace

double last_level_cache_bytes() {
  namespace fs = std::filesystem;
  std::error_code ec;
  int top = 0;
  std::map<std::string, double> instances;  // shared_cpu_list -> bytes, at level `top`
  for (const fs::directory_entry& cpu : fs::directory_iterator("/sys/devices/system/cpu", ec)) {
    const std::string name = cpu.path().filename().string();
    if (name.size() < 4 || name.rfind("cpu", 0) != 0 ||
        name.find_first_not_of("0123456789", 3) != std::string::npos)
      continue;
    for (const fs::directory_entry& index : fs::directory_iterator(cpu.path() / "cache", ec)) {
      if (first_line(index.path() / "type") == "Instruction") continue;
      int level = 0;
      double bytes = 0;
      std::string unit;
      std::istringstream(first_line(index.path() / "level")) >> level;
      std::istringstream(first_line(index.path() / "size")) >> bytes >> unit;
      bytes *= unit == "K" ? 1024.0 : unit == "M" ? 1024.0 * 1024 : unit == "G" ? 1 << 30 : 1.0;
      if (level <= 0 || !(bytes > 0) || level < top) continue;
      if (level > top) instances.clear(), top = level;
      const std::string shared = first_line(index.path() / "shared_cpu_list");
      instances[shared.empty() ? name : shared] = bytes;  // unknown sharing: one per CPU
    }
  }
  double total = 0;
  for (const auto& [cpus, bytes] : instances) total += bytes;
  return total;
}

std::string eigen_version() {
  return std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) + "." +
         std::to_string(EIGEN_MINOR_VERSION);
}

std::string mpi_library_version() {
#ifdef PTDP_CALIBRATION_MPI
  char buf[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  if (MPI_Get_library_version(buf, &len) != MPI_SUCCESS) return "unknown";
  std::string v(buf, static_cast<size_t>(len));
  const size_t nl = v.find_first_of("\r\n,");
  return nl == std::string::npos ? v : v.substr(0, nl);
#else
  return "none";
#endif
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace ptdp
