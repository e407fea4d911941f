// InputError: the one exception type for bad user input (files, flags, presets).
// Its message is a single line that starts with the offending field or flag, e.g.
//   "tensor_model_parallel_size: 3 does not divide num_attention_heads (96)".
// The CLI turns it into a message on stderr and exit status 2.
#pragma once

#include <stdexcept>
#include <string>

namespace ptdp {

class InputError : public std::runtime_error {
 public:
  // Line breaks and other control characters in either part (they may come from the input:
  // a JSON key, a flag's value) are shown as escapes, so that the message stays one line.
  InputError(const std::string& field, const std::string& problem)
      : std::runtime_error(one_line(field) + ": " + one_line(problem)), field_(one_line(field)) {}
  const std::string& field() const { return field_; }

 private:
  static std::string one_line(const std::string& s) {
    std::string out;
    out.reserve(s.size());
    for (const char c : s) {
      if (c == '\n') {
        out += "\\n";
      } else if (c == '\r') {
        out += "\\r";
      } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
        const char* hex = "0123456789abcdef";
        out += "\\x";
        out += hex[(static_cast<unsigned char>(c) >> 4) & 0xf];
        out += hex[static_cast<unsigned char>(c) & 0xf];
      } else {
        out += c;
      }
    }
    return out;
  }
  std::string field_;
};

}  // namespace ptdp
