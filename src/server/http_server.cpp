// The HTTP side: accept loop, one coroutine per connection (on its own strand), routing, auth, limits, and
// the generation driver that runs a GenerationPlan against the engine thread and streams the result.
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/json.hpp>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <deque>
#include <fstream>
#include <iterator>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "deepinfer/recipe/model_formats.h"
#include "deepinfer/server/api.h"
#include "deepinfer/server/http_framing.h"
#include "deepinfer/server/server.h"
#include "kv_transfer.h"
#include "ucx_transport.h"

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
constexpr uint64_t kDiscardBodyBytes = 64 * 1024;  // a refused request's body up to this is read and dropped
constexpr int kReservedFileDescriptors = 64;  // kept free of connections: engine, disk tier, logs, accept()
constexpr std::string_view kJson = "application/json";
constexpr std::string_view kClientGone = "the client went away";
constexpr std::string_view kPrometheusText = "text/plain; version=0.0.4; charset=utf-8";

// Ends an engine KV reservation (the decode side's first phase) that no submit took over: a failed transfer, a
// client gone, any early return. id 0: nothing to end.
struct KvReservationGuard {
  explicit KvReservationGuard(engine::EngineClient& engine) : engine(engine) {}
  ~KvReservationGuard() {
    if (id != 0) engine.release_kv_blocks(id);
  }
  KvReservationGuard(const KvReservationGuard&) = delete;
  KvReservationGuard& operator=(const KvReservationGuard&) = delete;
  engine::EngineClient& engine;
  uint64_t id = 0;
};

double seconds_since(Clock::time_point start, Clock::time_point end = Clock::now()) {
  return std::chrono::duration<double>(end - start).count();
}

// The request's events, queued by the engine thread and awaited by the request's coroutine. deliver() posts
// one wake-up to the request's strand (at most one outstanding), which cancels the timer the coroutine
// waits on; the coroutine always checks the queue before waiting, so no wake-up is lost.
class RequestChannel final : public engine::EventSink, public std::enable_shared_from_this<RequestChannel> {
 public:
  explicit RequestChannel(asio::any_io_executor executor) : executor_(executor), timer_(executor) {}

  void deliver(std::vector<engine::GenerationEvent> events) override {
    {
      std::lock_guard lock(mu_);
      for (engine::GenerationEvent& event : events) events_.push_back(std::move(event));
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

  std::vector<engine::GenerationEvent> take() {
    std::lock_guard lock(mu_);
    std::vector<engine::GenerationEvent> out(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
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
  std::deque<engine::GenerationEvent> events_;  // GUARDED_BY(mu_)
  bool wake_posted_ = false;            // GUARDED_BY(mu_)
  bool client_gone_ = false;            // strand only
  bool done_ = false;                   // strand only
};

struct Connection {
  Connection(tcp::socket socket, size_t buffer_limit) : stream(std::move(socket)), buffer(buffer_limit) {}
  beast::tcp_stream stream;
  beast::flat_buffer buffer;  // bounded: a header or trailer that never ends cannot grow it past the limit
  bool close = false;             // close after the current response
  bool response_started = false;  // bytes of the current response went out
};

struct RequestInfo {
  unsigned version = 11;
  bool keep_alive = false;
  std::string method;
  std::string target;
  std::string origin;  // the Origin header (CORS), empty when absent
  Clock::time_point start = Clock::now();
};

enum class Route {
  kHealth, kMetrics, kWorkerInfo, kModels, kModel, kChat, kCompletions, kMessages, kCountTokens, kResponses, kTokenize, kDetokenize
};

struct RouteEntry {
  std::string_view path;
  http::verb method;
  Route route;
  bool needs_auth;
};

constexpr RouteEntry kRoutes[] = {
    {"/health", http::verb::get, Route::kHealth, false},
    {"/metrics", http::verb::get, Route::kMetrics, false},
    {"/worker/info", http::verb::get, Route::kWorkerInfo, false},
    {"/v1/models", http::verb::get, Route::kModels, true},
    {"/v1/chat/completions", http::verb::post, Route::kChat, true},
    {"/v1/completions", http::verb::post, Route::kCompletions, true},
    {"/v1/messages", http::verb::post, Route::kMessages, true},
    {"/v1/messages/count_tokens", http::verb::post, Route::kCountTokens, true},
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

// Builds an ApiError outside the coroutines (g++ 12 rejects aggregate initialization from string literals in a
// coroutine body: "array used as initializer").
ApiError api_error(int status, std::string message, std::string code = {}, int retry_after_seconds = 0,
                   std::string param = {}) {
  return ApiError{status, std::move(message), std::move(param), std::move(code), retry_after_seconds};
}

// The API error of a refusal decided while reading the request's bytes (http_framing.h words it).
ApiError framing_error(const FramingError& refused) {
  return api_error(refused.status, refused.message, refused.status == 413 ? "request_too_large" : std::string());
}

std::vector<std::pair<std::string, std::string>> allow_header(const std::string& method) { return {{"Allow", method}}; }

// The answer to a CORS preflight (outside the coroutines, as api_error above): the methods the API takes and the
// headers the browser asked for (else the ones clients send).
std::vector<std::pair<std::string, std::string>> preflight_headers(std::string requested_headers) {
  if (requested_headers.empty()) requested_headers = "authorization, content-type, x-api-key, anthropic-version";
  return {{"Access-Control-Allow-Methods", "GET, POST, OPTIONS"},
          {"Access-Control-Allow-Headers", std::move(requested_headers)},
          {"Access-Control-Max-Age", "600"}};
}

ApiError engine_error(const Status& status) {
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
      return bad_request(status.message());
    case StatusCode::kUnsupported:
      return ApiError{400, status.message(), {}, "unsupported", 0};
    case StatusCode::kShuttingDown:  // the engine's stop, or why the process stops (a tensor-parallel rank died)
      return ApiError{503, status.message().empty() ? "the server is shutting down" : status.message(), {}, {}, 5};
    default:
      spdlog::error("request failed in the engine: {}", status.to_string());
      return ApiError{500, "internal server error", {}, {}, 0};
  }
}

}  // namespace

Result<recipe::PromptFormat> default_chat_format(const std::string& model_type) {
  if (model_type == "deepseek_v3" || model_type == "deepseek_v2") return recipe::PromptFormat::kDeepSeekV3;
  if (model_type == "deepseek_v4") return recipe::PromptFormat::kDeepSeekV4;
  return Status::unsupported("model_type '" + model_type + "' has no default chat format; pass --chat-format");
}

Result<recipe::PromptFormat> checkpoint_chat_format(const std::filesystem::path& root, const std::string& model_type) {
  Result<std::optional<recipe::PromptFormat>> named = recipe::detect_format(root);
  if (!named.ok()) return named.status();
  if (named->has_value()) return **named;
  return default_chat_format(model_type);
}

std::optional<recipe::V4Revision> checkpoint_v4_revision(const std::filesystem::path& root) {
  std::ifstream in(root / "encoding" / "encoding_dsv4.py", std::ios::binary);
  if (!in) return std::nullopt;
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.find("Beyond maximum") != std::string::npos) return recipe::V4Revision::k0731;
  if (text.find("Absolute maximum") != std::string::npos) return recipe::V4Revision::kPreview;
  return std::nullopt;
}

struct Server::Impl {
  Impl(ServerConfig config_in, ModelInfo model_in, std::unique_ptr<engine::EngineClient> engine,
       std::shared_ptr<const recipe::Tokenizer> tokenizer)
      : config(std::move(config_in)),
        model(std::move(model_in)),
        client(std::move(engine)),
        work(asio::make_work_guard(ioc)),
        acceptor(ioc),
        kv_acceptor(ioc),
        signals(ioc),
        force_stop(ioc),
        drain_deadline(ioc),
        created(unix_time()) {
    limits.max_header_bytes = static_cast<size_t>(config.max_header_bytes);
    limits.max_body_bytes = static_cast<uint64_t>(config.max_body_bytes);
    api.model = &model;
    api.tokenizer = std::move(tokenizer);
    if (config.tokenization_cache_bytes > 0) {
      tokenization_cache =
          std::make_unique<recipe::TokenizationCache>(static_cast<size_t>(config.tokenization_cache_bytes));
      api.tokenization_cache = tokenization_cache.get();
    }
    api.chat_format = config.chat_format;
    api.v4_revision = config.chat_format_revision;
    api.default_max_tokens = config.default_max_tokens;
    boost::json::object info{
        {"role", config.role},
        {"instance_id", random_id("worker-")},
        {"model", model.served_model_name},
        {"model_type", model.model_type},
        {"vocab_size", model.vocab_size},
        {"max_model_len", model.max_model_len},
        {"bos_token_id", model.bos_token_id},
        {"chat_format", recipe::format_name(config.chat_format)},
        {"chat_format_revision", recipe::v4_revision_name(config.chat_format_revision)},
        {"default_max_tokens", config.default_max_tokens},
        {"block_size", kBlockTokens},
        {"model_fingerprint", config.model_fingerprint_hex},
        {"kv_events_endpoint", config.kv_events_endpoint},
        {"kv_events_replay_endpoint", config.kv_events_replay_endpoint},
    };
    worker_info_body = boost::json::serialize(info);
  }

  Status bind();
  Status bind_kv_transfer();
  void arm_signals();
  void begin_shutdown(bool drain);
  void maybe_finish();

  awaitable<void> listen();
  awaitable<void> listen_kv_transfer();
  // Role prefill: serves one accepted transfer stream on `executor` (a new strand if none), or refuses it with an
  // error frame when --kv-transfer-max-connections are running or the server drains.
  void accept_kv_transfer(std::unique_ptr<KvStream> stream, asio::any_io_executor executor = {});
  awaitable<void> refuse_connection(tcp::socket socket, std::string reason);
  awaitable<void> session(tcp::socket socket, std::string peer);
  void release_connection(const std::string& peer);
  awaitable<void> handle(std::shared_ptr<Connection> conn, Request& request);
  awaitable<int> dispatch(std::shared_ptr<Connection> conn, Request& request, RequestInfo& info);
  awaitable<int> generate(std::shared_ptr<Connection> conn, Request& request, RequestInfo& info, Route route);
  // Role decode: the engine's reservation for a transfer's blocks (EngineClient::reserve_kv_blocks), awaited on
  // this coroutine's executor for at most `timeout`; one that arrives later is released.
  awaitable<Result<engine::KvReservation>> reserve_kv_blocks(std::vector<TokenId> tokens,
                                                             std::chrono::milliseconds timeout);
  awaitable<void> watch_disconnect(std::shared_ptr<Connection> conn, std::shared_ptr<RequestChannel> channel);
  awaitable<void> watch_disconnect_during_fetch(std::shared_ptr<Connection> conn,
                                                std::shared_ptr<KvFetchControl> control,
                                                std::shared_ptr<bool> fetch_over);
  awaitable<int> send(Connection& conn, const RequestInfo& info, int status, std::string body,
                      std::string_view content_type, std::vector<std::pair<std::string, std::string>> headers = {});
  awaitable<int> send_error(Connection& conn, const RequestInfo& info, const ApiError& error, Dialect dialect,
                            std::vector<std::pair<std::string, std::string>> headers = {});
  awaitable<void> linger_close(Connection& conn);
  // One piece of an event stream: a chunk (HTTP/1.1) or raw bytes (HTTP/1.0); `last` ends the stream (the
  // last chunk; nothing for HTTP/1.0, whose connection closes). False when the write failed.
  awaitable<bool> write_sse(Connection& conn, bool chunked, const std::string& bytes, bool last);
  bool authorized(const http::request_header<>& header) const;
  // What a request's header alone decides, before any body byte is read: draining, no route, wrong method,
  // no key. An error, or the route to run.
  struct Precheck {
    const RouteEntry* entry = nullptr;
    std::optional<ApiError> error;
    std::vector<std::pair<std::string, std::string>> headers;
  };
  Precheck precheck(const http::request_header<>& header) const;
  // CORS headers for a response to `origin` (ServerConfig::allowed_origins); none when it is not allowed.
  std::vector<std::pair<std::string, std::string>> cors_headers(const std::string& origin) const {
    if (origin.empty() || config.allowed_origins.empty()) return {};
    for (const std::string& allowed : config.allowed_origins) {
      if (allowed == "*") return {{"Access-Control-Allow-Origin", "*"}};
      if (allowed == origin) return {{"Access-Control-Allow-Origin", origin}, {"Vary", "Origin"}};
    }
    return {};
  }
  recipe::TokenizationCache::Stats tokenization_stats() const {
    return tokenization_cache ? tokenization_cache->stats() : recipe::TokenizationCache::Stats{};
  }

  ServerConfig config;
  HttpLimits limits;
  ModelInfo model;
  std::unique_ptr<recipe::TokenizationCache> tokenization_cache;  // null when the config turns it off
  ApiContext api;
  Metrics metrics;
  // Before the io_context: a session frame the io_context destroys releases its slot here.
  std::mutex connections_mu;
  int32_t connections = 0;                                    // GUARDED_BY(connections_mu)
  std::unordered_map<std::string, int32_t> connections_by_ip;  // GUARDED_BY(connections_mu)
  int32_t max_connections = 0;                                // effective limits, set by start()
  int32_t max_connections_per_ip = 0;
  std::unique_ptr<engine::EngineClient> client;  // outlives the io_context: pending coroutines cancel through it
  asio::io_context ioc;
  asio::executor_work_guard<asio::io_context::executor_type> work;
  tcp::acceptor acceptor;
  tcp::acceptor kv_acceptor;  // role prefill: decode workers' KV transfers (TCP)
  std::shared_ptr<UcxTransport> ucx;  // --kv-transfer-protocol ucx|rdma: both roles
  KvTransferOptions kv_options;
  std::atomic<int32_t> kv_transfers{0};  // role prefill: transfers being served (a drain waits for them too)
  std::mutex fetches_mu;
  std::set<std::shared_ptr<KvFetchControl>> fetches;  // GUARDED_BY(fetches_mu): role decode, in flight
  asio::signal_set signals;
  asio::steady_timer force_stop;
  asio::steady_timer drain_deadline;
  std::vector<std::thread> threads;

  std::mutex join_mu;
  std::atomic<int32_t> in_flight{0};  // generation requests holding a concurrency slot
  std::atomic<int32_t> active{0};     // requests being handled (drain waits for 0)
  std::atomic<bool> draining{false};
  std::atomic<bool> stopped{false};
  int signal_count = 0;
  int64_t created;
  std::string worker_info_body;  // GET /worker/info
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

Status Server::Impl::bind_kv_transfer() {
  kv_options.timeout_ms = config.kv_transfer_timeout_ms;
  kv_options.deadline_ms = config.kv_transfer_deadline_ms;
  kv_options.block_bytes = config.kv_block_bytes;
  kv_options.max_tokens = model.max_model_len;
  kv_options.fingerprint_hex = config.model_fingerprint_hex;
  if (config.role != "prefill" && config.role != "decode") return Status();
  if (config.kv_transfer_protocol != "tcp") {
    UcxOptions ucx_options;
    ucx_options.rdma_only = config.kv_transfer_protocol == "rdma";
    ucx_options.net_devices = config.rdma_device_names;
    Result<std::shared_ptr<UcxTransport>> made = UcxTransport::create(ucx_options);
    if (!made.ok()) return made.status();
    ucx = std::move(made).value();
    kv_options.ucx = ucx;
  }
  if (config.role != "prefill" && config.role != "decode") return Status();
  boost::json::object info = boost::json::parse(worker_info_body).as_object();
  info["kv_transfer_protocol"] = config.kv_transfer_protocol;  // the router pairs workers of one wire only
  if (config.role == "decode") {
    worker_info_body = boost::json::serialize(info);
    return Status();
  }
  if (ucx != nullptr) {
    Result<uint16_t> port = ucx->listen(
        acceptor.local_endpoint().address().to_string(), static_cast<uint16_t>(config.kv_transfer_port),
        asio::make_strand(ioc), [this](std::unique_ptr<KvStream> stream) { accept_kv_transfer(std::move(stream)); });
    if (!port.ok()) {
      return Status::io_error(fmt::format("cannot listen for KV transfers (UCX) on {}:{} (--kv-transfer-port): {}",
                                          config.host, config.kv_transfer_port, port.status().message()));
    }
    info["kv_transfer_port"] = *port;
    worker_info_body = boost::json::serialize(info);
    spdlog::info("KV transfers served over UCX on {}:{}", config.host, *port);
    return Status();
  }
  boost::system::error_code ec;
  const tcp::endpoint endpoint(acceptor.local_endpoint().address(), static_cast<uint16_t>(config.kv_transfer_port));
  kv_acceptor.open(endpoint.protocol(), ec);
  if (!ec) kv_acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) kv_acceptor.bind(endpoint, ec);
  if (!ec) kv_acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status::io_error(fmt::format("cannot listen for KV transfers on {}:{} (--kv-transfer-port): {}",
                                        config.host, config.kv_transfer_port, ec.message()));
  }
  info["kv_transfer_port"] = kv_acceptor.local_endpoint().port();
  worker_info_body = boost::json::serialize(info);
  spdlog::info("KV transfers served on {}:{}", config.host, kv_acceptor.local_endpoint().port());
  return Status();
}

awaitable<void> Server::Impl::listen_kv_transfer() {
  while (kv_acceptor.is_open()) {
    boost::system::error_code ec;
    tcp::socket socket =
        co_await kv_acceptor.async_accept(asio::make_strand(ioc), asio::redirect_error(use_awaitable, ec));
    if (ec) {
      if (!kv_acceptor.is_open() || ec == asio::error::operation_aborted) co_return;
      spdlog::warn("KV transfer accept failed: {}", ec.message());
      asio::steady_timer pause(co_await asio::this_coro::executor, std::chrono::milliseconds(50));
      co_await pause.async_wait(asio::redirect_error(use_awaitable, ec));
      continue;
    }
    auto executor = socket.get_executor();
    accept_kv_transfer(make_tcp_kv_stream(std::move(socket)), executor);
  }
}

void Server::Impl::accept_kv_transfer(std::unique_ptr<KvStream> accepted, asio::any_io_executor executor) {
  if (!executor) executor = asio::make_strand(ioc);
  std::shared_ptr<KvStream> stream = std::move(accepted);
  if (draining.load() || kv_transfers.load() >= config.kv_transfer_max_connections) {
    const std::string why = draining.load() ? std::string("the prefill worker is shutting down")
                                            : fmt::format("the prefill worker is at its limit of {} KV transfers at "
                                                          "once (--kv-transfer-max-connections)",
                                                          config.kv_transfer_max_connections);
    asio::co_spawn(executor, refuse_kv_transfer(std::move(stream), why), asio::detached);
    return;
  }
  ++kv_transfers;
  asio::co_spawn(executor, serve_kv_transfer(std::move(stream), *client, kv_options, metrics),
                 [this](std::exception_ptr error) {
                   --kv_transfers;
                   if (draining) asio::post(ioc, [this] { maybe_finish(); });
                   if (!error) return;
                   try {
                     std::rethrow_exception(error);
                   } catch (const std::exception& e) {
                     spdlog::error("a KV transfer failed: {}", e.what());
                   }
                 });
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
      if (config.on_shutdown) config.on_shutdown();
      boost::system::error_code ec;
      acceptor.close(ec);
      kv_acceptor.close(ec);
      if (ucx != nullptr) ucx->stop_listening();
      if (drain) {
        drain_deadline.expires_after(std::chrono::seconds(config.shutdown_timeout_seconds));
        drain_deadline.async_wait([this](const boost::system::error_code& ec) {
          if (ec || stopped.load()) return;
          spdlog::warn("drain deadline of {} s (--shutdown-timeout-s) passed with {} request(s) in flight; "
                       "ending them",
                       config.shutdown_timeout_seconds, active.load());
          begin_shutdown(false);
        });
      }
    }
    if (!drain) {
      {
        std::lock_guard lock(fetches_mu);
        for (const std::shared_ptr<KvFetchControl>& fetch : fetches) fetch->abort("the server is stopping");
      }
      client->stop();  // live requests end with an error their coroutines send
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
  if (!draining || active.load() != 0 || kv_transfers.load() != 0 || stopped.exchange(true)) return;
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
    const tcp::endpoint remote = socket.remote_endpoint(ec);
    std::string peer = ec ? std::string("unknown") : remote.address().to_string();
    std::string refusal;
    {
      std::lock_guard lock(connections_mu);
      int32_t& from_peer = connections_by_ip[peer];
      if (connections >= max_connections) {
        refusal = fmt::format("the server is at its limit of {} open connections (--max-connections)",
                              max_connections);
      } else if (from_peer >= max_connections_per_ip) {
        refusal = fmt::format("this client address holds {} open connections, the limit per address "
                              "(--max-connections-per-ip)",
                              from_peer);
      } else {
        ++connections;
        ++from_peer;
      }
      if (!refusal.empty() && from_peer == 0) connections_by_ip.erase(peer);
    }
    if (!refusal.empty()) {
      metrics.count_http_status(503);
      asio::co_spawn(executor, refuse_connection(std::move(socket), std::move(refusal)), asio::detached);
      continue;
    }
    asio::co_spawn(executor, session(std::move(socket), peer), [](std::exception_ptr error) {
      if (!error) return;
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        spdlog::error("connection ended by an exception: {}", e.what());
      } catch (...) {
        spdlog::error("connection ended by an exception");
      }
    });
  }
}

void Server::Impl::release_connection(const std::string& peer) {
  std::lock_guard lock(connections_mu);
  --connections;
  if (auto it = connections_by_ip.find(peer); it != connections_by_ip.end() && --it->second <= 0) {
    connections_by_ip.erase(it);
  }
}

// Over a connection limit: one short 503 (no request is read), then close. Bounded by the write timeout.
awaitable<void> Server::Impl::refuse_connection(tcp::socket socket, std::string reason) {
  beast::tcp_stream stream(std::move(socket));
  const std::string body = error_body(api_error(503, reason + "; retry shortly", "too_many_connections", 1),
                                      Dialect::kOpenAI);
  const std::string bytes = fmt::format(
      "HTTP/1.1 503 Service Unavailable\r\nServer: deepinfer\r\nContent-Type: application/json\r\nRetry-After: "
      "1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{}",
      body.size(), body);
  stream.expires_after(std::chrono::seconds(5));
  beast::error_code ec;
  co_await asio::async_write(stream, asio::buffer(bytes), asio::redirect_error(use_awaitable, ec));
  stream.socket().shutdown(tcp::socket::shutdown_send, ec);
  stream.socket().close(ec);
}

awaitable<int> Server::Impl::send(Connection& conn, const RequestInfo& info, int status, std::string body,
                                  std::string_view content_type,
                                  std::vector<std::pair<std::string, std::string>> headers) {
  http::response<http::string_body> response{static_cast<http::status>(status), info.version};
  response.set(http::field::server, "deepinfer");
  response.set(http::field::content_type, content_type);
  for (auto& [name, value] : headers) response.set(name, value);
  for (auto& [name, value] : cors_headers(info.origin)) response.set(name, value);
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

awaitable<bool> Server::Impl::write_sse(Connection& conn, bool chunked, const std::string& bytes, bool last) {
  beast::error_code ec;
  conn.stream.expires_after(kWriteTimeout);
  if (last) {
    if (chunked) co_await asio::async_write(conn.stream, http::make_chunk_last(), asio::redirect_error(use_awaitable, ec));
  } else if (chunked) {
    co_await asio::async_write(conn.stream, http::make_chunk(asio::buffer(bytes)), asio::redirect_error(use_awaitable, ec));
  } else {
    co_await asio::async_write(conn.stream, asio::buffer(bytes), asio::redirect_error(use_awaitable, ec));
  }
  co_return !ec;
}

// After refusing a request without reading its body: stop sending, read and discard what the client still
// sends (bounded), so that closing does not reset the connection before the client reads our answer.
awaitable<void> Server::Impl::linger_close(Connection& conn) {
  beast::error_code ec;
  conn.stream.socket().shutdown(tcp::socket::shutdown_send, ec);
  // Bounded in bytes and time, so that a refused client cannot keep the connection (or the server reading)
  // going: enough for a client to finish writing a modest body and read our answer.
  std::vector<char> scratch(64 * 1024);
  int64_t budget = std::min<int64_t>(config.max_body_bytes, 4ll << 20) + (1ll << 20);
  const auto deadline = Clock::now() + std::chrono::seconds(3);
  while (budget > 0 && Clock::now() < deadline) {
    conn.stream.expires_after(std::chrono::seconds(2));
    size_t n = co_await conn.stream.async_read_some(asio::buffer(scratch), asio::redirect_error(use_awaitable, ec));
    if (ec) break;
    budget -= static_cast<int64_t>(n);
  }
}

bool Server::Impl::authorized(const http::request_header<>& request) const {
  if (config.api_key.empty()) return true;
  std::string_view authorization = request[http::field::authorization];
  if (authorization.size() > 7 && beast::iequals(authorization.substr(0, 7), "Bearer ") &&
      constant_time_equal(authorization.substr(7), config.api_key)) {
    return true;
  }
  return constant_time_equal(request["x-api-key"], config.api_key);
}

Server::Impl::Precheck Server::Impl::precheck(const http::request_header<>& header) const {
  Precheck out;
  std::string_view path(header.target().data(), header.target().size());
  path = path.substr(0, path.find('?'));
  if (draining && path != "/health" && path != "/metrics") {
    out.error = api_error(503, "the server is shutting down", {}, 5);
    return out;
  }
  const auto matches = [&](const RouteEntry& candidate) {
    return candidate.path == path || (candidate.route == Route::kModels && path.starts_with("/v1/models/"));
  };
  const RouteEntry* allowed = nullptr;
  for (const RouteEntry& candidate : kRoutes) {
    if (!matches(candidate)) continue;
    allowed = &candidate;
    if (candidate.method == header.method()) out.entry = &candidate;
  }
  const std::string method(header.method_string());
  if (allowed == nullptr) {
    out.error = api_error(404, fmt::format("no route for {} {}", method, loggable_target(path)), "not_found");
    return out;
  }
  if (out.entry == nullptr) {
    const std::string allow(http::to_string(allowed->method));
    out.error = api_error(405, fmt::format("{} does not accept {}; use {}", std::string(path), method, allow),
                          "method_not_allowed");
    out.headers = allow_header(allow);
    return out;
  }
  const bool needs_auth = out.entry->needs_auth || (out.entry->route == Route::kMetrics && config.metrics_require_api_key);
  if (needs_auth && !authorized(header)) {
    out.entry = nullptr;
    out.error = api_error(401, "missing or invalid API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
                          "invalid_api_key");
  }
  return out;
}

awaitable<void> Server::Impl::session(tcp::socket socket, std::string peer) {
  // The connection's slot returns however the session ends: normally, by an exception, or when its frame is
  // destroyed because a handler threw below it (the HTTP thread's catch).
  struct SlotRelease {
    Impl& impl;
    std::string peer;
    ~SlotRelease() { impl.release_connection(peer); }
  } slot{*this, peer};
  auto conn = std::make_shared<Connection>(std::move(socket), connection_buffer_bytes(limits));
  beast::error_code ec;
  while (!conn->close) {
    RequestParser parser(limits);
    conn->response_started = false;
    // The next request's header must be complete within the idle timeout (slow headers included).
    conn->stream.expires_after(std::chrono::seconds(config.idle_timeout_seconds));
    co_await http::async_read_header(conn->stream, conn->buffer, parser, asio::redirect_error(use_awaitable, ec));
    RequestInfo info;
    info.version = parser.get().version() == 10 ? 10 : 11;
    info.target = loggable_target(std::string_view(parser.get().target().data(), parser.get().target().size()));
    info.method = std::string(parser.get().method_string());
    if (ec) {
      if (std::optional<FramingError> refused = parse_error_response(ec, limits)) {
        conn->close = true;
        info.keep_alive = false;
        spdlog::info("{} {} {} (refused while reading the header)", info.method, info.target, refused->status);
        co_await send_error(*conn, info, framing_error(*refused), dialect_of(info.target));
        co_await linger_close(*conn);
      }
      break;
    }
    info.keep_alive = parser.get().keep_alive();
    info.origin = std::string(parser.get()[http::field::origin]);
    const Dialect dialect = dialect_of(info.target);
    // A CORS preflight from an allowed origin: answered before routing and authentication.
    if (parser.get().method() == http::verb::options && !cors_headers(info.origin).empty() &&
        parser.get().count(http::field::access_control_request_method) > 0 && parser.is_done()) {
      co_await send(*conn, info, 204, std::string(), kJson,
                    preflight_headers(std::string(parser.get()[http::field::access_control_request_headers])));
      spdlog::info("{} {} 204 (CORS preflight)", info.method, info.target);
      if (conn->close) break;
      continue;
    }
    if (config.test_hook_on_request) {
      config.test_hook_on_request(std::string_view(parser.get().target().data(), parser.get().target().size()));
    }
    // Refusals the header alone decides, before any body byte is read or buffered: framing, route, key.
    std::optional<ApiError> refusal;
    std::vector<std::pair<std::string, std::string>> refusal_headers;
    if (std::optional<FramingError> framing = check_framing(parser.get().base())) {
      refusal = framing_error(*framing);
      conn->close = true;  // where the body ends is unknown: nothing after it may be read as a request (RFC 9112 6.3)
    } else {
      Precheck checked = precheck(parser.get().base());
      refusal = std::move(checked.error);
      refusal_headers = std::move(checked.headers);
    }
    if (refusal) {
      // The answer goes out at once. Then a small body of a known length (no 100-continue pending) is read into
      // the bounded parser within a second and dropped, so the connection can go on; any other body is never
      // read, and the connection closes.
      const boost::optional<std::uint64_t> length = parser.content_length();
      const bool discard = !parser.is_done() && length && *length <= kDiscardBodyBytes && !parser.get().chunked() &&
                           !beast::iequals(parser.get()[http::field::expect], "100-continue");
      if (!parser.is_done() && !discard) conn->close = true;
      spdlog::info("{} {} {} (refused before the body)", info.method, info.target, refusal->status);
      co_await send_error(*conn, info, *refusal, dialect, std::move(refusal_headers));
      if (!conn->close && discard) {
        conn->stream.expires_after(std::chrono::seconds(1));
        co_await http::async_read(conn->stream, conn->buffer, parser, asio::redirect_error(use_awaitable, ec));
        if (ec) break;
      }
      if (conn->close) {
        co_await linger_close(*conn);
        break;
      }
      continue;
    }
    if (beast::iequals(parser.get()[http::field::expect], "100-continue")) {
      http::response<http::empty_body> go_on{http::status::continue_, info.version};
      co_await http::async_write(conn->stream, go_on, asio::redirect_error(use_awaitable, ec));
      if (ec) break;
    }
    conn->stream.expires_after(std::chrono::seconds(config.body_read_timeout_seconds));
    co_await http::async_read(conn->stream, conn->buffer, parser, asio::redirect_error(use_awaitable, ec));
    if (ec) {
      if (std::optional<FramingError> refused = parse_error_response(ec, limits)) {
        conn->close = true;
        spdlog::info("{} {} {} (refused while reading the body)", info.method, info.target, refused->status);
        co_await send_error(*conn, info, framing_error(*refused), dialect);
        co_await linger_close(*conn);
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
  info.target = loggable_target(std::string_view(request.target().data(), request.target().size()));
  info.origin = std::string(request[http::field::origin]);
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
  std::string_view path(request.target().data(), request.target().size());
  path = path.substr(0, path.find('?'));
  const Dialect dialect = dialect_of(path);  // every /v1/messages* route answers errors as Anthropic does
  Precheck checked = precheck(request.base());  // again: draining may have begun while the body was read
  if (checked.error) co_return co_await send_error(*conn, info, *checked.error, dialect, std::move(checked.headers));
  const RouteEntry* entry = checked.entry;
  Route route = entry->route;
  if (route == Route::kModels && path != "/v1/models") route = Route::kModel;
  switch (route) {
    case Route::kHealth: {
      if (draining) {
        // Still answering its in-flight requests, taking no new ones: out of a router's or load balancer's rotation.
        boost::json::object body{{"status", "draining"},
                                 {"error", fmt::format("the server is shutting down: it finishes its {} in-flight "
                                                       "request(s) and takes no new ones",
                                                       active.load() - 1)}};  // not counting this probe
        co_return co_await send(*conn, info, 503, boost::json::serialize(body), kJson);
      }
      const double busy = client->load().busy_seconds;
      if (config.health_max_step_seconds > 0 && busy > config.health_max_step_seconds) {
        boost::json::object body{
            {"status", "unhealthy"},
            {"error", fmt::format("the engine has been in one step for {:.1f} s (over --health-max-step-seconds {}): "
                                  "it, or a tensor- or data-parallel peer, may be hung",
                                  busy, config.health_max_step_seconds)}};
        co_return co_await send(*conn, info, 503, boost::json::serialize(body), kJson);
      }
      co_return co_await send(*conn, info, 200, std::string(R"({"status":"ok"})"), kJson);
    }
    case Route::kMetrics:
      co_return co_await send(*conn, info, 200, metrics.render(client->load(), tokenization_stats()), kPrometheusText);
    case Route::kWorkerInfo:
      co_return co_await send(*conn, info, 200, worker_info_body, kJson);
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
    case Route::kCountTokens:
    case Route::kTokenize:
    case Route::kDetokenize: {
      ApiResult<boost::json::value> body = parse_body(request.body(), config.max_json_depth);
      if (auto* error = std::get_if<ApiError>(&body)) co_return co_await send_error(*conn, info, *error, dialect);
      const boost::json::value& value = std::get<boost::json::value>(body);
      ApiResult<std::string> out = route == Route::kTokenize      ? tokenize_endpoint(value, api)
                                   : route == Route::kCountTokens ? count_tokens_endpoint(value, api)
                                                                  : detokenize_endpoint(value, api);
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

// While a decode worker fetches a request's KV (before the request reaches the engine): a client that goes away
// aborts the fetch (its socket closes, so the prefill worker cancels its prefill too).
awaitable<void> Server::Impl::watch_disconnect_during_fetch(std::shared_ptr<Connection> conn,
                                                            std::shared_ptr<KvFetchControl> control,
                                                            std::shared_ptr<bool> fetch_over) {
  tcp::socket& socket = conn->stream.socket();
  while (!*fetch_over) {
    beast::error_code ec;
    co_await socket.async_wait(tcp::socket::wait_read, asio::redirect_error(use_awaitable, ec));
    if (ec == asio::error::operation_aborted || *fetch_over) co_return;
    char byte = 0;
    const ssize_t n = ec ? -1 : ::recv(socket.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) co_return;  // pipelined data: the client is there
    if (n < 0 && !ec && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    spdlog::info("client went away during its KV transfer; aborting it");
    control->abort(std::string(kClientGone));
    co_return;
  }
}

awaitable<Result<engine::KvReservation>> Server::Impl::reserve_kv_blocks(std::vector<TokenId> tokens,
                                                                         std::chrono::milliseconds timeout) {
  struct Waiting {
    explicit Waiting(asio::any_io_executor executor) : timer(executor) {}
    asio::steady_timer timer;
    std::optional<Result<engine::KvReservation>> result;  // on the executor only
    bool abandoned = false;                               // on the executor only
  };
  const asio::any_io_executor executor = co_await asio::this_coro::executor;
  auto waiting = std::make_shared<Waiting>(executor);
  waiting->timer.expires_after(timeout);
  engine::EngineClient* engine = client.get();  // outlives the io_context
  client->reserve_kv_blocks(std::move(tokens), [waiting, executor, engine](Result<engine::KvReservation> result) {
    asio::post(executor, [waiting, engine, result = std::move(result)]() mutable {
      if (waiting->abandoned) {
        if (result.ok()) engine->release_kv_blocks(result->id);
        return;
      }
      waiting->result = std::move(result);
      waiting->timer.cancel();
    });
  });
  boost::system::error_code ec;
  co_await waiting->timer.async_wait(asio::redirect_error(use_awaitable, ec));
  if (!waiting->result) {
    waiting->abandoned = true;
    co_return Status::io_error("timed out after " + std::to_string(timeout.count()) +
                               " ms waiting for the engine to reserve KV blocks");
  }
  co_return std::move(*waiting->result);
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
  std::optional<std::string> prefill_endpoint;
  if (auto header = request.find("X-KV-Prefill-Endpoint"); header != request.end()) {
    if (config.role != "decode") {
      const ApiError error = bad_request(fmt::format(
          "header X-KV-Prefill-Endpoint: only a --role decode worker takes its prompt's KV from a prefill worker "
          "(this one is --role {})",
          config.role));
      metrics.count_outcome("error_400");
      co_return co_await send_error(*conn, info, error, dialect);
    }
    prefill_endpoint = std::string(header->value());
  }
  request.body().clear();
  request.body().shrink_to_fit();

  // Disaggregated: the prefill worker computes the prompt's whole blocks (all but the last token's, which this
  // worker computes with the first token) and moves their KV here, checked, before the request is queued. Two
  // phases: first the engine holds the leading blocks this device caches and reserves blocks for the rest (so the
  // transfer asks only for what is missing, and a full pool is known before any block moves); then the transfer.
  engine::KvHandoff handoff;
  KvReservationGuard reservation(*client);
  const size_t blocks = prefill_endpoint ? (plan.prompt_token_ids.size() - 1) / kBlockTokens : 0;
  if (blocks > 0) {
    Result<engine::KvReservation> reserved = co_await reserve_kv_blocks(
        std::vector<TokenId>(plan.prompt_token_ids.begin(),
                             plan.prompt_token_ids.begin() + static_cast<std::ptrdiff_t>(blocks * kBlockTokens)),
        std::chrono::milliseconds(kv_options.timeout_ms));
    if (reserved.ok()) {
      reservation.id = reserved->id;
      handoff.reservation = reserved->id;
      handoff.import_first_block = reserved->first_block;
    } else {
      const StatusCode code = reserved.status().code();
      metrics.count_kv_transfer_failure(code == StatusCode::kResourceExhausted ? "no_room"
                                        : code == StatusCode::kIoError          ? "timeout"
                                                                                : "refused");
      spdlog::warn("KV transfer from {}: {}; computing the prompt here", *prefill_endpoint,
                   reserved.status().message());
    }
  }
  if (handoff.reservation != 0) {
    const int64_t first_missing = handoff.import_first_block;
    if (static_cast<int64_t>(blocks) > first_missing) {
      kvcache::transfer::KvTransferRequest ask;
      ask.fingerprint_hex = config.model_fingerprint_hex;
      ask.ttl_class = static_cast<uint32_t>(plan.params.kv_ttl_class);
      ask.first_block = static_cast<uint32_t>(first_missing);
      // The whole blocks and the next token: the prefill worker then reuses every block it caches (kv_wire.h).
      ask.tokens.assign(plan.prompt_token_ids.begin(),
                        plan.prompt_token_ids.begin() + static_cast<std::ptrdiff_t>(blocks * kBlockTokens + 1));
      const Clock::time_point asked = Clock::now();
      std::string reason;
      // The fetch ends early if the client goes away (watched as during generation) or the server stops.
      auto control = std::make_shared<KvFetchControl>(co_await asio::this_coro::executor);
      auto fetch_over = std::make_shared<bool>(false);
      {
        std::lock_guard lock(fetches_mu);
        fetches.insert(control);
      }
      asio::co_spawn(co_await asio::this_coro::executor, watch_disconnect_during_fetch(conn, control, fetch_over),
                     asio::detached);
      Result<std::vector<std::vector<std::byte>>> fetched =
          co_await fetch_kv_blocks(*prefill_endpoint, std::move(ask), kv_options, metrics, reason, control);
      *fetch_over = true;
      {
        beast::error_code ignored;
        conn->stream.socket().cancel(ignored);  // ends the watcher's wait
        std::lock_guard lock(fetches_mu);
        fetches.erase(control);
      }
      if (control->aborted() && control->why() == kClientGone) {
        ++metrics.client_disconnects;
        metrics.count_outcome("client_disconnect");
        conn->close = true;
        co_return 499;
      }
      if (fetched.ok()) {
        metrics.kv_transfer_seconds.observe(seconds_since(asked));
        handoff.import_blocks = std::move(fetched).value();
      } else {
        metrics.count_kv_transfer_failure(reason);
        spdlog::warn("KV transfer from {} failed ({}); computing the prompt here: {}", *prefill_endpoint, reason,
                     fetched.status().message());
        handoff = {};
      }
    }
  }
  if (handoff.reservation != 0) {
    reservation.id = 0;  // the submit ends it, whatever its outcome
  } else if (reservation.id != 0) {
    // A failed transfer: the blocks go back now, ahead of the submit (the engine takes commands in order), not when
    // this request ends: computing the prompt here needs them (a prompt over half the pool would wait forever).
    client->release_kv_blocks(reservation.id);
    reservation.id = 0;
  }

  FinishInfo finish;
  finish.prompt_tokens = static_cast<int64_t>(plan.prompt_token_ids.size());
  metrics.prompt_tokens += finish.prompt_tokens;
  auto executor = co_await asio::this_coro::executor;
  auto channel = std::make_shared<RequestChannel>(executor);
  struct CancelGuard {
    engine::EngineClient& loop;
    engine::EngineClient::Ticket ticket;
    bool armed = true;
    ~CancelGuard() {
      if (armed) loop.cancel(ticket);
    }
  } cancel_guard{*client, client->submit(std::move(plan.prompt_token_ids), plan.params, channel, std::move(handoff))};
  asio::co_spawn(executor, watch_disconnect(conn, channel), asio::detached);

  std::vector<TokenLogprobs> batch_logprobs, all_logprobs;
  std::vector<recipe::StreamEvent> deltas;
  std::optional<ApiError> failure;
  bool done = false, client_gone = false, headers_sent = false;
  std::optional<Clock::time_point> first_token, last_token;
  http::response<http::empty_body> sse_header{http::status::ok, info.version};
  const bool chunked_sse = info.version >= 11;
  http::response_serializer<http::empty_body> sse_serializer{sse_header};
  beast::error_code ec;

  while (!done) {
    co_await channel->wait();
    if (channel->client_gone()) {
      client_gone = true;
      break;
    }
    for (engine::GenerationEvent& generated : channel->take()) {
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
        // Known from the first token on, so the streamed opening reports it too (regression: Anthropic's
        // message_start counted the cached tokens as input_tokens).
        finish.cached_tokens = event.num_cached_tokens;
        plan.writer->push_token(*event.token);
        if (event.logprob) batch_logprobs.push_back(token_logprobs(*event.token, *event.logprob, event.top_logprobs));
        const bool stopped = plan.builder->push(*event.token, deltas);
        finish.reasoning_tokens = plan.builder->reasoning_tokens();
        if (stopped) {
          // A stop string, or the one tool call parallel_tool_calls: false allows (then the answer ends as the
          // model's own end after a call would: finish_reason tool_calls, stop_reason tool_use). The engine's finish
          // event will not be read: its cached-token count comes from this token's event.
          finish.kind = plan.builder->tool_call_limit_reached() ? FinishInfo::Kind::kStop : FinishInfo::Kind::kStopString;
          metrics.prompt_tokens_cached += event.num_cached_tokens;
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
          plan.builder->finish(deltas, finish.kind == FinishInfo::Kind::kLength);
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
      for (auto& [name, value] : cors_headers(info.origin)) sse_header.set(name, value);
      // HTTP/1.0 has no chunked coding: the event stream is the raw body, ended by closing the connection.
      sse_header.keep_alive(info.keep_alive && !draining && chunked_sse);
      if (chunked_sse) sse_header.chunked(true);
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
    if (!bytes.empty() && !co_await write_sse(*conn, chunked_sse, bytes, false)) {
      client_gone = true;
      break;
    }
    if (done && !co_await write_sse(*conn, chunked_sse, {}, true)) conn->close = true;
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
    if (!co_await write_sse(*conn, chunked_sse, bytes, false) || !co_await write_sse(*conn, chunked_sse, {}, true)) {
      conn->close = true;
    }
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

Result<std::unique_ptr<Server>> Server::start(ServerConfig config, ModelInfo model, std::unique_ptr<engine::EngineClient> engine,
                                              std::shared_ptr<const recipe::Tokenizer> tokenizer) {
  if (engine == nullptr || tokenizer == nullptr)
    return Status::invalid_argument("the server needs an engine and a tokenizer");
  if (model.max_model_len < 2) return Status::invalid_argument("max_model_len must be at least 2");
  if (config.max_body_bytes < 1) return Status::invalid_argument("--max-body-bytes must be positive");
  if (config.max_concurrent_requests < 1) return Status::invalid_argument("--max-concurrent-requests must be positive");
  if (config.max_json_depth < 2) return Status::invalid_argument("--max-json-depth must be at least 2");
  if (config.http_threads < 1) config.http_threads = 1;
  if (config.max_header_bytes < 1024 || config.max_header_bytes > (1 << 24))
    return Status::invalid_argument("--max-header-bytes must be between 1KiB and 16MiB");
  if (config.max_connections < 1) return Status::invalid_argument("--max-connections must be positive");
  if (config.max_connections_per_ip < 0) return Status::invalid_argument("--max-connections-per-ip must be >= 0");
  if (config.idle_timeout_seconds < 1 || config.body_read_timeout_seconds < 1)
    return Status::invalid_argument("the idle and body read timeouts must be at least 1 s");
  if (config.shutdown_timeout_seconds < 0) return Status::invalid_argument("--shutdown-timeout-s must be >= 0");
  if (config.health_max_step_seconds < 0) return Status::invalid_argument("--health-max-step-seconds must be >= 0");
  auto impl = std::make_unique<Impl>(std::move(config), std::move(model), std::move(engine), std::move(tokenizer));
  if (Status s = impl->bind(); !s.ok()) {
    impl->client->stop();
    return s;
  }
  if (Status s = impl->bind_kv_transfer(); !s.ok()) {
    impl->client->stop();
    return s;
  }
  if (impl->config.handle_signals) {
    impl->signals.add(SIGINT);
    impl->signals.add(SIGTERM);
    impl->arm_signals();
  }
  impl->max_connections = impl->config.max_connections;
  if (rlimit limit{}; ::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    const int64_t usable = static_cast<int64_t>(limit.rlim_cur) - kReservedFileDescriptors;
    if (usable < impl->max_connections) {
      impl->max_connections = static_cast<int32_t>(std::max<int64_t>(usable, 1));
      spdlog::warn("--max-connections {} lowered to {}: the file-descriptor limit (ulimit -n) is {}",
                   impl->config.max_connections, impl->max_connections, static_cast<int64_t>(limit.rlim_cur));
    }
  }
  impl->max_connections_per_ip = impl->config.max_connections_per_ip > 0
                                     ? std::min(impl->config.max_connections_per_ip, impl->max_connections)
                                     : std::max(1, impl->max_connections / 2);
  asio::co_spawn(impl->ioc, impl->listen(), asio::detached);
  if (impl->kv_acceptor.is_open()) asio::co_spawn(impl->ioc, impl->listen_kv_transfer(), asio::detached);
  for (int32_t i = 0; i < impl->config.http_threads; ++i) {
    // What escapes a handler (not a coroutine, which its completion handler catches) unwinds that handler's
    // operation, and with it the connection's coroutine and socket; the thread logs it and serves on.
    impl->threads.emplace_back([io = &impl->ioc] {
      while (true) {
        try {
          io->run();
          return;
        } catch (const std::exception& e) {
          spdlog::error("an HTTP handler threw: {}; its connection is closed", e.what());
        } catch (...) {
          spdlog::error("an HTTP handler threw; its connection is closed");
        }
      }
    });
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
  // No UCX completion may post to the io_context once its threads are gone.
  if (impl_->ucx != nullptr) impl_->ucx->stop();
  impl_->client->stop();
}

}  // namespace deepinfer::server
