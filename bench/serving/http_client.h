// The benchmarks' HTTP side, shared by bench_serving and bench_replay --live: a blocking keep-alive HTTP/1.1
// client (Boost.Beast) for one connection, an incremental SSE scanner, and latency percentiles. Plain http://
// only; nothing here knows the OpenAI request shapes.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/verb.hpp>
#include <boost/json/object.hpp>
#include <chrono>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/core/status.h"

namespace deepinfer::bench {

using BenchClock = std::chrono::steady_clock;

double ms_between(BenchClock::time_point start, BenchClock::time_point end);

struct HttpUrl {
  std::string host = "127.0.0.1";
  std::string port = "8000";
  std::string base_path;  // "" or "/prefix", without a trailing "/" or "/v1"
};

// "http://host:port[/prefix][/v1]" -> HttpUrl. Errors: InvalidArgument for another scheme.
Result<HttpUrl> parse_http_url(const std::string& text);

// One keep-alive connection; connects lazily and reconnects after the server closed it. A request that fails on
// a reused connection before any response byte (the server dropped it while idle) is retried once on a new
// one. Not thread-safe: one client per thread. Errors (connect, write, read) come back as IoError naming the
// host, port and path; the connection is then closed, so the next call starts a fresh one.
class HttpClient {
 public:
  HttpClient(HttpUrl url, std::string api_key);

  struct Response {
    int status = 0;
    std::string body;
  };

  // `path` is appended to the URL's base path; the body is sent as application/json.
  Result<Response> request(boost::beast::http::verb method, const std::string& path, const std::string& body);

  // POSTs `body` and calls on_bytes(body received so far, arrival time) after every read once the headers are in,
  // until the response ends. Returns the HTTP status.
  using OnBytes = std::function<void(const std::string& body_so_far, BenchClock::time_point now)>;
  Result<int> stream(const std::string& path, const std::string& body, const OnBytes& on_bytes);

  void disconnect();

 private:
  void ensure_connected();
  void write(boost::beast::http::verb method, const std::string& path, const std::string& body);
  Status io_error(const std::string& path, const std::exception& e);

  HttpUrl url_;
  std::string api_key_;
  boost::asio::io_context io_;
  boost::asio::ip::tcp::socket socket_;
  boost::beast::flat_buffer buffer_;
};

// Incremental SSE: feeds each complete event's `data:` payload (lines joined with "\n") found in `body` from
// `consumed` on to on_data, and advances `consumed` past it. A partial event at the end is left for later.
void scan_sse(const std::string& body, size_t& consumed, const std::function<void(const std::string&)>& on_data);

struct LatencyStats {
  double p50 = 0, p90 = 0, p99 = 0, mean = 0;
};

// Percentiles by linear interpolation between closest ranks (numpy's default); all zero when empty.
LatencyStats summarize_latencies(std::vector<double> values);

// {"p50", "p90", "p99", "mean"}, rounded to 3 decimals.
boost::json::object latency_json(const LatencyStats& stats);

}  // namespace deepinfer::bench
