// Prefill/decode disaggregation's KV transfer, both sides, in the server's io_context: the frames of
// kvcache/transfer/kv_wire.h over one KvStream per transfer (kv_stream.h): TCP (Boost.Asio) or UCX's stream API
// (ucx_transport.h: --kv-transfer-protocol ucx|rdma).
//
// Decode side (fetch_kv_blocks): after the engine reserved blocks for them (the caller's first phase), connects to
// the prefill worker's KV transfer endpoint, asks for the KV of the prompt's whole blocks it lacks, receives the blocks as the prefill worker's chunked prefill computes them, then the
// completion record, and checks every block against its checksum. Only then are the blocks handed to the engine
// (engine::KvHandoff::import_blocks into the reservation), so a request never decodes on unchecked KV.
// Prefill side (serve_kv_transfer): one coroutine per connection: reads the request, runs it on the engine as a
// prefill (max_tokens 1; engine::KvHandoff::export_block streams each block as soon as a step has computed it),
// writes the blocks, then the completion record.
//
// Every wait has the transfer timeout (--kv-transfer-timeout-ms: connecting, each read, each write, and the
// prefill side's wait for the engine's next block); a timeout, a closed or reset connection, an error frame, a
// corrupt block or a short completion record ends the transfer with a Status on the decode side and cancels the
// engine request on the prefill side (its blocks go back to its pool). Nothing else is touched.
// Thread-safety: the coroutines run on the connection's strand; the engine's callbacks only queue and post.
#pragma once

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <cstddef>
#include <memory>
#include <cstdint>
#include <string>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/engine/engine_client.h"
#include "deepinfer/kvcache/transfer/kv_wire.h"
#include "deepinfer/server/metrics.h"
#include "kv_stream.h"

namespace deepinfer::server {

class UcxTransport;

struct KvTransferOptions {
  int64_t timeout_ms = 30000;  // every wait (see above)
  int64_t deadline_ms = 120000;  // decode side: the whole transfer, connecting to the last block checked
  size_t block_bytes = 0;      // this worker's KV block (engine::Engine::block_bytes()); REQUIRES > 0
  int64_t max_tokens = 0;      // the longest prompt a peer may send (max_model_len)
  std::string fingerprint_hex;  // this worker's block-hash fingerprint: the peer's must equal it
  std::shared_ptr<UcxTransport> ucx;  // decode side: fetches over UCX; null: over TCP
};

// Ends a decode-side fetch from elsewhere (its client went away, the server stops): abort() closes the fetch's
// socket on the fetch's strand, and the fetch returns Status ShuttingDown-like Internal "aborted: WHY" with reason
// "aborted". Thread-safety: abort() from any thread.
class KvFetchControl : public std::enable_shared_from_this<KvFetchControl> {
 public:
  explicit KvFetchControl(boost::asio::any_io_executor strand) : strand_(std::move(strand)) {}
  void abort(std::string why);
  // On the fetch's strand.
  bool aborted() const { return aborted_; }
  const std::string& why() const { return why_; }
  void attach(KvStream* stream) { stream_ = stream; }

 private:
  boost::asio::any_io_executor strand_;
  KvStream* stream_ = nullptr;                  // strand only
  bool aborted_ = false;                        // strand only
  std::string why_;                             // strand only
};

// Decode side. `endpoint`: "HOST:PORT" of a prefill worker's KV transfer listener. `tokens`: whole blocks of the
// prompt. Returns the payloads of blocks request.first_block .. tokens/64 - 1, each checked.
// Errors: DeadlineExceeded-like IoError "timed out ..." (reason "timeout"; "deadline" past options.deadline_ms), IoError for connect/reset ("connect"),
// Unavailable-like FailedPrecondition with the peer's error text ("peer_error"), Corruption for a bad block or
// frame ("corrupt" / "protocol"): `reason` is set to the metric's label.
boost::asio::awaitable<Result<std::vector<std::vector<std::byte>>>> fetch_kv_blocks(
    std::string endpoint, kvcache::transfer::KvTransferRequest request, const KvTransferOptions& options,
    Metrics& metrics, std::string& reason, std::shared_ptr<KvFetchControl> control = nullptr);

// Prefill side: answers a connection over the limit of transfers at once with an error frame and closes it
// (within 1 s).
boost::asio::awaitable<void> refuse_kv_transfer(std::shared_ptr<KvStream> stream, std::string message);

// Prefill side: serves one connection until its transfer ends.
boost::asio::awaitable<void> serve_kv_transfer(std::shared_ptr<KvStream> stream, engine::EngineClient& client,
                                               const KvTransferOptions& options, Metrics& metrics);

}  // namespace deepinfer::server
