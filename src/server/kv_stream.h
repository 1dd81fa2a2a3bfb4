// The byte stream a KV transfer runs over (kv_transfer.h), one per transfer: TCP (Boost.Asio) or UCX's stream API
// (ucx_transport.h). The frames of kvcache/transfer/kv_wire.h go over it unchanged.
//
// Every operation takes its own timeout and reports one of: success; beast::error::timeout (the timeout passed; the
// stream is then closed: a half-done frame cannot be resumed); asio::error::operation_aborted (close() was called);
// or the transport's error (a reset, refused or closed connection, as an asio error code where one fits).
// Thread-safety: a stream belongs to one strand: its coroutines and close() run there (close() from elsewhere goes
// through asio::post onto that strand, as KvFetchControl::abort does).
#pragma once

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace deepinfer::server {

class KvStream {
 public:
  using Duration = std::chrono::milliseconds;
  virtual ~KvStream() = default;
  // Writes every buffer, in order; the buffers stay valid until the call returns.
  virtual boost::asio::awaitable<boost::beast::error_code> write(std::vector<boost::asio::const_buffer> buffers,
                                                                 Duration timeout) = 0;
  // Fills `buffer` exactly.
  virtual boost::asio::awaitable<boost::beast::error_code> read(boost::asio::mutable_buffer buffer,
                                                                Duration timeout) = 0;
  // Completes when the peer closes or resets the stream, or close() is called (a read of one byte, no timeout:
  // the prefill side's watch on a decode worker that sends nothing after its request).
  virtual boost::asio::awaitable<void> wait_peer_closed() = 0;
  // No more writes from this side (the peer's reads then end after what was written).
  virtual void shutdown_send() = 0;
  // Ends every pending operation (operation_aborted) and releases the connection at once: data this side wrote
  // but the transport has not sent yet may be lost (an abort).
  virtual void close() = 0;
  // The normal end, after the last write: what was written reaches the peer first (UCX: a flush, then the
  // disconnect; TCP: the kernel's orderly close), then as close().
  virtual void finish() = 0;
  // "ADDRESS:PORT" of the peer, or "unknown".
  virtual std::string peer() const = 0;
};

// TCP: the stream over a connected socket (TCP_NODELAY set).
std::unique_ptr<KvStream> make_tcp_kv_stream(boost::asio::ip::tcp::socket socket);

}  // namespace deepinfer::server
