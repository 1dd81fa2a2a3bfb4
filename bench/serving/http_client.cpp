// Blocking Beast client, SSE scanning and percentiles for the benchmark programs (see http_client.h).
#include "http_client.h"

#include <algorithm>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/http.hpp>
#include <cmath>
#include <exception>

namespace deepinfer::bench {

namespace asio = boost::asio;
namespace http = boost::beast::http;

double ms_between(BenchClock::time_point start, BenchClock::time_point end) {
  return std::chrono::duration<double, std::milli>(end - start).count();
}

Result<HttpUrl> parse_http_url(const std::string& text) {
  HttpUrl url;
  std::string rest = text;
  if (rest.starts_with("http://")) {
    rest = rest.substr(7);
  } else if (rest.find("://") != std::string::npos) {
    return Status::invalid_argument("only http:// URLs are supported: " + text);
  }
  const size_t slash = rest.find('/');
  const std::string authority = rest.substr(0, slash);
  if (slash != std::string::npos) url.base_path = rest.substr(slash);
  while (!url.base_path.empty() && url.base_path.back() == '/') url.base_path.pop_back();
  if (url.base_path.ends_with("/v1")) url.base_path.resize(url.base_path.size() - 3);
  const size_t colon = authority.rfind(':');
  if (colon != std::string::npos) {
    url.host = authority.substr(0, colon);
    url.port = authority.substr(colon + 1);
  } else {
    url.host = authority;
    url.port = "80";
  }
  if (url.host.empty()) return Status::invalid_argument("no host in URL " + text);
  return url;
}

HttpClient::HttpClient(HttpUrl url, std::string api_key)
    : url_(std::move(url)), api_key_(std::move(api_key)), socket_(io_) {}

Status HttpClient::io_error(const std::string& path, const std::exception& e) {
  disconnect();
  return Status::io_error("http://" + url_.host + ":" + url_.port + url_.base_path + path + ": " + e.what());
}

// A kept-alive connection the server has meanwhile closed (idle timeout) fails on first use with nothing
// received; such a request is sent once more on a fresh connection. Any other failure is returned.
Result<HttpClient::Response> HttpClient::request(http::verb method, const std::string& path, const std::string& body) {
  for (int attempt = 0;; ++attempt) {
    const bool reused = socket_.is_open();
    http::response_parser<http::string_body> parser;
    parser.body_limit(boost::none);
    try {
      ensure_connected();
      write(method, path, body);
      http::read(socket_, buffer_, parser);
      Response out{static_cast<int>(parser.get().result_int()), std::move(parser.get().body())};
      if (!parser.get().keep_alive()) disconnect();
      return out;
    } catch (const std::exception& e) {
      if (reused && attempt == 0 && !parser.got_some()) {
        disconnect();
        continue;
      }
      return io_error(path, e);
    }
  }
}

Result<int> HttpClient::stream(const std::string& path, const std::string& body, const OnBytes& on_bytes) {
  for (int attempt = 0;; ++attempt) {
    const bool reused = socket_.is_open();
    http::response_parser<http::string_body> parser;
    parser.body_limit(boost::none);
    try {
      ensure_connected();
      write(http::verb::post, path, body);
      while (!parser.is_done()) {
        http::read_some(socket_, buffer_, parser);
        if (parser.is_header_done()) on_bytes(parser.get().body(), BenchClock::now());
      }
      if (!parser.get().keep_alive()) disconnect();
      return static_cast<int>(parser.get().result_int());
    } catch (const std::exception& e) {
      if (reused && attempt == 0 && !parser.got_some()) {
        disconnect();
        continue;
      }
      return io_error(path, e);
    }
  }
}

void HttpClient::disconnect() {
  boost::system::error_code ec;
  socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ec);
  socket_.close(ec);
  buffer_.clear();
}

void HttpClient::ensure_connected() {
  if (socket_.is_open()) return;
  asio::ip::tcp::resolver resolver(io_);
  asio::connect(socket_, resolver.resolve(url_.host, url_.port));
  socket_.set_option(asio::ip::tcp::no_delay(true));
  buffer_.clear();
}

void HttpClient::write(http::verb method, const std::string& path, const std::string& body) {
  http::request<http::string_body> req{method, url_.base_path + path, 11};
  req.set(http::field::host, url_.host);
  req.set(http::field::content_type, "application/json");
  if (!api_key_.empty()) req.set(http::field::authorization, "Bearer " + api_key_);
  req.body() = body;
  req.keep_alive(true);
  req.prepare_payload();
  http::write(socket_, req);
}

void scan_sse(const std::string& body, size_t& consumed, const std::function<void(const std::string&)>& on_data) {
  while (true) {
    const size_t end = body.find("\n\n", consumed);
    if (end == std::string::npos) return;
    std::string_view event(body.data() + consumed, end - consumed);
    consumed = end + 2;
    std::string data;
    size_t start = 0;
    while (start <= event.size()) {
      size_t line_end = event.find('\n', start);
      if (line_end == std::string_view::npos) line_end = event.size();
      std::string_view line = event.substr(start, line_end - start);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.starts_with("data:")) {
        line.remove_prefix(5);
        if (line.starts_with(" ")) line.remove_prefix(1);
        if (!data.empty()) data += '\n';
        data.append(line);
      }
      start = line_end + 1;
    }
    if (!data.empty()) on_data(data);
  }
}

LatencyStats summarize_latencies(std::vector<double> values) {
  LatencyStats s;
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  auto pct = [&](double p) {
    const double rank = p / 100.0 * static_cast<double>(values.size() - 1);
    const size_t lo = static_cast<size_t>(std::floor(rank));
    const size_t hi = std::min(lo + 1, values.size() - 1);
    return values[lo] + (values[hi] - values[lo]) * (rank - static_cast<double>(lo));
  };
  s.p50 = pct(50);
  s.p90 = pct(90);
  s.p99 = pct(99);
  double sum = 0;
  for (double v : values) sum += v;
  s.mean = sum / static_cast<double>(values.size());
  return s;
}

boost::json::object latency_json(const LatencyStats& s) {
  auto r = [](double v) { return std::round(v * 1000.0) / 1000.0; };
  return {{"p50", r(s.p50)}, {"p90", r(s.p90)}, {"p99", r(s.p99)}, {"mean", r(s.mean)}};
}

}  // namespace deepinfer::bench
