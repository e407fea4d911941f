// InputError: the one exception type for bad user input (files, flags, presets).
// Its message is a single line that starts with the offending field or flag, e.g.
//   "tensor_model_parallel_size: 3 does not divide num_attention_heads (96)".
// The CLI turns it into a message on stderr and exit status 2.
#pragma once

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>

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

// A number as error messages show it: six significant digits (%g, as a stream prints it).
inline std::string error_number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

inline void require_positive(const std::string& field, int64_t value) {
  if (value <= 0) throw InputError(field, "must be positive, got " + std::to_string(value));
}

// Where `word` stands in `text` as a whole identifier (letters, digits and '_' on neither side:
// not hidden_size inside ffn_hidden_size), at or after `from`; npos if nowhere. Error messages
// name fields so, and the CLI renames them by it.
inline size_t find_identifier(std::string_view text, std::string_view word, size_t from = 0) {
  auto part = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  };
  for (size_t at = text.find(word, from); at != std::string_view::npos;
       at = text.find(word, at + 1)) {
    const size_t end = at + word.size();
    if ((at == 0 || !part(text[at - 1])) && (end == text.size() || !part(text[end]))) return at;
  }
  return std::string_view::npos;
}

}  // namespace ptdp
