// `deepinfer router` (router.h): client connections, the proxy to the workers, the health checker, metrics.
#include <spdlog/spdlog.h>

#include <atomic>
#include <sys/socket.h>

#include <boost/asio.hpp>
#include <boost/asio/experimental/as_tuple.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/json.hpp>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "deepinfer/kvcache/block_hash.h"
#include "deepinfer/recipe/conversation.h"
#include "deepinfer/recipe/renderer.h"
#include "deepinfer/recipe/tokenization_cache.h"
#include "deepinfer/recipe/tokenizer.h"
#include "deepinfer/router/router.h"
#include "deepinfer/router/routing_keys.h"
#include "deepinfer/server/api.h"
#include "deepinfer/server/http_framing.h"
#include "deepinfer/server/metrics.h"
#include "kv_event_subscriber.h"

namespace deepinfer::router {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace json = boost::json;
using asio::awaitable;
using asio::use_awaitable;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
constexpr auto kTuple = asio::experimental::as_tuple(use_awaitable);

Result<WorkerAddress> parse_worker_url(std::string_view url) {
  const auto bad = [&](std::string_view why) {
    return Status::invalid_argument("worker URL '" + std::string(url) + "' " + std::string(why) +
                                    " (expected http://HOST:PORT)");
  };
  constexpr std::string_view kScheme = "http://";
  if (!url.starts_with(kScheme)) return bad("does not start with http://");
  std::string_view rest = url.substr(kScheme.size());
  while (rest.ends_with('/')) rest.remove_suffix(1);
  if (rest.find('/') != std::string_view::npos) return bad("has a path");
  WorkerAddress out;
  std::string_view port;
  if (rest.starts_with('[')) {
    const size_t close = rest.find(']');
    if (close == std::string_view::npos || close + 1 >= rest.size() || rest[close + 1] != ':') return bad("has no port");
    out.host = std::string(rest.substr(1, close - 1));
    port = rest.substr(close + 2);
  } else {
    const size_t colon = rest.rfind(':');
    if (colon == std::string_view::npos) return bad("has no port");
    out.host = std::string(rest.substr(0, colon));
    port = rest.substr(colon + 1);
  }
  if (out.host.empty()) return bad("has no host");
  int value = 0;
  if (port.empty() || port.size() > 5) return bad("has no valid port");
  for (char c : port) {
    if (c < '0' || c > '9') return bad("has no valid port");
    value = value * 10 + (c - '0');
  }
  if (value <= 0 || value > 65535) return bad("has no valid port");
  out.port = static_cast<uint16_t>(value);
  return out;
}

std::string reachable_endpoint(std::string_view endpoint, std::string_view worker_host) {
  for (std::string_view wildcard : {"tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"}) {
    if (endpoint.starts_with(wildcard)) {
      const std::string host =
          worker_host.find(':') != std::string_view::npos ? "[" + std::string(worker_host) + "]" : std::string(worker_host);
      return "tcp://" + host + ":" + std::string(endpoint.substr(wildcard.size()));
    }
  }
  return std::string(endpoint);
}

namespace {

enum class Route { kGenerate, kAnyWorker, kHealth, kMetrics };
enum class Dialect { kOpenAI, kAnthropic };

struct RouteEntry {
  std::string_view path;
  http::verb method;
  Route route;
};
constexpr RouteEntry kRoutes[] = {
    {"/health", http::verb::get, Route::kHealth},
    {"/metrics", http::verb::get, Route::kMetrics},
    {"/v1/models", http::verb::get, Route::kAnyWorker},
    {"/v1/chat/completions", http::verb::post, Route::kGenerate},
    {"/v1/completions", http::verb::post, Route::kGenerate},
    {"/v1/messages", http::verb::post, Route::kGenerate},
    {"/v1/responses", http::verb::post, Route::kGenerate},
    {"/v1/messages/count_tokens", http::verb::post, Route::kAnyWorker},
    {"/tokenize", http::verb::post, Route::kAnyWorker},
    {"/detokenize", http::verb::post, Route::kAnyWorker},
};

// What planning a prompt needs, from the first worker that told its /worker/info (the workers serve one model).
struct PlanContext {
  server::ModelInfo model;
  server::ApiContext api;
};

struct Worker {
  std::string url;
  WorkerAddress address;
  bool prefill = false;  // a --prefill worker (never answers a request itself)
  // GUARDED_BY(Impl::mu):
  WorkerState state;
  bool info_known = false;
  std::string instance;
  std::optional<kvcache::ModelFingerprint> fingerprint;
  std::map<std::string, uint64_t> requests_by_reason;
  uint64_t prompt_tokens = 0;
  uint64_t predicted_cached_tokens = 0;
  std::string role;               // as its /worker/info says
  bool fingerprint_warned = false;  // logged once: its fingerprint differs from a decode worker's
  int32_t kv_transfer_port = 0;   // a prefill worker's, from its /worker/info
  std::string kv_wire;            // "tcp" or "ucx" (--kv-transfer-protocol ucx or rdma), from its /worker/info
  bool wire_warned = false;       // logged once: its KV transfer wire differs from a decode worker's
};

std::string_view reason_text(std::string_view reason) { return reason.empty() ? "none" : reason; }

// A client watched while the router waits for a worker's response header (Router::Impl::proxy).
struct ClientWatch {
  bool over = false;          // the header came (or the attempt ended): stop watching
  bool client_gone = false;
  tcp::socket* upstream = nullptr;  // closed when the client goes
};

awaitable<void> watch_client(tcp::socket& client, std::shared_ptr<ClientWatch> watch) {
  while (!watch->over) {
    boost::system::error_code ec;
    co_await client.async_wait(tcp::socket::wait_read, asio::redirect_error(use_awaitable, ec));
    if (ec == asio::error::operation_aborted || watch->over) co_return;
    // Readiness alone proves nothing: peek. 0 bytes: the client closed; data: it pipelined its next request.
    char byte = 0;
    const ssize_t n = ec ? -1 : ::recv(client.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) co_return;
    if (n < 0 && !ec && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    watch->client_gone = true;
    if (watch->upstream != nullptr) {
      boost::system::error_code ignored;
      watch->upstream->close(ignored);
    }
    co_return;
  }
}

}  // namespace

struct Router::Impl {
  RouterConfig config;
  asio::io_context ioc;
  tcp::acceptor acceptor{ioc};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::vector<std::thread> threads;
  asio::signal_set signals{ioc};
  std::atomic<bool> stopping{false};
  std::atomic<bool> stopped{false};
  std::atomic<int32_t> active{0};  // requests in flight
  std::mutex stop_mu;
  std::condition_variable stop_cv;

  std::mutex mu;
  std::vector<Worker> workers;                   // GUARDED_BY(mu) except url/address
  std::unique_ptr<RoutingPolicy> policy;          // GUARDED_BY(mu)
  std::shared_ptr<const PlanContext> plan;        // GUARDED_BY(mu)
  std::map<std::string, uint64_t> errors;         // GUARDED_BY(mu)
  uint64_t retries = 0;                           // GUARDED_BY(mu)
  std::map<std::string, uint64_t> prefill_where;  // GUARDED_BY(mu): disaggregated requests, remote or local prefill

  std::unique_ptr<KvIndex> index;
  std::unique_ptr<KvEventSubscriber> subscriber;
  std::shared_ptr<const recipe::Tokenizer> tokenizer;
  std::unique_ptr<recipe::TokenizationCache> tokenization_cache;
  server::Histogram ttft{{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
  server::Histogram e2e{{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}};

  void begin_stop(bool drain);
  void finish();
  awaitable<void> listen();
  awaitable<void> session(tcp::socket socket);
  awaitable<bool> respond(beast::tcp_stream& client, http::response<http::string_body>& response);
  awaitable<bool> handle(beast::tcp_stream& client, http::request<http::string_body>& request);
  awaitable<bool> generate(beast::tcp_stream& client, http::request<http::string_body>& request, Dialect dialect,
                           bool routed);
  enum class Outcome { kDone, kRetry, kClientGone };
  // Sends `request` to `worker` and relays the answer. kRetry: nothing went to the client (`failure` says why).
  awaitable<Outcome> proxy(beast::tcp_stream& client, const http::request<http::string_body>& request, int32_t worker,
                           bool may_retry, bool keep_alive, Clock::time_point arrival, Dialect dialect,
                           std::function<void()> on_first_byte, std::string& failure,
                           std::optional<std::string> prefill_endpoint);
  awaitable<std::optional<std::pair<int, std::string>>> get(const WorkerAddress& address, std::string target,
                                                            int32_t timeout_ms);
  awaitable<void> health_loop(int32_t worker);
  void take_worker_info(int32_t worker, const std::string& body);
  void set_health(int32_t worker, bool healthy);
  // Whether a worker may take requests now: healthy and, disaggregated, of its pool's role (its /worker/info), a
  // prefill worker with its KV transfer port known. With mu held.
  bool usable(const Worker& w) const {
    if (!w.state.healthy) return false;
    if (config.prefill_workers.empty()) return true;
    return w.info_known && w.role == (w.prefill ? "prefill" : "decode") && (!w.prefill || w.kv_transfer_port > 0);
  }
  std::string metrics_text();
  void count_error(const std::string& reason) {
    std::lock_guard lock(mu);
    ++errors[reason];
  }
};

// ---- prompts ---------------------------------------------------------------------------------------------

namespace {

struct PromptFacts {
  std::vector<int32_t> token_ids;  // empty: unknown
  uint64_t affinity = 0;
};

PromptFacts analyze(std::string_view target, const std::string& body, const PlanContext* plan,
                    const recipe::Tokenizer* tokenizer, int64_t affinity_chars) {
  PromptFacts out;
  auto parsed = server::parse_body(body, 64);
  if (!std::holds_alternative<json::value>(parsed)) return out;
  const json::value& value = std::get<json::value>(parsed);
  out.affinity = affinity_key(affinity_text(value.as_object(), tokenizer), affinity_chars);
  if (plan == nullptr) return out;
  server::ApiResult<server::GenerationPlan> result =
      target == "/v1/chat/completions" ? server::plan_chat_completion(value, plan->api)
      : target == "/v1/completions"    ? server::plan_completion(value, plan->api)
      : target == "/v1/messages"       ? server::plan_anthropic_messages(value, plan->api)
                                       : server::plan_responses(value, plan->api);
  if (auto* generation = std::get_if<server::GenerationPlan>(&result)) {
    out.token_ids.assign(generation->prompt_token_ids.begin(), generation->prompt_token_ids.end());
  }
  return out;
}

bool hop_by_hop(http::field name, beast::string_view text) {
  switch (name) {
    case http::field::connection:
    case http::field::keep_alive:
    case http::field::transfer_encoding:
    case http::field::content_length:
    case http::field::host:
    case http::field::expect:
    case http::field::upgrade:
    case http::field::te:
    case http::field::trailer:
    case http::field::proxy_authenticate:
    case http::field::proxy_authorization:
      return true;
    default:
      return beast::iequals(text, "proxy-connection");
  }
}

std::string error_json(Dialect dialect, int status, const std::string& message) {
  server::ApiError error;
  error.status = status;
  error.message = message;
  return server::error_body(error, dialect == Dialect::kAnthropic ? server::Dialect::kAnthropic : server::Dialect::kOpenAI);
}

}  // namespace

// ---- lifecycle -------------------------------------------------------------------------------------------

Result<std::unique_ptr<Router>> Router::start(RouterConfig config) {
  if (config.workers.empty()) return Status::invalid_argument("no worker: give --worker URL (one or more)");
  if (config.workers.size() > 65535) return Status::invalid_argument("more than 65535 workers");
  if (config.max_retries < 0) return Status::invalid_argument("--max-retries must be >= 0");
  for (int32_t v : {config.health_check_interval_ms, config.health_check_timeout_ms, config.connect_timeout_ms,
                    config.first_byte_timeout_ms, config.stream_idle_timeout_ms}) {
    if (v <= 0) return Status::invalid_argument("router timeouts and intervals must be positive");
  }
  if (config.affinity_chars < 1) return Status::invalid_argument("--affinity-chars must be at least 1");
  if (config.http_threads < 1) return Status::invalid_argument("--http-threads must be at least 1");
  if (config.max_local_prefill_tokens < 0) return Status::invalid_argument("--max-local-prefill-tokens must be >= 0");
  if (config.workers.size() + config.prefill_workers.size() > 65535) return Status::invalid_argument("more than 65535 workers");
  auto impl = std::make_unique<Impl>();
  std::vector<std::pair<std::string, bool>> urls;
  for (const std::string& url : config.workers) urls.emplace_back(url, false);
  for (const std::string& url : config.prefill_workers) urls.emplace_back(url, true);
  for (const auto& [url, prefill] : urls) {
    Result<WorkerAddress> address = parse_worker_url(url);
    if (!address.ok()) return address.status();
    Worker worker;
    worker.prefill = prefill;
    worker.url = url;
    while (worker.url.ends_with('/')) worker.url.pop_back();
    worker.address = *address;
    worker.state.healthy = false;  // until its first health check
    impl->workers.push_back(std::move(worker));
  }
  if (config.policy == Policy::kKvAware && config.tokenizer_path.empty()) {
    return Status::invalid_argument(
        "--policy kv-aware needs the workers' tokenizer to hash prompts as they do: give --model-path DIR (the "
        "checkpoint the workers serve) or --tokenizer PATH");
  }
  if (!config.tokenizer_path.empty()) {
    std::filesystem::path path = config.tokenizer_path;
    if (std::filesystem::is_directory(path)) path /= "tokenizer.json";
    Result<std::shared_ptr<const recipe::Tokenizer>> tokenizer = recipe::Tokenizer::load(path);
    if (!tokenizer.ok()) return tokenizer.status();
    impl->tokenizer = *tokenizer;
    impl->tokenization_cache = std::make_unique<recipe::TokenizationCache>(64ll << 20);
  }
  std::vector<std::string> names;
  for (const Worker& w : impl->workers) names.push_back(w.url);
  impl->policy = std::make_unique<RoutingPolicy>(config.policy, names, config.weights);
  impl->index = std::make_unique<KvIndex>(static_cast<int32_t>(impl->workers.size()));
  impl->subscriber = std::make_unique<KvEventSubscriber>(*impl->index, static_cast<int32_t>(impl->workers.size()));

  boost::system::error_code ec;
  const asio::ip::address address = asio::ip::make_address(config.host, ec);
  if (ec) return Status::invalid_argument("--host '" + config.host + "' is not an IP address");
  const tcp::endpoint endpoint(address, config.port);
  impl->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status::io_error("cannot listen on " + config.host + ":" + std::to_string(config.port) + ": " + ec.message());
  }
  impl->config = std::move(config);
  impl->work.emplace(impl->ioc.get_executor());
  Impl* raw = impl.get();
  if (raw->config.handle_signals) {
    raw->signals.add(SIGINT);
    raw->signals.add(SIGTERM);
    raw->signals.async_wait([raw](const boost::system::error_code& error, int) {
      if (!error) raw->begin_stop(true);
    });
  }
  asio::co_spawn(raw->ioc, raw->listen(), asio::detached);
  for (int32_t w = 0; w < static_cast<int32_t>(raw->workers.size()); ++w) {
    asio::co_spawn(asio::make_strand(raw->ioc), raw->health_loop(w), asio::detached);
  }
  for (int32_t t = 0; t < raw->config.http_threads; ++t) {
    raw->threads.emplace_back([raw] { raw->ioc.run(); });
  }
  return std::unique_ptr<Router>(new Router(std::move(impl)));
}

Router::Router(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Router::~Router() {
  shutdown(false);
  wait();
}

uint16_t Router::port() const {
  boost::system::error_code ec;
  return impl_->acceptor.local_endpoint(ec).port();
}

void Router::shutdown(bool drain) {
  asio::post(impl_->ioc, [impl = impl_.get(), drain] { impl->begin_stop(drain); });
}

void Router::wait() {
  for (std::thread& thread : impl_->threads) {
    if (thread.joinable()) thread.join();
  }
}

void Router::Impl::begin_stop(bool drain) {
  if (stopping.exchange(true)) {
    if (!drain) finish();
    return;
  }
  boost::system::error_code ec;
  acceptor.close(ec);
  signals.cancel(ec);
  if (!drain || active.load() == 0) {
    finish();
    return;
  }
  auto timer = std::make_shared<asio::steady_timer>(ioc, std::chrono::seconds(config.shutdown_timeout_seconds));
  timer->async_wait([this, timer](const boost::system::error_code&) { finish(); });
  // Poll for the last request to end.
  auto poll = std::make_shared<std::function<void()>>();
  auto tick = std::make_shared<asio::steady_timer>(ioc);
  *poll = [this, tick, poll] {
    if (active.load() == 0) {
      finish();
      return;
    }
    tick->expires_after(std::chrono::milliseconds(50));
    tick->async_wait([poll](const boost::system::error_code&) { (*poll)(); });
  };
  (*poll)();
}

void Router::Impl::finish() {
  if (stopped.exchange(true)) return;
  work.reset();
  ioc.stop();
}

// ---- client side -----------------------------------------------------------------------------------------

awaitable<void> Router::Impl::listen() {
  while (acceptor.is_open()) {
    auto [ec, socket] = co_await acceptor.async_accept(asio::make_strand(ioc), kTuple);
    if (ec) {
      if (!acceptor.is_open() || ec == asio::error::operation_aborted) co_return;
      spdlog::warn("router: accept failed: {}", ec.message());
      asio::steady_timer pause(co_await asio::this_coro::executor, std::chrono::milliseconds(50));
      co_await pause.async_wait(kTuple);
      continue;
    }
    boost::system::error_code opt_ec;
    socket.set_option(tcp::no_delay(true), opt_ec);
    auto executor = socket.get_executor();
    asio::co_spawn(executor, session(std::move(socket)), [](std::exception_ptr error) {
      if (!error) return;
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        spdlog::error("router: connection ended by an exception: {}", e.what());
      }
    });
  }
}

awaitable<bool> Router::Impl::respond(beast::tcp_stream& client, http::response<http::string_body>& response) {
  response.prepare_payload();
  client.expires_after(std::chrono::seconds(config.idle_timeout_seconds));
  auto [ec, n] = co_await http::async_write(client, response, kTuple);
  co_return !ec && response.keep_alive();
}

awaitable<void> Router::Impl::session(tcp::socket socket) {
  beast::tcp_stream client(std::move(socket));
  server::HttpLimits limits;
  limits.max_header_bytes = static_cast<size_t>(config.max_header_bytes);
  limits.max_body_bytes = static_cast<uint64_t>(config.max_body_bytes);
  beast::flat_buffer buffer(server::connection_buffer_bytes(limits));
  while (!stopping) {
    server::RequestParser parser(limits);
    client.expires_after(std::chrono::seconds(config.idle_timeout_seconds));
    auto [header_ec, header_n] = co_await http::async_read_header(client, buffer, parser, kTuple);
    boost::system::error_code ec = header_ec;
    if (!ec && !parser.is_done()) {
      // A client that waits for "100 Continue" before its body (curl does past 1 MiB) gets it.
      if (beast::iequals(parser.get()[http::field::expect], "100-continue")) {
        http::response<http::empty_body> go_on{http::status::continue_, 11};
        auto [continue_ec, continue_n] = co_await http::async_write(client, go_on, kTuple);
        ec = continue_ec;
      }
      if (!ec) {
        auto [body_ec, body_n] = co_await http::async_read(client, buffer, parser, kTuple);
        ec = body_ec;
      }
    }
    if (ec) {
      if (auto refusal = server::parse_error_response(ec, limits)) {
        http::response<http::string_body> response{static_cast<http::status>(refusal->status), 11};
        response.set(http::field::content_type, "application/json");
        response.body() = error_json(Dialect::kOpenAI, refusal->status, refusal->message);
        response.keep_alive(false);
        co_await respond(client, response);
      }
      co_return;
    }
    if (auto framing = server::check_framing(parser.get())) {
      http::response<http::string_body> response{static_cast<http::status>(framing->status), 11};
      response.set(http::field::content_type, "application/json");
      response.body() = error_json(Dialect::kOpenAI, framing->status, framing->message);
      response.keep_alive(false);
      co_await respond(client, response);
      co_return;
    }
    http::request<http::string_body> request = parser.release();
    active.fetch_add(1);
    const bool keep = co_await handle(client, request);
    active.fetch_sub(1);
    if (!keep) break;
  }
  boost::system::error_code ec;
  client.socket().shutdown(tcp::socket::shutdown_both, ec);
}

awaitable<bool> Router::Impl::handle(beast::tcp_stream& client, http::request<http::string_body>& request) {
  const std::string target(request.target());
  std::string_view path(target);
  if (const size_t q = path.find('?'); q != std::string_view::npos) path = path.substr(0, q);
  const Dialect dialect = path.starts_with("/v1/messages") ? Dialect::kAnthropic : Dialect::kOpenAI;
  const RouteEntry* entry = nullptr;
  for (const RouteEntry& candidate : kRoutes) {
    if (candidate.path == path || (candidate.path == "/v1/models" && path.starts_with("/v1/models/"))) {
      entry = &candidate;
      break;
    }
  }
  http::response<http::string_body> response{http::status::ok, request.version()};
  response.keep_alive(request.keep_alive());
  response.set(http::field::content_type, "application/json");
  if (entry == nullptr || entry->method != request.method()) {
    const int status = entry == nullptr ? 404 : 405;
    response.result(static_cast<http::status>(status));
    response.body() = error_json(dialect, status,
                                 entry == nullptr ? "no route for " + std::string(request.method_string()) + " " +
                                                        std::string(path)
                                                  : "method " + std::string(request.method_string()) +
                                                        " not allowed on " + std::string(path));
    co_return co_await respond(client, response);
  }
  switch (entry->route) {
    case Route::kHealth: {
      int32_t healthy = 0, answering = 0;  // answering: workers that answer requests (not prefill workers)
      {
        std::lock_guard lock(mu);
        for (const Worker& w : workers) {
          healthy += usable(w) ? 1 : 0;
          answering += usable(w) && !w.prefill ? 1 : 0;
        }
      }
      response.result(answering > 0 && !stopping ? http::status::ok : http::status::service_unavailable);
      json::object body{{"status", answering > 0 && !stopping ? "ok" : "unavailable"},
                        {"healthy_workers", healthy},
                        {"workers", static_cast<int64_t>(workers.size())}};
      response.body() = json::serialize(body);
      co_return co_await respond(client, response);
    }
    case Route::kMetrics:
      response.set(http::field::content_type, "text/plain; version=0.0.4");
      response.body() = metrics_text();
      co_return co_await respond(client, response);
    case Route::kAnyWorker:
      co_return co_await generate(client, request, dialect, false);
    case Route::kGenerate:
      co_return co_await generate(client, request, dialect, true);
  }
  co_return false;
}

awaitable<bool> Router::Impl::generate(beast::tcp_stream& client, http::request<http::string_body>& request,
                                       Dialect dialect, bool routed) {
  const Clock::time_point arrival = Clock::now();
  const int32_t n = static_cast<int32_t>(workers.size());
  RouteRequest route;
  route.excluded.assign(static_cast<size_t>(n), 0);
  std::shared_ptr<const PlanContext> plan_context;
  std::vector<std::optional<kvcache::ModelFingerprint>> fingerprints(static_cast<size_t>(n));
  {
    std::lock_guard lock(mu);
    plan_context = plan;
    for (int32_t w = 0; w < n; ++w) fingerprints[static_cast<size_t>(w)] = workers[static_cast<size_t>(w)].fingerprint;
  }
  if (routed) {
    std::string_view path(request.target().data(), request.target().size());
    if (const size_t q = path.find('?'); q != std::string_view::npos) path = path.substr(0, q);
    PromptFacts facts = analyze(path, request.body(), plan_context.get(), tokenizer.get(), config.affinity_chars);
    route.prompt_tokens = static_cast<int64_t>(facts.token_ids.size());
    route.affinity_key = facts.affinity;
    if (config.policy == Policy::kKvAware && !facts.token_ids.empty()) {
      route.matches.assign(static_cast<size_t>(n), PrefixMatch{});
      // One chain per fingerprint (workers of one model and compute mode share one).
      std::vector<uint8_t> done(static_cast<size_t>(n), 0);
      for (int32_t w = 0; w < n; ++w) {
        if (done[static_cast<size_t>(w)] || !fingerprints[static_cast<size_t>(w)]) continue;
        const kvcache::ModelFingerprint fp = *fingerprints[static_cast<size_t>(w)];
        const std::vector<kvcache::BlockHash> chain = kvcache::block_hash_chain(facts.token_ids, fp);
        const std::vector<PrefixMatch> matches = index->match(chain);
        for (int32_t v = w; v < n; ++v) {
          if (fingerprints[static_cast<size_t>(v)] == fp) {
            route.matches[static_cast<size_t>(v)] = matches[static_cast<size_t>(v)];
            done[static_cast<size_t>(v)] = 1;
          }
        }
      }
    }
  }
  const bool keep_alive = request.keep_alive();
  const bool disaggregated = !config.prefill_workers.empty();
  for (int32_t w = 0; w < n; ++w) {
    if (workers[static_cast<size_t>(w)].prefill) route.excluded[static_cast<size_t>(w)] = 1;  // never answers
  }
  std::string failure;
  for (int32_t attempt = 0; attempt <= config.max_retries; ++attempt) {
    Decision decision;
    Decision prefill_decision;
    std::optional<std::string> prefill_endpoint;
    {
      std::lock_guard lock(mu);
      std::vector<WorkerState> states;
      for (const Worker& w : workers) {
        states.push_back(w.state);
        states.back().healthy = usable(w);  // disaggregated: also of the right role
      }
      if (routed) {
        decision = policy->choose(route, states);
      } else {
        int32_t best = -1;
        for (int32_t w = 0; w < n; ++w) {
          if (!states[static_cast<size_t>(w)].healthy || route.excluded[static_cast<size_t>(w)]) continue;
          if (best < 0 || states[static_cast<size_t>(w)].in_flight < states[static_cast<size_t>(best)].in_flight) best = w;
        }
        decision.worker = best;
        decision.reason = "least_load";
      }
      if (decision.worker < 0) break;
      // Disaggregated: the prefill worker for the part the decode worker lacks (unless that part is short).
      const bool local = config.policy == Policy::kKvAware && !route.matches.empty() &&
                         decision.uncached_tokens <= config.max_local_prefill_tokens;
      if (disaggregated && routed && !local) {
        RouteRequest prefill_route = route;
        const Worker& decode = workers[static_cast<size_t>(decision.worker)];
        for (int32_t w = 0; w < n; ++w) {
          Worker& candidate = workers[static_cast<size_t>(w)];
          // A prefill worker of another model or KV dtype than the decode worker's: its blocks would be refused.
          // (A worker not reached yet has no fingerprint; it is not usable either, and not another model.)
          const bool other_model = candidate.prefill && candidate.fingerprint && decode.fingerprint &&
                                   *candidate.fingerprint != *decode.fingerprint;
          // A prefill worker serving KV over another wire than the decode worker's (TCP against UCX): the decode
          // worker's transfer would fail only at its timeout.
          const bool other_wire = candidate.prefill && !candidate.kv_wire.empty() && !decode.kv_wire.empty() &&
                                  candidate.kv_wire != decode.kv_wire;
          if (other_wire && !candidate.wire_warned) {
            candidate.wire_warned = true;
            spdlog::error("router: prefill worker {} ({}) serves KV transfers over {}, decode worker {} fetches over "
                          "{} (--kv-transfer-protocol must match): it is not paired with that decode worker",
                          w, candidate.url, candidate.kv_wire, decode.url, decode.kv_wire);
          }
          if (other_model && !candidate.fingerprint_warned) {
            candidate.fingerprint_warned = true;
            spdlog::error("router: prefill worker {} ({}) has block fingerprint {}, decode worker {} has {}: another "
                          "checkpoint or KV dtype; it is not paired with that decode worker",
                          w, candidate.url, candidate.fingerprint ? candidate.fingerprint->to_hex() : "none",
                          decode.url, decode.fingerprint ? decode.fingerprint->to_hex() : "none");
          }
          prefill_route.excluded[static_cast<size_t>(w)] = !candidate.prefill || other_model || other_wire;
        }
        prefill_decision = policy->choose(prefill_route, states);
        if (prefill_decision.worker >= 0) {
          Worker& prefill = workers[static_cast<size_t>(prefill_decision.worker)];
          prefill.state.in_flight += 1;
          prefill.state.pending_prefill_tokens += prefill_decision.uncached_tokens;
          ++prefill.requests_by_reason[std::string(reason_text(prefill_decision.reason))];
          prefill.prompt_tokens += static_cast<uint64_t>(route.prompt_tokens);
          prefill.predicted_cached_tokens += static_cast<uint64_t>(prefill_decision.cached_tokens);
          const std::string host =
              prefill.address.host.find(':') != std::string::npos ? "[" + prefill.address.host + "]" : prefill.address.host;
          // The decode worker asks for only the blocks its device lacks (it knows them: KvReservation).
          prefill_endpoint = host + ":" + std::to_string(prefill.kv_transfer_port);
        }
      }
      if (disaggregated && routed) ++prefill_where[prefill_endpoint ? "remote" : "local"];
      Worker& worker = workers[static_cast<size_t>(decision.worker)];
      worker.state.in_flight += 1;
      worker.state.pending_prefill_tokens += decision.uncached_tokens;
      worker.state.active_tokens += route.prompt_tokens;
      if (routed) {
        ++worker.requests_by_reason[std::string(attempt > 0 ? "retry" : reason_text(decision.reason))];
        worker.prompt_tokens += static_cast<uint64_t>(route.prompt_tokens);
        worker.predicted_cached_tokens += static_cast<uint64_t>(decision.cached_tokens);
      }
      if (attempt > 0) ++retries;
    }
    const int32_t w = decision.worker;
    const int32_t p = prefill_endpoint ? prefill_decision.worker : -1;
    bool pending_released = false;
    auto release_pending = [&] {
      if (pending_released) return;
      pending_released = true;
      std::lock_guard lock(mu);
      workers[static_cast<size_t>(w)].state.pending_prefill_tokens -= decision.uncached_tokens;
      if (p >= 0) {
        Worker& prefill = workers[static_cast<size_t>(p)];
        prefill.state.pending_prefill_tokens -= prefill_decision.uncached_tokens;
        prefill.state.in_flight -= 1;  // its part ends before the decode worker's first byte
      }
    };
    const bool may_retry = attempt < config.max_retries;
    Outcome outcome = co_await proxy(client, request, w, may_retry, keep_alive, arrival, dialect, release_pending,
                                     failure, prefill_endpoint);
    release_pending();
    {
      std::lock_guard lock(mu);
      Worker& worker = workers[static_cast<size_t>(w)];
      worker.state.in_flight -= 1;
      worker.state.active_tokens -= route.prompt_tokens;
    }
    if (outcome == Outcome::kRetry) {
      route.excluded[static_cast<size_t>(w)] = 1;
      continue;
    }
    e2e.observe(std::chrono::duration<double>(Clock::now() - arrival).count());
    co_return outcome == Outcome::kDone && keep_alive;
  }
  const int status = failure.empty() ? 503 : 502;
  count_error(failure.empty() ? "no_worker" : "worker_error");
  http::response<http::string_body> response{static_cast<http::status>(status), request.version()};
  response.keep_alive(keep_alive);
  response.set(http::field::content_type, "application/json");
  response.set(http::field::retry_after, "1");
  response.body() = error_json(
      dialect, status,
      failure.empty() ? "no healthy worker can take the request (the router has " + std::to_string(n) +
                            " workers; see its /health and /metrics)"
                      : "no worker answered the request (last: " + failure + ")");
  co_return co_await respond(client, response);
}

awaitable<Router::Impl::Outcome> Router::Impl::proxy(beast::tcp_stream& client,
                                                     const http::request<http::string_body>& request, int32_t w,
                                                     bool may_retry, bool keep_alive, Clock::time_point arrival,
                                                     Dialect dialect, std::function<void()> on_first_byte,
                                                     std::string& failure,
                                                     std::optional<std::string> prefill_endpoint) {
  const Worker& worker = workers[static_cast<size_t>(w)];  // url and address never change
  auto executor = co_await asio::this_coro::executor;
  beast::tcp_stream upstream(executor);
  const auto fail_before_header = [&](const std::string& why, bool unhealthy) -> Outcome {
    spdlog::warn("router: worker {} ({}): {}{}", w, worker.url, why, may_retry ? "; retrying elsewhere" : "");
    if (unhealthy) set_health(w, false);
    failure = "worker " + worker.url + ": " + why;
    return Outcome::kRetry;
  };
  tcp::resolver resolver(executor);
  auto [resolve_ec, endpoints] =
      co_await resolver.async_resolve(worker.address.host, std::to_string(worker.address.port), kTuple);
  if (resolve_ec) co_return fail_before_header("cannot resolve: " + resolve_ec.message(), true);
  upstream.expires_after(std::chrono::milliseconds(config.connect_timeout_ms));
  auto [connect_ec, connected] = co_await upstream.async_connect(endpoints, kTuple);
  if (connect_ec) co_return fail_before_header("cannot connect: " + connect_ec.message(), true);
  boost::system::error_code opt_ec;
  upstream.socket().set_option(tcp::no_delay(true), opt_ec);

  http::request<http::string_body> out{request.method(), request.target(), 11};
  for (const auto& field : request) {
    if (!hop_by_hop(field.name(), field.name_string())) out.insert(field.name_string(), field.value());
  }
  out.set(http::field::host, worker.address.host + ":" + std::to_string(worker.address.port));
  // Only the router names a prefill worker: a client's header would make a decode worker connect where it says.
  out.erase("X-KV-Prefill-Endpoint");
  if (prefill_endpoint) out.set("X-KV-Prefill-Endpoint", *prefill_endpoint);
  out.body() = request.body();
  out.keep_alive(false);
  out.prepare_payload();
  upstream.expires_after(std::chrono::milliseconds(config.first_byte_timeout_ms));
  auto [write_ec, written] = co_await http::async_write(upstream, out, kTuple);
  if (write_ec) co_return fail_before_header("sending the request failed: " + write_ec.message(), true);

  http::response_parser<http::buffer_body> parser;
  parser.body_limit(boost::none);
  beast::flat_buffer buffer;
  // Until the worker's header (for a non-streamed answer: its end), a client that goes away closes the upstream
  // connection, so the worker cancels the request instead of finishing it for nobody.
  auto watch = std::make_shared<ClientWatch>();
  watch->upstream = &upstream.socket();
  asio::co_spawn(executor, watch_client(client.socket(), watch), asio::detached);
  auto [header_ec, header_n] = co_await http::async_read_header(upstream, buffer, parser, kTuple);
  watch->over = true;
  watch->upstream = nullptr;
  {
    boost::system::error_code ignored;
    client.socket().cancel(ignored);  // ends the watcher's wait
  }
  if (watch->client_gone) {
    count_error("client_disconnect");
    co_return Outcome::kClientGone;
  }
  if (header_ec) {
    co_return fail_before_header(header_ec == beast::error::timeout
                                     ? "no response header within --first-byte-timeout-ms"
                                     : "the connection ended before a response: " + header_ec.message(),
                                 header_ec != beast::error::timeout);
  }
  const int status = parser.get().result_int();
  if (may_retry && (status == 429 || status >= 500)) {
    spdlog::warn("router: worker {} ({}) answered {}; retrying elsewhere", w, worker.url, status);
    failure = "worker " + worker.url + " answered " + std::to_string(status);
    co_return Outcome::kRetry;
  }
  // From here on the client gets this worker's answer: no retry.
  http::response<http::empty_body> head{static_cast<http::status>(status), 11};
  for (const auto& field : parser.get()) {
    if (!hop_by_hop(field.name(), field.name_string())) head.insert(field.name_string(), field.value());
  }
  head.keep_alive(keep_alive);
  head.chunked(true);
  const bool sse = parser.get()[http::field::content_type].starts_with("text/event-stream");
  client.expires_after(std::chrono::milliseconds(config.stream_idle_timeout_ms));
  http::response_serializer<http::empty_body> serializer(head);
  auto [head_ec, head_n] = co_await http::async_write_header(client, serializer, kTuple);
  if (head_ec) {
    count_error("client_disconnect");
    co_return Outcome::kClientGone;
  }
  // Each piece of the body as it arrives (async_read_some: async_read would wait for 16 KiB, holding an SSE stream's
  // events back until its end).
  std::array<char, 16384> chunk;
  bool first = true;
  while (!parser.is_done()) {
    parser.get().body().data = chunk.data();
    parser.get().body().size = chunk.size();
    upstream.expires_after(std::chrono::milliseconds(config.stream_idle_timeout_ms));
    auto [read_ec, read_n] = co_await http::async_read_some(upstream, buffer, parser, kTuple);
    const size_t got = chunk.size() - parser.get().body().size;
    if (got > 0) {
      if (first) {
        first = false;
        on_first_byte();
        if (sse) ttft.observe(std::chrono::duration<double>(Clock::now() - arrival).count());
      }
      client.expires_after(std::chrono::milliseconds(config.stream_idle_timeout_ms));  // a client that stops reading
      auto [chunk_ec, chunk_n] = co_await asio::async_write(client, http::make_chunk(asio::buffer(chunk.data(), got)), kTuple);
      if (chunk_ec) {
        count_error("client_disconnect");
        co_return Outcome::kClientGone;  // upstream closes as it goes out of scope: the worker cancels
      }
    }
    if (read_ec && read_ec != http::error::need_buffer) {
      count_error("stream_broken");
      spdlog::warn("router: worker {} ({}): the response broke off: {}", w, worker.url, read_ec.message());
      if (read_ec != beast::error::timeout) set_health(w, false);
      const std::string message = "the worker's response broke off (" + read_ec.message() + ")";
      std::string event;
      if (sse) {
        event = dialect == Dialect::kAnthropic ? "event: error\ndata: " + error_json(dialect, 502, message) + "\n\n"
                                               : "data: " + error_json(dialect, 502, message) + "\n\n";
        co_await asio::async_write(client, http::make_chunk(asio::buffer(event)), kTuple);
      }
      co_await asio::async_write(client, http::make_chunk_last(), kTuple);
      co_return Outcome::kClientGone;  // the response is incomplete: close the connection
    }
  }
  auto [last_ec, last_n] = co_await asio::async_write(client, http::make_chunk_last(), kTuple);
  client.expires_never();
  if (last_ec) co_return Outcome::kClientGone;
  if (status >= 500 || status == 429) count_error("worker_error");
  co_return Outcome::kDone;
}

// ---- health and worker info ------------------------------------------------------------------------------

awaitable<std::optional<std::pair<int, std::string>>> Router::Impl::get(const WorkerAddress& address,
                                                                       std::string target, int32_t timeout_ms) {
  auto executor = co_await asio::this_coro::executor;
  tcp::resolver resolver(executor);
  auto [resolve_ec, endpoints] = co_await resolver.async_resolve(address.host, std::to_string(address.port), kTuple);
  if (resolve_ec) co_return std::nullopt;
  beast::tcp_stream stream(executor);
  stream.expires_after(std::chrono::milliseconds(timeout_ms));
  auto [connect_ec, connected] = co_await stream.async_connect(endpoints, kTuple);
  if (connect_ec) co_return std::nullopt;
  http::request<http::empty_body> request{http::verb::get, target, 11};
  request.set(http::field::host, address.host + ":" + std::to_string(address.port));
  request.keep_alive(false);
  auto [write_ec, written] = co_await http::async_write(stream, request, kTuple);
  if (write_ec) co_return std::nullopt;
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(1 << 20);
  auto [read_ec, read_n] = co_await http::async_read(stream, buffer, parser, kTuple);
  if (read_ec) co_return std::nullopt;
  co_return std::make_pair(parser.get().result_int(), std::move(parser.get().body()));
}

void Router::Impl::set_health(int32_t w, bool healthy) {
  std::lock_guard lock(mu);
  Worker& worker = workers[static_cast<size_t>(w)];
  if (worker.state.healthy != healthy) {
    spdlog::info("router: worker {} ({}) is {}", w, worker.url, healthy ? "healthy" : "unhealthy");
  }
  worker.state.healthy = healthy;
}

namespace {

std::optional<kvcache::BlockHash> parse_hash_hex(std::string_view hex) {
  if (hex.size() != 32) return std::nullopt;
  kvcache::BlockHash out;
  for (size_t i = 0; i < 32; ++i) {
    const char c = hex[i];
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (digit < 0) return std::nullopt;
    uint64_t& half = i < 16 ? out.high : out.low;
    half = (half << 4) | static_cast<uint64_t>(digit);
  }
  return out;
}

std::string string_field(const json::object& object, std::string_view key) {
  const json::value* v = object.if_contains(key);
  return v != nullptr && v->is_string() ? std::string(v->as_string()) : std::string();
}

int64_t int_field(const json::object& object, std::string_view key) {
  const json::value* v = object.if_contains(key);
  return v != nullptr && v->is_int64() ? v->as_int64() : 0;
}

}  // namespace

void Router::Impl::take_worker_info(int32_t w, const std::string& body) {
  boost::system::error_code ec;
  json::value value = json::parse(body, ec);
  if (ec || !value.is_object()) {
    spdlog::warn("router: worker {}: /worker/info is not a JSON object", w);
    return;
  }
  const json::object& info = value.as_object();
  const std::string instance = string_field(info, "instance_id");
  const std::optional<kvcache::BlockHash> fingerprint = parse_hash_hex(string_field(info, "model_fingerprint"));
  const std::string events = string_field(info, "kv_events_endpoint");
  const std::string replay = string_field(info, "kv_events_replay_endpoint");
  const std::string role = string_field(info, "role");
  std::shared_ptr<PlanContext> fresh;
  {
    std::lock_guard lock(mu);
    Worker& worker = workers[static_cast<size_t>(w)];
    if (worker.info_known && worker.instance == instance) return;
    worker.info_known = true;
    worker.instance = instance;
    worker.fingerprint = fingerprint;
    worker.role = role;
    worker.kv_transfer_port = static_cast<int32_t>(int_field(info, "kv_transfer_port"));
    const std::string protocol = string_field(info, "kv_transfer_protocol");
    worker.kv_wire = protocol.empty() ? "" : protocol == "tcp" ? "tcp" : "ucx";
    const bool disaggregated = !config.prefill_workers.empty();
    const char* want = worker.prefill ? "prefill" : disaggregated ? "decode" : nullptr;
    if (want != nullptr && role != want) {
      spdlog::error("router: worker {} ({}) is --role {}; as a {} it must be --role {}: not used", w, worker.url,
                    role.empty() ? "?" : role, worker.prefill ? "--prefill worker" : "--decode worker", want);
    }
    if (plan == nullptr && tokenizer != nullptr) {
      Result<recipe::PromptFormat> format = recipe::parse_format(string_field(info, "chat_format"));
      Result<recipe::V4Revision> revision = recipe::parse_v4_revision(string_field(info, "chat_format_revision"));
      if (format.ok()) {
        fresh = std::make_shared<PlanContext>();
        fresh->model.served_model_name = string_field(info, "model");
        fresh->model.model_type = string_field(info, "model_type");
        fresh->model.vocab_size = int_field(info, "vocab_size");
        fresh->model.max_model_len = int_field(info, "max_model_len");
        fresh->model.bos_token_id = int_field(info, "bos_token_id");
        fresh->api.tokenizer = tokenizer;
        fresh->api.tokenization_cache = tokenization_cache.get();
        fresh->api.chat_format = *format;
        fresh->api.v4_revision = revision.ok() ? *revision : recipe::V4Revision::k0731;
        fresh->api.default_max_tokens = int_field(info, "default_max_tokens");
        fresh->api.model = &fresh->model;
        plan = fresh;
      } else {
        spdlog::warn("router: worker {}: /worker/info names no chat format the router knows", w);
      }
    }
  }
  spdlog::info("router: worker {} ({}): instance {}, fingerprint {}, KV events {}", w, workers[static_cast<size_t>(w)].url,
               instance, fingerprint ? fingerprint->to_hex() : "none", events.empty() ? "off" : events);
  if (!events.empty()) {
    const std::string& host = workers[static_cast<size_t>(w)].address.host;
    subscriber->connect(w, reachable_endpoint(events, host), replay.empty() ? "" : reachable_endpoint(replay, host),
                        instance);
  } else {
    index->clear_worker(w);
  }
}

awaitable<void> Router::Impl::health_loop(int32_t w) {
  asio::steady_timer timer(co_await asio::this_coro::executor);
  const WorkerAddress address = workers[static_cast<size_t>(w)].address;
  while (!stopping) {
    auto health = co_await get(address, "/health", config.health_check_timeout_ms);
    const bool healthy = health && health->first == 200;
    if (healthy) {
      auto info = co_await get(address, "/worker/info", config.health_check_timeout_ms);
      if (info && info->first == 200) take_worker_info(w, info->second);
    }
    set_health(w, healthy);
    timer.expires_after(std::chrono::milliseconds(config.health_check_interval_ms));
    co_await timer.async_wait(kTuple);
  }
}

// ---- metrics ---------------------------------------------------------------------------------------------

std::string Router::Impl::metrics_text() {
  std::string out;
  const auto line = [&](std::string_view name, std::string_view labels, auto value) {
    out += name;
    if (!labels.empty()) out += "{" + std::string(labels) + "}";
    out += " " + std::to_string(value) + "\n";
  };
  const auto header = [&](std::string_view name, std::string_view type, std::string_view help) {
    out += "# HELP " + std::string(name) + " " + std::string(help) + "\n# TYPE " + std::string(name) + " " +
           std::string(type) + "\n";
  };
  std::lock_guard lock(mu);
  const auto label = [&](size_t w) { return "worker=\"" + workers[w].url + "\""; };
  header("deepinfer_router_requests_total", "counter", "Requests sent to a worker, by the policy's reason");
  for (size_t w = 0; w < workers.size(); ++w) {
    for (const auto& [reason, count] : workers[w].requests_by_reason) {
      line("deepinfer_router_requests_total", label(w) + ",reason=\"" + reason + "\"", count);
    }
  }
  header("deepinfer_router_request_errors_total", "counter", "Requests the router ended with an error, by reason");
  for (const auto& [reason, count] : errors) line("deepinfer_router_request_errors_total", "reason=\"" + reason + "\"", count);
  header("deepinfer_router_retries_total", "counter", "Attempts after a worker failed");
  line("deepinfer_router_retries_total", "", retries);
  if (!config.prefill_workers.empty()) {
    header("deepinfer_router_prefill_total", "counter",
           "Disaggregated requests by where their prompt was prefilled: remote (a prefill worker, KV moved to the "
           "decode worker) or local (the decode worker held all but --max-local-prefill-tokens of it, or no prefill "
           "worker could take it)");
    for (const char* where : {"remote", "local"}) {
      auto it = prefill_where.find(where);
      line("deepinfer_router_prefill_total", std::string("where=\"") + where + "\"",
           it == prefill_where.end() ? uint64_t{0} : it->second);
    }
  }
  ttft.render("deepinfer_router_time_to_first_token_seconds",
              "Streaming requests: arrival to the first body byte from the worker", out);
  e2e.render("deepinfer_router_e2e_request_latency_seconds", "Arrival to response end", out);
  header("deepinfer_router_worker_healthy", "gauge", "1 when the worker's last health check passed");
  for (size_t w = 0; w < workers.size(); ++w) line("deepinfer_router_worker_healthy", label(w), workers[w].state.healthy ? 1 : 0);
  header("deepinfer_router_worker_in_flight", "gauge", "Requests in flight on the worker");
  for (size_t w = 0; w < workers.size(); ++w) line("deepinfer_router_worker_in_flight", label(w), workers[w].state.in_flight);
  header("deepinfer_router_worker_prompt_tokens_total", "counter", "Prompt tokens routed to the worker");
  for (size_t w = 0; w < workers.size(); ++w) line("deepinfer_router_worker_prompt_tokens_total", label(w), workers[w].prompt_tokens);
  header("deepinfer_router_worker_predicted_cached_tokens_total", "counter",
         "Of those, held by the worker per the router's index");
  for (size_t w = 0; w < workers.size(); ++w) {
    line("deepinfer_router_worker_predicted_cached_tokens_total", label(w), workers[w].predicted_cached_tokens);
  }
  header("deepinfer_router_worker_kv_blocks", "gauge", "Blocks the router's index holds for the worker (any tier)");
  for (size_t w = 0; w < workers.size(); ++w) line("deepinfer_router_worker_kv_blocks", label(w), index->worker_blocks(static_cast<int32_t>(w)));
  header("deepinfer_router_kv_events_total", "counter", "KV event batches applied");
  for (size_t w = 0; w < workers.size(); ++w) line("deepinfer_router_kv_events_total", label(w), subscriber->batches(static_cast<int32_t>(w)));
  header("deepinfer_router_kv_event_gaps_total", "counter", "KV event sequence gaps");
  for (size_t w = 0; w < workers.size(); ++w) line("deepinfer_router_kv_event_gaps_total", label(w), subscriber->gaps(static_cast<int32_t>(w)));
  return out;
}

}  // namespace deepinfer::router
