#include "tests/support/launch.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

namespace ptdp::test {

namespace fs = std::filesystem;

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

fs::path scratch_dir(const std::string& test) {
  const fs::path dir = fs::temp_directory_path() / (test + "." + std::to_string(getpid()));
  fs::create_directories(dir);
  return dir;
}

Outcome launch(const std::string& mpiexec, const std::string& binary, int np,
               const std::string& args, const std::string& test) {
  static int counter = 0;
  const fs::path dir = scratch_dir(test);
  const fs::path out = dir / ("out" + std::to_string(counter));
  const fs::path err = dir / ("err" + std::to_string(counter++));
  std::string cmd =
      np > 0 ? mpiexec + " --allow-run-as-root --oversubscribe -np " + std::to_string(np) + " "
             : std::string();
  cmd += binary + " " + args + " > " + out.string() + " 2> " + err.string();
  Outcome r;
  const int raw = std::system(cmd.c_str());
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128;
  r.out = read_file(out);
  r.err = read_file(err);
  return r;
}

}  // namespace ptdp::test
