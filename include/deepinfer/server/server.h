// `deepinfer serve`'s HTTP server: OpenAI-compatible (chat completions, completions, models) and
// Anthropic-compatible (messages) endpoints, plus /health, /metrics, /tokenize and /detokenize, on
// Boost.Beast with C++20 coroutines. The engine is reached only through engine::EngineClient; HTTP runs on a small
// pool of io_context threads, each connection on its own strand. See src/server/README.md for the routes,
// the request semantics and how each API dialect maps onto the Conversation.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string_view>
#include <memory>
#include <string>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/recipe/renderer.h"
#include "deepinfer/recipe/tokenizer.h"
#include "deepinfer/engine/engine_client.h"

namespace deepinfer::server {

struct ServerConfig {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;  // 0: an ephemeral port (see Server::port())
  // Non-empty: /v1/*, /tokenize and /detokenize require `Authorization: Bearer KEY` or `x-api-key: KEY`.
  // /health and /metrics stay open (probes and scrapers; /metrics keyed with metrics_require_api_key).
  std::string api_key;
  int64_t max_body_bytes = 16ll << 20;    // larger bodies get 413
  int32_t max_concurrent_requests = 256;  // generation requests in flight; more get 429 with Retry-After
  int32_t max_json_depth = 64;            // deeper request JSON gets 400
  recipe::PromptFormat chat_format = recipe::PromptFormat::kDeepSeekV3;
  // deepseek-v4 only: which revision's reasoning-effort preambles (conversation.h); --chat-format-revision.
  recipe::V4Revision chat_format_revision = recipe::V4Revision::k0731;
  // max_tokens when a request gives none; 0: until the context (max_model_len) is full.
  int64_t default_max_tokens = 0;
  int32_t http_threads = 2;
  // Capacity of the one TokenizationCache every request's prompt is tokenized through (runs of text seen in
  // earlier requests, e.g. the history of a growing agent conversation, are not encoded again); 0: none.
  int64_t tokenization_cache_bytes = 64ll << 20;
  // Limits that hold before authentication (SECURITY.md lists them). A keep-alive connection idle this long,
  // or a request header not complete this long after the connection became idle, is closed.
  int32_t idle_timeout_seconds = 60;
  int32_t body_read_timeout_seconds = 60;  // a body not complete this long after its header: connection closed
  int64_t max_header_bytes = 64 * 1024;    // request line + header fields, and trailer fields apart: 431
  // Open connections at once; more are answered 503 and closed. Clamped at start to the file-descriptor
  // limit (RLIMIT_NOFILE) less 64 descriptors kept for the engine, the disk tier and logs.
  int32_t max_connections = 1024;
  // Share of max_connections one client address may hold; 0: half of max_connections. Raise it to
  // max_connections behind a gateway that is the only client.
  int32_t max_connections_per_ip = 0;
  // SIGTERM / shutdown(true): in-flight requests get this long to finish; then streams end with an error
  // event, the rest is cancelled, and the server stops (a Kubernetes grace period is 30 s).
  int32_t shutdown_timeout_seconds = 30;
  // GET /health answers 503 (unhealthy) while the engine has spent longer than this in one iteration (EngineLoad::
  // busy_seconds: a step, or its data-parallel group's lock-step question): a hung engine, or a tensor- or
  // data-parallel peer stopped mid-collective, takes the server out of its router's rotation long before the
  // collectives' 60 s timeout ends the group. 0: /health does not look (serve's default for one process).
  int32_t health_max_step_seconds = 0;
  bool metrics_require_api_key = false;  // /metrics behind api_key too (when one is set)
  // CORS (--allowed-origins): browser origins ("https://app.example", or "*") whose pages may call the API.
  // Empty: no CORS headers and no preflight answers (the default). A request from a listed Origin gets
  // Access-Control-Allow-Origin; an OPTIONS preflight from one gets 204 with the allowed methods and headers
  // (before authentication, as browsers send no credentials on a preflight).
  std::vector<std::string> allowed_origins;
  // Test seam, empty in production: called on the HTTP thread with each request's path once its header is
  // read, outside every per-request handler; what it throws ends that connection only.
  std::function<void(std::string_view path)> test_hook_on_request;
  // GET /worker/info (open like /health; what `deepinfer router` reads, router/router.h): this worker's role, the
  // model fingerprint in its block hashes (32 hex digits, kvcache::BlockHash::to_hex) and where it publishes KV
  // events (the endpoints as bound, e.g. tcp://*:5557; empty: none), beside the model facts of ModelInfo.
  std::string role = "both";
  std::string model_fingerprint_hex;
  std::string kv_events_endpoint;
  std::string kv_events_replay_endpoint;
  // Prefill/decode disaggregation (src/server/kv_transfer.h; GET /worker/info says the port). Role "prefill":
  // decode workers' KV transfers are served on host:kv_transfer_port (0: an ephemeral port). Role "decode": a
  // request with the header `X-KV-Prefill-Endpoint: HOST:PORT` has the KV of its prompt's whole blocks computed
  // by that prefill worker and moved here before it decodes; a transfer that fails (timeout, dead peer, corrupt
  // block) is counted and the prompt computed here. Other roles refuse the header (400).
  int32_t kv_transfer_port = 8998;
  int64_t kv_transfer_timeout_ms = 30000;  // every wait of a transfer, on both sides
  int64_t kv_transfer_deadline_ms = 120000;  // role decode: a whole transfer (a peer trickling blocks is cut off)
  int32_t kv_transfer_max_connections = 256;  // role prefill: transfers at once; more get an error frame
  // "tcp" (Boost.Asio) or "ucx" / "rdma" (UCX's stream API; rdma: RDMA transports only, refused at startup where
  // the machine has no RDMA device). Both sides of a transfer must use the same protocol.
  std::string kv_transfer_protocol = "tcp";
  std::string rdma_device_names;  // "rdma": UCX_NET_DEVICES (comma-separated); empty: UCX's choice
  size_t kv_block_bytes = 0;               // engine::Engine::block_bytes(); REQUIRES > 0 for prefill / decode
  // Install SIGINT/SIGTERM handlers: the first signal drains (stop accepting, finish in-flight requests,
  // stop); a second one cancels what is still running and stops at once.
  bool handle_signals = false;
  // Called once, on the server's I/O thread, when it begins to stop (a signal or shutdown()); must not block. serve
  // uses it in a data-parallel group to bound the stop: the engine may be waiting on a hung peer's collective.
  std::function<void()> on_shutdown;
};

// What the server says and checks about the model.
struct ModelInfo {
  std::string served_model_name;  // the `model` requests must name (or omit), and /v1/models' id
  std::string model_type;         // config.json's, e.g. "deepseek_v3"
  int64_t vocab_size = 0;         // the embedding's size: ids at or above it are rejected
  int64_t max_model_len = 0;      // prompt + generated tokens
  int64_t bos_token_id = 0;       // prepended to /v1/completions and /tokenize text prompts
  std::string description;        // optional; shown in /v1/models (the built-in default says what it is)
  std::filesystem::path root;     // the checkpoint directory
};

// Process-wide, once at startup (before other threads): allocations of a KV block's size (96 KiB to a few MiB) are
// kept in the heap when freed instead of glibc's default (fresh mmap'd pages, unmapped on free), so the next received
// or exported block reuses memory rather than page-faulting it in again: clear_page and page faults were ~30% of a
// loopback transfer's time (perf). M_MMAP_THRESHOLD 32 MiB (glibc's maximum), M_TRIM_THRESHOLD 256 MiB. Measured
// with bench/cluster/bench_kv_transfer over TCP on 2 cores: 96 KiB blocks 0.57 -> 1.5 GB/s, 1.9 MiB 0.73 -> 1.0.
void keep_freed_kv_blocks_in_the_heap();

// The chat format a checkpoint's model_type implies: deepseek_v2 and deepseek_v3 -> deepseek-v3.
Result<recipe::PromptFormat> default_chat_format(const std::string& model_type);
// The chat format of the checkpoint under `root`: what recipe::detect_format reads there (config.json's
// "chat_format" key, DeepInfer's own, which the built-in demo model sets; DeepSeek's encoder in encoding/; an
// official chat template; a known model name in name_or_path / _name_or_path), else default_chat_format(model_type).
// Errors: InvalidArgument for a "chat_format" value that is not a format name; Unsupported when nothing names one.
Result<recipe::PromptFormat> checkpoint_chat_format(const std::filesystem::path& root, const std::string& model_type);
// The deepseek-v4 revision a checkpoint's own encoder says (`encoding/encoding_dsv4.py` under `root`: its
// "Beyond maximum" preamble is 0731's, an "Absolute maximum" one alone the preview's); nullopt when the
// checkpoint ships no encoder or it says neither (the caller uses 0731, the released revision).
std::optional<recipe::V4Revision> checkpoint_v4_revision(const std::filesystem::path& root);

class Server {
 public:
  // Binds host:port, starts the engine thread and the HTTP threads, and returns at once.
  // Errors: IoError when the address cannot be bound; InvalidArgument for a bad config.
  static Result<std::unique_ptr<Server>> start(ServerConfig config, ModelInfo model, std::unique_ptr<engine::EngineClient> engine,
                                               std::shared_ptr<const recipe::Tokenizer> tokenizer);
  ~Server();  // shutdown(false) and wait()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  uint16_t port() const;  // the bound port
  // Stops accepting connections and requests (new ones get 503); when `drain`, lets in-flight requests
  // finish, else cancels them; then stops. Thread-safe; returns at once.
  void shutdown(bool drain = true);
  // Blocks until the server has stopped (after shutdown() or a signal).
  void wait();

  struct Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace deepinfer::server
