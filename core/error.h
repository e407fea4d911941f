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
  InputError(std::string field, const std::string& problem)
      : std::runtime_error(field + ": " + problem), field_(std::move(field)) {}
  const std::string& field() const { return field_; }

 private:
  std::string field_;
};

}  // namespace ptdp
