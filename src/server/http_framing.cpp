// RequestParser and the framing checks of http_framing.h.
#include "deepinfer/server/http_framing.h"

#include <fmt/format.h>

#include <algorithm>

namespace deepinfer::server {
namespace beast = boost::beast;

namespace {
// Beast 1.81's basic_fields throws std::length_error when a name's or value's size + 2 exceeds 65,535
// (basic_fields::new_element), i.e. from 65,534 bytes on: refuse those before they reach it.
constexpr size_t kMaxFieldPartBytes = 65533;
constexpr size_t kBodyReserveBytes = 64 * 1024;  // most reserved up front; the rest grows as bytes arrive

// A field's value without its optional whitespace (spaces and tabs) on either side.
std::string_view trimmed(beast::string_view value) {
  std::string_view out(value.data(), value.size());
  while (!out.empty() && (out.front() == ' ' || out.front() == '\t')) out.remove_prefix(1);
  while (!out.empty() && (out.back() == ' ' || out.back() == '\t')) out.remove_suffix(1);
  return out;
}
}  // namespace

RequestParser::RequestParser(const HttpLimits& limits) : limits_(limits) {
  header_limit(static_cast<std::uint32_t>(std::min<size_t>(limits.max_header_bytes, UINT32_MAX)));
  body_limit(limits.max_body_bytes);
}

void RequestParser::on_request_impl(http::verb method, beast::string_view method_string, beast::string_view target,
                                    int version, beast::error_code& ec) {
  ec = {};
  message_.target(target);
  if (method != http::verb::unknown) {
    message_.method(method);
  } else {
    message_.method_string(method_string);
  }
  message_.version(static_cast<unsigned>(version));
}

void RequestParser::on_response_impl(int, beast::string_view, int, beast::error_code& ec) {
  ec = http::error::bad_method;  // a request parser
}

void RequestParser::on_field_impl(http::field name, beast::string_view name_string, beast::string_view value,
                                  beast::error_code& ec) {
  ec = {};
  const size_t bytes = name_string.size() + value.size() + 4;  // ": " and CRLF
  if (name_string.size() > kMaxFieldPartBytes || value.size() > kMaxFieldPartBytes) {
    ec = http::error::header_limit;
    return;
  }
  if (is_header_done()) {  // a trailer field of a chunked body: counted, then dropped
    trailer_bytes_ += bytes;
    if (trailer_bytes_ > limits_.max_header_bytes) ec = http::error::header_limit;
    return;
  }
  field_bytes_ += bytes;
  if (field_bytes_ > limits_.max_header_bytes) {
    ec = http::error::header_limit;
    return;
  }
  message_.insert(name, name_string, value);
}

void RequestParser::on_header_impl(beast::error_code& ec) { ec = {}; }

void RequestParser::on_body_init_impl(const boost::optional<std::uint64_t>& content_length, beast::error_code& ec) {
  ec = {};
  if (content_length) {
    if (*content_length > limits_.max_body_bytes) {
      ec = http::error::body_limit;
      return;
    }
    message_.body().reserve(static_cast<size_t>(std::min<std::uint64_t>(*content_length, kBodyReserveBytes)));
  }
}

std::size_t RequestParser::on_body_impl(beast::string_view body, beast::error_code& ec) {
  ec = {};
  if (message_.body().size() + body.size() > limits_.max_body_bytes) {
    ec = http::error::body_limit;
    return 0;
  }
  message_.body().append(body.data(), body.size());
  return body.size();
}

void RequestParser::on_chunk_header_impl(std::uint64_t, beast::string_view, beast::error_code& ec) { ec = {}; }

std::size_t RequestParser::on_chunk_body_impl(std::uint64_t, beast::string_view body, beast::error_code& ec) {
  return on_body_impl(body, ec);
}

void RequestParser::on_finish_impl(beast::error_code& ec) { ec = {}; }

std::optional<FramingError> check_framing(const http::request_header<>& header) {
  if (header.version() >= 11 && header.find(http::field::host) == header.end()) {
    return FramingError{400, "malformed HTTP request: HTTP/1.1 requires a Host header (RFC 9112 section 3.2)"};
  }
  if (header.count(http::field::host) > 1) {
    return FramingError{400, "malformed HTTP request: more than one Host header"};
  }
  // A compressed body would be parsed as JSON as it is: refused (RFC 9110 section 15.5.16), "identity" only.
  const auto [first, last] = header.equal_range(http::field::content_encoding);
  for (auto field = first; field != last; ++field) {
    const std::string_view coding = trimmed(field->value());
    if (!coding.empty() && !beast::iequals(coding, "identity")) {
      return FramingError{415, fmt::format("Content-Encoding '{}' is not supported: send the body uncompressed",
                                           std::string(field->value().substr(0, 200)))};
    }
  }
  const auto te = header.find(http::field::transfer_encoding);
  if (te == header.end()) return std::nullopt;
  if (header.version() < 11) {
    return FramingError{400, "malformed HTTP request: Transfer-Encoding on an HTTP/1.0 request"};
  }
  // Exactly one coding, "chunked" (any case, optional whitespace), in exactly one field.
  const std::string_view value = trimmed(te->value());
  if (header.count(http::field::transfer_encoding) != 1 || !beast::iequals(value, "chunked")) {
    std::string shown(te->value().substr(0, 200));
    return FramingError{501, fmt::format("Transfer-Encoding '{}' is not supported: send the body as is, with "
                                         "Content-Length, or with 'Transfer-Encoding: chunked' alone",
                                         shown)};
  }
  return std::nullopt;
}

std::optional<FramingError> parse_error_response(const beast::error_code& ec, const HttpLimits& limits) {
  if (ec == http::error::header_limit || ec == http::error::buffer_overflow) {
    return FramingError{431, fmt::format("the request's header or trailer fields are larger than the server's limit "
                                         "of {} bytes (--max-header-bytes)",
                                         limits.max_header_bytes)};
  }
  if (ec == http::error::body_limit) {
    return FramingError{413, fmt::format("the request body is larger than the server's limit of {} bytes "
                                         "(--max-body-bytes)",
                                         limits.max_body_bytes)};
  }
  static const boost::system::error_category& category =
      http::make_error_code(http::error::end_of_stream).category();
  if (ec.category() == category && ec != http::error::end_of_stream && ec != http::error::partial_message) {
    return FramingError{400, "malformed HTTP request: " + ec.message()};
  }
  return std::nullopt;
}

std::string loggable_target(std::string_view target) {
  const size_t query = target.find('?');
  if (query == std::string_view::npos) return std::string(target.substr(0, 512));
  return std::string(target.substr(0, std::min<size_t>(query, 512))) + "?…";
}

}  // namespace deepinfer::server
