#include "simulator/timeline_export.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

namespace ptdp {
namespace {

const char* stream_name(Stream s) {
  switch (s) {
    case Stream::kCompute:
      return "compute";
    case Stream::kTensor:
      return "tensor-parallel comm";
    case Stream::kPipeline:
      return "pipeline p2p";
    case Stream::kData:
      return "data-parallel comm";
    case Stream::kContext:
      return "context";
    case Stream::kExpert:
      return "expert";
  }
  return "?";
}

constexpr int kStreams = 6;  // Stream's values

int track(int rank, Stream stream) {
  return rank * kStreams + static_cast<int>(stream);
}
int track(const Span& s) {
  return track(s.rank, s.stream);
}

// Fill colours: forward blue, backward green, input-gradient teal, weight-gradient orange,
// communication grey/purple, optimizer red. Odd chunks are drawn darker.
std::string colour(const Span& s) {
  const bool dark = s.chunk > 0 && s.chunk % 2 == 1;
  if (s.stream == Stream::kTensor) return dark ? "#8c8c8c" : "#b5b5b5";
  if (s.stream == Stream::kPipeline) return "#d9b3ff";
  if (s.stream == Stream::kData) return "#9467bd";
  if (s.stream == Stream::kContext) return "#e7969c";
  if (s.stream == Stream::kExpert) return "#bcbd22";
  switch (s.kind) {
    case ActionKind::kForward:
      return dark ? "#1f5fa8" : "#6baed6";
    case ActionKind::kBackward:
      return dark ? "#238b45" : "#74c476";
    case ActionKind::kBackwardInput:
      return dark ? "#1b7f7a" : "#66c2a4";
    case ActionKind::kBackwardWeight:
      return dark ? "#d95f0e" : "#fdae6b";
    case ActionKind::kOptimizerStep:
      return "#de2d26";
    default:
      return "#969696";
  }
}

// Chrome's reserved colour names, so chrome://tracing colours by kind too.
const char* chrome_colour(const Span& s) {
  if (s.stream != Stream::kCompute) return "grey";
  switch (s.kind) {
    case ActionKind::kForward:
      return s.chunk % 2 ? "rail_load" : "rail_response";
    case ActionKind::kBackward:
    case ActionKind::kBackwardInput:
      return s.chunk % 2 ? "cq_build_passed" : "good";
    case ActionKind::kBackwardWeight:
      return "yellow";
    case ActionKind::kOptimizerStep:
      return "terrible";
    default:
      return "grey";
  }
}

// Text inside SVG (XML): markup characters as entities, and the control characters XML 1.0
// does not allow (all below 0x20 but tab, line feed and carriage return) as '?'.
std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '&')
      out += "&amp;";
    else if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '"')
      out += "&quot;";
    else if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r')
      out += '?';
    else
      out += c;
  }
  return out;
}

// A JSON string literal, quotes included: backslashes, quotes and control characters escaped,
// bytes that are not UTF-8 replaced (a model name comes from the user's file).
std::string json_string(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string micros(Picos t) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6f", static_cast<double>(t) / 1e6);
  return buf;
}

}  // namespace

std::string span_name(const Span& s) {
  PipelineAction a;
  a.kind = s.kind;
  a.microbatch = s.microbatch;
  a.chunk = s.chunk;
  std::string name = to_string(a);
  if (s.stream == Stream::kTensor) name = "tp " + name;
  if (s.stream == Stream::kContext) name = "cp " + name;
  if (s.stream == Stream::kExpert) name = "ep " + name;
  if (s.stream == Stream::kData && s.kind != ActionKind::kGradSync &&
      s.kind != ActionKind::kEmbeddingSync)
    name = "dp buckets chunk " + std::to_string(s.chunk);
  return name;
}

void write_chrome_trace(std::ostream& out, const std::vector<Span>& spans,
                        const std::string& title) {
  write_chrome_trace(out, spans, title, TraceExtras{});
}

void write_chrome_trace(std::ostream& out, const std::vector<Span>& spans, const std::string& title,
                        const TraceExtras& extras) {
  out << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"title\":" << json_string(title);
  if (!extras.other_data.empty()) out << "," << extras.other_data;
  out << "},\"traceEvents\":[\n";
  std::set<std::pair<int, int>> tracks;
  std::set<int> replicas;
  for (const Span& s : spans) {
    tracks.emplace(s.replica, track(s));
    replicas.insert(s.replica);
  }
  std::set<std::pair<int, int>> op_tracks;
  for (const OpSpan& o : extras.ops) {
    if (o.stream)
      tracks.emplace(o.replica, track(o.rank, *o.stream));
    else
      op_tracks.emplace(o.replica, o.rank);
    replicas.insert(o.replica);
  }
  if (!extras.steps.empty()) replicas.insert(0);
  bool first = true;
  auto sep = [&] {
    if (!first) out << ",\n";
    first = false;
  };
  auto thread = [&](int pid, int tid, const std::string& name, int sort) {
    sep();
    out << "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" << pid << ",\"tid\":" << tid
        << ",\"args\":{\"name\":\"" << name << "\"}}";
    sep();
    out << "{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":" << pid << ",\"tid\":" << tid
        << ",\"args\":{\"sort_index\":" << sort << "}}";
  };
  for (int r : replicas) {
    sep();
    out << "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" << r
        << ",\"args\":{\"name\":\"replica " << r << "\"}}";
  }
  for (const auto& [replica, tid] : tracks)
    thread(replica, tid,
           "pipeline rank " + std::to_string(tid / kStreams) + " " +
               stream_name(static_cast<Stream>(tid % kStreams)),
           tid);
  for (const auto& [replica, rank] : op_tracks)
    thread(replica, kOpTrack + rank, "pipeline rank " + std::to_string(rank) + " ops",
           rank * kStreams);
  if (!extras.steps.empty()) thread(0, kStepTrack, "steps", -1);
  for (const Span& s : spans) {
    PipelineAction code;
    code.kind = s.kind;
    sep();
    out << "{\"ph\":\"X\",\"name\":\"" << span_name(s) << "\",\"cat\":\"" << stream_name(s.stream)
        << "\",\"ts\":" << micros(s.start) << ",\"dur\":" << micros(s.end - s.start)
        << ",\"pid\":" << s.replica << ",\"tid\":" << track(s) << ",\"cname\":\""
        << chrome_colour(s) << "\",\"args\":{\"microbatch\":" << s.microbatch
        << ",\"chunk\":" << s.chunk << ",\"stage\":" << s.rank << ",\"action\":\""
        << to_string(code) << "\"}}";
  }
  for (const OpSpan& o : extras.ops) {
    sep();
    out << "{\"ph\":\"X\",\"name\":" << json_string(o.name)
        << ",\"cat\":" << json_string(o.category) << ",\"ts\":" << micros(o.start)
        << ",\"dur\":" << micros(o.end - o.start) << ",\"pid\":" << o.replica
        << ",\"tid\":" << (o.stream ? track(o.rank, *o.stream) : kOpTrack + o.rank)
        << ",\"args\":{\"microbatch\":" << o.microbatch << ",\"chunk\":" << o.chunk
        << ",\"stage\":" << o.rank;
    if (!o.role.empty()) out << ",\"role\":" << json_string(o.role);
    out << "}}";
  }
  for (const StepSpan& st : extras.steps) {
    sep();
    out << "{\"ph\":\"X\",\"name\":\"step " << st.step
        << "\",\"cat\":\"step\",\"ts\":" << micros(st.start)
        << ",\"dur\":" << micros(st.end - st.start) << ",\"pid\":0,\"tid\":" << kStepTrack
        << ",\"args\":{\"step\":" << st.step << ",\"warmup\":" << (st.warmup ? "true" : "false")
        << "}}";
  }
  out << "\n]}\n";
}

void write_svg(std::ostream& out, const std::vector<Span>& spans, Picos end,
               const std::string& title) {
  // Rows: every (replica, rank, stream) that has a span, in that order.
  std::map<std::tuple<int, int, int>, int> rows;
  for (const Span& s : spans)
    rows.emplace(std::make_tuple(s.replica, s.rank, static_cast<int>(s.stream)), 0);
  int i = 0;
  for (auto& [key, row] : rows) row = i++;
  const double left = 170, top = 46, row_h = 18, width = 1400;
  const double plot_w = width - left - 20;
  const double height = top + row_h * static_cast<double>(rows.size()) + 50;
  const double scale = end > 0 ? plot_w / static_cast<double>(end) : 0;
  char buf[512];
  out << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  std::snprintf(buf, sizeof buf,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"10\">\n",
                width, height);
  out << buf;
  out << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  out << "<text x=\"10\" y=\"18\" font-size=\"14\">" << xml_escape(title) << "</text>\n";
  // Legend.
  const std::pair<const char*, const char*> legend[] = {
      {"#6baed6", "forward"},         {"#74c476", "backward"},       {"#66c2a4", "input grad (B)"},
      {"#fdae6b", "weight grad (W)"}, {"#b5b5b5", "TP collectives"}, {"#d9b3ff", "in p2p call"},
      {"#9467bd", "DP reduction"},    {"#e7969c", "CP ring"},        {"#bcbd22", "EP all-to-all"},
      {"#de2d26", "optimizer"}};
  double lx = left;
  for (const auto& [fill, label] : legend) {
    std::snprintf(buf, sizeof buf,
                  "<rect x=\"%.0f\" y=\"24\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                  "<text x=\"%.0f\" y=\"34\">%s</text>\n",
                  lx, fill, lx + 16, label);
    out << buf;
    lx += 112;
  }
  out << "<text x=\"" << width - 10
      << "\" y=\"34\" text-anchor=\"end\" fill=\"#555\">darker: odd "
         "model chunks; numbers: microbatch</text>\n";
  for (const auto& [key, row] : rows) {
    const auto& [replica, rank, stream] = key;
    const double y = top + row_h * row;
    const bool many = std::get<0>(rows.rbegin()->first) > 0;
    const std::string label = (many ? "replica " + std::to_string(replica) + " " : std::string()) +
                              "stage " + std::to_string(rank) + " " +
                              stream_name(static_cast<Stream>(stream));
    std::snprintf(buf, sizeof buf, "<text x=\"4\" y=\"%.1f\">%s</text>\n", y + 12, label.c_str());
    out << buf;
    if (row % 2 == 0) {
      std::snprintf(
          buf, sizeof buf,
          "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#f4f4f4\"/>\n", left,
          y, plot_w, row_h);
      out << buf;
    }
  }
  for (const Span& s : spans) {
    const double x = left + static_cast<double>(s.start) * scale;
    const double w = std::max(0.5, static_cast<double>(s.end - s.start) * scale);
    const double y =
        top + row_h * rows.at(std::make_tuple(s.replica, s.rank, static_cast<int>(s.stream)));
    const std::string name = span_name(s);
    std::snprintf(buf, sizeof buf,
                  "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\" "
                  "stroke=\"white\" stroke-width=\"0.3\"><title>%s %.3f-%.3f ms</title></rect>\n",
                  x, y + 1, w, row_h - 2, colour(s).c_str(), xml_escape(name).c_str(),
                  static_cast<double>(s.start) / 1e9, static_cast<double>(s.end) / 1e9);
    out << buf;
    if (w > 14 && s.microbatch >= 0 && s.stream == Stream::kCompute) {
      std::snprintf(buf, sizeof buf,
                    "<text x=\"%.2f\" y=\"%.1f\" font-size=\"9\" fill=\"white\">%d</text>\n", x + 2,
                    y + 12, s.microbatch);
      out << buf;
    }
  }
  // Time axis in milliseconds.
  const double axis_y = top + row_h * static_cast<double>(rows.size()) + 10;
  std::snprintf(buf, sizeof buf,
                "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"black\"/>\n", left,
                axis_y, left + plot_w, axis_y);
  out << buf;
  for (int k = 0; k <= 10; ++k) {
    const double x = left + plot_w * k / 10.0;
    std::snprintf(buf, sizeof buf,
                  "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>"
                  "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.2f ms</text>\n",
                  x, axis_y, x, axis_y + 4, x, axis_y + 16,
                  static_cast<double>(end) / 1e9 * k / 10.0);
    out << buf;
  }
  out << "</svg>\n";
}

}  // namespace ptdp
