// The HTTP side: accept loop, one coroutine per connection (on its own strand), routing, auth, limits, and
// the generation driver that runs a GenerationPlan against the engine thread and streams the result.
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "api.h"
#include "deepinfer/server/server.h"

namespace deepinfer::server {
namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using asio::awaitable;
using asio::use_awaitable;
using Clock = std::chrono::steady_clock;
using Request = http::request<http::string_body>;

namespace {

constexpr auto kWriteTimeout = std::chrono::seconds(30);
constexpr auto kBodyReadTimeout = std::chrono::seconds(60);
constexpr size_t kHeaderLimitBytes = 64 * 1024;
constexpr std::string_view kJson = "application/json";
constexpr std::string_view kPrometheusText = "text/plain; version=0.0.4; charset=utf-8";

double seconds_since(Clock::time_point start, Clock::time_point end = Clock::now()) {
  return std::chrono::duration<double>(end - start).count();
}

// The request's events, queued by the engine thread and awaited by the request's coroutine. deliver() posts
// one wake-up to the request's strand (at most one outstanding), which cancels the timer the coroutine
// waits on; the coroutine always checks the queue before waiting, so no wake-up is lost.
class RequestChannel final : public EventSink, public std::enable_shared_from_this<RequestChannel> {
 public:
  explicit RequestChannel(asio::any_io_executor executor) : executor_(executor), timer_(executor) {}

  void deliver(std::vector<GenerationEvent> events) override {
    {
      std::lock_guard lock(mu_);
      for (GenerationEvent& event : events) events_.push_back(std::move(event));
      if (wake_posted_) return;
      wake_posted_ = true;
    }
    asio::post(executor_, [self = shared_from_this()] {
      {
        std::lock_guard lock(self->mu_);
        self->wake_posted_ = false;
      }
      self->timer_.cancel();
    });
  }

  // On the strand: until there are events or the client went away.
  awaitable<void> wait() {
    while (true) {
      bool ready = client_gone_;
      {
        std::lock_guard lock(mu_);
        ready = ready || !events_.empty();
      }
      if (ready) co_return;
      timer_.expires_at(Clock::time_point::max());
      boost::system::error_code ec;
      co_await timer_.async_wait(asio::redirect_error(use_awaitable, ec));
    }
  }

  std::vector<GenerationEvent> take() {
    std::lock_guard lock(mu_);
    std::vector<GenerationEvent> out(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
    events_.clear();
    return out;
  }

  // On the strand.
  void mark_client_gone() {
    client_gone_ = true;
    timer_.cancel();
  }
  bool client_gone() const { return client_gone_; }
  void set_done() { done_ = true; }
  bool done() const { return done_; }

 private:
  asio::any_io_executor executor_;
  asio::steady_timer timer_;
  std::mutex mu_;
  std::deque<GenerationEvent> events_;  // GUARDED_BY(mu_)
  bool wake_posted_ = false;            // GUARDED_BY(mu_)
  bool client_gone_ = false;            // strand only
  bool done_ = false;                   // strand only
};

struct Connection {
  explicit Connection(tcp::socket socket) : stream(std::move(socket)) {}
  beast::tcp_stream stream;
  beast::flat_buffer buffer;
  bool close = false;             // close after the current response
  bool response_started = false;  // bytes of the current response went out
};

struct RequestInfo {
  unsigned version = 11;
  bool keep_alive = false;
  std::string method;
  std::string target;
  Clock::time_point start = Clock::now();
};

enum class Route { kHealth, kMetrics, kModels, kModel, kChat, kCompletions, kMessages, kResponses, kTokenize, kDetokenize };

struct RouteEntry {
  std::string_view path;
  http::verb method;
  Route route;
  bool needs_auth;
};

constexpr RouteEntry kRoutes[] = {
    {"/health", http::verb::get, Route::kHealth, false},
    {"/metrics", http::verb::get, Route::kMetrics, false},
    {"/v1/models", http::verb::get, Route::kModels, true},
    {"/v1/chat/completions", http::verb::post, Route::kChat, true},
    {"/v1/completions", http::verb::post, Route::kCompletions, true},
    {"/v1/messages", http::verb::post, Route::kMessages, true},
    {"/v1/responses", http::verb::post, Route::kResponses, true},
    {"/tokenize", http::verb::post, Route::kTokenize, true},
    {"/detokenize", http::verb::post, Route::kDetokenize, true},
};

Dialect dialect_of(std::string_view target) {
  return target.starts_with("/v1/messages") ? Dialect::kAnthropic : Dialect::kOpenAI;
}

bool constant_time_equal(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i % (b.empty() ? 1 : b.size())]);
  return diff == 0 && !b.empty();
}

bool is_http_protocol_error(const beast::error_code& ec) {
  static const boost::system::error_category& category = http::make_error_code(http::error::end_of_stream).category();
  return ec.category() == category && ec != http::error::end_of_stream && ec != http::error::partial_message;
}

// Builds an ApiError outside the coroutines (g++ 12 rejects aggregate initialization from string literals in a
// coroutine body: "array used as initializer").
ApiError api_error(int status, std::string message, std::string code = {}, int retry_after_seconds = 0,
                   std::string param = {}) {
  return ApiError{status, std::move(message), std::move(param), std::move(code), retry_after_seconds};
}

std::vector<std::pair<std::string, std::string>> allow_header(const std::string& method) { return {{"Allow", method}}; }

ApiError engine_error(const Status& status) {
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
      return bad_request(status.message());
    case StatusCode::kUnsupported:
      return ApiError{503, "the server is shutting down", {}, {}, 5};
    default:
      spdlog::error("request failed in the engine: {}", status.to_string());
      return ApiError{500, "internal server error", {}, {}, 0};
  }
}

}  // namespace

Result<recipe::PromptFormat> default_chat_format(const std::string& model_type) {
  if (model_type == "deepseek_v3" || model_type == "deepseek_v2") return recipe::PromptFormat::kDeepSeekV3;
  return Status::unsupported("model_type '" + model_type + "' has no default chat format; pass --chat-format");
}

struct Server::Impl {
  Impl(ServerConfig config_in, ModelInfo model_in, std::unique_ptr<StepEngine> engine,
       std::shared_ptr<const recipe::Tokenizer> tokenizer)
      : config(std::move(config_in)),
        model(std::move(model_in)),
        loop(std::make_unique<EngineLoop>(std::move(engine))),
        work(asio::make_work_guard(ioc)),
        acceptor(ioc),
        signals(ioc),
        force_stop(ioc),
        created(unix_time()) {
    api.model = &model;
    api.tokenizer = std::move(tokenizer);
    if (config.tokenization_cache_bytes > 0) {
      tokenization_cache =
          std::make_unique<recipe::TokenizationCache>(static_cast<size_t>(config.tokenization_cache_bytes));
      api.tokenization_cache = tokenization_cache.get();
    }
    api.chat_format = config.chat_format;
    api.default_max_tokens = config.default_max_tokens;
  }

  Status bind();
  void arm_signals();
  void begin_shutdown(bool drain);
  void maybe_finish();

  awaitable<void> listen();
  awaitable<void> session(tcp::socket socket);
  awaitable<void> handle(std::shared_ptr<Connection> conn, Request& request);
  awaitable<int> dispatch(std::shared_ptr<Connection> conn, Request& request, RequestInfo& info);
  awaitable<int> generate(std::shared_ptr<Connection> conn, Request& request, RequestInfo& info, Route route);
  awaitable<void> watch_disconnect(std::shared_ptr<Connection> conn, std::shared_ptr<RequestChannel> channel);
  awaitable<int> send(Connection& conn, const RequestInfo& info, int status, std::string body,
                      std::string_view content_type, std::vector<std::pair<std::string, std::string>> headers = {});
  awaitable<int> send_error(Connection& conn, const RequestInfo& info, const ApiError& error, Dialect dialect,
                            std::vector<std::pair<std::string, std::string>> headers = {});
  awaitable<void> linger_close(Connection& conn);
  ApiError too_large() const {
    return api_error(413,
                     fmt::format("the request body is larger than the server's limit of {} bytes (--max-body-bytes)",
                                 config.max_body_bytes),
                     "request_too_large");
  }
  bool authorized(const Request& request) const;
  recipe::TokenizationCache::Stats tokenization_stats() const {
    return tokenization_cache ? tokenization_cache->stats() : recipe::TokenizationCache::Stats{};
  }

  ServerConfig config;
  ModelInfo model;
  std::unique_ptr<recipe::TokenizationCache> tokenization_cache;  // null when the config turns it off
  ApiContext api;
  Metrics metrics;
  std::unique_ptr<EngineLoop> loop;  // outlives the io_context: pending coroutines cancel through it
  asio::io_context ioc;
  asio::executor_work_guard<asio::io_context::executor_type> work;
  tcp::acceptor acceptor;
  asio::signal_set signals;
  asio::steady_timer force_stop;
  std::vector<std::thread> threads;
  std::mutex join_mu;
  std::atomic<int32_t> in_flight{0};  // generation requests holding a concurrency slot
  std::atomic<int32_t> active{0};     // requests being handled (drain waits for 0)
  std::atomic<bool> draining{false};
  std::atomic<bool> stopped{false};
  int signal_count = 0;
  int64_t created;
  uint16_t port = 0;
};

Status Server::Impl::bind() {
  boost::system::error_code ec;
  asio::ip::address address = asio::ip::make_address(config.host, ec);
  if (ec) {
    tcp::resolver resolver(ioc);
    auto results = resolver.resolve(config.host, std::to_string(config.port), ec);
    if (ec || results.empty())
      return Status::invalid_argument("--host " + config.host + ": cannot resolve: " + ec.message());
    address = results.begin()->endpoint().address();
  }
  tcp::endpoint endpoint(address, config.port);
  acceptor.open(endpoint.protocol(), ec);
  if (!ec) acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status::io_error(fmt::format("cannot listen on {}:{}: {}", config.host, config.port, ec.message()));
  }
  port = acceptor.local_endpoint().port();
  return Status();
}

void Server::Impl::arm_signals() {
  signals.async_wait([this](const boost::system::error_code& ec, int signal_number) {
    if (ec) return;
    if (++signal_count == 1) {
      spdlog::info("signal {}: draining {} in-flight request(s); a second signal cancels them", signal_number,
                   active.load());
      begin_shutdown(true);
      arm_signals();
    } else {
      spdlog::warn("signal {}: cancelling in-flight requests", signal_number);
      begin_shutdown(false);
    }
  });
}

void Server::Impl::begin_shutdown(bool drain) {
  asio::post(ioc, [this, drain] {
    if (!draining.exchange(true)) {
      boost::system::error_code ec;
      acceptor.close(ec);
    }
    if (!drain) {
      loop->stop();  // live requests end with an error their coroutines send
      // ... unless a client does not read it: stop anyway after a grace period.
      force_stop.expires_after(std::chrono::seconds(2));
      force_stop.async_wait([this](const boost::system::error_code& ec) {
        if (ec || stopped.exchange(true)) return;
        work.reset();
        ioc.stop();
      });
    }
    maybe_finish();
  });
}

void Server::Impl::maybe_finish() {
  if (!draining || active.load() != 0 || stopped.exchange(true)) return;
  work.reset();
  ioc.stop();
}

awaitable<void> Server::Impl::listen() {
  while (acceptor.is_open()) {
    boost::system::error_code ec;
    tcp::socket socket =
        co_await acceptor.async_accept(asio::make_strand(ioc), asio::redirect_error(use_awaitable, ec));
    if (ec) {
      if (!acceptor.is_open() || ec == asio::error::operation_aborted) co_return;
      spdlog::warn("accept failed: {}", ec.message());  // e.g. out of file descriptors: back off briefly
      asio::steady_timer pause(co_await asio::this_coro::executor, std::chrono::milliseconds(50));
      co_await pause.async_wait(asio::redirect_error(use_awaitable, ec));
      continue;
    }
    socket.set_option(tcp::no_delay(true), ec);
    auto executor = socket.get_executor();
    asio::co_spawn(executor, session(std::move(socket)), [](std::exception_ptr error) {
      if (!error) return;
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        spdlog::error("connection ended by an exception: {}", e.what());
      }
    });
  }
}

awaitable<int> Server::Impl::send(Connection& conn, const RequestInfo& info, int status, std::string body,
                                  std::string_view content_type,
                                  std::vector<std::pair<std::string, std::string>> headers) {
  http::response<http::string_body> response{static_cast<http::status>(status), info.version};
  response.set(http::field::server, "deepinfer");
  response.set(http::field::content_type, content_type);
  for (auto& [name, value] : headers) response.set(name, value);
  response.body() = std::move(body);
  response.keep_alive(info.keep_alive && !conn.close && !draining);
  response.prepare_payload();
  if (!response.keep_alive()) conn.close = true;
  conn.response_started = true;
  conn.stream.expires_after(kWriteTimeout);
  beast::error_code ec;
  co_await http::async_write(conn.stream, response, asio::redirect_error(use_awaitable, ec));
  if (ec) conn.close = true;
  metrics.count_http_status(status);
  co_return status;
}

awaitable<int> Server::Impl::send_error(Connection& conn, const RequestInfo& info, const ApiError& error,
                                        Dialect dialect, std::vector<std::pair<std::string, std::string>> headers) {
  if (error.retry_after_seconds > 0) headers.emplace_back("Retry-After", std::to_string(error.retry_after_seconds));
  if (error.status == 401) headers.emplace_back("WWW-Authenticate", "Bearer");
  if (error.status == 413 || error.status == 503) conn.close = true;
  co_return co_await send(conn, info, error.status, error_body(error, dialect), "application/json", std::move(headers));
}

// After refusing a request without reading its body: stop sending, read and discard what the client still
// sends (bounded), so that closing does not reset the connection before the client reads our answer.
awaitable<void> Server::Impl::linger_close(Connection& conn) {
  beast::error_code ec;
  conn.stream.socket().shutdown(tcp::socket::shutdown_send, ec);
  std::vector<char> scratch(64 * 1024);
  int64_t budget = config.max_body_bytes + (64ll << 20);
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (budget > 0 && Clock::now() < deadline) {
    conn.stream.expires_after(std::chrono::seconds(2));
    size_t n = co_await conn.stream.async_read_some(asio::buffer(scratch), asio::redirect_error(use_awaitable, ec));
    if (ec) break;
    budget -= static_cast<int64_t>(n);
  }
}

bool Server::Impl::authorized(const Request& request) const {
  if (config.api_key.empty()) return true;
  std::string_view authorization = request[http::field::authorization];
  if (authorization.size() > 7 && beast::iequals(authorization.substr(0, 7), "Bearer ") &&
      constant_time_equal(authorization.substr(7), config.api_key)) {
    return true;
  }
  return constant_time_equal(request["x-api-key"], config.api_key);
}

awaitable<void> Server::Impl::session(tcp::socket socket) {
  auto conn = std::make_shared<Connection>(std::move(socket));
  beast::error_code ec;
  while (!conn->close) {
    http::request_parser<http::string_body> parser;
    parser.header_limit(kHeaderLimitBytes);
    parser.body_limit(static_cast<uint64_t>(config.max_body_bytes));
    conn->response_started = false;
    conn->stream.expires_after(std::chrono::seconds(config.idle_timeout_seconds));
    co_await http::async_read_header(conn->stream, conn->buffer, parser, asio::redirect_error(use_awaitable, ec));
    RequestInfo info;
    if (ec == http::error::body_limit) {  // the Content-Length alone is over the limit
      info.version = parser.get().version();
      co_await send_error(*conn, info, too_large(), dialect_of(parser.get().target()));
      co_await linger_close(*conn);
      break;
    }
    if (ec) {
      if (is_http_protocol_error(ec)) {
        conn->close = true;
        co_await send_error(*conn, info, bad_request("malformed HTTP request: " + ec.message()), Dialect::kOpenAI);
      }
      break;
    }
    info.version = parser.get().version();
    info.keep_alive = parser.get().keep_alive();
    info.method = std::string(parser.get().method_string());
    info.target = std::string(parser.get().target());
    const Dialect dialect = dialect_of(info.target);
    if (beast::iequals(parser.get()[http::field::expect], "100-continue")) {
      http::response<http::empty_body> go_on{http::status::continue_, info.version};
      co_await http::async_write(conn->stream, go_on, asio::redirect_error(use_awaitable, ec));
      if (ec) break;
    }
    conn->stream.expires_after(kBodyReadTimeout);
    co_await http::async_read(conn->stream, conn->buffer, parser, asio::redirect_error(use_awaitable, ec));
    if (ec == http::error::body_limit) {
      co_await send_error(*conn, info, too_large(), dialect);
      co_await linger_close(*conn);
      break;
    }
    if (ec) {
      if (is_http_protocol_error(ec)) {
        conn->close = true;
        co_await send_error(*conn, info, bad_request("malformed HTTP request: " + ec.message()), dialect);
      }
      break;
    }
    conn->stream.expires_never();
    Request request = parser.release();
    co_await handle(conn, request);
  }
  conn->stream.socket().shutdown(tcp::socket::shutdown_send, ec);
  conn->stream.socket().close(ec);  // also ends a disconnect watcher still waiting on it
}

awaitable<void> Server::Impl::handle(std::shared_ptr<Connection> conn, Request& request) {
  ++active;
  RequestInfo info;
  info.version = request.version();
  info.keep_alive = request.keep_alive();
  info.method = std::string(request.method_string());
  info.target = std::string(request.target());
  int status = 500;
  bool failed = false;
  try {
    status = co_await dispatch(conn, request, info);
  } catch (const std::exception& e) {
    spdlog::error("{} {}: {}", info.method, info.target, e.what());
    failed = true;
  }
  if (failed) {
    if (conn->response_started) {
      conn->close = true;
    } else {
      const Dialect dialect = info.target.starts_with("/v1/messages") ? Dialect::kAnthropic : Dialect::kOpenAI;
      status = co_await send_error(*conn, info, api_error(500, "internal server error"), dialect);
    }
  }
  spdlog::info("{} {} {} {:.1f} ms", info.method, info.target, status, 1e3 * seconds_since(info.start));
  --active;
  if (draining) maybe_finish();
}

awaitable<int> Server::Impl::dispatch(std::shared_ptr<Connection> conn, Request& request, RequestInfo& info) {
  std::string_view path = request.target();
  path = path.substr(0, path.find('?'));
  const Dialect dialect = path == "/v1/messages" ? Dialect::kAnthropic : Dialect::kOpenAI;
  if (draining && path != "/health" && path != "/metrics") {
    co_return co_await send_error(*conn, info, api_error(503, "the server is shutting down", {}, 5), dialect);
  }
  const RouteEntry* entry = nullptr;
  bool path_known = false;
  for (const RouteEntry& candidate : kRoutes) {
    const bool matches =
        candidate.path == path || (candidate.route == Route::kModels && path.starts_with("/v1/models/"));
    if (!matches) continue;
    path_known = true;
    if (candidate.method == request.method()) entry = &candidate;
  }
  if (!path_known) {
    co_return co_await send_error(
        *conn, info, api_error(404, fmt::format("no route for {} {}", info.method, std::string(path)), "not_found"),
        dialect);
  }
  if (entry == nullptr) {
    const RouteEntry* allowed = nullptr;
    for (const RouteEntry& candidate : kRoutes) {
      if (candidate.path == path || (candidate.route == Route::kModels && path.starts_with("/v1/models/")))
        allowed = &candidate;
    }
    const std::string allow(http::to_string(allowed->method));
    co_return co_await send_error(
        *conn, info,
        api_error(405, fmt::format("{} does not accept {}; use {}", std::string(path), info.method, allow),
                  "method_not_allowed"),
        dialect, allow_header(allow));
  }
  if (entry->needs_auth && !authorized(request)) {
    co_return co_await send_error(
        *conn, info,
        api_error(401, "missing or invalid API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
                  "invalid_api_key"),
        dialect);
  }
  Route route = entry->route;
  if (route == Route::kModels && path != "/v1/models") route = Route::kModel;
  switch (route) {
    case Route::kHealth:
      co_return co_await send(*conn, info, 200, std::string(R"({"status":"ok"})"), kJson);
    case Route::kMetrics:
      co_return co_await send(*conn, info, 200, metrics.render(loop->load(), tokenization_stats()), kPrometheusText);
    case Route::kModels:
      co_return co_await send(*conn, info, 200, models_body(model, created), kJson);
    case Route::kModel: {
      const std::string_view id = path.substr(std::string_view("/v1/models/").size());
      if (id != model.served_model_name) {
        co_return co_await send_error(*conn, info,
                                      api_error(404,
                                                fmt::format("The model `{}` does not exist; this server serves `{}`",
                                                            std::string(id), model.served_model_name),
                                                "model_not_found", 0, "model"),
                                      dialect);
      }
      co_return co_await send(*conn, info, 200, boost::json::serialize(model_object(model, created)), kJson);
    }
    case Route::kTokenize:
    case Route::kDetokenize: {
      ApiResult<boost::json::value> body = parse_body(request.body(), config.max_json_depth);
      if (auto* error = std::get_if<ApiError>(&body)) co_return co_await send_error(*conn, info, *error, dialect);
      const boost::json::value& value = std::get<boost::json::value>(body);
      ApiResult<std::string> out =
          route == Route::kTokenize ? tokenize_endpoint(value, api) : detokenize_endpoint(value, api);
      if (auto* error = std::get_if<ApiError>(&out)) co_return co_await send_error(*conn, info, *error, dialect);
      co_return co_await send(*conn, info, 200, std::move(std::get<std::string>(out)), kJson);
    }
    case Route::kChat:
    case Route::kCompletions:
    case Route::kMessages:
    case Route::kResponses:
      co_return co_await generate(conn, request, info, route);
  }
  co_return 500;
}

awaitable<void> Server::Impl::watch_disconnect(std::shared_ptr<Connection> conn,
                                               std::shared_ptr<RequestChannel> channel) {
  tcp::socket& socket = conn->stream.socket();
  while (true) {
    beast::error_code ec;
    co_await socket.async_wait(tcp::socket::wait_read, asio::redirect_error(use_awaitable, ec));
    if (ec == asio::error::operation_aborted || channel->done()) co_return;
    // Readiness alone proves nothing (the reactor may report data the request read already consumed): peek.
    // 0 bytes: the peer closed; data: the client pipelined its next request and is still there.
    char byte = 0;
    const ssize_t n = ec ? -1 : ::recv(socket.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) co_return;
    if (n < 0 && !ec && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    spdlog::info("client went away ({}); cancelling its request", ec       ? ec.message()
                                                                  : n == 0 ? "connection closed"
                                                                           : std::strerror(errno));
    channel->mark_client_gone();
    co_return;
  }
}

awaitable<int> Server::Impl::generate(std::shared_ptr<Connection> conn, Request& request, RequestInfo& info,
                                      Route route) {
  const Dialect dialect = route == Route::kMessages ? Dialect::kAnthropic : Dialect::kOpenAI;
  if (in_flight.fetch_add(1) >= config.max_concurrent_requests) {
    --in_flight;
    metrics.count_outcome("error_429");
    co_return co_await send_error(*conn, info,
                                  api_error(429,
                                            fmt::format("the server is at its limit of {} concurrent requests "
                                                        "(--max-concurrent-requests); retry shortly",
                                                        config.max_concurrent_requests),
                                            "rate_limit_exceeded", 1),
                                  dialect);
  }
  struct SlotGuard {
    std::atomic<int32_t>& count;
    ~SlotGuard() { --count; }
  } slot{in_flight};

  ApiResult<boost::json::value> body = parse_body(request.body(), config.max_json_depth);
  if (auto* error = std::get_if<ApiError>(&body)) {
    metrics.count_outcome(fmt::format("error_{}", error->status));
    co_return co_await send_error(*conn, info, *error, dialect);
  }
  ApiResult<GenerationPlan> planned =
      route == Route::kChat          ? plan_chat_completion(std::get<boost::json::value>(body), api)
      : route == Route::kCompletions ? plan_completion(std::get<boost::json::value>(body), api)
      : route == Route::kResponses   ? plan_responses(std::get<boost::json::value>(body), api)
                                     : plan_anthropic_messages(std::get<boost::json::value>(body), api);
  if (auto* error = std::get_if<ApiError>(&planned)) {
    metrics.count_outcome(fmt::format("error_{}", error->status));
    co_return co_await send_error(*conn, info, *error, dialect);
  }
  GenerationPlan& plan = std::get<GenerationPlan>(planned);
  // Retention class of the request's cached KV (kvcache::RetentionConfig::defaults(): default, chat, agent).
  if (auto header = request.find("X-KV-Cache-Class"); header != request.end()) {
    std::string name(header->value());
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
    std::optional<kvcache::TtlClassId> ttl_class = kvcache::RetentionConfig::defaults().find(name);
    if (!ttl_class) {
      const ApiError error = bad_request(
          fmt::format("header X-KV-Cache-Class: '{}' is not a retention class; use default, chat or agent", name));
      metrics.count_outcome("error_400");
      co_return co_await send_error(*conn, info, error, dialect);
    }
    plan.params.kv_ttl_class = *ttl_class;
  }
  request.body().clear();
  request.body().shrink_to_fit();

  FinishInfo finish;
  finish.prompt_tokens = static_cast<int64_t>(plan.prompt_token_ids.size());
  metrics.prompt_tokens += finish.prompt_tokens;
  auto executor = co_await asio::this_coro::executor;
  auto channel = std::make_shared<RequestChannel>(executor);
  struct CancelGuard {
    EngineLoop& loop;
    EngineLoop::Ticket ticket;
    bool armed = true;
    ~CancelGuard() {
      if (armed) loop.cancel(ticket);
    }
  } cancel_guard{*loop, loop->submit(std::move(plan.prompt_token_ids), plan.params, channel)};
  asio::co_spawn(executor, watch_disconnect(conn, channel), asio::detached);

  std::vector<TokenLogprobs> batch_logprobs, all_logprobs;
  std::vector<recipe::StreamEvent> deltas;
  std::optional<ApiError> failure;
  bool done = false, client_gone = false, headers_sent = false;
  std::optional<Clock::time_point> first_token, last_token;
  http::response<http::empty_body> sse_header{http::status::ok, info.version};
  http::response_serializer<http::empty_body> sse_serializer{sse_header};
  beast::error_code ec;

  while (!done) {
    co_await channel->wait();
    if (channel->client_gone()) {
      client_gone = true;
      break;
    }
    for (GenerationEvent& generated : channel->take()) {
      if (done) break;
      if (!generated.error.ok()) {
        cancel_guard.armed = false;
        failure = engine_error(generated.error);
        done = true;
        break;
      }
      engine::TokenEvent& event = generated.event;
      if (event.token) {
        const Clock::time_point now = Clock::now();
        if (!first_token) {
          first_token = now;
          metrics.time_to_first_token.observe(seconds_since(info.start, now));
        }
        last_token = now;
        ++finish.completion_tokens;
        if (event.logprob) batch_logprobs.push_back({*event.token, *event.logprob, std::move(event.top_logprobs)});
        if (plan.builder->push(*event.token, deltas)) {
          finish.kind = FinishInfo::Kind::kStopString;
          finish.stop_string = plan.builder->stop_string();
          done = true;
        }
      }
      if (!done && event.finished) {
        cancel_guard.armed = false;
        done = true;
        finish.cached_tokens = event.num_cached_tokens;
        metrics.prompt_tokens_cached += event.num_cached_tokens;
        if (event.finish_reason == engine::FinishReason::kStop ||
            event.finish_reason == engine::FinishReason::kLength) {
          finish.kind = event.finish_reason == engine::FinishReason::kLength ? FinishInfo::Kind::kLength
                                                                             : FinishInfo::Kind::kStop;
          plan.builder->finish(deltas);
        } else if (event.finish_reason == engine::FinishReason::kAborted) {
          failure = bad_request(event.message.empty() ? "the engine could not run this request" : event.message);
        } else {
          failure = api_error(503, "the request was cancelled: the server is shutting down", {}, 5);
        }
      }
    }
    if (failure) break;
    if (!plan.stream) {
      all_logprobs.insert(all_logprobs.end(), std::make_move_iterator(batch_logprobs.begin()),
                          std::make_move_iterator(batch_logprobs.end()));
      batch_logprobs.clear();
      deltas.clear();
      continue;
    }
    std::string bytes;
    if (!headers_sent) {
      sse_header.set(http::field::server, "deepinfer");
      sse_header.set(http::field::content_type, "text/event-stream");
      sse_header.set(http::field::cache_control, "no-cache");
      sse_header.set("X-Accel-Buffering", "no");
      sse_header.keep_alive(info.keep_alive && !draining);
      sse_header.chunked(true);
      if (!sse_header.keep_alive()) conn->close = true;
      conn->response_started = true;
      conn->stream.expires_after(kWriteTimeout);
      co_await http::async_write_header(conn->stream, sse_serializer, asio::redirect_error(use_awaitable, ec));
      if (ec) {
        client_gone = true;
        break;
      }
      metrics.count_http_status(200);
      headers_sent = true;
      bytes = plan.writer->start(finish);
    }
    bytes += plan.writer->deltas(deltas, batch_logprobs);
    deltas.clear();
    if (done) bytes += plan.writer->finish(plan.builder->message(), finish, batch_logprobs);
    if (!bytes.empty()) {
      conn->stream.expires_after(kWriteTimeout);
      co_await asio::async_write(conn->stream, http::make_chunk(asio::buffer(bytes)),
                                 asio::redirect_error(use_awaitable, ec));
      if (ec) {
        client_gone = true;
        break;
      }
    }
    if (done) {
      co_await asio::async_write(conn->stream, http::make_chunk_last(), asio::redirect_error(use_awaitable, ec));
      if (ec) conn->close = true;
    }
  }

  // Stop the disconnect watcher (its wait is the only operation pending on the socket now).
  channel->set_done();
  conn->stream.socket().cancel(ec);
  metrics.generation_tokens += finish.completion_tokens;
  metrics.malformed_tool_calls += plan.builder->malformed_tool_calls();
  if (client_gone) {
    ++metrics.client_disconnects;
    metrics.count_outcome("client_disconnect");
    conn->close = true;
    co_return 499;  // nginx's "client closed request", for the log
  }
  if (failure) {
    metrics.count_outcome(fmt::format("error_{}", failure->status));
    if (!headers_sent) co_return co_await send_error(*conn, info, *failure, dialect);
    const std::string bytes = plan.writer->stream_error(*failure);
    conn->stream.expires_after(kWriteTimeout);
    co_await asio::async_write(conn->stream, http::make_chunk(asio::buffer(bytes)),
                               asio::redirect_error(use_awaitable, ec));
    if (!ec) co_await asio::async_write(conn->stream, http::make_chunk_last(), asio::redirect_error(use_awaitable, ec));
    if (ec) conn->close = true;
    co_return 200;
  }
  int status = 200;
  if (!plan.stream) {
    status = co_await send(*conn, info, 200, plan.writer->finish(plan.builder->message(), finish, all_logprobs), kJson);
  }
  const OutputMessage& message = plan.builder->message();
  metrics.count_outcome(finish.kind == FinishInfo::Kind::kLength ? "length"
                        : message.tool_calls.empty()             ? "stop"
                                                                 : "tool_calls");
  if (first_token && last_token && finish.completion_tokens > 1) {
    metrics.time_per_output_token.observe(seconds_since(*first_token, *last_token) /
                                          static_cast<double>(finish.completion_tokens - 1));
  }
  metrics.e2e_request_latency.observe(seconds_since(info.start));
  co_return status;
}

Result<std::unique_ptr<Server>> Server::start(ServerConfig config, ModelInfo model, std::unique_ptr<StepEngine> engine,
                                              std::shared_ptr<const recipe::Tokenizer> tokenizer) {
  if (engine == nullptr || tokenizer == nullptr)
    return Status::invalid_argument("the server needs an engine and a tokenizer");
  if (model.max_model_len < 2) return Status::invalid_argument("max_model_len must be at least 2");
  if (config.max_body_bytes < 1) return Status::invalid_argument("--max-body-bytes must be positive");
  if (config.max_concurrent_requests < 1) return Status::invalid_argument("--max-concurrent-requests must be positive");
  if (config.max_json_depth < 2) return Status::invalid_argument("--max-json-depth must be at least 2");
  if (config.http_threads < 1) config.http_threads = 1;
  auto impl = std::make_unique<Impl>(std::move(config), std::move(model), std::move(engine), std::move(tokenizer));
  if (Status s = impl->bind(); !s.ok()) {
    impl->loop->stop();
    return s;
  }
  if (impl->config.handle_signals) {
    impl->signals.add(SIGINT);
    impl->signals.add(SIGTERM);
    impl->arm_signals();
  }
  asio::co_spawn(impl->ioc, impl->listen(), asio::detached);
  for (int32_t i = 0; i < impl->config.http_threads; ++i) {
    impl->threads.emplace_back([io = &impl->ioc] { io->run(); });
  }
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() {
  shutdown(false);
  wait();
}

uint16_t Server::port() const { return impl_->port; }

void Server::shutdown(bool drain) { impl_->begin_shutdown(drain); }

void Server::wait() {
  std::lock_guard lock(impl_->join_mu);
  for (std::thread& thread : impl_->threads) {
    if (thread.joinable()) thread.join();
  }
  impl_->loop->stop();
}

}  // namespace deepinfer::server
