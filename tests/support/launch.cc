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

std::vector<pid_t> ranks_of(const std::string& marker, const std::string& rank,
                            const std::string& launcher) {
  std::vector<pid_t> pids;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmdline = read_file(e.path() / "cmdline");
    if (cmdline.find(marker) == std::string::npos || cmdline.find("mpirun") != std::string::npos ||
        cmdline.find(launcher) != std::string::npos)
      continue;
    std::string env = read_file(e.path() / "environ");
    for (char& c : env) c = c == '\0' ? '\n' : c;
    if (("\n" + env).find("\nOMPI_COMM_WORLD_RANK=" + rank + "\n") != std::string::npos)
      pids.push_back(static_cast<pid_t>(std::stol(name)));
  }
  return pids;
}

}  // namespace ptdp::test
