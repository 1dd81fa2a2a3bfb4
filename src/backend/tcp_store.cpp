// The rendezvous store of a parallel group (communicator.h): rank 0 serves a key-value map over TCP, every rank is
// a client. A get waits on the server for its key, up to the client's timeout. Messages, little-endian:
//   set: 'S' u32 key_len key u64 value_len value        -> u8 0
//   get: 'G' u32 key_len key u64 timeout_ms             -> u8 0 u64 value_len value | u8 1 (timed out)
//   add: 'A' u32 key_len key i64 delta                  -> u8 0 i64 sum | u8 2 (the key holds no counter)
// A client waits for each answer at most kAnswerGrace past what it asked the server to wait (a get's timeout): a
// server that stopped answering (its process hung: SIGSTOP) fails the call with IoError instead of blocking it forever,
// and the connection is closed (later calls fail at once).
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>

#include <boost/asio.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <atomic>
#include <map>
#include <memory>
#include <system_error>
#include <mutex>
#include <thread>

#include "deepinfer/backend/communicator.h"

namespace deepinfer::backend {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;

constexpr size_t kMaxKeyBytes = 4096;
// A group's values are small (transport addresses, NCCL's unique id): a bigger one is a bad client, closed.
constexpr uint64_t kMaxValueBytes = uint64_t{1} << 20;
// Connections served at once (a group's ranks hold one or two each); more are closed at once.
constexpr size_t kMaxConnections = 256;

template <class T>
void put(std::vector<std::byte>& out, T value) {
  const auto* p = reinterpret_cast<const std::byte*>(&value);
  out.insert(out.end(), p, p + sizeof(T));
}

template <class T>
T read_value(tcp::socket& socket) {
  T value{};
  asio::read(socket, asio::buffer(&value, sizeof(T)));
  return value;
}

std::string read_key(tcp::socket& socket) {
  const uint32_t length = read_value<uint32_t>(socket);
  if (length > kMaxKeyBytes) throw std::runtime_error("store key too long");
  std::string key(length, '\0');
  asio::read(socket, asio::buffer(key.data(), key.size()));
  return key;
}

// The map and its waiters; one thread per connection (a group has a few ranks, each with one or two connections).
class StoreServer {
 public:
  explicit StoreServer(tcp::acceptor acceptor) : acceptor_(std::move(acceptor)) {
    accept_thread_ = std::thread([this] { accept_loop(); });
  }
  ~StoreServer() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      for (const auto& c : connections_) ::shutdown(c->socket.native_handle(), SHUT_RDWR);
    }
    changed_.notify_all();
    ::shutdown(acceptor_.native_handle(), SHUT_RDWR);
    boost::system::error_code ignored;
    acceptor_.close(ignored);
    if (accept_thread_.joinable()) accept_thread_.join();
    for (const auto& c : connections_) c->thread.join();
  }
  int port() const { return port_; }
  void set_port(int port) { port_ = port; }

 private:
  // One thread per connection; finished ones are joined here, so that probes and scanners cost nothing lasting
  // (regression: a thread and its stack per connection ever made, until the process could make no more).
  void accept_loop() {
    while (true) {
      boost::system::error_code error;
      tcp::socket socket(acceptor_.get_executor());
      acceptor_.accept(socket, error);
      std::lock_guard lock(mu_);
      if (stopping_) return;
      if (error) continue;
      reap_finished();
      if (connections_.size() >= kMaxConnections) continue;  // closed as `socket` goes
      socket.set_option(tcp::no_delay(true), error);
      ::fcntl(socket.native_handle(), F_SETFD, FD_CLOEXEC);
      auto connection = std::make_shared<Connection>(std::move(socket));
      try {
        connection->thread = std::thread([this, connection] {
          serve(connection->socket);
          boost::system::error_code ignored;
          connection->socket.shutdown(tcp::socket::shutdown_both, ignored);
          connection->done = true;
        });
      } catch (const std::system_error&) {
        continue;  // no thread to be had: the connection closes
      }
      connections_.push_back(std::move(connection));
    }
  }

  // REQUIRES: mu_ held.
  void reap_finished() {
    for (auto it = connections_.begin(); it != connections_.end();) {
      if ((*it)->done) {
        (*it)->thread.join();
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void serve(tcp::socket& socket) {
    try {
      while (true) {
        const char op = read_value<char>(socket);
        const std::string key = read_key(socket);
        if (op == 'S') {
          const uint64_t length = read_value<uint64_t>(socket);
          if (length > kMaxValueBytes) return;
          std::vector<std::byte> value(length);
          asio::read(socket, asio::buffer(value.data(), value.size()));
          {
            std::lock_guard lock(mu_);
            values_[key] = std::move(value);
          }
          changed_.notify_all();
          const uint8_t ok = 0;
          asio::write(socket, asio::buffer(&ok, 1));
        } else if (op == 'G') {
          const uint64_t timeout_ms = read_value<uint64_t>(socket);
          std::vector<std::byte> reply;
          {
            std::unique_lock lock(mu_);
            const bool found = changed_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                                                 [&] { return stopping_ || values_.count(key) > 0; });
            if (stopping_) return;
            if (!found) {
              reply.push_back(std::byte{1});
            } else {
              const std::vector<std::byte>& value = values_[key];
              reply.push_back(std::byte{0});
              put<uint64_t>(reply, value.size());
              reply.insert(reply.end(), value.begin(), value.end());
            }
          }
          asio::write(socket, asio::buffer(reply));
        } else if (op == 'A') {
          const int64_t delta = read_value<int64_t>(socket);
          std::vector<std::byte> reply;
          {
            std::lock_guard lock(mu_);
            std::vector<std::byte>& value = values_[key];
            if (value.empty()) value.resize(sizeof(int64_t));  // a fresh key: the counter starts at 0
            if (value.size() != sizeof(int64_t)) {
              reply.push_back(std::byte{2});
            } else {
              int64_t sum = 0;
              std::memcpy(&sum, value.data(), sizeof(sum));
              sum += delta;
              std::memcpy(value.data(), &sum, sizeof(sum));
              reply.push_back(std::byte{0});
              put<int64_t>(reply, sum);
            }
          }
          changed_.notify_all();
          asio::write(socket, asio::buffer(reply));
        } else {
          return;
        }
      }
    } catch (const std::exception&) {
      // The client went away (or sent nonsense): its connection ends, the map stays.
    }
  }

  tcp::acceptor acceptor_;
  int port_ = 0;
  std::mutex mu_;
  std::condition_variable changed_;
  bool stopping_ = false;
  std::map<std::string, std::vector<std::byte>> values_;
  struct Connection {
    explicit Connection(tcp::socket s) : socket(std::move(s)) {}
    tcp::socket socket;
    std::thread thread;
    std::atomic<bool> done{false};
  };
  std::vector<std::shared_ptr<Connection>> connections_;  // GUARDED_BY(mu_)
  std::thread accept_thread_;
};

// How long past a get's own timeout (set and add: past 0) a client waits for the server's answer.
constexpr std::chrono::milliseconds kAnswerGrace{3000};

// Reads exactly `size` bytes before `deadline`, else throws (timed out, closed, error).
void read_until(tcp::socket& socket, void* data, size_t size, std::chrono::steady_clock::time_point deadline) {
  auto* out = static_cast<char*>(data);
  while (size > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) throw std::runtime_error("the store did not answer in time (its process may be hung)");
    pollfd fd{socket.native_handle(), POLLIN, 0};
    const int ready = ::poll(&fd, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (ready < 0 && errno != EINTR) throw std::system_error(errno, std::generic_category(), "poll");
    if (ready <= 0) continue;
    const ssize_t got = ::recv(socket.native_handle(), out, size, 0);
    if (got == 0) throw std::runtime_error("the store closed the connection");
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      throw std::system_error(errno, std::generic_category(), "recv");
    }
    out += got;
    size -= static_cast<size_t>(got);
  }
}

template <class T>
T read_until(tcp::socket& socket, std::chrono::steady_clock::time_point deadline) {
  T value{};
  read_until(socket, &value, sizeof(T), deadline);
  return value;
}

class TcpStoreClient final : public TcpStore {
 public:
  TcpStoreClient(std::unique_ptr<asio::io_context> io, tcp::socket socket, std::unique_ptr<StoreServer> server)
      : io_(std::move(io)), socket_(std::move(socket)), server_(std::move(server)) {}
  ~TcpStoreClient() override {
    boost::system::error_code ignored;
    socket_.close(ignored);
    server_.reset();
  }

  Status set(const std::string& key, std::span<const std::byte> value) override {
    std::vector<std::byte> message;
    put<char>(message, 'S');
    put<uint32_t>(message, static_cast<uint32_t>(key.size()));
    const auto* k = reinterpret_cast<const std::byte*>(key.data());
    message.insert(message.end(), k, k + key.size());
    put<uint64_t>(message, value.size());
    message.insert(message.end(), value.begin(), value.end());
    try {
      check_open();
      asio::write(socket_, asio::buffer(message));
      read_until<uint8_t>(socket_, std::chrono::steady_clock::now() + kAnswerGrace);
    } catch (const std::exception& e) {
      broken();
      return Status::io_error("rendezvous store: set '" + key + "': " + e.what());
    }
    return Status();
  }

  Result<std::vector<std::byte>> get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::vector<std::byte> message;
    put<char>(message, 'G');
    put<uint32_t>(message, static_cast<uint32_t>(key.size()));
    const auto* k = reinterpret_cast<const std::byte*>(key.data());
    message.insert(message.end(), k, k + key.size());
    put<uint64_t>(message, static_cast<uint64_t>(std::max<int64_t>(timeout.count(), 0)));
    try {
      check_open();
      const auto deadline = std::chrono::steady_clock::now() + std::max(timeout, std::chrono::milliseconds(0)) +
                            kAnswerGrace;
      asio::write(socket_, asio::buffer(message));
      if (read_until<uint8_t>(socket_, deadline) != 0) {
        return Status::internal("rendezvous store: no rank set '" + key + "' within " +
                                std::to_string(timeout.count()) + " ms");
      }
      const uint64_t length = read_until<uint64_t>(socket_, deadline);
      if (length > kMaxValueBytes) {
        broken();
        return Status::io_error("rendezvous store: value too long");
      }
      std::vector<std::byte> value(length);
      read_until(socket_, value.data(), value.size(), deadline);
      return value;
    } catch (const std::exception& e) {
      broken();
      return Status::io_error("rendezvous store: get '" + key + "': " + e.what());
    }
  }

  Result<int64_t> add(const std::string& key, int64_t delta) override {
    std::vector<std::byte> message;
    put<char>(message, 'A');
    put<uint32_t>(message, static_cast<uint32_t>(key.size()));
    const auto* k = reinterpret_cast<const std::byte*>(key.data());
    message.insert(message.end(), k, k + key.size());
    put<int64_t>(message, delta);
    try {
      check_open();
      const auto deadline = std::chrono::steady_clock::now() + kAnswerGrace;
      asio::write(socket_, asio::buffer(message));
      if (read_until<uint8_t>(socket_, deadline) != 0) {
        return Status::invalid_argument("rendezvous store: add to '" + key +
                                        "': it holds a value other than a counter");
      }
      return read_until<int64_t>(socket_, deadline);
    } catch (const std::exception& e) {
      broken();
      return Status::io_error("rendezvous store: add to '" + key + "': " + e.what());
    }
  }

  // A call that failed midway leaves the connection out of step with the server: closed, so later calls fail at once.
  void broken() {
    boost::system::error_code ignored;
    socket_.close(ignored);
  }
  void check_open() const {
    if (!socket_.is_open()) throw std::runtime_error("the connection failed earlier");
  }

  int port() const override { return server_ ? server_->port() : 0; }

 private:
  std::unique_ptr<asio::io_context> io_;
  tcp::socket socket_;
  std::unique_ptr<StoreServer> server_;
};

Result<tcp::socket> connect_once(asio::io_context& io, const std::string& host, int port) {
  boost::system::error_code error;
  tcp::resolver resolver(io);
  auto endpoints = resolver.resolve(host, std::to_string(port), error);
  if (error) return Status::io_error("rendezvous store: resolve " + host + ": " + error.message());
  tcp::socket socket(io);
  asio::connect(socket, endpoints, error);
  if (error) return Status::io_error("rendezvous store: connect " + host + ":" + std::to_string(port) + ": " +
                                     error.message());
  socket.set_option(tcp::no_delay(true), error);
  ::fcntl(socket.native_handle(), F_SETFD, FD_CLOEXEC);
  return socket;
}

}  // namespace

Result<std::unique_ptr<TcpStore>> serve_tcp_store(const std::string& host, int port) {
  auto io = std::make_unique<asio::io_context>();
  boost::system::error_code error;
  tcp::resolver resolver(*io);
  auto endpoints = resolver.resolve(host, std::to_string(port), error);
  if (error || endpoints.empty()) return Status::io_error("rendezvous store: resolve " + host + ": " + error.message());
  tcp::acceptor acceptor(*io);
  const tcp::endpoint endpoint = *endpoints.begin();
  acceptor.open(endpoint.protocol(), error);
  if (!error) acceptor.set_option(tcp::acceptor::reuse_address(true), error);
  if (!error) acceptor.bind(endpoint, error);
  if (!error) acceptor.listen(64, error);
  // Not inherited by the ranks this process starts.
  if (!error) ::fcntl(acceptor.native_handle(), F_SETFD, FD_CLOEXEC);
  if (error) {
    return Status::io_error("rendezvous store: listen on " + host + ":" + std::to_string(port) + ": " +
                            error.message());
  }
  const int bound = acceptor.local_endpoint().port();
  auto server = std::make_unique<StoreServer>(std::move(acceptor));
  server->set_port(bound);
  Result<tcp::socket> socket = connect_once(*io, host, bound);
  if (!socket.ok()) return socket.status();
  tcp::socket connected = std::move(socket).value();
  return std::unique_ptr<TcpStore>(new TcpStoreClient(std::move(io), std::move(connected), std::move(server)));
}

Result<std::unique_ptr<TcpStore>> connect_tcp_store(const std::string& host, int port,
                                                    std::chrono::milliseconds timeout) {
  auto io = std::make_unique<asio::io_context>();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    Result<tcp::socket> socket = connect_once(*io, host, port);
    if (socket.ok()) {
      tcp::socket connected = std::move(socket).value();
      return std::unique_ptr<TcpStore>(new TcpStoreClient(std::move(io), std::move(connected), nullptr));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::io_error(socket.status().message() + " (gave up after " + std::to_string(timeout.count()) +
                              " ms)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace deepinfer::backend
