// The KV transfer's rate on loopback over TCP and over UCX (prefill/decode disaggregation, src/server/kv_transfer.h),
// next to a raw socket moving the same bytes in the same process (the ceiling of one TCP stream here) and XXH3 over
// them (UCX's own ceiling: ucx_perftest, run beside this by bench/cluster/kv_transfer_rates.sh).
// The product's two sides run as they do in the workers: serve_kv_transfer (the prefill side: its outbox, the
// checksums, the block frames) and fetch_kv_blocks (the decode side: frames, size and order checks, checksum
// verification). Only the engine is replaced, by a source that exports every block at once (the real one copies
// each block off the device as its step ends: a prefill worker's step time, not the transfer's).
// Prints one JSON line per (transport, block size, blocks): seconds, GB/s, the raw socket's GB/s, XXH3's GB/s.
// Usage: bench_kv_transfer [--blocks N] [--reps R] [--block-bytes B,...] [--protocol tcp|ucx|both]
#include <fmt/format.h>

#include <boost/asio.hpp>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "deepinfer/engine/engine_client.h"
#include "deepinfer/kvcache/transfer/kv_wire.h"
#include "deepinfer/server/metrics.h"
#include "deepinfer/server/server.h"
#include "kv_transfer.h"
#include "ucx_transport.h"

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using deepinfer::Result;
using namespace deepinfer;

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The engine's place: every prompt block exported at submit, then the request's end.
class BlockSource final : public engine::EngineClient {
 public:
  explicit BlockSource(size_t block_bytes) : payload_(block_bytes) {
    for (size_t i = 0; i < payload_.size(); ++i) payload_[i] = static_cast<std::byte>((i * 131) & 0xff);
  }
  Ticket submit(std::vector<TokenId> prompt, engine::SamplingParams, std::shared_ptr<engine::EventSink> sink,
                engine::KvHandoff handoff) override {
    const int64_t blocks = static_cast<int64_t>(prompt.size()) / kvcache::kBlockTokens;
    for (int64_t i = 0; i < blocks; ++i) handoff.export_block(i, payload_);
    engine::GenerationEvent done;
    done.event.finished = true;
    done.event.finish_reason = engine::FinishReason::kLength;
    sink->deliver({std::move(done)});
    return next_++;
  }
  void cancel(Ticket) override {}
  void reserve_kv_blocks(std::vector<TokenId>, std::function<void(Result<engine::KvReservation>)> done) override {
    done(Status::unsupported("the benchmark's prefill side reserves nothing"));
  }
  void release_kv_blocks(uint64_t) override {}
  engine::EngineLoad load() const override { return {}; }
  void stop() override {}

 private:
  std::vector<std::byte> payload_;
  Ticket next_ = 1;
};

// One TCP stream moving `blocks` writes of `block_bytes`: into one reused buffer (`fresh` false: the link's ceiling
// here), or into a new buffer per block as the receiver keeps them (`fresh` true: the ceiling with the same memory
// traffic, first touch of every page included).
double raw_socket_seconds(size_t block_bytes, int64_t blocks, bool fresh) {
  asio::io_context io;
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  const uint16_t port = acceptor.local_endpoint().port();
  std::vector<std::byte> out(block_bytes, std::byte{1});
  std::thread sender([&] {
    asio::io_context sio;
    tcp::socket s(sio);
    s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    s.set_option(tcp::no_delay(true));
    for (int64_t i = 0; i < blocks; ++i) asio::write(s, asio::buffer(out));
  });
  tcp::socket r = acceptor.accept();
  std::vector<std::vector<std::byte>> in(fresh ? static_cast<size_t>(blocks) : 1);
  const Clock::time_point start = Clock::now();
  for (int64_t i = 0; i < blocks; ++i) {
    std::vector<std::byte>& block = in[fresh ? static_cast<size_t>(i) : 0];
    block.resize(block_bytes);
    asio::read(r, asio::buffer(block));
  }
  const double seconds = since(start);
  sender.join();
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  server::keep_freed_kv_blocks_in_the_heap();  // as `deepinfer serve` does at startup
  int64_t blocks = 256;
  int reps = 3;
  // The demo model's f32 latent block; V2-Lite's and V3's bf16 blocks (27 and 61 layers x 576 values x 64 tokens).
  std::vector<size_t> sizes{98'304, 1'990'656, 4'497'408};
  std::vector<std::string> protocols{"tcp", "ucx"};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--blocks") blocks = std::atoll(argv[i + 1]);
    else if (flag == "--reps") reps = std::atoi(argv[i + 1]);
    else if (flag == "--block-bytes") {
      sizes.clear();
      std::string list = argv[i + 1];
      for (size_t start = 0; start < list.size();) {
        const size_t comma = std::min(list.find(',', start), list.size());
        sizes.push_back(std::stoull(list.substr(start, comma - start)));
        start = comma + 1;
      }
    } else if (flag == "--protocol") {
      protocols.clear();
      const std::string p = argv[i + 1];
      if (p == "tcp" || p == "both") protocols.push_back("tcp");
      if (p == "ucx" || p == "both") protocols.push_back("ucx");
    } else {
      std::cerr << "usage: bench_kv_transfer [--blocks N] [--reps R] [--block-bytes B,...] [--protocol tcp|ucx|both]\n";
      return 2;
    }
  }
  for (const std::string& protocol : protocols)
  for (size_t block_bytes : sizes) {
    BlockSource source(block_bytes);
    server::Metrics metrics;
    server::KvTransferOptions options;
    options.timeout_ms = 60000;
    options.block_bytes = block_bytes;
    options.max_tokens = blocks * kvcache::kBlockTokens;
    options.fingerprint_hex = std::string(32, 'a');
    asio::io_context io;
    tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    uint16_t port = acceptor.local_endpoint().port();
    // The prefill side on its own thread and io_context, as in a prefill worker.
    asio::io_context prefill_io;
    auto guard = asio::make_work_guard(prefill_io);
    std::thread prefill_thread([&] { prefill_io.run(); });
    std::shared_ptr<server::UcxTransport> ucx;
    if (protocol == "ucx") {
      Result<std::shared_ptr<server::UcxTransport>> made = server::UcxTransport::create({});
      if (!made.ok()) {
        std::cerr << made.status().to_string() << "\n";
        std::exit(1);
      }
      ucx = *made;
      options.ucx = ucx;
      Result<uint16_t> listening =
          ucx->listen("127.0.0.1", 0, asio::make_strand(prefill_io), [&](std::unique_ptr<server::KvStream> stream) {
            asio::co_spawn(asio::make_strand(prefill_io),
                           server::serve_kv_transfer(std::move(stream), source, options, metrics), asio::detached);
          });
      if (!listening.ok()) {
        std::cerr << listening.status().to_string() << "\n";
        std::exit(1);
      }
      port = *listening;
    }
    std::vector<double> seconds, raw, raw_fresh, hash;
    for (int rep = 0; rep < reps; ++rep) {
      if (protocol == "tcp") {
        acceptor.async_accept(asio::make_strand(prefill_io), [&](boost::system::error_code ec, tcp::socket socket) {
          if (!ec)
            asio::co_spawn(socket.get_executor(),
                           server::serve_kv_transfer(server::make_tcp_kv_stream(std::move(socket)), source, options,
                                                     metrics),
                           asio::detached);
        });
      }
      std::thread accept_thread([&] { io.run(); io.restart(); });
      kvcache::transfer::KvTransferRequest request;
      request.fingerprint_hex = options.fingerprint_hex;
      request.tokens.assign(static_cast<size_t>(blocks * kvcache::kBlockTokens), 1);
      asio::io_context decode_io;
      Result<std::vector<std::vector<std::byte>>> got = Status::internal("not run");
      const Clock::time_point start = Clock::now();
      asio::co_spawn(decode_io,
                     [&]() -> asio::awaitable<void> {
                       std::string reason;
                       got = co_await server::fetch_kv_blocks(fmt::format("127.0.0.1:{}", port), request, options,
                                                              metrics, reason);
                     },
                     asio::detached);
      decode_io.run();
      seconds.push_back(since(start));
      accept_thread.join();
      if (!got.ok() || static_cast<int64_t>(got->size()) != blocks) {
        std::cerr << "transfer failed: " << got.status().to_string() << "\n";
        std::exit(1);
      }
      raw.push_back(raw_socket_seconds(block_bytes, blocks, false));
      raw_fresh.push_back(raw_socket_seconds(block_bytes, blocks, true));
      const Clock::time_point h = Clock::now();
      uint64_t sink = 0;
      for (const auto& b : *got) sink ^= kvcache::transfer::block_checksum(b);
      hash.push_back(since(h) + (sink == 42 ? 1e-12 : 0));
    }
    guard.reset();
    prefill_thread.join();
    if (ucx != nullptr) ucx->stop();
    std::sort(seconds.begin(), seconds.end());
    std::sort(raw.begin(), raw.end());
    std::sort(raw_fresh.begin(), raw_fresh.end());
    std::sort(hash.begin(), hash.end());
    const double bytes = static_cast<double>(block_bytes) * static_cast<double>(blocks);
    const auto median = [](const std::vector<double>& v) { return v[v.size() / 2]; };
    std::cout << fmt::format(
                     "{{\"bench\": \"kv_transfer\", \"transport\": \"{}-loopback\", \"block_bytes\": {}, "
                     "\"blocks\": {}, \"reps\": {}, \"seconds_median\": {:.4f}, \"seconds_min\": {:.4f}, "
                     "\"gb_per_s\": {:.3f}, \"raw_socket_gb_per_s\": {:.3f}, \"raw_socket_fresh_buffers_gb_per_s\": "
                     "{:.3f}, \"vs_raw_socket\": {:.2f}, \"vs_raw_socket_fresh_buffers\": {:.2f}, "
                     "\"xxh3_gb_per_s\": {:.2f}}}",
                     protocol, block_bytes, blocks, reps, median(seconds), seconds.front(), bytes / median(seconds) / 1e9,
                     bytes / median(raw) / 1e9, bytes / median(raw_fresh) / 1e9, median(raw) / median(seconds),
                     median(raw_fresh) / median(seconds), bytes / median(hash) / 1e9)
              << std::endl;
  }
  return 0;
}
