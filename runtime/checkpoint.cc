#include "runtime/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

#include "core/error.h"
#include "core/output_file.h"
#include "core/presets.h"
#include "kernels/cpu/hash.h"

namespace ptdp {
namespace {

constexpr char kMagic[] = "PTDPCKPT1\n";

// The error of a failed write: InputError("--save", ...) naming the path and the system's
// reason (a full disk, a file-size limit, permissions).
InputError save_error(const std::string& what, const std::string& path, int err) {
  return InputError("--save", "cannot " + what + " " + path + ": " + std::strerror(err));
}

// The fields of two layouts that differ, as "key <checkpoint's value> in the checkpoint,
// <this run's value> here" (one level into objects such as the model), at most four of them.
std::string differences(const nlohmann::json& saved, const nlohmann::json& now) {
  std::vector<std::string> out;
  auto walk = [&](const auto& self, const nlohmann::json& a, const nlohmann::json& b,
                  const std::string& prefix, int depth) -> void {
    if (a == b) return;
    if (a.is_object() && b.is_object() && depth < 2) {
      std::set<std::string> keys;
      for (const auto& [k, v] : a.items()) keys.insert(k);
      for (const auto& [k, v] : b.items()) keys.insert(k);
      for (const std::string& k : keys)
        self(self, a.value(k, nlohmann::json()), b.value(k, nlohmann::json()), prefix + k + ".",
             depth + 1);
      return;
    }
    const std::string name = prefix.empty() ? "layout" : prefix.substr(0, prefix.size() - 1);
    auto value = [](const nlohmann::json& j) {
      return j.is_null() ? std::string("absent") : j.dump();
    };
    out.push_back(name + " " + value(a) + " in the checkpoint, " + value(b) + " here");
  };
  walk(walk, saved, now, "", 0);
  std::string text;
  for (size_t i = 0; i < out.size() && i < 4; ++i) text += (i ? "; " : "") + out[i];
  if (out.size() > 4) text += "; and " + std::to_string(out.size() - 4) + " more";
  return text;
}

// A short description of a layout for error messages; "?" for what a damaged file lacks.
std::string describe(const nlohmann::json& l) {
  auto get = [&](const char* key) {
    return l.is_object() && l.contains(key) ? l[key].dump() : std::string("?");
  };
  const bool distributed =
      l.is_object() && l.value("distributed_optimizer", nlohmann::json()) == true;
  std::ostringstream s;
  s << "t=" << get("t") << " p=" << get("p") << " d=" << get("d") << " v=" << get("v")
    << (l.is_object() && l.contains("cp") ? " cp=" + get("cp") : std::string())
    << (distributed ? " distributed optimizer" : "");
  return s.str();
}

}  // namespace

std::string checkpoint_step_dir(const std::string& dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%07lld", static_cast<long long>(step));
  return (std::filesystem::path(dir) / name).string();
}

std::string checkpoint_file(const std::string& dir, int64_t step, int64_t rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank_%05lld.bin", static_cast<long long>(rank));
  return (std::filesystem::path(checkpoint_step_dir(dir, step)) / name).string();
}

void write_checkpoint_shard(const std::string& dir, int64_t rank, int64_t step,
                            const nlohmann::json& layout,
                            const std::vector<std::span<const float>>& arrays) {
  std::error_code ec;
  std::filesystem::create_directories(checkpoint_step_dir(dir, step), ec);
  if (ec) throw save_error("create", checkpoint_step_dir(dir, step), ec.value());
  // The rank is recorded so that shards swapped or renamed between ranks are refused on load
  // (ranks of one layout can hold arrays of the same sizes, e.g. tensor-parallel halves).
  nlohmann::json header = {
      {"step", step}, {"rank", rank}, {"layout", layout}, {"arrays", nlohmann::json::array()}};
  for (const auto& a : arrays) header["arrays"].push_back(a.size());
  std::string bytes = kMagic;
  bytes += header.dump() + "\n";
  for (const auto& a : arrays)
    bytes.append(reinterpret_cast<const char*>(a.data()), a.size() * sizeof(float));
  const uint64_t sum = fnv1a(bytes);
  bytes.append(reinterpret_cast<const char*>(&sum), sizeof sum);
  write_file_atomically(checkpoint_file(dir, step, rank), bytes, "--save");
}

void write_latest(const std::string& dir, int64_t step) {
  write_file_atomically((std::filesystem::path(dir) / "latest").string(),
                        std::to_string(step) + "\n", "--save");
}

std::vector<int64_t> prune_checkpoints(const std::string& dir, int64_t latest, int64_t keep) {
  std::vector<int64_t> older;  // steps of the complete checkpoints before `latest`
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() != 12 || name.compare(0, 5, "step_") != 0 ||
        name.find_first_not_of("0123456789", 5) != std::string::npos)
      continue;
    const int64_t step = std::stoll(name.substr(5));
    if (step < latest) older.push_back(step);
  }
  std::sort(older.rbegin(), older.rend());
  std::vector<int64_t> removed;
  for (size_t i = static_cast<size_t>(std::max<int64_t>(keep - 1, 0)); i < older.size(); ++i) {
    std::filesystem::remove_all(checkpoint_step_dir(dir, older[i]), ec);
    if (ec) throw std::runtime_error("cannot remove " + checkpoint_step_dir(dir, older[i]));
    removed.push_back(older[i]);
  }
  return removed;
}

int64_t read_latest(const std::string& dir) {
  std::ifstream in(std::filesystem::path(dir) / "latest");
  std::string text;
  if (in) std::getline(in, text, '\0');
  // Exactly what write_latest writes: decimal digits and one newline.
  if (!text.empty() && text.back() == '\n') text.pop_back();
  if (!in || text.empty() || text.size() > 18 ||
      text.find_first_not_of("0123456789") != std::string::npos)
    throw InputError("--load", "no checkpoint in " + dir + " (no readable 'latest' file)");
  return std::stoll(text);
}

CheckpointShard read_checkpoint_shard(const std::string& dir, int64_t rank, int64_t step,
                                      const nlohmann::json& expected) {
  const std::string path = checkpoint_file(dir, step, rank);
  check_regular_input(path, "--load");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw InputError("--load", "no shard for rank " + std::to_string(rank) + " at " + path +
                                   " (a checkpoint of another layout?)");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t magic = sizeof kMagic - 1;
  if (bytes.size() < magic + sizeof(uint64_t) || bytes.compare(0, magic, kMagic) != 0)
    throw InputError("--load", path + " is not a ptdp checkpoint");
  uint64_t stored = 0;
  std::memcpy(&stored, bytes.data() + bytes.size() - sizeof stored, sizeof stored);
  const size_t body = bytes.size() - sizeof stored;
  if (fnv1a(std::string_view(bytes).substr(0, body)) != stored)
    throw InputError("--load", path + " is corrupt (checksum mismatch)");
  // The header: one JSON object line, {"step": N, "layout": {...}, "arrays": [sizes]}.
  const size_t eol = bytes.find('\n', magic);
  const nlohmann::json header =
      eol < body ? nlohmann::json::parse(bytes.begin() + static_cast<std::ptrdiff_t>(magic),
                                         bytes.begin() + static_cast<std::ptrdiff_t>(eol), nullptr,
                                         /*allow_exceptions=*/false)
                 : nlohmann::json();
  if (!header.is_object() || !header.contains("step") || !header["step"].is_number_integer() ||
      !header.contains("layout") || !header.contains("arrays") || !header["arrays"].is_array())
    throw InputError("--load", path + " has an unreadable header");
  CheckpointShard c;
  c.step = header["step"].get<int64_t>();
  c.layout = header["layout"];
  if (c.step != step)
    throw InputError("--load", path + " holds step " + std::to_string(c.step) + ", not step " +
                                   std::to_string(step) + " as its directory and 'latest' say");
  if (!header.contains("rank"))
    throw InputError("--load", path + " was written by a ptdp older than 2026-11-25, whose " +
                                   "shards do not record their rank; save the run again");
  if (!header["rank"].is_number_integer() || header["rank"].get<int64_t>() != rank)
    throw InputError("--load", path + " holds the shard of rank " + header["rank"].dump() +
                                   ", not of rank " + std::to_string(rank) +
                                   " (shards swapped or renamed?)");
  if (c.layout != expected) {
    const std::string was = describe(c.layout), now = describe(expected);
    throw InputError("--load",
                     "the checkpoint in " + dir + " was written by " +
                         (was == now ? "another model or batch (same layout, " + was + ")"
                                     : "another layout (" + was + ") than this run (" + now + ")") +
                         ": " + differences(c.layout, expected));
  }
  size_t pos = eol + 1;
  for (const auto& n : header["arrays"]) {
    // Sizes are compared with what the file holds before anything is allocated.
    if (!n.is_number_unsigned() || n.get<uint64_t>() > (body - pos) / sizeof(float))
      throw InputError("--load", path + " is truncated");
    const size_t count = n.get<size_t>();
    std::vector<float> a(count);
    if (count > 0) std::memcpy(a.data(), bytes.data() + pos, count * sizeof(float));
    pos += count * sizeof(float);
    c.arrays.push_back(std::move(a));
  }
  if (pos != body) throw InputError("--load", path + " is corrupt (bytes after its arrays)");
  return c;
}

}  // namespace ptdp
