// BACKEND_CHECK: the CUDA backend's invariant check. backend.h makes shape mismatches programming errors that
// abort (mini-sglang's RuntimeCheck, built on std::source_location); device faults and memory exhaustion are
// Status values instead. The message expression is evaluated only on failure.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <source_location>
#include <string>

namespace deepinfer::backend::cuda {

[[noreturn]] inline void check_failed(const char* condition, const std::string& message,
                                      std::source_location where = std::source_location::current()) {
  std::fprintf(stderr, "%s:%u: CUDA backend check failed: %s (%s)\n", where.file_name(),
               static_cast<unsigned>(where.line()), message.c_str(), condition);
  std::abort();
}

}  // namespace deepinfer::backend::cuda

#define BACKEND_CHECK(condition, message)                                              \
  do {                                                                                 \
    if (!(condition)) ::deepinfer::backend::cuda::check_failed(#condition, (message)); \
  } while (0)
