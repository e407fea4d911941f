#include <csignal>
#include <iostream>

#include "cli/cli.h"

int main(int argc, char** argv) {
  // A write past a file-size limit (RLIMIT_FSIZE) fails with EFBIG, reported like a full disk,
  // instead of killing the process with SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  return ptdp::run_cli(argc, argv, std::cout, std::cerr);
}
