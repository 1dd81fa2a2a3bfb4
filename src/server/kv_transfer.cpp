// The KV transfer's two sides over a KvStream: TCP or UCX (kv_transfer.h).
#include "kv_transfer.h"

#include "ucx_transport.h"

#include "deepinfer/kvcache/tier_policy.h"
#include "deepinfer/server/server.h"

#include <fmt/format.h>
#include <malloc.h>
#include <spdlog/spdlog.h>

#include <boost/beast/core.hpp>
#include <chrono>
#include <deque>
#include <mutex>
#include <optional>
#include <utility>

namespace deepinfer::server {
namespace asio = boost::asio;
namespace beast = boost::beast;
using tcp = asio::ip::tcp;
using asio::awaitable;
using asio::use_awaitable;
namespace wire = kvcache::transfer;

namespace {

using Clock = std::chrono::steady_clock;

// The buffers of one write (built outside the coroutines: GCC 12 miscompiles braced lists in a co_await's operands).
std::vector<asio::const_buffer> buffers_of(asio::const_buffer a) { return std::vector<asio::const_buffer>(1, a); }
std::vector<asio::const_buffer> buffers_of(asio::const_buffer a, asio::const_buffer b) {
  std::vector<asio::const_buffer> v;
  v.push_back(a);
  v.push_back(b);
  return v;
}

// Reads one frame (header and body), each read within `timeout`. With `block_index`, a block frame's leading 4-byte
// index is read into it (little-endian) and the body is the payload alone: read in place, never moved.
awaitable<Result<std::pair<wire::FrameType, std::vector<std::byte>>>> read_frame(KvStream& stream,
                                                                                 uint32_t max_body_bytes,
                                                                                 KvStream::Duration timeout,
                                                                                 beast::error_code& ec,
                                                                                 std::optional<uint32_t>* block_index =
                                                                                     nullptr) {
  std::array<std::byte, wire::kFrameHeaderBytes> header_bytes{};
  ec = co_await stream.read(asio::buffer(header_bytes), timeout);
  if (ec) co_return Status::io_error(ec.message());
  Result<wire::FrameHeader> header = wire::decode_frame_header(header_bytes, max_body_bytes);
  if (!header.ok()) co_return header.status();
  uint32_t body_bytes = header->body_bytes;
  if (block_index != nullptr) block_index->reset();
  if (block_index != nullptr && header->type == wire::FrameType::kBlock && body_bytes >= 4) {
    std::array<std::byte, 4> index_bytes{};
    ec = co_await stream.read(asio::buffer(index_bytes), timeout);
    if (ec) co_return Status::io_error(ec.message());
    *block_index = wire::decode_block_index(index_bytes);
    body_bytes -= 4;
  }
  std::vector<std::byte> body(body_bytes);
  if (!body.empty()) {
    ec = co_await stream.read(asio::buffer(body), timeout);
    if (ec) co_return Status::io_error(ec.message());
  }
  co_return std::make_pair(header->type, std::move(body));
}

std::string describe(const beast::error_code& ec, int64_t timeout_ms) {
  if (ec == beast::error::timeout) return fmt::format("timed out after {} ms (--kv-transfer-timeout-ms)", timeout_ms);
  return ec.message();
}

// The prefill side's queue between the engine thread (blocks, the request's end) and the connection's strand.
class Outbox final : public engine::EventSink, public std::enable_shared_from_this<Outbox> {
 public:
  struct Item {
    enum class Kind { kBlock, kDone, kError } kind = Kind::kBlock;
    int64_t index = 0;
    std::vector<std::byte> payload;
    std::string message;
  };

  Outbox(asio::any_io_executor strand, Metrics& metrics) : strand_(strand), timer_(strand), metrics_(metrics) {}

  void push(Item item) {
    {
      std::lock_guard lock(mu_);
      items_.push_back(std::move(item));
      if (wake_posted_) return;
      wake_posted_ = true;
    }
    asio::post(strand_, [self = shared_from_this()] {
      {
        std::lock_guard lock(self->mu_);
        self->wake_posted_ = false;
      }
      self->timer_.cancel();
    });
  }

  // Engine thread: the prefill's end (its one token is not needed: the decode worker samples its own).
  void deliver(std::vector<engine::GenerationEvent> events) override {
    for (engine::GenerationEvent& event : events) {
      // The prefill's cache hits, as a completion's are counted: once, at its token (the step that ends the
      // prompt, before its last blocks go out), or at its end if it ends before one. Counted at the end only, the
      // count lagged the decode worker's answer: the request ends cancelled once every block is out.
      if (!cache_hits_counted_ && event.error.ok() && (event.event.token.has_value() || event.event.finished)) {
        cache_hits_counted_ = true;
        metrics_.prompt_tokens_cached += event.event.num_cached_tokens;
      }
      if (!event.error.ok()) {
        push({Item::Kind::kError, 0, {}, event.error.message()});
      } else if (event.event.finished) {
        const engine::FinishReason reason = event.event.finish_reason;
        if (reason == engine::FinishReason::kStop || reason == engine::FinishReason::kLength) {
          push({Item::Kind::kDone, 0, {}, {}});
        } else {
          push({Item::Kind::kError, 0, {},
                event.event.message.empty() ? std::string("the prefill worker ended the request") : event.event.message});
        }
      }
    }
  }

  // On the strand: until items are queued (true), the peer went away, or `timeout` passes with none (false).
  awaitable<bool> wait(std::chrono::milliseconds timeout) {
    const Clock::time_point deadline = Clock::now() + timeout;
    while (true) {
      {
        std::lock_guard lock(mu_);
        if (!items_.empty()) co_return true;
      }
      if (peer_gone_ || Clock::now() >= deadline) co_return false;
      timer_.expires_at(deadline);
      boost::system::error_code ec;
      co_await timer_.async_wait(asio::redirect_error(use_awaitable, ec));
    }
  }

  // On the strand: until the decode worker has closed its end, or `timeout` passes; what the engine still sends
  // (the prefill's end) is dropped, nobody waits for it any more.
  awaitable<void> wait_peer_gone(std::chrono::milliseconds timeout) {
    const Clock::time_point until = Clock::now() + timeout;
    while (!peer_gone_ && Clock::now() < until) {
      co_await wait(std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()));
      take();
    }
  }

  std::deque<Item> take() {
    std::lock_guard lock(mu_);
    std::deque<Item> out;
    out.swap(items_);
    return out;
  }

  // On the strand.
  void mark_peer_gone() {
    peer_gone_ = true;
    timer_.cancel();
  }
  bool peer_gone() const { return peer_gone_; }

 private:
  asio::any_io_executor strand_;
  asio::steady_timer timer_;
  Metrics& metrics_;  // the server's: outlives its engine client, which holds this outbox
  std::mutex mu_;
  std::deque<Item> items_;   // GUARDED_BY(mu_)
  bool wake_posted_ = false;  // GUARDED_BY(mu_)
  bool cache_hits_counted_ = false;  // the engine thread's
  bool peer_gone_ = false;    // strand only
};

// The prefill side's checks of a decode worker's first frame.
Result<wire::KvTransferRequest> accept_request(const std::pair<wire::FrameType, std::vector<std::byte>>& frame,
                                               const KvTransferOptions& options) {
  if (frame.first != wire::FrameType::kRequest) return Status::invalid_argument("the first frame must be a request");
  Result<wire::KvTransferRequest> request = wire::decode_request(frame.second);
  if (!request.ok()) return request.status();
  if (request->fingerprint_hex != options.fingerprint_hex) {
    return Status::invalid_argument(fmt::format("the decode worker's model fingerprint {} is not this prefill worker's "
                                                "{} (both must run the same checkpoint and KV dtype)",
                                                request->fingerprint_hex, options.fingerprint_hex));
  }
  const size_t tokens = request->tokens.size();
  if (tokens < kvcache::kBlockTokens || tokens % kvcache::kBlockTokens > 1) {
    return Status::invalid_argument(fmt::format(
        "{} tokens asked for: a KV transfer moves whole 64-token blocks (and takes one more token at most)", tokens));
  }
  static const size_t classes = kvcache::RetentionConfig::defaults().classes.size();
  if (request->ttl_class >= classes) {
    return Status::invalid_argument(
        fmt::format("ttl_class {} is not a retention class (0..{})", request->ttl_class, classes - 1));
  }
  if (request->first_block >= tokens / kvcache::kBlockTokens) {
    return Status::invalid_argument(fmt::format("first block {} asked for of {} blocks: nothing to send",
                                                request->first_block, tokens / kvcache::kBlockTokens));
  }
  return request;
}

// The prefill side's error frame, then the connection's end.
// `await_close`: then wait (within `timeout`) for the decode worker to close first, reading nothing else: closing
// this end at once could lose the frame on a transport without a half-close (UCX drops a disconnected endpoint's
// unread data). Only where nothing else reads the stream (before watch_peer starts).
awaitable<void> send_error(KvStream& stream, std::string message, std::chrono::milliseconds timeout,
                           bool await_close) {
  spdlog::warn("KV transfer to {}: {}", stream.peer(), message);
  const std::vector<std::byte> frame = wire::encode_error(message);
  const beast::error_code ec = co_await stream.write(buffers_of(asio::buffer(frame)), timeout);
  stream.shutdown_send();
  if (!ec && await_close) {
    std::array<std::byte, 1> byte{};
    co_await stream.read(asio::buffer(byte), timeout);
  }
}

// The decode worker sends nothing after its request: a read that completes means it closed or reset. Holds the
// stream until then (serve_kv_transfer closes it on its way out, which ends this wait).
awaitable<void> watch_peer(std::shared_ptr<KvStream> stream, std::shared_ptr<Outbox> outbox) {
  co_await stream->wait_peer_closed();
  outbox->mark_peer_gone();
}

}  // namespace

namespace {

// fetch_kv_blocks without the abort bookkeeping.
awaitable<Result<std::vector<std::vector<std::byte>>>> fetch_blocks(std::string endpoint,
                                                                    wire::KvTransferRequest request,
                                                                    const KvTransferOptions& options,
                                                                    Metrics& metrics, std::string& reason,
                                                                    KvFetchControl* control) {
  const auto timeout = std::chrono::milliseconds(options.timeout_ms);
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(options.deadline_ms);
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == endpoint.size()) {
    reason = "connect";
    co_return Status::invalid_argument("KV transfer endpoint '" + endpoint + "' is not HOST:PORT");
  }
  std::string host = endpoint.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const std::string port = endpoint.substr(colon + 1);
  if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos || std::stoi(port) < 1 ||
      std::stoi(port) > 65535) {
    reason = "connect";
    co_return Status::invalid_argument("KV transfer endpoint '" + endpoint.substr(0, 200) + "': the port is not 1..65535");
  }
  auto executor = co_await asio::this_coro::executor;
  if (control != nullptr && control->aborted()) co_return Status::internal("aborted before connecting");
  beast::error_code ec;
  tcp::resolver resolver(executor);
  const auto targets = co_await resolver.async_resolve(host, port, asio::redirect_error(use_awaitable, ec));
  if (ec || targets.empty()) {
    reason = "connect";
    co_return Status::io_error(
        fmt::format("KV transfer: resolving {}: {}", endpoint, ec ? ec.message() : std::string("no address")));
  }
  std::unique_ptr<KvStream> stream;
  if (options.ucx != nullptr) {
    const tcp::endpoint target = *targets.begin();
    Result<std::unique_ptr<KvStream>> made =
        options.ucx->connect(target.address().to_string(), target.port());
    if (!made.ok()) {
      reason = "connect";
      co_return made.status();
    }
    stream = std::move(made).value();
  } else {
    beast::tcp_stream connecting(executor);
    connecting.expires_after(timeout);
    co_await connecting.async_connect(targets, asio::redirect_error(use_awaitable, ec));
    if (ec) {
      reason = ec == beast::error::timeout ? "timeout" : "connect";
      co_return Status::io_error(
          fmt::format("KV transfer: connecting to {}: {}", endpoint, describe(ec, options.timeout_ms)));
    }
    stream = make_tcp_kv_stream(connecting.release_socket());
  }
  if (control != nullptr) {
    control->attach(stream.get());
    if (control->aborted()) {  // aborted while resolving or connecting: nothing was attached to close then
      stream->close();
      co_return Status::internal("aborted while connecting");
    }
  }
  const size_t first = request.first_block;
  const size_t expected = request.tokens.size() / kvcache::kBlockTokens - first;  // a trailing extra token: no block
  const std::vector<std::byte> ask = wire::encode_request(request);
  ec = co_await stream->write(buffers_of(asio::buffer(ask)), timeout);
  if (ec) {
    reason = ec == beast::error::timeout ? "timeout" : "connect";
    co_return Status::io_error(fmt::format("KV transfer: sending the request to {}: {}", endpoint,
                                           describe(ec, options.timeout_ms)));
  }
  const uint32_t max_body =
      static_cast<uint32_t>(std::max<size_t>(options.block_bytes + 4, 4 + 8 * expected) + (1u << 16));
  std::vector<std::vector<std::byte>> blocks;
  blocks.reserve(expected);
  while (true) {
    // Each wait: the prefill worker's next block may follow a whole chunk; and the whole transfer within its
    // deadline (a peer that trickles blocks just inside the wait's timeout is cut off there).
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const bool deadline_bound = left < timeout;
    std::optional<uint32_t> block_index;
    Result<std::pair<wire::FrameType, std::vector<std::byte>>> frame = co_await read_frame(
        *stream, max_body, std::max(std::chrono::milliseconds(0), std::min(timeout, left)), ec, &block_index);
    if (!frame.ok()) {
      if (ec == beast::error::timeout && deadline_bound) {
        reason = "deadline";
        co_return Status::io_error(fmt::format("KV transfer from {}: after {} of {} blocks: past the transfer's "
                                               "deadline of {} ms (--kv-transfer-deadline-ms)",
                                               endpoint, blocks.size(), expected, options.deadline_ms));
      }
      if (ec) {
        reason = ec == beast::error::timeout ? "timeout" : "connect";
        co_return Status::io_error(fmt::format("KV transfer from {}: after {} of {} blocks: {}", endpoint, blocks.size(),
                                               expected, describe(ec, options.timeout_ms)));
      }
      reason = "protocol";
      co_return frame.status();
    }
    auto& [type, body] = *frame;
    if (type == wire::FrameType::kError) {
      reason = "peer_error";
      // The peer's words go to a log: printable ASCII only, 300 characters at most.
      std::string text;
      for (size_t i = 0; i < body.size() && text.size() < 300; ++i) {
        const auto c = static_cast<unsigned char>(body[i]);
        text += c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?';
      }
      co_return Status::failed_precondition(
          fmt::format("the prefill worker at {} ended the KV transfer: {}", endpoint, text));
    }
    if (type == wire::FrameType::kBlock) {
      if (!block_index) {
        reason = "protocol";
        co_return Status::corruption("KV transfer: a block frame without its index");
      }
      const uint32_t index = *block_index;
      if (index != first + blocks.size() || blocks.size() >= expected) {
        reason = "protocol";
        co_return Status::corruption(
            blocks.size() >= expected
                ? fmt::format("KV transfer: block {} arrived after the {} blocks asked for", index, expected)
                : fmt::format("KV transfer: block {} arrived where block {} was due", index, first + blocks.size()));
      }
      if (body.size() != options.block_bytes) {
        reason = "protocol";
        co_return Status::corruption(fmt::format("KV transfer: block {} has {} bytes; this worker's blocks have {} "
                                                 "(another model, cache dtype or speculative setting)",
                                                 index, body.size(), options.block_bytes));
      }
      metrics.kv_transfer_blocks_received += 1;
      metrics.kv_transfer_bytes_received += static_cast<int64_t>(body.size());
      blocks.push_back(std::move(body));
      continue;
    }
    if (type != wire::FrameType::kDone) {
      reason = "protocol";
      co_return Status::corruption("KV transfer: a request frame from the prefill worker");
    }
    Result<std::vector<uint64_t>> checksums = wire::decode_done(body);
    if (!checksums.ok()) {
      reason = "protocol";
      co_return checksums.status();
    }
    if (checksums->size() != expected || blocks.size() != expected) {
      reason = "protocol";
      co_return Status::corruption(fmt::format("KV transfer: the completion record lists {} blocks; {} were asked "
                                               "for and {} arrived",
                                               checksums->size(), expected, blocks.size()));
    }
    for (size_t i = 0; i < expected; ++i) {
      if (wire::block_checksum(blocks[i]) != (*checksums)[i]) {
        reason = "corrupt";
        co_return Status::corruption(fmt::format("KV transfer: block {} does not match its checksum", i));
      }
    }
    stream->finish();
    co_return blocks;
  }
}

}  // namespace

void keep_freed_kv_blocks_in_the_heap() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
}

void KvFetchControl::abort(std::string why) {
  asio::post(strand_, [self = shared_from_this(), why = std::move(why)]() mutable {
    if (self->aborted_) return;
    self->aborted_ = true;
    self->why_ = std::move(why);
    if (self->stream_ != nullptr) self->stream_->close();
  });
}

awaitable<Result<std::vector<std::vector<std::byte>>>> fetch_kv_blocks(std::string endpoint,
                                                                       wire::KvTransferRequest request,
                                                                       const KvTransferOptions& options,
                                                                       Metrics& metrics, std::string& reason,
                                                                       std::shared_ptr<KvFetchControl> control) {
  Result<std::vector<std::vector<std::byte>>> result =
      co_await fetch_blocks(std::move(endpoint), std::move(request), options, metrics, reason, control.get());
  if (control != nullptr) {
    control->attach(nullptr);
    if (!result.ok() && control->aborted()) {
      reason = "aborted";
      co_return Status::internal("KV transfer aborted: " + control->why());
    }
  }
  co_return result;
}

awaitable<void> refuse_kv_transfer(std::shared_ptr<KvStream> stream, std::string message) {
  co_await send_error(*stream, std::move(message), std::chrono::milliseconds(1000), true);
  stream->finish();
}

namespace {

// serve_kv_transfer's body; the caller closes the stream however this ends.
awaitable<void> serve_transfer(std::shared_ptr<KvStream> stream_ptr, engine::EngineClient& client,
                               const KvTransferOptions& options, Metrics& metrics) {
  const auto timeout = std::chrono::milliseconds(options.timeout_ms);
  KvStream& stream = *stream_ptr;
  const std::string peer = stream.peer();
  beast::error_code ec;
  // Before the peer watch starts: the error frame, then the decode worker's close.
  auto fail = [&](std::string message) { return send_error(stream, std::move(message), timeout, true); };

  const uint32_t max_request = static_cast<uint32_t>(48 + 4 * std::max<int64_t>(options.max_tokens, 0));
  Result<std::pair<wire::FrameType, std::vector<std::byte>>> frame =
      co_await read_frame(stream, max_request, timeout, ec);
  if (!frame.ok()) {
    if (!ec) co_await fail(frame.status().message());
    co_return;  // the peer went away or sent nothing in time
  }
  Result<wire::KvTransferRequest> request = accept_request(*frame, options);
  if (!request.ok()) co_return co_await fail(request.status().message());
  const size_t tokens = request->tokens.size();
  const int64_t first = request->first_block;
  const int64_t expected = static_cast<int64_t>(tokens) / kvcache::kBlockTokens - first;
  metrics.prompt_tokens += static_cast<int64_t>(tokens);

  auto outbox = std::make_shared<Outbox>(co_await asio::this_coro::executor, metrics);
  engine::SamplingParams params;
  params.max_tokens = 1;
  params.temperature = 0.0f;
  params.ignore_eos = true;
  params.kv_ttl_class = request->ttl_class;
  engine::KvHandoff handoff;
  handoff.export_from_block = first;
  handoff.export_block = [outbox](int64_t index, std::vector<std::byte> payload) {
    outbox->push({Outbox::Item::Kind::kBlock, index, std::move(payload), {}});
  };
  const engine::EngineClient::Ticket ticket =
      client.submit(std::move(request->tokens), params, outbox, std::move(handoff));
  bool finished = false;
  struct CancelGuard {
    engine::EngineClient& client;
    engine::EngineClient::Ticket ticket;
    bool& finished;
    ~CancelGuard() {
      if (!finished) client.cancel(ticket);  // the prefill's blocks go back to the pool
    }
  } cancel_guard{client, ticket, finished};

  asio::co_spawn(co_await asio::this_coro::executor, watch_peer(stream_ptr, outbox), asio::detached);
  // From here the peer watch reads the stream: an error frame, then the decode worker's close as the watch sees it.
  auto fail_watched = [&](std::string message) -> awaitable<void> {
    co_await send_error(stream, std::move(message), timeout, false);
    co_await outbox->wait_peer_gone(timeout);
  };

  std::vector<uint64_t> checksums;
  checksums.reserve(static_cast<size_t>(expected));
  bool all_sent = false;
  while (!finished) {
    if (!co_await outbox->wait(timeout)) {
      if (outbox->peer_gone()) {
        spdlog::warn("KV transfer to {}: the decode worker went away after {} of {} blocks; prefill cancelled", peer,
                     checksums.size(), expected);
        break;
      }
      co_await fail_watched(
          fmt::format("no KV block from the engine within {} ms (--kv-transfer-timeout-ms); {} of {} sent",
                      options.timeout_ms, checksums.size(), expected));
      break;
    }
    for (Outbox::Item& item : outbox->take()) {
      if (item.kind == Outbox::Item::Kind::kError) {
        co_await fail_watched(item.message);
        finished = true;  // the engine ended the request itself
        break;
      }
      if (item.kind == Outbox::Item::Kind::kDone) {
        // The completion record goes right after the last block (below), so an end reported first is short.
        finished = true;
        co_await fail_watched(
            fmt::format("the prefill ended with {} of {} blocks computed", checksums.size(), expected));
        break;
      }
      const auto prefix = wire::encode_block_prefix(static_cast<uint32_t>(item.index), item.payload.size());
      checksums.push_back(wire::block_checksum(item.payload));
      ec = co_await stream.write(buffers_of(asio::buffer(prefix), asio::buffer(item.payload)), timeout);
      if (ec) {
        spdlog::warn("KV transfer to {}: block {}: {}; prefill cancelled", peer, item.index,
                     describe(ec, options.timeout_ms));
        break;
      }
      metrics.kv_transfer_blocks_sent += 1;
      metrics.kv_transfer_bytes_sent += static_cast<int64_t>(item.payload.size());
      if (static_cast<int64_t>(checksums.size()) == expected) {
        // Every block is out: the completion record now, not a step later when the engine reports the end (the
        // prefill's one token is nobody's: the request is cancelled on the way out, its blocks stay cached).
        const std::vector<std::byte> done = wire::encode_done(checksums);
        ec = co_await stream.write(buffers_of(asio::buffer(done)), timeout);
        if (ec) spdlog::warn("KV transfer to {}: sending the completion record: {}", peer, describe(ec, options.timeout_ms));
        stream.shutdown_send();
        all_sent = true;
        // The decode worker closes first, once it has read the completion record: closing this end earlier could
        // lose what a transport still holds (UCX has no half-close). Bounded by the timeout.
        if (!ec) co_await outbox->wait_peer_gone(timeout);
        break;
      }
    }
    if (all_sent || ec) break;
  }
}

}  // namespace

awaitable<void> serve_kv_transfer(std::shared_ptr<KvStream> stream, engine::EngineClient& client,
                                  const KvTransferOptions& options, Metrics& metrics) {
  std::exception_ptr error;
  try {
    co_await serve_transfer(stream, client, options, metrics);
  } catch (...) {
    error = std::current_exception();
  }
  stream->finish();  // what was written reaches the decode worker; the peer watch then ends and lets go
  if (error) std::rethrow_exception(error);
}

}  // namespace deepinfer::server
