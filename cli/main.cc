#include <iostream>

#include "cli/cli.h"

int main(int argc, char** argv) {
  return ptdp::run_cli(argc, argv, std::cout, std::cerr);
}
