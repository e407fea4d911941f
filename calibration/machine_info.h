// What a machine file records about where it was made: the CPU, host, memory, library
// versions and the date.
#pragma once

#include <string>

namespace ptdp {

std::string cpu_model_name();  // /proc/cpuinfo's "model name", or "unknown CPU"
std::string host_name();
double host_memory_bytes();  // MemTotal of /proc/meminfo, 0 when unknown
// The node's last-level cache: the highest level of /sys/devices/system/cpu/cpu*/cache, each
// instance (each distinct set of CPUs sharing one) counted once; 0 when unknown.
double last_level_cache_bytes();
std::string eigen_version();
std::string mpi_library_version();  // MPI_Get_library_version's first line, or "none"
std::string utc_now();              // 2026-01-31T12:00:00Z

}  // namespace ptdp
