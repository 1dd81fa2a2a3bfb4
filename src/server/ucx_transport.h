// UCX for the KV transfer (--kv-transfer-protocol ucx|rdma): one UCP context and worker per server, progressed by
// one thread of its own; listeners and client endpoints by socket address (UCX's connection manager over TCP or
// RDMA-CM); data over UCP's stream API, so the transfer's frames (kv_wire.h) go unchanged. UCX picks the
// transports (shared memory, TCP, RDMA verbs where the hardware has them); `rdma` restricts it to RDMA transports
// and fails at startup where there are none. Library: libucx (Debian's libucx-dev; DESIGN.md's transport).
//
// Thread-safety: the worker is created in UCS_THREAD_MODE_MULTI, so endpoints are made and operations posted from
// the server's strands while the progress thread runs the completions; each completion wakes its coroutine by
// posting to the coroutine's strand. A UcxTransport outlives every endpoint and listener made from it (they hold
// it by shared_ptr).
#pragma once

#include <boost/asio.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "deepinfer/core/status.h"
#include "kv_stream.h"

namespace deepinfer::server {

struct UcxOptions {
  bool rdma_only = false;   // --kv-transfer-protocol rdma: UCX_TLS limited to RDMA transports (+ self, shm)
  std::string net_devices;  // --rdma-device-names: UCX_NET_DEVICES (e.g. "mlx5_0:1,mlx5_1:1"); empty: UCX's choice
};

class UcxTransport : public std::enable_shared_from_this<UcxTransport> {
 public:
  // Reads UCX's configuration (UCX_* environment variables apply, then `options`), makes the context and worker
  // and starts the progress thread. Errors: Unavailable-like IoError naming UCX's status (e.g. no RDMA device).
  static Result<std::shared_ptr<UcxTransport>> create(const UcxOptions& options);
  ~UcxTransport();
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  // Accepts connections on host:port (0: an ephemeral port); returns the bound port. Each accepted stream is
  // handed to `on_accept` on `executor` (a strand per connection is made from it). One listener per transport.
  Result<uint16_t> listen(const std::string& host, uint16_t port, boost::asio::any_io_executor executor,
                          std::function<void(std::unique_ptr<KvStream>)> on_accept);
  void stop_listening();
  // Stops listening and the progress thread: no completion runs (or posts to an executor) afterwards; pending
  // operations never complete. For the server's stop, after its io_context threads have ended. Idempotent.
  void stop();

  // A client stream to host:port (a numeric address, or "localhost"; the caller resolves names). UCX connects in
  // the background: a refused or unreachable peer shows as the first operation's error.
  Result<std::unique_ptr<KvStream>> connect(const std::string& host, uint16_t port);

  struct Impl;

 private:
  UcxTransport() = default;
  std::unique_ptr<Impl> impl_;
};

}  // namespace deepinfer::server
