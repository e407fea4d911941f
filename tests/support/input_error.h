// What an InputError thrown by a call says: for tests of bad input that name a field.
#pragma once

#include <functional>
#include <string>

#include "core/error.h"

namespace ptdp::test {

// The InputError thrown by f as "field|message", or "no error".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.field() + "|" + e.what();
  }
  return "no error";
}

inline std::string field_of(const std::function<void()>& f) {
  const std::string e = error_of(f);
  return e.substr(0, e.find('|'));
}

inline std::string message_of(const std::function<void()>& f) {
  const std::string e = error_of(f);
  return e.substr(e.find('|') + 1);
}

}  // namespace ptdp::test
