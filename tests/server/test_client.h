// A small blocking HTTP/1.1 client for the server tests (Boost.Beast), with keep-alive, raw sends, SSE
// parsing, and a streaming read that can stop part-way (to disconnect mid-stream).
#pragma once

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/json.hpp>
#include <cctype>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace deepinfer::server::testing {

struct HttpResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;
  bool keep_alive = false;

  boost::json::value json() const { return boost::json::parse(body); }
};

class TestClient {
 public:
  explicit TestClient(uint16_t port) : port_(port), socket_(io_) { connect(); }

  void connect() {
    boost::system::error_code ec;
    socket_.close(ec);
    socket_ = boost::asio::ip::tcp::socket(io_);
    socket_.connect({boost::asio::ip::make_address("127.0.0.1"), port_});
    buffer_.clear();
  }

  HttpResponse request(boost::beast::http::verb method, const std::string& target, const std::string& body = {},
                       std::vector<std::pair<std::string, std::string>> headers = {}) {
    namespace http = boost::beast::http;
    http::request<http::string_body> req{method, target, 11};
    req.set(http::field::host, "127.0.0.1");
    req.set(http::field::content_type, "application/json");
    for (auto& [name, value] : headers) req.set(name, value);
    req.body() = body;
    req.keep_alive(true);
    req.prepare_payload();
    http::write(socket_, req);
    return read_response();
  }

  HttpResponse post(const std::string& target, const std::string& body,
                    std::vector<std::pair<std::string, std::string>> headers = {}) {
    return request(boost::beast::http::verb::post, target, body, std::move(headers));
  }
  HttpResponse get(const std::string& target, std::vector<std::pair<std::string, std::string>> headers = {}) {
    return request(boost::beast::http::verb::get, target, {}, std::move(headers));
  }

  // Sends raw bytes (for malformed requests) and reads one response.
  HttpResponse raw(const std::string& bytes) {
    boost::asio::write(socket_, boost::asio::buffer(bytes));
    return read_response();
  }

  // Sends a request and reads its response until `enough(body so far)` holds; returns the body so far.
  template <class Predicate>
  std::string stream_until(const std::string& target, const std::string& body, Predicate enough) {
    namespace http = boost::beast::http;
    http::request<http::string_body> req{http::verb::post, target, 11};
    req.set(http::field::host, "127.0.0.1");
    req.set(http::field::content_type, "application/json");
    req.body() = body;
    req.prepare_payload();
    http::write(socket_, req);
    http::response_parser<http::string_body> parser;
    parser.body_limit(boost::none);
    while (!parser.is_done()) {
      http::read_some(socket_, buffer_, parser);
      if (parser.is_header_done() && enough(parser.get().body())) break;
    }
    return parser.get().body();
  }

  void close() {
    boost::system::error_code ec;
    socket_.shutdown(boost::asio::ip::tcp::socket::shutdown_both, ec);
    socket_.close(ec);
  }

 private:
  HttpResponse read_response() {
    namespace http = boost::beast::http;
    http::response_parser<http::string_body> parser;
    parser.body_limit(boost::none);
    http::read(socket_, buffer_, parser);
    HttpResponse out;
    out.status = static_cast<int>(parser.get().result_int());
    for (const auto& field : parser.get()) {
      std::string name(field.name_string());
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      out.headers[name] = std::string(field.value());
    }
    out.keep_alive = parser.get().keep_alive();
    out.body = parser.get().body();
    return out;
  }

  uint16_t port_;
  boost::asio::io_context io_;
  boost::asio::ip::tcp::socket socket_;
  boost::beast::flat_buffer buffer_;
};

// The `data:` payloads of an SSE body, in order, "[DONE]" included as a string value.
struct SseEvent {
  std::string event;  // the `event:` line, if any
  std::string data;
};

inline std::vector<SseEvent> parse_sse(const std::string& body) {
  std::vector<SseEvent> events;
  SseEvent current;
  size_t start = 0;
  while (start < body.size()) {
    size_t end = body.find('\n', start);
    if (end == std::string::npos) end = body.size();
    std::string line = body.substr(start, end - start);
    start = end + 1;
    if (line.empty()) {
      if (!current.data.empty() || !current.event.empty()) events.push_back(std::move(current));
      current = {};
    } else if (line.starts_with("data: ")) {
      current.data += line.substr(6);
    } else if (line.starts_with("event: ")) {
      current.event = line.substr(7);
    }
  }
  return events;
}

}  // namespace deepinfer::server::testing
