// `ptdp calibrate`: measure this machine and write a machine file (docs/calibration.md,
// docs/file_formats.md) that `--cluster FILE` prices with. Under mpirun every rank measures at
// the same time (collectives need the ranks; ranks that share cores compute side by side as
// they will in `ptdp run`); rank 0 writes the file and reports.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "calibration/calibrate.h"
#include "cli/cli.h"
#include "cli/commands.h"
#include "cli/job_flags.h"
#include "cli/report.h"
#include "core/error.h"
#include "runtime/communicator.h"

namespace ptdp {
namespace {

struct CalibrateFlags {
  JobFlags job;
  std::string backend = "cpu";
  bool quick = false;
  bool bf16 = false, fp16 = false;
  double time_limit_s = 0;
  std::vector<int64_t> group_sizes;
  std::string out;
  bool json = false;
};

// This process's command line, as recorded in the machine file.
std::string command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string line;
  for (char c : all) line += c == '\0' ? ' ' : c;
  while (!line.empty() && line.back() == ' ') line.pop_back();
  return line.empty() ? "ptdp calibrate" : line;
}

// The model whose shapes are measured: --model (and the model flags), else a small GPT.
ModelSpec model_of(const JobFlags& j) {
  if (!j.model.empty() || j.num_layers || j.hidden_size) return j.resolve_model();
  ModelSpec m;
  m.name = "calibration-gpt";
  m.num_layers = 4;
  m.hidden_size = 256;
  m.num_attention_heads = 4;
  m.seq_length = 128;
  m.vocab_size = 1024;
  m.validate();
  return m;
}

void draw_bar(double fraction, const std::string& what) {
  const int width = 30;
  const int filled = static_cast<int>(fraction * width + 0.5);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(width, '.');
  std::fprintf(stderr, "\r[%s] %3.0f%% %-40.40s", bar.c_str(), 100 * fraction, what.c_str());
  std::fflush(stderr);
}

int calibrate_main(const CalibrateFlags& f, std::ostream& out, std::ostream& err) {
  const int lrank = launcher_rank();
  CalibrateOptions o;
  try {
    // cpu-staged: the CPU kernels on memory treated as a device's (runtime/backend.h), which
    // runs calibrate's device paths on any machine (tests).
    if (f.backend != "cpu" && f.backend != "cuda" && f.backend != "cpu-staged")
      throw InputError("--backend", "must be cpu, cuda or cpu-staged, not '" + f.backend + "'");
    if (f.out.empty()) throw InputError("--out", "is required");
    check_writable(f.out, "--out");  // before minutes of measuring, on every rank alike
    if (!(f.time_limit_s >= 0 && std::isfinite(f.time_limit_s)))
      throw InputError("--time-limit-s", "must be a finite number of seconds, 0 or more");
    o.backend = f.backend;
    o.model = model_of(f.job);
    o.quick = f.quick;
    if (f.bf16 && f.fp16) throw InputError("--fp16", "conflicts with --bf16");
    o.precision = f.bf16 ? DType::kBF16 : f.fp16 ? DType::kF16 : DType::kF32;
    o.time_limit_s = f.time_limit_s;
    o.group_sizes = f.group_sizes;
    o.command = command_line();
  } catch (const InputError& e) {
    if (lrank <= 0) err << "ptdp: " << e.what() << "\n";
    return 2;
  }
  std::unique_ptr<Communicator> world;
  if (lrank >= 0 && mpi_available()) world = make_mpi_world();
  if (!world) world = make_self_communicator();
  std::unique_ptr<ControlPlane> control =
      world->size() > 1 ? make_mpi_control_plane() : make_self_control_plane();
  const bool root = world->rank() == 0;
  const bool bar = root && isatty(STDERR_FILENO);
  if (bar) o.progress = draw_bar;
  // Under mpirun the ranks' stderr reaches the terminal through the launcher, never as a
  // terminal itself: rank 0 reports each tenth done as a line instead of a bar.
  int tenths = 0;
  if (root && !bar && lrank >= 0)
    o.progress = [&tenths](double fraction, const std::string& what) {
      const int now = static_cast<int>(fraction * 10 + 1e-9);
      if (now <= tenths) return;
      tenths = now;
      std::fprintf(stderr, "ptdp calibrate: %d%% (%s)\n", 10 * now, what.c_str());
      std::fflush(stderr);
    };
  nlohmann::json machine;
  try {
    machine = calibrate(o, *world, *control);
  } catch (const InputError& e) {  // thrown on every rank alike, before measuring: all stop
    if (root) err << "ptdp: " << e.what() << "\n";
    return 2;
  }
  if (bar) std::fprintf(stderr, "\r%80s\r", "");
  if (!root) return 0;
  write_file_atomically(f.out, machine.dump(1) + "\n", "--out");
  if (f.json) {
    out << nlohmann::json{{"out", f.out},
                          {"machine", machine["machine"]},
                          {"fits", machine["fits"]}}
               .dump(2)
        << "\n";
  } else {
    print_calibration(out, machine);
    out << "wrote " << f.out << " (ptdp predict|plan|simulate --cluster " << f.out << ")\n";
  }
  return 0;
}

}  // namespace

Action add_calibrate_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "calibrate",
      "measure this machine's kernels, memory and collectives and fit the cost model to them "
      "(mpirun -np N ptdp calibrate ... for the collectives)");
  auto f = std::make_shared<CalibrateFlags>();
  f->job.add_model_flags(*sub);
  sub->add_option("--backend", f->backend,
                  "cpu (Eigen kernels, MPI collectives), cuda (the CUDA backend's kernels, NCCL "
                  "collectives where each rank has a GPU of its own) or cpu-staged (the CPU "
                  "kernels through the device paths, for tests)")
      ->capture_default_str();
  sub->add_flag("--quick", f->quick, "fewer sizes and shorter timings");
  sub->add_flag(
      "--bf16", f->bf16,
      "measure the kernels on bf16 weights and activations, as ptdp run --bf16 runs them");
  sub->add_flag(
      "--fp16", f->fp16,
      "measure the kernels on fp16 weights and activations, as ptdp run --fp16 runs them");
  sub->add_option("--time-limit-s", f->time_limit_s,
                  "bound the measurements' time (shorter timings; 0: no bound)");
  sub->add_option("--group-sizes", f->group_sizes,
                  "time the collectives over groups of these sizes (each dividing the ranks; "
                  "default: every divisor from 2)")
      ->delimiter(',');
  sub->add_option("--out", f->out, "the machine file to write")->required();
  sub->add_flag("--json", f->json, "print the fits as JSON");
  return [f](std::ostream& out, std::ostream& err) { return calibrate_main(*f, out, err); };
}

}  // namespace ptdp
