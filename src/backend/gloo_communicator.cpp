// Collectives over Gloo's TCP transport (communicator.h) on host memory: the CPU backend's communicator. Gloo
// reports failures by throwing; here the first one is kept (status()) and later collectives do nothing, so that a
// dead peer ends the step with an error instead of an exception through the model's code.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <numeric>

#include "deepinfer/backend/communicator.h"

namespace deepinfer::backend {
namespace {

// Gloo's messages start with its source location ("[./gloo/transport/tcp/pair.cc:598] Connection closed by peer
// ..."): noise in a log line, and not for the API clients whose requests a failed group ends.
std::string without_source_location(std::string message) {
  if (message.starts_with("[") && message.find("] ") != std::string::npos &&
      message.find(".cc:") < message.find("] ")) {
    message.erase(0, message.find("] ") + 2);
  }
  return message;
}

// Gloo's rendezvous over our store, keys under `prefix`.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(TcpStore& store, std::string prefix, std::chrono::milliseconds timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    Status s = store_.set(prefix_ + key, std::as_bytes(std::span(data)));
    if (!s.ok()) throw std::runtime_error(s.message());
  }
  std::vector<char> get(const std::string& key) override {
    Result<std::vector<std::byte>> value = store_.get(prefix_ + key, timeout_);
    if (!value.ok()) throw std::runtime_error(value.status().message());
    std::vector<char> out(value->size());
    std::memcpy(out.data(), value->data(), out.size());
    return out;
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    for (const std::string& key : keys) {
      Result<std::vector<std::byte>> value = store_.get(prefix_ + key, timeout);
      if (!value.ok()) throw std::runtime_error(value.status().message());
    }
  }

 private:
  TcpStore& store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

float* f32(const Tensor& t) { return static_cast<float*>(t.data); }

void check_contiguous(const Tensor& t, const char* what) {
  if (t.dtype != DType::kF32 || (t.rows > 1 && t.stride != t.cols)) {
    std::fprintf(stderr, "gloo communicator: %s needs a contiguous float32 tensor\n", what);
    std::abort();
  }
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::Context> context, std::string name)
      : context_(std::move(context)), name_(std::move(name)) {}

  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }
  Status status() const override { return status_; }
  bool failed() const override { return failed_.load(); }

  void all_reduce_sum(Tensor x) override {
    check_contiguous(x, "all_reduce_sum");
    if (x.rows * x.cols == 0) return;
    run("all_reduce", [&] {
      gloo::AllreduceOptions opts(context_);
      opts.setOutput(f32(x), static_cast<size_t>(x.rows * x.cols));
      opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      gloo::allreduce(opts);
    });
  }

  void all_gather_rows(const Tensor& in, Tensor out) override {
    check_contiguous(in, "all_gather_rows");
    check_contiguous(out, "all_gather_rows");
    if (in.rows * in.cols == 0) return;  // every rank gathers nothing (Gloo divides by the size)
    run("all_gather", [&] {
      gloo::AllgatherOptions opts(context_);
      opts.setInput(f32(in), static_cast<size_t>(in.rows * in.cols));
      opts.setOutput(f32(out), static_cast<size_t>(out.rows * out.cols));
      gloo::allgather(opts);
    });
  }

  void reduce_scatter_rows(const Tensor& in, Tensor out) override {
    check_contiguous(in, "reduce_scatter_rows");
    check_contiguous(out, "reduce_scatter_rows");
    if (out.rows * out.cols == 0) return;
    // Gloo has no reduce-scatter over unbound buffers: all-reduce a copy, keep this rank's rows.
    scratch_.assign(f32(in), f32(in) + in.rows * in.cols);
    all_reduce_sum(Tensor{scratch_.data(), DType::kF32, in.rows, in.cols, in.cols});
    if (!status_.ok()) return;
    std::memcpy(out.data, scratch_.data() + rank() * out.rows * out.cols,
                static_cast<size_t>(out.rows * out.cols) * sizeof(float));
  }

  void all_to_all_rows(const Tensor& in, std::span<const int64_t> send_rows, Tensor out,
                       std::span<const int64_t> recv_rows) override {
    check_contiguous(in, "all_to_all_rows");
    check_contiguous(out, "all_to_all_rows");
    std::vector<int64_t> send(send_rows.begin(), send_rows.end()), recv(recv_rows.begin(), recv_rows.end());
    for (int64_t& n : send) n *= in.cols;
    for (int64_t& n : recv) n *= out.cols;
    // Gloo wants non-null pointers even for empty buffers.
    float dummy_in = 0.0f, dummy_out = 0.0f;
    float* in_ptr = in.data != nullptr ? f32(in) : &dummy_in;
    float* out_ptr = out.data != nullptr ? f32(out) : &dummy_out;
    run("all_to_all", [&] {
      gloo::AlltoallvOptions opts(context_);
      opts.setInput(in_ptr, send);
      opts.setOutput(out_ptr, recv);
      gloo::alltoallv(opts);
    });
  }

  void all_to_all_counts(std::span<const int64_t> send, std::span<int64_t> recv) override {
    std::vector<int64_t> in(send.begin(), send.end());
    std::vector<int64_t> ones(static_cast<size_t>(size()), 1);
    run("all_to_all_counts", [&] {
      gloo::AlltoallvOptions opts(context_);
      opts.setInput(in.data(), ones);
      opts.setOutput(recv.data(), ones);
      gloo::alltoallv(opts);
    });
  }

  void broadcast_host(std::span<std::byte> bytes, int root) override { broadcast_bytes(bytes, root, false); }
  void broadcast_host_waiting(std::span<std::byte> bytes, int root) override { broadcast_bytes(bytes, root, true); }

  void broadcast(Tensor x, int root) override {
    check_contiguous(x, "broadcast");
    broadcast_host(std::as_writable_bytes(std::span(f32(x), static_cast<size_t>(x.rows * x.cols))), root);
  }

  void barrier() override {
    run("barrier", [&] {
      gloo::BarrierOptions opts(context_);
      gloo::barrier(opts);
    });
  }

 private:
  // `waiting`: no group timeout (a follower waiting for its leader's next command).
  void broadcast_bytes(std::span<std::byte> bytes, int root, bool waiting) {
    if (bytes.empty()) return;
    run("broadcast", [&] {
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(reinterpret_cast<uint8_t*>(bytes.data()), bytes.size());
      opts.setRoot(root);
      if (waiting) opts.setTimeout(std::chrono::hours(24 * 365));
      gloo::broadcast(opts);
    });
  }

  template <class F>
  void run(const char* what, F&& f) {
    if (!status_.ok()) return;
    try {
      f();
    } catch (const std::exception& e) {
      status_ = Status::internal(name_ + " rank " + std::to_string(rank()) + ": " + what + " failed: " +
                                 without_source_location(e.what()));
      failed_ = true;
    }
  }

  std::shared_ptr<gloo::Context> context_;
  std::string name_;
  Status status_;
  std::atomic<bool> failed_{false};
  std::vector<float> scratch_;
};

class SingleCommunicator final : public Communicator {
 public:
  explicit SingleCommunicator(Backend& backend) : backend_(backend) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Status status() const override { return Status(); }
  bool failed() const override { return false; }
  void all_reduce_sum(Tensor) override {}
  void all_gather_rows(const Tensor& in, Tensor out) override { backend_.copy(in, out); }
  void reduce_scatter_rows(const Tensor& in, Tensor out) override { backend_.copy(in, out); }
  void all_to_all_rows(const Tensor& in, std::span<const int64_t> send_rows, Tensor out,
                       std::span<const int64_t>) override {
    if (send_rows[0] > 0) backend_.copy(in.rows_slice(0, send_rows[0]), out.rows_slice(0, send_rows[0]));
  }
  void all_to_all_counts(std::span<const int64_t> send, std::span<int64_t> recv) override { recv[0] = send[0]; }
  void broadcast_host(std::span<std::byte>, int) override {}
  void broadcast_host_waiting(std::span<std::byte>, int) override {}
  void broadcast(Tensor, int) override {}
  void barrier() override {}

 private:
  Backend& backend_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_gloo_communicator(TcpStore& store, const std::string& prefix, int rank,
                                                             int size, const std::string& interface_host,
                                                             std::chrono::milliseconds timeout) {
  if (size < 1 || rank < 0 || rank >= size) {
    return Status::invalid_argument("gloo group '" + prefix + "': rank " + std::to_string(rank) + " of " +
                                    std::to_string(size));
  }
  // Gloo's TCP pairs write with plain send(): a peer that died would kill this process with SIGPIPE instead of
  // failing the collective. Ignored process-wide, as Python (and so PyTorch's Gloo users) does; write errors then
  // come back as EPIPE, which Gloo turns into the exception kept in status().
  std::signal(SIGPIPE, SIG_IGN);
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = interface_host;
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(timeout);
    StoreAdapter adapter(store, prefix + "/", timeout);
    context->connectFullMesh(adapter, device);
    return std::unique_ptr<Communicator>(new GlooCommunicator(std::move(context), "group '" + prefix + "'"));
  } catch (const std::exception& e) {
    return Status::internal("gloo group '" + prefix + "' rank " + std::to_string(rank) + " of " +
                            std::to_string(size) + ": " + e.what());
  }
}

std::unique_ptr<Communicator> make_single_communicator(Backend& backend) {
  return std::make_unique<SingleCommunicator>(backend);
}

}  // namespace deepinfer::backend
