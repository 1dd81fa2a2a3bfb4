// `deepinfer router`: a KV-aware gateway in front of `deepinfer serve` workers (DESIGN.md, "Disaggregation and
// routing"). It answers the same OpenAI and Anthropic endpoints as a worker and forwards each request, bytes
// unchanged, to the worker a policy picks (policy.h), streaming the answer back as it comes.
//
// What it knows of the workers:
//   - GET /worker/info of each worker (model, chat format, block size, model fingerprint, KV-event endpoints),
//     fetched by the health checker until it succeeds;
//   - GET /health every health_check_interval_ms; a worker that fails it, or a connection to it, takes no new
//     requests until it passes again;
//   - the workers' KV events (ZeroMQ, vLLM's schema; kv_index.h): what each caches, per tier, replayed from
//     the worker's replay endpoint when the router starts late or misses a batch;
//   - its own count of each worker's requests in flight and their prompt tokens.
// For the kv-aware policy the router renders and tokenizes each prompt exactly as the workers do (the server's
// dialect code with the workers' chat format and the tokenizer under tokenizer_path), hashes its blocks with
// each worker's fingerprint and asks the index.
//
// Retries: a request goes to another worker (at most max_retries times) when its worker cannot be reached,
// answers 429 or 5xx, or ends the connection before the response's header — never once a byte of the
// response went to the client. A stream that breaks after that ends with an error event in the request's
// dialect.
//
// Routes: POST /v1/chat/completions, /v1/completions, /v1/messages, /v1/responses (routed by the policy);
// POST /v1/messages/count_tokens, /tokenize, /detokenize and GET /v1/models[/id] (to the least-loaded healthy
// worker); GET /health (200 while a worker is healthy, else 503) and GET /metrics (the router's, below) answered
// by the router itself. Authentication headers are forwarded; the workers check them.
//
// Metrics (Prometheus text, prefix deepinfer_router_):
//   requests_total{worker,reason}      counter    requests sent to a worker, by the policy's reason (policy.h) or
//                                                 "retry"
//   request_errors_total{reason}       counter    requests the router ended: no_worker, worker_error (after
//                                                 retries), stream_broken, client_disconnect
//   retries_total                      counter    attempts after a worker failed
//   time_to_first_token_seconds        histogram  streaming requests: arrival -> first body byte from the worker
//   e2e_request_latency_seconds        histogram  arrival -> response end
//   worker_healthy{worker}             gauge      1 when the last health check passed
//   worker_in_flight{worker}           gauge      requests in flight
//   worker_prompt_tokens_total{worker} counter    prompt tokens routed there (tokenized requests)
//   worker_predicted_cached_tokens_total{worker}  counter  of those, held by the worker per the index (its hit
//                                                 rate as the router predicts it; the worker's own
//                                                 deepinfer_prompt_tokens_cached_total is what it got)
//   worker_kv_blocks{worker}           gauge      blocks the index holds for the worker (any tier)
//   kv_events_total{worker}            counter    KV event batches applied
//   kv_event_gaps_total{worker}        counter    sequence gaps (replayed, or the worker's entries dropped)
//
// Thread-safety: start() returns a running router; shutdown() and wait() may be called from any thread.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/router/policy.h"

namespace deepinfer::router {

struct RouterConfig {
  std::string host = "127.0.0.1";
  uint16_t port = 8080;  // 0: an ephemeral port (Router::port())
  // Base URLs of the workers, http://HOST:PORT (no path). At least one. With prefill_workers, these are the
  // decode workers (--decode; `deepinfer serve --role decode`).
  std::vector<std::string> workers;
  // Prefill/decode disaggregation (--prefill; `deepinfer serve --role prefill`): each request goes to a decode
  // worker (the policy over `workers`) with the header X-KV-Prefill-Endpoint naming a prefill worker (the policy
  // over these: the one with most of the prompt cached) whose KV transfer port (its /worker/info) the decode
  // worker fetches the prompt's blocks from. A prompt whose uncached part on the chosen decode worker is at most
  // max_local_prefill_tokens (kv-aware only: the index knows it) is prefilled there, with no transfer.
  std::vector<std::string> prefill_workers;
  int64_t max_local_prefill_tokens = 512;
  Policy policy = Policy::kKvAware;
  CostWeights weights;
  // tokenizer.json, or a directory holding it (the workers' checkpoint). Required by kv-aware; optional
  // otherwise (consistent-hash then decodes token-id prompts to text with it).
  std::filesystem::path tokenizer_path;
  // consistent-hash: characters of system + user text in the key (the seed's gateway: 2,048).
  int64_t affinity_chars = kSeedAffinityChars;
  int32_t health_check_interval_ms = 1000;
  int32_t health_check_timeout_ms = 1000;
  int32_t connect_timeout_ms = 2000;
  // A worker must send its response header within this (a long prefill counts) ...
  int32_t first_byte_timeout_ms = 600'000;
  // ... and then some bytes at least this often (a stream's tokens).
  int32_t stream_idle_timeout_ms = 600'000;
  int32_t max_retries = 2;
  int64_t max_body_bytes = 16ll << 20;
  int64_t max_header_bytes = 64 * 1024;
  int32_t http_threads = 2;
  int32_t idle_timeout_seconds = 60;  // a keep-alive client connection idle this long is closed
  // SIGINT/SIGTERM: stop accepting, let in-flight requests finish (shutdown_timeout_seconds at most), stop.
  bool handle_signals = false;
  int32_t shutdown_timeout_seconds = 30;
};

class Router {
 public:
  // Binds host:port, starts the HTTP threads, the health checker and the KV-event subscriber; returns at once.
  // Errors: InvalidArgument for a bad config (no worker, a worker URL that is not http://HOST:PORT, kv-aware
  // without a tokenizer), NotFound / Corruption for the tokenizer, IoError when the address cannot be bound.
  static Result<std::unique_ptr<Router>> start(RouterConfig config);
  ~Router();  // shutdown(false), wait()
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  uint16_t port() const;
  void shutdown(bool drain = true);
  void wait();

  struct Impl;

 private:
  explicit Router(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// http://HOST:PORT (HOST a name, an IPv4 address or [IPv6]) -> host, port. Errors: InvalidArgument naming the URL.
struct WorkerAddress {
  std::string host;  // without brackets
  uint16_t port = 0;
};
Result<WorkerAddress> parse_worker_url(std::string_view url);

// A worker's ZeroMQ endpoint as seen from the router: tcp://*:P, tcp://0.0.0.0:P and tcp://[::]:P become
// tcp://HOST:P with the worker's host; anything else is returned unchanged.
std::string reachable_endpoint(std::string_view endpoint, std::string_view worker_host);

}  // namespace deepinfer::router
