// What a machine file records about where it was made: the CPU, host, memory, library
// versions and the date.
#pragma once

#include <string>

namespace ptdp {

std::string cpu_model_name();  // /proc/cpuinfo's "model name", or "unknown CPU"
std::string host_name();
double host_memory_bytes();  // MemTotal of /proc/meminfo, 0 when unknown
std::string eigen_version();
std::string mpi_library_version();  // MPI_Get_library_version's first line, or "none"
std::string utc_now();              // 2026-01-31T12:00:00Z

}  // namespace ptdp
