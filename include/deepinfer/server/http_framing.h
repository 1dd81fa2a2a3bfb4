// HTTP/1 request framing with the server's limits, in plain (non-coroutine) code so that the fuzzer
// (fuzz/fuzz_http_framing.cpp) drives exactly what `deepinfer serve` runs: a Beast parser that never throws
// (field sizes, header + trailer bytes and body bytes are limits that end the parse with an error code), and
// the checks RFC 9112 asks of a server once the header is in (Host, Transfer-Encoding).
#pragma once

#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace deepinfer::server {

namespace http = boost::beast::http;

struct HttpLimits {
  // Bytes of the request line and header fields, and separately of all trailer fields (name + value + 4 per
  // field) of a chunked body: over either is 431. Also bounds how much the connection buffers while it waits
  // for the end of a header or trailer (see connection_buffer_bytes()).
  size_t max_header_bytes = 64 * 1024;
  // Body bytes after de-chunking: over is 413.
  uint64_t max_body_bytes = 16ull << 20;
};

// The most bytes a connection buffers at once: one header (or trailer) plus one 64 KiB read. Give the
// connection's beast::flat_buffer this as its limit; more ends the read with http::error::buffer_overflow.
inline size_t connection_buffer_bytes(const HttpLimits& limits) { return limits.max_header_bytes + 64 * 1024; }

// A request parser (Beast's basic_parser, like http::request_parser<string_body>) that enforces HttpLimits
// without exceptions: a field name or value Beast's fields cannot store (>= 65,534 bytes), header fields or
// trailer fields beyond max_header_bytes end the parse with http::error::header_limit; a body beyond
// max_body_bytes with http::error::body_limit. Trailer fields are counted and then discarded (RFC 9110
// §6.5.1 lets a recipient drop them; nothing here uses them). The body buffer grows with what arrives, never
// reserved up front from Content-Length. One parser per request. Not thread-safe.
class RequestParser final : public http::basic_parser<true> {
 public:
  explicit RequestParser(const HttpLimits& limits);

  http::request<http::string_body>& get() { return message_; }
  const http::request<http::string_body>& get() const { return message_; }
  http::request<http::string_body> release() { return std::move(message_); }
  size_t trailer_bytes() const { return trailer_bytes_; }

 private:
  void on_request_impl(http::verb method, boost::beast::string_view method_string, boost::beast::string_view target,
                       int version, boost::beast::error_code& ec) override;
  void on_response_impl(int, boost::beast::string_view, int, boost::beast::error_code& ec) override;
  void on_field_impl(http::field name, boost::beast::string_view name_string, boost::beast::string_view value,
                     boost::beast::error_code& ec) override;
  void on_header_impl(boost::beast::error_code& ec) override;
  void on_body_init_impl(const boost::optional<std::uint64_t>& content_length, boost::beast::error_code& ec) override;
  std::size_t on_body_impl(boost::beast::string_view body, boost::beast::error_code& ec) override;
  void on_chunk_header_impl(std::uint64_t size, boost::beast::string_view extensions,
                            boost::beast::error_code& ec) override;
  std::size_t on_chunk_body_impl(std::uint64_t remain, boost::beast::string_view body,
                                 boost::beast::error_code& ec) override;
  void on_finish_impl(boost::beast::error_code& ec) override;

  HttpLimits limits_;
  http::request<http::string_body> message_;
  size_t field_bytes_ = 0;
  size_t trailer_bytes_ = 0;
};

// Why a request whose header parsed must still be refused before its body is read (RFC 9112): HTTP/1.1
// without Host (§3.2: 400); a Transfer-Encoding other than exactly "chunked" (gzip, compress, ..., or
// chunked twice: 501, since the body could not be read as sent); Transfer-Encoding on HTTP/1.0 (§6.1: 400).
struct FramingError {
  int status = 400;
  std::string message;
};
std::optional<FramingError> check_framing(const http::request_header<>& header);

// The status and message the server answers a parse error with, or nullopt for errors that just end the
// connection (the client went away, a timeout). header_limit and buffer_overflow: 431; body_limit: 413 (the
// caller words that one with --max-body-bytes); other protocol errors: 400 "malformed HTTP request: ...".
std::optional<FramingError> parse_error_response(const boost::beast::error_code& ec, const HttpLimits& limits);

// The request target as the access log may show it: the path only (a query string may carry a credential,
// e.g. ?api_key=..., and is replaced by "?…").
std::string loggable_target(std::string_view target);

}  // namespace deepinfer::server
