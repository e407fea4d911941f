// `ptdp tokenize input.txt tokens.bin`: byte-level tokens (uint16, little-endian) of any file,
// for `ptdp run --data tokens.bin` (vocabulary of at least 256).
#include <CLI/CLI.hpp>
#include <memory>

#include "cli/commands.h"
#include "runtime/data.h"

namespace ptdp {

Action add_tokenize_command(CLI::App& app) {
  auto* sub = app.add_subcommand("tokenize", "write byte-level tokens of a text file for ptdp run");
  auto paths = std::make_shared<std::pair<std::string, std::string>>();
  sub->add_option("input", paths->first, "any file (text)")->required();
  sub->add_option("output", paths->second, "token file to write (uint16 per token)")->required();
  return [paths](std::ostream& out, std::ostream&) {
    const int64_t n = tokenize_file(paths->first, paths->second);
    out << "ptdp tokenize: " << n << " tokens (byte-level, vocabulary 256) written to "
        << paths->second << "\n";
    return 0;
  };
}

}  // namespace ptdp
