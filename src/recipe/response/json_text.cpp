// What the response builders share: JSON text as clients expect it, SSE framing, ids, error bodies.
#include <boost/json.hpp>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>

#include "deepinfer/recipe/detokenizer.h"
#include "deepinfer/recipe/response_builder.h"

namespace deepinfer::recipe {
namespace json = boost::json;

namespace {

void append_json(const json::value& value, std::string& out) {
  switch (value.kind()) {
    case json::kind::object: {
      out += '{';
      bool first = true;
      for (const auto& [key, item] : value.get_object()) {
        if (!first) out += ',';
        first = false;
        out += json::serialize(json::string_view(key));
        out += ':';
        append_json(item, out);
      }
      out += '}';
      return;
    }
    case json::kind::array: {
      out += '[';
      bool first = true;
      for (const json::value& item : value.get_array()) {
        if (!first) out += ',';
        first = false;
        append_json(item, out);
      }
      out += ']';
      return;
    }
    case json::kind::double_: {
      const double number = value.get_double();
      if (!std::isfinite(number)) break;  // boost's form (JSON has no spelling for it)
      char buffer[64];
      auto [end, ec] = std::to_chars(buffer, buffer + sizeof(buffer), number);
      std::string text(buffer, end);
      // A whole number keeps a fraction so that it reads back as a float ("12.0", like Python's json).
      if (text.find_first_of(".e") == std::string::npos) text += ".0";
      out += text;
      return;
    }
    default:
      break;
  }
  out += json::serialize(value);
}

std::string_view openai_type(int status) {
  switch (status) {
    case 429:
      return "rate_limit_error";
    default:
      return status >= 500 ? "server_error" : "invalid_request_error";  // 502 from a gateway too
  }
}

std::string_view anthropic_type(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 413:
      return "request_too_large";
    case 429:
      return "rate_limit_error";
    case 503:
    case 529:
      return "overloaded_error";
    default:
      return status >= 500 ? "api_error" : "invalid_request_error";  // 500, and 502 from a gateway
  }
}

}  // namespace

std::string to_json_text(const json::value& value) {
  std::string out;
  append_json(value, out);
  return out;
}

std::string sse_frame(const StreamChunk& chunk) {
  if (chunk.done) return "data: [DONE]\n\n";
  std::string out;
  if (!chunk.event.empty()) out += "event: " + chunk.event + "\n";
  out += "data: ";
  out += to_json_text(chunk.data);
  out += "\n\n";
  return out;
}

std::string sse_frames(std::span<const StreamChunk> chunks) {
  std::string out;
  for (const StreamChunk& chunk : chunks) out += sse_frame(chunk);
  return out;
}

json::object error_object(const ErrorInfo& error, ErrorDialect dialect) {
  // A message may quote request bytes (a path, a header): invalid UTF-8 there becomes U+FFFD, so the body is
  // always valid JSON text.
  std::string message;
  append_utf8_lossy(error.message, message, /*keep_incomplete_tail=*/false);
  if (dialect == ErrorDialect::kAnthropic) {
    return {{"type", "error"}, {"error", {{"type", anthropic_type(error.status)}, {"message", message}}}};
  }
  json::object inner{{"message", message}, {"type", openai_type(error.status)}, {"param", nullptr}, {"code", nullptr}};
  if (!error.param.empty()) inner["param"] = error.param;
  if (!error.code.empty()) inner["code"] = error.code;
  return {{"error", std::move(inner)}};
}

std::string random_id(std::string_view prefix) {
  thread_local std::mt19937_64 generator{std::random_device{}()};
  char digits[32];
  const unsigned long long high = generator();
  const unsigned low = static_cast<uint32_t>(generator());
  std::snprintf(digits, sizeof(digits), "%016llx%08x", high, low);
  std::string out(prefix);
  out += digits;
  return out;
}

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace deepinfer::recipe
