// Fuzz target: arbitrary bytes as what a client sends on one connection, read the way `deepinfer serve`
// reads it (src/server/http_framing.*: Beast's parser with our limits, a bounded buffer, the framing checks),
// request after request. Nothing may throw or crash; a parsed body never exceeds the limit. The first byte
// picks how the bytes are split into reads (partial headers, chunk boundaries).
#include <boost/beast/core.hpp>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "deepinfer/server/http_framing.h"

using namespace deepinfer::server;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t step = 1 + data[0] % 64;
  std::string_view input(reinterpret_cast<const char*>(data + 1), size - 1);
  HttpLimits limits;
  // Small limits so the fuzzer reaches them; with bit 7 of byte 0, limits above Beast's own field size limit
  // (65,534 bytes), where a field that Beast would throw on must be refused by our parser first.
  limits.max_header_bytes = (data[0] & 0x80) != 0 ? 128 * 1024 : 4096;
  limits.max_body_bytes = 8192;
  boost::beast::flat_buffer buffer(connection_buffer_bytes(limits));
  size_t offset = 0;
  for (int request = 0; request < 16; ++request) {
    RequestParser parser(limits);
    boost::beast::error_code ec;
    bool header_checked = false;
    while (!parser.is_done()) {
      if (buffer.size() == 0 || ec == boost::beast::http::error::need_more) {
        if (offset >= input.size()) return 0;
        const size_t n = std::min(step * 97, input.size() - offset);
        if (buffer.max_size() - buffer.size() < n) return 0;  // the server ends the read: buffer_overflow
        auto space = buffer.prepare(n);
        std::memcpy(space.data(), input.data() + offset, n);
        buffer.commit(n);
        offset += n;
      }
      const size_t used = parser.put(buffer.data(), ec);
      buffer.consume(used);
      if (ec == boost::beast::http::error::need_more) continue;
      if (ec) {
        (void)parse_error_response(ec, limits);
        return 0;
      }
      if (parser.is_header_done() && !header_checked) {
        header_checked = true;
        if (check_framing(parser.get().base())) return 0;  // refused before the body
        (void)loggable_target(std::string_view(parser.get().target().data(), parser.get().target().size()));
      }
    }
    if (parser.get().body().size() > limits.max_body_bytes) abort();
    if (!parser.get().keep_alive()) return 0;
  }
  return 0;
}
