// DEEPINFER_CHECK(cond, message...): an invariant of ours that must hold in every build, release included
// (unlike assert, which the CI's RelWithDebInfo build compiles away). On failure it prints the condition, the
// message and the source location to stderr and aborts: a broken invariant is a bug, and continuing would
// corrupt KV state or answer with wrong tokens. For input errors return a Status instead (status.h).
// The message is only evaluated on failure. Thread-safe.
#pragma once

#include <string_view>

namespace deepinfer::detail {
[[noreturn]] void check_failed(std::string_view condition, std::string_view message, const char* file, int line,
                               const char* function);
}  // namespace deepinfer::detail

// __FILE__/__LINE__ rather than std::source_location: clang 14 (the fuzz and sanitizer builds) lacks it.
#define DEEPINFER_CHECK(cond, ...)                                                                          \
  do {                                                                                                      \
    if (!(cond)) [[unlikely]] {                                                                             \
      ::deepinfer::detail::check_failed(#cond, ::std::string_view{"" __VA_ARGS__}, __FILE__, __LINE__, __func__); \
    }                                                                                                       \
  } while (false)
