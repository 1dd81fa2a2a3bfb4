// UCX for the KV transfer (ucx_transport.h).
#include "ucx_transport.h"

#include <fmt/format.h>
#include <arpa/inet.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <list>
#include <mutex>
#include <thread>
#include <utility>

namespace deepinfer::server {
namespace asio = boost::asio;
namespace beast = boost::beast;
using asio::awaitable;
using asio::use_awaitable;
using tcp = asio::ip::tcp;

namespace {

using Clock = std::chrono::steady_clock;

// UCX statuses as error codes (message: ucs_status_string); a cancelled operation is operation_aborted.
class UcxCategory final : public boost::system::error_category {
 public:
  const char* name() const noexcept override { return "ucx"; }
  std::string message(int ev) const override { return ucs_status_string(static_cast<ucs_status_t>(ev)); }
};
const UcxCategory& ucx_category() {
  static const UcxCategory category;
  return category;
}
beast::error_code to_error(ucs_status_t status) {
  if (status == UCS_OK) return {};
  if (status == UCS_ERR_CANCELED) return asio::error::operation_aborted;
  return {static_cast<int>(status), ucx_category()};
}

std::string address_text(const sockaddr* addr) {
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (addr->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(addr);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (addr->sa_family == AF_INET6) {
    const auto* in = reinterpret_cast<const sockaddr_in6*>(addr);
    inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof(host));
    port = ntohs(in->sin6_port);
  }
  return fmt::format("{}:{}", host, port);
}

// One posted operation: its completion (on the progress thread) records the status and wakes the waiting
// coroutine by cancelling its timer on the coroutine's strand.
// The waiting coroutine checks `done` and starts its timer wait inside `strand` (it hops there first), and the
// completion cancels the timer through the same strand, so a completion between the check and the wait cannot
// be missed whatever executor the coroutine runs on. After the transport's stop() (`stopping`), a completion
// only marks its operation: the executors may be gone.
struct Op {
  Op(const asio::any_io_executor& executor, const std::atomic<bool>* transport_stopping)
      : strand(asio::make_strand(executor)), timer(strand), stopping(transport_stopping) {}
  asio::strand<asio::any_io_executor> strand;
  asio::steady_timer timer;
  const std::atomic<bool>* stopping;
  std::atomic<bool> done{false};
  ucs_status_t status = UCS_OK;  // written before `done`
};
void complete(void* user_data, ucs_status_t status) {
  auto* holder = static_cast<std::shared_ptr<Op>*>(user_data);
  std::shared_ptr<Op> op = std::move(*holder);
  delete holder;
  op->status = status;
  op->done.store(true, std::memory_order_release);
  if (!op->stopping->load()) asio::post(op->strand, [op] { op->timer.cancel(); });
}
void on_send(void* /*request*/, ucs_status_t status, void* user_data) { complete(user_data, status); }
void on_recv(void* /*request*/, ucs_status_t status, size_t /*length*/, void* user_data) {
  complete(user_data, status);
}

// What the endpoint's error handler and close need; lives until the endpoint's close completes.
struct EndpointState {
  std::atomic<bool> failed{false};
  std::string peer;
};
void on_endpoint_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* state = static_cast<EndpointState*>(arg);
  if (!state->failed.exchange(true)) spdlog::debug("UCX endpoint to {}: {}", state->peer, ucs_status_string(status));
}

}  // namespace

struct UcxTransport::Impl {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  // The listener, guarded by accept_mu across "still listening?" and the accepting ucp_ep_create (or the reject),
  // and across stop_listening's destroy, so no accept uses a destroyed listener. Lock order: accept_mu, then
  // UCX's worker lock (taken inside those calls); the progress thread's callbacks never take accept_mu.
  std::mutex accept_mu;
  std::atomic<ucp_listener_h> listener{nullptr};
  std::thread progress;
  std::atomic<bool> stopping{false};
  asio::any_io_executor accept_executor;
  std::function<void(std::unique_ptr<KvStream>)> on_accept;
  std::weak_ptr<UcxTransport> self;

  // Endpoints being closed: the close request and the state its error handler may still use.
  struct Closing {
    void* request = nullptr;
    std::unique_ptr<EndpointState> state;
  };
  std::mutex closing_mu;
  std::list<Closing> closing;  // GUARDED_BY(closing_mu)

  void run();
  void reap_closing(bool all);
  void close_endpoint(ucp_ep_h ep, std::unique_ptr<EndpointState> state, bool force);
  std::unique_ptr<KvStream> make_stream(ucp_ep_h ep, std::unique_ptr<EndpointState> state);
};

namespace {

// A UCX endpoint as a KvStream (kv_stream.h).
class UcxKvStream final : public KvStream {
 public:
  UcxKvStream(std::shared_ptr<UcxTransport> owner, UcxTransport::Impl* impl, ucp_ep_h ep,
              std::unique_ptr<EndpointState> state)
      : owner_(std::move(owner)), impl_(impl), ep_(ep), state_(std::move(state)) {}
  // Dropped without finish(): an error path, or the io_context destroying a suspended transfer at shutdown (its
  // buffers already gone). A forced close purges pending operations without touching their buffers.
  ~UcxKvStream() override { release(true); }

  awaitable<beast::error_code> write(std::vector<asio::const_buffer> buffers, Duration timeout) override {
    const Clock::time_point deadline = Clock::now() + timeout;
    for (const asio::const_buffer& buffer : buffers) {
      if (buffer.size() == 0) continue;
      beast::error_code ec = co_await run(deadline, [&](ucp_request_param_t& param) {
        param.cb.send = on_send;
        return ucp_stream_send_nbx(ep_, buffer.data(), buffer.size(), &param);
      });
      if (ec) co_return ec;
    }
    co_return beast::error_code{};
  }

  awaitable<beast::error_code> read(asio::mutable_buffer buffer, Duration timeout) override {
    if (buffer.size() == 0) co_return beast::error_code{};
    co_return co_await run(Clock::now() + timeout, [&](ucp_request_param_t& param) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_STREAM_RECV_FLAG_WAITALL;
      param.cb.recv_stream = on_recv;
      size_t length = 0;
      return ucp_stream_recv_nbx(ep_, buffer.data(), buffer.size(), &length, &param);
    });
  }

  awaitable<void> wait_peer_closed() override {
    std::byte byte{};
    co_await run(Clock::now() + std::chrono::hours(24 * 365), [&](ucp_request_param_t& param) {
      param.cb.recv_stream = on_recv;
      size_t length = 0;
      return ucp_stream_recv_nbx(ep_, &byte, 1, &length, &param);
    });
  }

  // UCP streams have no half-close: the peer sees the end when this side's close (a flush, then the
  // disconnect) reaches it.
  void shutdown_send() override {}

  void close() override { release(true); }
  void finish() override { release(false); }

  std::string peer() const override { return state_ != nullptr ? state_->peer : peer_after_close_; }

 private:
  // Posts one operation and waits for it until `deadline`. On the deadline the endpoint is force-closed, which
  // completes the operation as cancelled; the request is freed only after its completion ran.
  template <typename Submit>
  awaitable<beast::error_code> run(Clock::time_point deadline, Submit submit) {
    if (ep_ == nullptr) co_return asio::error::operation_aborted;
    if (impl_->stopping.load()) co_return asio::error::operation_aborted;
    auto op = std::make_shared<Op>(co_await asio::this_coro::executor, &impl_->stopping);
    auto* holder = new std::shared_ptr<Op>(op);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = ucp_dt_make_contig(1);
    param.user_data = holder;
    ucs_status_ptr_t request = submit(param);
    // Even an operation done in place may leave data in UCX's queues (a TCP send buffer, an unfinished wireup):
    // the progress thread must run to move it.
    ucp_worker_signal(impl_->worker);
    if (request == nullptr) {  // done in place: no callback
      delete holder;
      co_return beast::error_code{};
    }
    if (UCS_PTR_IS_ERR(request)) {
      delete holder;
      co_return to_error(UCS_PTR_STATUS(request));
    }
    bool timed_out = false;
    while (true) {
      co_await asio::post(op->strand, use_awaitable);  // the check and the wait below run inside the strand
      if (op->done.load(std::memory_order_acquire)) break;
      if (!timed_out && Clock::now() >= deadline) {
        timed_out = true;
        release(true);  // the pending operation completes as cancelled
        deadline = Clock::now() + std::chrono::seconds(5);
      } else if (timed_out && Clock::now() >= deadline) {
        spdlog::error("UCX: a cancelled operation did not complete within 5 s; its request is left to UCX");
        co_return beast::error::timeout;
      }
      op->timer.expires_at(std::min(deadline, Clock::now() + std::chrono::milliseconds(100)));  // and a backstop
      beast::error_code ignored;
      co_await op->timer.async_wait(asio::redirect_error(use_awaitable, ignored));
    }
    ucp_request_free(request);
    if (timed_out) co_return beast::error::timeout;
    co_return to_error(op->status);
  }

  // Closes the endpoint once: a flush and a disconnect, or at once (force: after an error or timeout, or when
  // asked to end pending operations).
  void release(bool force) {
    if (ep_ == nullptr) return;
    peer_after_close_ = state_->peer;
    const bool failed = state_->failed.load();
    impl_->close_endpoint(ep_, std::move(state_), force || failed);
    ep_ = nullptr;
  }

  std::shared_ptr<UcxTransport> owner_;
  UcxTransport::Impl* impl_;
  ucp_ep_h ep_;
  std::unique_ptr<EndpointState> state_;
  std::string peer_after_close_ = "unknown";
};

void on_connection(ucp_conn_request_h request, void* arg) {
  auto* impl = static_cast<UcxTransport::Impl*>(arg);
  std::string peer = "unknown";
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  if (ucp_conn_request_query(request, &attr) == UCS_OK)
    peer = address_text(reinterpret_cast<const sockaddr*>(&attr.client_address));
  // Inside this callback the listener is alive: its destroy needs the worker lock this progress holds.
  if (impl->stopping.load()) {
    if (ucp_listener_h listener = impl->listener.load(); listener != nullptr) ucp_listener_reject(listener, request);
    return;
  }
  // The endpoint is made on an asio thread (the worker is multi-threaded), not inside UCX's progress.
  asio::post(impl->accept_executor, [impl, request, peer] {
    std::shared_ptr<UcxTransport> owner = impl->self.lock();
    if (owner == nullptr) return;
    std::unique_lock lock(impl->accept_mu);
    ucp_listener_h listener = impl->listener.load();
    if (listener == nullptr) return;  // destroyed meanwhile: UCX dropped what it had handed out
    if (impl->stopping.load()) {
      ucp_listener_reject(listener, request);
      return;
    }
    auto state = std::make_unique<EndpointState>();
    state->peer = peer;
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.conn_request = request;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = on_endpoint_error;
    params.err_handler.arg = state.get();
    ucp_ep_h ep = nullptr;
    if (const ucs_status_t s = ucp_ep_create(impl->worker, &params, &ep); s != UCS_OK) {
      spdlog::warn("UCX: accepting a KV transfer from {}: {}", peer, ucs_status_string(s));
      return;
    }
    lock.unlock();
    ucp_worker_signal(impl->worker);
    impl->on_accept(impl->make_stream(ep, std::move(state)));
  });
}

}  // namespace

std::unique_ptr<KvStream> UcxTransport::Impl::make_stream(ucp_ep_h ep, std::unique_ptr<EndpointState> state) {
  return std::make_unique<UcxKvStream>(self.lock(), this, ep, std::move(state));
}

void UcxTransport::Impl::close_endpoint(ucp_ep_h ep, std::unique_ptr<EndpointState> state, bool force) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
  if (request != nullptr && !UCS_PTR_IS_ERR(request)) {
    std::lock_guard lock(closing_mu);
    closing.push_back({request, std::move(state)});
  }
  ucp_worker_signal(worker);
}

void UcxTransport::Impl::reap_closing(bool all) {
  std::lock_guard lock(closing_mu);
  for (auto it = closing.begin(); it != closing.end();) {
    if (all || ucp_request_check_status(it->request) != UCS_INPROGRESS) {
      ucp_request_free(it->request);
      it = closing.erase(it);
    } else {
      ++it;
    }
  }
}

void UcxTransport::Impl::run() {
  int fd = -1;
  const bool can_sleep = ucp_worker_get_efd(worker, &fd) == UCS_OK;
  while (!stopping.load()) {
    while (ucp_worker_progress(worker) != 0) {
    }
    reap_closing(false);
    if (!can_sleep) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      continue;
    }
    const ucs_status_t armed = ucp_worker_arm(worker);
    if (armed == UCS_ERR_BUSY) continue;  // more events arrived: progress again
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, 10);  // woken by UCX events and ucp_worker_signal; 10 ms bounds every other wait
  }
}

Result<std::shared_ptr<UcxTransport>> UcxTransport::create(const UcxOptions& options) {
  if (options.rdma_only) {
    std::error_code ec;
    const std::filesystem::path devices = "/sys/class/infiniband";
    if (!std::filesystem::exists(devices, ec) || std::filesystem::is_empty(devices, ec)) {
      return Status::failed_precondition(
          "--kv-transfer-protocol rdma: this machine has no RDMA device (/sys/class/infiniband is empty); use ucx "
          "(UCX's TCP and shared-memory transports) or tcp");
    }
  }
  setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
  setenv("UCX_RDMA_CM_REUSEADDR", "y", 0);
  ucp_config_t* config = nullptr;
  if (const ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK)
    return Status::io_error(fmt::format("UCX: reading its configuration: {}", ucs_status_string(s)));
  auto modify = [&](const char* name, const std::string& value) -> Status {
    if (const ucs_status_t s = ucp_config_modify(config, name, value.c_str()); s != UCS_OK)
      return Status::invalid_argument(fmt::format("UCX: {}={}: {}", name, value, ucs_status_string(s)));
    return Status();
  };
  // A restarted prefill worker rebinds its port at once (TIME_WAIT connections do not block it), as the TCP
  // listener's SO_REUSEADDR does; UCX_TCP_CM_REUSEADDR / UCX_RDMA_CM_REUSEADDR in the environment still win.
  // (Transport-level settings are read from the environment only: set here, at startup, unless given.)
  Status configured;
  if (options.rdma_only) configured = modify("TLS", "rc,ud,dc,rc_x,ud_x,dc_x,self,sm");
  if (configured.ok() && !options.net_devices.empty()) configured = modify("NET_DEVICES", options.net_devices);
  if (!configured.ok()) {
    ucp_config_release(config);
    return configured;
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_STREAM | UCP_FEATURE_WAKEUP;
  params.name = "deepinfer-kv-transfer";
  std::shared_ptr<UcxTransport> transport(new UcxTransport());
  transport->impl_ = std::make_unique<Impl>();
  Impl& impl = *transport->impl_;
  impl.self = transport;
  const ucs_status_t inited = ucp_init(&params, config, &impl.context);
  ucp_config_release(config);
  if (inited != UCS_OK) {
    impl.context = nullptr;
    return Status::io_error(fmt::format("UCX: ucp_init: {}", ucs_status_string(inited)));
  }
  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_MULTI;
  if (const ucs_status_t s = ucp_worker_create(impl.context, &worker_params, &impl.worker); s != UCS_OK) {
    impl.worker = nullptr;
    return Status::io_error(fmt::format("UCX: ucp_worker_create: {}", ucs_status_string(s)));
  }
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
  if (ucp_worker_query(impl.worker, &attr) == UCS_OK && attr.thread_mode != UCS_THREAD_MODE_MULTI)
    return Status::failed_precondition("UCX: this libucx was built without multi-threaded workers (--enable-mt)");
  impl.progress = std::thread([&impl] { impl.run(); });
  return transport;
}

void UcxTransport::stop() {
  if (impl_ == nullptr) return;
  stop_listening();
  impl_->stopping.store(true);
  if (impl_->worker != nullptr) ucp_worker_signal(impl_->worker);
  if (impl_->progress.joinable() && impl_->progress.get_id() != std::this_thread::get_id()) impl_->progress.join();
}

UcxTransport::~UcxTransport() {
  if (impl_ == nullptr) return;
  stop();  // from here on, completions mark their operations done without posting anywhere
  if (impl_->worker != nullptr) {
    // Give closing endpoints a moment to finish their disconnects, then release what is left.
    for (int i = 0; i < 100; ++i) {
      while (ucp_worker_progress(impl_->worker) != 0) {
      }
      impl_->reap_closing(false);
      std::lock_guard lock(impl_->closing_mu);
      if (impl_->closing.empty()) break;
    }
    impl_->reap_closing(true);
    ucp_worker_destroy(impl_->worker);
  }
  if (impl_->context != nullptr) ucp_cleanup(impl_->context);
}

Result<uint16_t> UcxTransport::listen(const std::string& host, uint16_t port, asio::any_io_executor executor,
                                      std::function<void(std::unique_ptr<KvStream>)> on_accept) {
  if (impl_->listener != nullptr) return Status::failed_precondition("UCX: already listening");
  boost::system::error_code ec;
  const asio::ip::address address = asio::ip::make_address(host == "localhost" ? "127.0.0.1" : host, ec);
  if (ec) return Status::invalid_argument(fmt::format("UCX listens on a numeric address; '{}' is not one", host));
  const tcp::endpoint endpoint(address, port);
  impl_->accept_executor = std::move(executor);
  impl_->on_accept = std::move(on_accept);
  ucp_listener_params_t params{};
  params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  params.sockaddr.addr = endpoint.data();
  params.sockaddr.addrlen = static_cast<socklen_t>(endpoint.size());
  params.conn_handler.cb = on_connection;
  params.conn_handler.arg = impl_.get();
  ucp_listener_h listener = nullptr;
  if (const ucs_status_t s = ucp_listener_create(impl_->worker, &params, &listener); s != UCS_OK)
    return Status::io_error(fmt::format("UCX: listening on {}:{}: {}", host, port, ucs_status_string(s)));
  impl_->listener = listener;
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (const ucs_status_t s = ucp_listener_query(listener, &attr); s != UCS_OK)
    return Status::io_error(fmt::format("UCX: the listener's address: {}", ucs_status_string(s)));
  const auto* bound = reinterpret_cast<const sockaddr*>(&attr.sockaddr);
  const uint16_t bound_port = bound->sa_family == AF_INET6
                                  ? ntohs(reinterpret_cast<const sockaddr_in6*>(bound)->sin6_port)
                                  : ntohs(reinterpret_cast<const sockaddr_in*>(bound)->sin_port);
  ucp_worker_signal(impl_->worker);
  return bound_port;
}

void UcxTransport::stop_listening() {
  if (impl_ == nullptr) return;
  std::lock_guard lock(impl_->accept_mu);
  ucp_listener_h listener = impl_->listener.exchange(nullptr);
  if (listener != nullptr) ucp_listener_destroy(listener);
}

Result<std::unique_ptr<KvStream>> UcxTransport::connect(const std::string& host, uint16_t port) {
  boost::system::error_code ec;
  const asio::ip::address address = asio::ip::make_address(host == "localhost" ? "127.0.0.1" : host, ec);
  if (ec) return Status::invalid_argument(fmt::format("UCX connects to a numeric address; '{}' is not one", host));
  const tcp::endpoint endpoint(address, port);
  auto state = std::make_unique<EndpointState>();
  state->peer = fmt::format("{}:{}", host, port);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = endpoint.data();
  params.sockaddr.addrlen = static_cast<socklen_t>(endpoint.size());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = on_endpoint_error;
  params.err_handler.arg = state.get();
  ucp_ep_h ep = nullptr;
  if (const ucs_status_t s = ucp_ep_create(impl_->worker, &params, &ep); s != UCS_OK)
    return Status::io_error(fmt::format("UCX: connecting to {}:{}: {}", host, port, ucs_status_string(s)));
  ucp_worker_signal(impl_->worker);
  return impl_->make_stream(ep, std::move(state));
}

}  // namespace deepinfer::server
