// Collectives between the processes of one model (tensor and expert parallel): one process per device, each
// holding its shard of the weights, all running the same forward pass in lock step. The model's code calls the
// collectives below on backend memory; the CPU implementation is Gloo over TCP (so that every parallel code
// path runs in CI as several CPU processes on loopback), the CUDA one is NCCL on the backend's stream.
//
// Groups meet through a rendezvous store: a key-value store every rank can reach (TcpStore below, as torchrun's
// TCPStore: rank 0 serves it on --master-addr:--master-port). A group is named by a prefix in the store, so one
// store makes the world group and its tensor- and expert-parallel subgroups.
//
// Conventions: tensors are contiguous views (stride == cols) of the backend's memory in its activation dtype
// (float32 on the CPU); every rank of the group calls the same collectives in the same order with the same
// shapes (else the group hangs until the timeout). Sums are over ranks in the implementation's order, and
// every rank receives the same bits (Gloo's ring and NCCL's reduce then broadcast the same chunks), so values
// computed from a reduced tensor (MoE routing, argmax) agree across ranks.
// Errors: a collective does not return a Status (as the backend's ops do not): the first failure (a peer that
// died, a timeout) is kept and returned by status(); every later collective on the communicator does nothing.
// Thread-safety: one thread at a time per communicator.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/core/status.h"

namespace deepinfer::backend {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // x = sum over ranks of x (in place).
  virtual void all_reduce_sum(Tensor x) = 0;
  // out = the ranks' `in` stacked by rank: out [size * in.rows, in.cols], rank r's rows at r * in.rows.
  virtual void all_gather_rows(const Tensor& in, Tensor out) = 0;
  // out = rows [rank * out.rows, (rank + 1) * out.rows) of the sum over ranks of `in` (in.rows == size * out.rows).
  virtual void reduce_scatter_rows(const Tensor& in, Tensor out) = 0;
  // Rank r sends rows [sum(send_rows[..q]), +send_rows[q]) of `in` to rank q and receives recv_rows[q] rows from
  // rank q into `out`, stacked by source rank. send_rows / recv_rows have size() entries; every rank's recv_rows[q]
  // equals rank q's send_rows[r] (exchange the counts first, e.g. with all_to_all_counts).
  virtual void all_to_all_rows(const Tensor& in, std::span<const int64_t> send_rows, Tensor out,
                               std::span<const int64_t> recv_rows) = 0;
  // recv[q] = rank q's send[rank()] (host memory; send.size() == recv.size() == size()).
  virtual void all_to_all_counts(std::span<const int64_t> send, std::span<int64_t> recv) = 0;
  // x = root's x. Host bytes (a step's command) or backend memory (a tensor).
  virtual void broadcast_host(std::span<std::byte> bytes, int root) = 0;
  // broadcast_host without the group's timeout: a follower waiting for its leader's next command, however long the
  // server stays idle (a leader that dies still fails it at once: its connections close).
  virtual void broadcast_host_waiting(std::span<std::byte> bytes, int root) = 0;
  virtual void broadcast(Tensor x, int root) = 0;
  virtual void barrier() = 0;

  // The first failure of a collective (Internal: which collective, which peer or the timeout), else OK.
  virtual Status status() const = 0;
  // Whether a collective failed: the same as !status().ok(), but safe to ask from any thread (a supervisor).
  virtual bool failed() const = 0;
};

// The rendezvous store (torchrun's TCPStore, in spirit): rank 0 serves it, every rank connects as a client.
// set/get/add on string keys; get waits for the key up to the timeout. Thread-safety: one thread per client.
class TcpStore {
 public:
  virtual ~TcpStore() = default;
  virtual Status set(const std::string& key, std::span<const std::byte> value) = 0;
  // Waits up to `timeout` for the key. Errors: DeadlineExceeded-like Unavailable naming the key; IoError when the
  // server went away.
  virtual Result<std::vector<std::byte>> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // Adds `delta` to the counter at `key` (a key never set counts as 0; the value is 8 bytes, little-endian) and
  // returns the sum, atomically with respect to every other client (torch's TCPStore::add): of several clients that
  // add 1 to a fresh key, exactly one gets 1. Errors: IoError when the server went away; InvalidArgument when the key
  // holds a value that is not such a counter (set() wrote other bytes there).
  virtual Result<int64_t> add(const std::string& key, int64_t delta) = 0;
  // The port the server listens on (serving stores only; 0 for clients).
  virtual int port() const = 0;
};

// Serves a store on host:port (port 0: any free port, see port()) in a thread of its own, and is a client of it.
// Errors: IoError (address in use, ...).
Result<std::unique_ptr<TcpStore>> serve_tcp_store(const std::string& host, int port);
// Connects to the store at host:port, retrying until `timeout` (the server may start after the client).
Result<std::unique_ptr<TcpStore>> connect_tcp_store(const std::string& host, int port,
                                                    std::chrono::milliseconds timeout);

// A group of `size` ranks meeting under `prefix` in `store` (every rank passes the same prefix and size), over
// Gloo's TCP transport on `interface_host` (the address peers reach this rank at). Collectives give up after
// `timeout`. The store must outlive the call only. Sets SIGPIPE to ignored (a dead peer's socket must fail the
// collective, not kill the process). Errors: Internal (connection, timeout) naming the group.
Result<std::unique_ptr<Communicator>> make_gloo_communicator(TcpStore& store, const std::string& prefix, int rank,
                                                             int size, const std::string& interface_host,
                                                             std::chrono::milliseconds timeout);

// A group over NCCL (the CUDA backend's collectives, NVLink / InfiniBand): collectives on `backend`'s stream over its
// device memory (bf16 or float32 tensors), asynchronous like its ops; the host-memory ones (broadcast_host,
// all_to_all_counts) are staged through device memory and wait. The ranks meet through `store` under `prefix` (rank 0
// publishes NCCL's unique id). NCCL has no timeout: a rank that dies is the supervisor's to notice
// (apps/tensor_parallel_group). Keep NVLink multicast off where the machines ask it (NCCL_NVLS_ENABLE=0).
// Errors: Unsupported (a build without CUDA, a backend other than CUDA); Internal (NCCL's message) naming the group.
Result<std::unique_ptr<Communicator>> make_nccl_communicator(Backend& backend, TcpStore& store, const std::string& prefix,
                                                             int rank, int size, std::chrono::milliseconds timeout);

// A group of one: every collective is the identity (all_gather and reduce_scatter copy). Lets the model's
// parallel code run unchanged at world size 1.
std::unique_ptr<Communicator> make_single_communicator(Backend& backend);

}  // namespace deepinfer::backend
