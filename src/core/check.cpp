// The failure path of DEEPINFER_CHECK: one line on stderr, then abort (a core dump keeps the state).
#include "deepinfer/core/check.h"

#include <cstdio>
#include <cstdlib>

namespace deepinfer::detail {

void check_failed(std::string_view condition, std::string_view message, const char* file, int line,
                  const char* function) {
  std::fprintf(stderr, "%s:%d: %s: invariant violated: %.*s%s%.*s\n", file, line, function,
               static_cast<int>(condition.size()),
               condition.data(), message.empty() ? "" : ": ", static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
  std::abort();
}

}  // namespace deepinfer::detail
