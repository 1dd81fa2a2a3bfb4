// The KV transfer's TCP stream (kv_stream.h).
#include "kv_stream.h"

#include <fmt/format.h>

namespace deepinfer::server {
namespace asio = boost::asio;
namespace beast = boost::beast;
using asio::awaitable;
using asio::use_awaitable;
using tcp = asio::ip::tcp;

namespace {

class TcpKvStream final : public KvStream {
 public:
  explicit TcpKvStream(tcp::socket socket) : stream_(std::move(socket)) {
    beast::error_code ec;
    stream_.socket().set_option(tcp::no_delay(true), ec);
    const tcp::endpoint remote = stream_.socket().remote_endpoint(ec);
    if (!ec) peer_ = fmt::format("{}:{}", remote.address().to_string(), remote.port());
  }

  awaitable<beast::error_code> write(std::vector<asio::const_buffer> buffers, Duration timeout) override {
    beast::error_code ec;
    stream_.expires_after(timeout);
    co_await asio::async_write(stream_, buffers, asio::redirect_error(use_awaitable, ec));
    co_return ec;
  }

  awaitable<beast::error_code> read(asio::mutable_buffer buffer, Duration timeout) override {
    beast::error_code ec;
    stream_.expires_after(timeout);
    co_await asio::async_read(stream_, buffer, asio::redirect_error(use_awaitable, ec));
    co_return ec;
  }

  awaitable<void> wait_peer_closed() override {
    std::array<std::byte, 1> byte{};
    beast::error_code ec;
    co_await stream_.socket().async_read_some(asio::buffer(byte), asio::redirect_error(use_awaitable, ec));
  }

  void shutdown_send() override {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
  }

  void close() override {
    beast::error_code ignored;
    stream_.socket().close(ignored);
  }

  void finish() override { close(); }

  std::string peer() const override { return peer_; }

 private:
  beast::tcp_stream stream_;
  std::string peer_ = "unknown";
};

}  // namespace

std::unique_ptr<KvStream> make_tcp_kv_stream(tcp::socket socket) {
  return std::make_unique<TcpKvStream>(std::move(socket));
}

}  // namespace deepinfer::server
