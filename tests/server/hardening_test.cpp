// Regression tests of issue 13, each with the input that broke the server at de473f2, against the real server
// in-process: the trailer crash and trailer memory, the key checked before the body, connection caps, a
// handler that throws, the drain deadline, HTTP/1.0 streams, framing refusals, and what the log and
// /v1/models may show.
#include <gtest/gtest.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "server_fixture.h"

namespace deepinfer::server::testing {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using namespace std::chrono_literals;

const std::string kTokenize = R"({"prompt": "hello"})";

// A raw loopback socket: what an attacker sends, byte for byte.
class RawClient {
 public:
  explicit RawClient(uint16_t port) : socket_(io_) { socket_.connect({asio::ip::make_address("127.0.0.1"), port}); }
  // Writes all of `bytes`; false when the server closed or reset the connection meanwhile.
  bool send(const std::string& bytes) {
    boost::system::error_code ec;
    asio::write(socket_, asio::buffer(bytes), ec);
    return !ec;
  }
  // Everything until the server closes (or `timeout`).
  std::string read_all(std::chrono::milliseconds timeout = 10s) { return read_until({}, timeout); }
  // Reads until `until` occurs in what arrived (empty: never), the server closes, or `timeout`.
  std::string read_until(const std::string& until, std::chrono::milliseconds timeout = 10s) {
    std::string out;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    socket_.non_blocking(true);
    char buffer[65536];
    while (std::chrono::steady_clock::now() < deadline && (until.empty() || out.find(until) == std::string::npos)) {
      boost::system::error_code ec;
      const size_t n = socket_.read_some(asio::buffer(buffer), ec);
      if (ec == asio::error::would_block) {
        std::this_thread::sleep_for(2ms);
        continue;
      }
      if (ec) break;
      out.append(buffer, n);
    }
    return out;
  }

 private:
  asio::io_context io_;
  tcp::socket socket_;
};

int status_of(const std::string& response) {
  if (response.size() < 12 || !response.starts_with("HTTP/1.")) return 0;
  return std::stoi(response.substr(9, 3));
}

std::string chunked_head(const std::string& target, const std::string& extra_headers = {}) {
  return "POST " + target + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + extra_headers +
         "Transfer-Encoding: chunked\r\n\r\n" + fmt::format("{:x}\r\n", kTokenize.size()) + kTokenize + "\r\n0\r\n";
}

int64_t rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

void expect_serving(uint16_t port) {
  TestClient client(port);
  EXPECT_EQ(client.get("/health").status, 200);
}

// Regression: a trailer field of 65,535 bytes or more aborted the process (Beast threw "field value too
// large" on an HTTP thread), on any path, with or without a key.
TEST(HardeningTest, TrailerFieldOf65535BytesIsRefusedNotACrash) {
  TestServerOptions options;
  options.config.api_key = "sk-hardening";
  std::unique_ptr<Server> server = start_server(options);
  for (const std::string& name : {std::string("X-Long"), std::string(65535, 'n')}) {
    const bool long_name = name.size() > 1000;
    SCOPED_TRACE(long_name ? "long name" : "long value");
    RawClient client(server->port());
    const std::string field = long_name ? name + ": v\r\n" : name + ": " + std::string(65535, 'v') + "\r\n";
    client.send(chunked_head("/tokenize", "Authorization: Bearer sk-hardening\r\n") + field + "\r\n");
    const std::string response = client.read_all();
    EXPECT_EQ(status_of(response), 431) << response.substr(0, 300);
    EXPECT_NE(response.find("--max-header-bytes"), std::string::npos) << response.substr(0, 300);
    expect_serving(server->port());
  }
  // 65,000 bytes is within the limit: the request is served.
  RawClient client(server->port());
  client.send(chunked_head("/tokenize", "Authorization: Bearer sk-hardening\r\n") + "X-Long: " +
              std::string(65000, 'v') + "\r\n\r\n");
  const std::string response = client.read_until("\r\n\r\n");
  EXPECT_EQ(status_of(response), 200) << response.substr(0, 300);
  // Without the key, the body (and its trailer) is never read: 401 from the header alone.
  RawClient anonymous(server->port());
  anonymous.send(chunked_head("/tokenize") + "X-Long: " + std::string(70000, 'v') + "\r\n\r\n");
  EXPECT_EQ(status_of(anonymous.read_all()), 401);
  expect_serving(server->port());
}

// Regression: trailer bytes counted against no limit: 200 MiB of trailers got a 200 and the RSS stayed
// 211 MiB higher after the connection closed.
TEST(HardeningTest, TrailerBytesAreBoundedAndNothingIsHeld) {
  std::unique_ptr<Server> server = start_server();
  const int64_t rss_before = rss_bytes();
  RawClient client(server->port());
  client.send(chunked_head("/tokenize"));
  const std::string field = "X-Pad: " + std::string(1000, 'p') + "\r\n";
  std::string batch;
  for (int i = 0; i < 256; ++i) batch += field;  // ~256 KB per write
  int64_t sent = 0;
  while (sent < (200ll << 20) && client.send(batch)) sent += static_cast<int64_t>(batch.size());
  const std::string response = client.read_all(2s);
  EXPECT_LT(sent, 64ll << 20) << "the server kept reading trailer bytes";
  EXPECT_EQ(status_of(response), 431) << response.substr(0, 300);
  EXPECT_LT(rss_bytes() - rss_before, 32ll << 20);
  expect_serving(server->port());
}

// Regression: bodies were read whole before the key was checked: 64 stalled 16 MiB bodies held +1 GiB.
TEST(HardeningTest, TheKeyIsCheckedFromTheHeaderBeforeAnyBodyByte) {
  TestServerOptions options;
  options.config.api_key = "sk-hardening";
  std::unique_ptr<Server> server = start_server(options);
  const int64_t rss_before = rss_bytes();
  std::vector<std::unique_ptr<RawClient>> clients;
  for (int i = 0; i < 64; ++i) {
    auto client = std::make_unique<RawClient>(server->port());
    // A 16 MiB body announced, 1 MiB of it sent, then the client stalls.
    client->send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: 16777216\r\n\r\n" +
                 std::string(1 << 20, ' '));
    clients.push_back(std::move(client));
  }
  const auto start = std::chrono::steady_clock::now();
  for (auto& client : clients) {
    const std::string response = client->read_until("\r\n\r\n", 5s);
    EXPECT_EQ(status_of(response), 401) << response.substr(0, 200);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_LT(rss_bytes() - rss_before, 256ll << 20);
  clients.clear();
  expect_serving(server->port());
}

// Regression: no connection cap: with a 256 file-descriptor limit, 300 idle sockets locked every new client
// out. Now a cap (and a per-address share) answers the surplus with 503 at once.
TEST(HardeningTest, ConnectionCapAndPerAddressShare) {
  TestServerOptions options;
  options.config.max_connections = 8;
  options.config.max_connections_per_ip = 4;
  std::unique_ptr<Server> server = start_server(options);
  std::vector<std::unique_ptr<RawClient>> idle;
  for (int i = 0; i < 4; ++i) idle.push_back(std::make_unique<RawClient>(server->port()));
  std::this_thread::sleep_for(100ms);  // accepted
  RawClient over(server->port());
  const std::string refused = over.read_all(5s);
  EXPECT_EQ(status_of(refused), 503) << refused;
  EXPECT_NE(refused.find("too_many_connections"), std::string::npos) << refused;
  EXPECT_NE(refused.find("Retry-After: 1"), std::string::npos) << refused;
  idle.pop_back();  // a slot frees once the server sees the close
  for (int attempt = 0; attempt < 200; ++attempt) {
    std::this_thread::sleep_for(10ms);
    RawClient again(server->port());
    again.send("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    if (status_of(again.read_all(2s)) == 200) return;
  }
  FAIL() << "no slot came back after a connection closed";
}

// What escapes a handler closes that connection only; the server keeps serving on every HTTP thread.
TEST(HardeningTest, AThrowingHandlerEndsItsConnectionOnly) {
  TestServerOptions options;
  options.config.http_threads = 2;
  options.config.test_hook_on_request = [](std::string_view path) {
    if (path == "/boom") throw std::runtime_error("injected failure");
  };
  std::unique_ptr<Server> server = start_server(options);
  for (int i = 0; i < 16; ++i) {
    RawClient client(server->port());
    client.send("GET /boom HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_EQ(client.read_all(5s), "") << "attempt " << i;
    expect_serving(server->port());
  }
}

// Regression: SIGTERM's drain had no deadline (32 streams of 1,000 tokens kept the process alive 82 s).
TEST(HardeningTest, DrainDeadlineEndsStreamsWithAnErrorEventAndStops) {
  TestServerOptions options;
  options.config.shutdown_timeout_seconds = 1;
  std::unique_ptr<Server> server = start_server(options);
  const uint16_t port = server->port();
  std::vector<std::string> bodies(4);
  std::vector<std::thread> streams;
  for (size_t i = 0; i < bodies.size(); ++i) {
    streams.emplace_back([&, i] {
      TestClient client(port);
      bodies[i] = client
                      .post("/v1/chat/completions",
                            R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4000,
                                "ignore_eos": true, "stream": true})")
                      .body;
    });
  }
  for (int attempt = 0; attempt < 400; ++attempt) {
    if (metric_value(TestClient(port).get("/metrics").body, "deepinfer_num_requests_running") == 4) break;
    std::this_thread::sleep_for(10ms);
  }
  TestClient prober(port);  // a keep-alive connection opened before the drain (new ones are refused then)
  EXPECT_EQ(prober.get("/health").status, 200);
  const auto start = std::chrono::steady_clock::now();
  server->shutdown(/*drain=*/true);
  // While it drains, /health says so on a connection still open (a router or load balancer stops sending it
  // requests; regression: 200).
  std::this_thread::sleep_for(50ms);
  const HttpResponse health = prober.get("/health");
  EXPECT_EQ(health.status, 503) << health.body;
  EXPECT_NE(health.body.find("draining"), std::string::npos) << health.body;
  for (std::thread& stream : streams) stream.join();
  server->wait();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 4.0);
  EXPECT_GT(seconds, 0.9);
  for (const std::string& body : bodies) {
    EXPECT_NE(body.find("shutting down"), std::string::npos) << body.substr(body.size() > 300 ? body.size() - 300 : 0);
    EXPECT_TRUE(body.ends_with("data: [DONE]\n\n"));
  }
}

// Regression: HTTP/1.0 clients got chunked SSE (chunk-size lines inside the event stream).
TEST(HardeningTest, Http10StreamsAreRawEventsEndedByClose) {
  std::unique_ptr<Server> server = start_server();
  const std::string body =
      R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "ignore_eos": true, "stream": true})";
  RawClient client(server->port());
  client.send("POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: " +
              std::to_string(body.size()) + "\r\n\r\n" + body);
  const std::string response = client.read_all();
  const size_t header_end = response.find("\r\n\r\n");
  ASSERT_NE(header_end, std::string::npos) << response;
  const std::string header = response.substr(0, header_end);
  EXPECT_TRUE(header.starts_with("HTTP/1.0 200")) << header;
  EXPECT_EQ(header.find("chunked"), std::string::npos) << header;
  const std::string events = response.substr(header_end + 4);
  EXPECT_TRUE(events.starts_with("data: {")) << events.substr(0, 100);
  EXPECT_TRUE(events.ends_with("data: [DONE]\n\n")) << events;
}

// Regression: `Transfer-Encoding: gzip, chunked` was read as plain text; HTTP/1.1 without Host was accepted.
TEST(HardeningTest, FramingTheServerCannotReadIsRefused) {
  std::unique_ptr<Server> server = start_server();
  {
    RawClient client(server->port());
    client.send("POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n" +
                fmt::format("{:x}\r\n", kTokenize.size()) + kTokenize + "\r\n0\r\n\r\n");
    const std::string response = client.read_all();
    EXPECT_EQ(status_of(response), 501) << response;
    EXPECT_NE(response.find("Transfer-Encoding 'gzip, chunked' is not supported"), std::string::npos) << response;
  }
  {
    RawClient client(server->port());
    client.send("POST /tokenize HTTP/1.1\r\nContent-Length: " + std::to_string(kTokenize.size()) + "\r\n\r\n" +
                kTokenize);
    const std::string response = client.read_all();
    EXPECT_EQ(status_of(response), 400) << response;
    EXPECT_NE(response.find("requires a Host header"), std::string::npos) << response;
  }
  {  // Regression (a break-it pass, 2026-12-06): a body declared gzip-compressed was parsed as it was.
    RawClient client(server->port());
    client.send("POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: " +
                std::to_string(kTokenize.size()) + "\r\n\r\n" + kTokenize);
    const std::string response = client.read_all();
    EXPECT_EQ(status_of(response), 415) << response;
    EXPECT_NE(response.find("Content-Encoding 'gzip' is not supported"), std::string::npos) << response;
  }
  {  // identity is no encoding
    RawClient client(server->port());
    client.send("POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Encoding: identity\r\nConnection: close\r\n"
                "Content-Length: " + std::to_string(kTokenize.size()) + "\r\n\r\n" + kTokenize);
    EXPECT_EQ(status_of(client.read_all()), 200);
  }
  expect_serving(server->port());
}

// Regression: /v1/models returned the checkpoint's absolute path; the access log kept ?api_key=... query
// strings.
TEST(HardeningTest, NeitherModelsNorTheLogShowPathsOrQueryStrings) {
  auto ring = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(256);
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("hardening", ring));
  std::unique_ptr<Server> server = start_server();
  spdlog::set_level(spdlog::level::info);
  TestClient client(server->port());
  const HttpResponse models = client.get("/v1/models");
  EXPECT_EQ(models.body.find(model_dir().string()), std::string::npos) << models.body;
  EXPECT_EQ(models.json().at("data").at(0).at("root"), kModelName);
  EXPECT_EQ(client.get("/health?api_key=sk-secret-123").status, 200);
  server.reset();
  bool logged = false;
  for (const std::string& line : ring->last_formatted()) {
    EXPECT_EQ(line.find("sk-secret-123"), std::string::npos) << line;
    logged = logged || line.find("GET /health?… 200") != std::string::npos;
  }
  EXPECT_TRUE(logged);
  spdlog::set_default_logger(previous);
}

TEST(HardeningTest, MetricsCanRequireTheKey) {
  TestServerOptions options;
  options.config.api_key = "sk-hardening";
  options.config.metrics_require_api_key = true;
  std::unique_ptr<Server> server = start_server(options);
  TestClient client(server->port());
  EXPECT_EQ(client.get("/metrics").status, 401);
  EXPECT_EQ(client.get("/metrics", {{"Authorization", "Bearer sk-hardening"}}).status, 200);
  EXPECT_EQ(client.get("/health").status, 200);
}

// Regression (found by the breaker run after the first fix): with --max-header-bytes above 64 KiB, a header
// field of 65,534 bytes made Beast throw inside its read handler; the thread-level catch kept the server up but
// the connection's slot was never released, so 4 such requests locked an address out for good.
TEST(HardeningTest, AFieldBeastCannotStoreIsRefusedAndItsSlotComesBack) {
  TestServerOptions options;
  options.config.max_header_bytes = 128 * 1024;
  options.config.max_connections = 4;
  options.config.max_connections_per_ip = 4;
  std::unique_ptr<Server> server = start_server(options);
  for (int i = 0; i < 12; ++i) {
    RawClient client(server->port());
    const bool in_name = i % 2 == 1;
    client.send(in_name ? "GET /health HTTP/1.1\r\nHost: x\r\n" + std::string(65534, 'n') + ": v\r\n\r\n"
                        : "GET /health HTTP/1.1\r\nHost: x\r\nX: " + std::string(65534, 'a') + "\r\n\r\n");
    EXPECT_EQ(status_of(client.read_all(5s)), 431) << "attempt " << i;
  }
  for (int attempt = 0; attempt < 100; ++attempt) {  // slots return once each session ended
    RawClient again(server->port());
    again.send("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    if (status_of(again.read_all(2s)) == 200) return;
    std::this_thread::sleep_for(20ms);
  }
  FAIL() << "connection slots leaked";
}

// Regression: `Transfer-Encoding: gzip` without Content-Length got a 501 on a connection that stayed open, and
// the body was then served as the next request (request smuggling).
TEST(HardeningTest, ARefusedTransferEncodingClosesTheConnection) {
  std::unique_ptr<Server> server = start_server();
  RawClient client(server->port());
  client.send("POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"
              "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string response = client.read_all(5s);
  EXPECT_EQ(status_of(response), 501) << response;
  EXPECT_NE(response.find("Connection: close"), std::string::npos) << response;
  EXPECT_EQ(response.find("\"object\":\"list\""), std::string::npos) << "the smuggled request was served: " << response;
}

// Regression: a keyless request with a small body that never came got no answer at all (the server waited for
// the body, then closed); with Expect: 100-continue neither side ever sent anything.
TEST(HardeningTest, TheKeyRefusalIsSentBeforeWaitingForAnyBody) {
  TestServerOptions options;
  options.config.api_key = "sk-hardening";
  options.config.body_read_timeout_seconds = 30;
  std::unique_ptr<Server> server = start_server(options);
  for (const std::string& extra : {std::string(), std::string("Expect: 100-continue\r\n")}) {
    SCOPED_TRACE(extra.empty() ? "plain" : "100-continue");
    RawClient client(server->port());
    const auto start = std::chrono::steady_clock::now();
    client.send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra +
                "Content-Length: 100\r\n\r\n");
    const std::string response = client.read_until("\r\n\r\n", 5s);
    EXPECT_EQ(status_of(response), 401) << response;
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  }
}

// Regression: request bytes quoted in an error message (a path with obs-text, a header value) made the error
// body invalid UTF-8; an int64-max max_tokens overflowed in the context message.
TEST(HardeningTest, ErrorBodiesAreValidUtf8AndNumbersDoNotOverflow) {
  std::unique_ptr<Server> server = start_server();
  RawClient client(server->port());
  client.send("GET /v1/\xc0\xaf HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  const std::string response = client.read_all(5s);
  EXPECT_EQ(status_of(response), 404) << response;
  const std::string body = response.substr(response.find("\r\n\r\n") + 4);
  EXPECT_NO_THROW((void)boost::json::parse(body)) << body;
  EXPECT_NE(body.find("\xef\xbf\xbd"), std::string::npos) << "invalid bytes become U+FFFD: " << body;
  TestClient api(server->port());
  const HttpResponse huge = api.post(
      "/v1/chat/completions",
      R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9223372036854775807})");
  EXPECT_EQ(huge.status, 400) << huge.body;
  EXPECT_EQ(huge.body.find("-9"), std::string::npos) << huge.body;
  // /detokenize decodes at most max_model_len ids (a 16 MiB body of long tokens decoded to ~360 MB).
  std::string ids = "[";
  for (int i = 0; i < 5000; ++i) ids += (i ? ",70676" : "70676");
  const HttpResponse detok = api.post("/detokenize", R"({"tokens": )" + ids + "]}");
  EXPECT_EQ(detok.status, 400) << detok.body.substr(0, 200);
  EXPECT_NE(detok.body.find("max_model_len"), std::string::npos) << detok.body.substr(0, 200);
}

}  // namespace
}  // namespace deepinfer::server::testing
