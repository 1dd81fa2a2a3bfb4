// deepinfer serve [--model-path DIR] [--host H] [--port P] ...: the OpenAI- and Anthropic-compatible server on
// the CPU backend. With no --model-path it serves the built-in demo model (models/demo, which scripts/setup.sh
// unpacks from assets/demo-model). SIGINT/SIGTERM drain in-flight requests, then exit 0.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "commands.h"
#include "backend_choice.h"
#include "speculative_flags.h"
#include "data_parallel_group.h"
#include "tensor_parallel_group.h"
#include "deepinfer/engine/checkpoint_fingerprint.h"
#include "deepinfer/engine/engine.h"
#include "deepinfer/model/config.h"
#include "deepinfer/recipe/tokenizer.h"
#include "deepinfer/server/server.h"

namespace deepinfer::apps {
namespace {

constexpr int64_t kDefaultModelMaxTokens = 256;

// Where the built-in demo model lives (scripts/setup.sh unpacks it into <repo>/models/demo and demo-fp8),
// whatever the working directory: beside the binary's repository (build/apps/deepinfer), else the source
// tree this binary was built from, else ./models/demo.
std::vector<std::filesystem::path> builtin_model_dirs() {
  namespace fs = std::filesystem;
  std::vector<fs::path> roots;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) roots.push_back(exe.parent_path().parent_path().parent_path());
  roots.emplace_back(DEEPINFER_SOURCE_DIR);
  roots.push_back(fs::current_path(ec));
  std::vector<fs::path> dirs;
  for (const fs::path& root : roots) {
    for (const char* name : {"models/demo", "models/demo-fp8"}) {
      if (fs::exists(root / name / "config.json", ec)) dirs.push_back(fs::weakly_canonical(root / name, ec));
    }
  }
  return dirs;
}

// "1073741824", "2GiB", "512MiB", "1.5G" (binary units) or "2GB" (decimal) -> bytes.
std::optional<int64_t> parse_bytes(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  double value = 0;
  const char* first = text.data();
  const char* last = text.data() + text.size();
  auto [end, ec] = std::from_chars(first, last, value);
  if (ec != std::errc() || value < 0) return std::nullopt;
  const std::string_view unit(end, static_cast<size_t>(last - end));
  static const std::pair<std::string_view, double> kUnits[] = {
      {"", 1},         {"b", 1},       {"k", 0x1p10},   {"ki", 0x1p10}, {"kib", 0x1p10}, {"kb", 1e3},
      {"m", 0x1p20},   {"mi", 0x1p20}, {"mib", 0x1p20}, {"mb", 1e6},    {"g", 0x1p30},   {"gi", 0x1p30},
      {"gib", 0x1p30}, {"gb", 1e9},    {"t", 0x1p40},   {"ti", 0x1p40}, {"tib", 0x1p40}, {"tb", 1e12}};
  for (const auto& [name, scale] : kUnits) {
    if (unit == name) return static_cast<int64_t>(value * scale);
  }
  return std::nullopt;
}

std::string directory_name(const std::filesystem::path& path) {
  std::filesystem::path p = path;
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().string();
}

}  // namespace

std::function<int()> add_serve_command(CLI::App& app) {
  struct Options {
    std::optional<std::string> model_path;
    std::optional<std::string> positional_model;  // `deepinfer serve DIR`, as `vllm serve MODEL`
    std::optional<std::string> tokenizer;
    std::string host = "127.0.0.1";
    uint16_t port = 8000;
    std::string served_model_name;
    int64_t max_model_len = 0;
    int32_t max_num_seqs = 64;
    int32_t max_num_batched_tokens = 2048;
    std::string kv_cache_memory = "1GiB";
    std::string kv_host_cache_memory;  // empty: none, or 1GiB when a disk tier is set
    std::string tiered_kv_storage_path;
    std::string kv_disk_cache_size = "16GiB";
    double kv_cache_ttl_hours = 168.0;
    std::string kv_host_evict_rate = "unlimited";
    int32_t tensor_parallel_size = 1;
    std::string master_addr = "127.0.0.1";
    int32_t master_port = 0;
    int32_t internal_tp_rank = 0;  // > 0: this process is that rank of rank 0's group (started by rank 0)
    int32_t internal_dp_master_port = 0;  // with internal_tp_rank and data parallel: the data-parallel store's port
    int32_t data_parallel_size = 1, data_parallel_rank = 0;
    // The seed's cluster flags (its launch scripts run as written: each is honoured, or refused at startup naming
    // what this build lacks).
    std::string role = "both";
    int32_t pipeline_parallel_size = 1, expert_parallel_size = 1, cluster_nodes = 1, node_rank = 0;
    int32_t num_redundant_experts = 0;
    double moe_capacity_factor = 0.0;
    bool enable_eplb = false;
    int64_t eplb_rebalance_num_iterations = 1000;
    std::string eplb_policy = "global";
    std::optional<double> gpu_memory_utilization;
    std::optional<std::string> kv_transfer_protocol, rdma_device_names;
    std::optional<int64_t> kv_transfer_timeout_ms, kv_transfer_deadline_ms;
    std::optional<int32_t> kv_transfer_port;
    std::optional<int32_t> kv_transfer_max_connections;
    bool swa_bounded_replay = false;
    std::optional<std::string> chat_format;
    std::optional<std::string> chat_format_revision;
    std::string api_key;
    std::string max_body_bytes = "16MiB";
    int32_t max_concurrent_requests = 256;
    int32_t max_json_depth = 64;
    std::optional<int64_t> default_max_tokens;
    int32_t http_threads = 2;
    DeviceOptions device;
    bool no_prefix_caching = false;
    int64_t tokenization_cache_mb = 64;
    std::string max_header_bytes = "64KiB";
    int32_t max_connections = 1024;
    int32_t max_connections_per_ip = 0;
    int32_t idle_timeout_s = 60;
    int32_t body_read_timeout_s = 60;
    int32_t shutdown_timeout_s = 30;
    std::optional<int32_t> health_max_step_seconds;  // default: 20 in a tensor- or data-parallel group, else 0
    bool metrics_require_api_key = false;
    std::vector<std::string> allowed_origins;
    bool kv_disk_reset = false;
    std::string kv_events_endpoint;
    std::string kv_events_replay_endpoint;
    SpeculativeOptions speculative;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("serve", "Serve a DeepSeek checkpoint with OpenAI- and Anthropic-compatible APIs");
  cmd->add_option("model", options->positional_model, "Checkpoint directory, as a positional argument (same as --model-path)");
  cmd->add_option("--model-path,--model", options->model_path,
                  "Checkpoint directory (config.json, *.safetensors, tokenizer.json); default: models/demo, "
                  "the built-in default model");
  cmd->add_option("--tokenizer", options->tokenizer, "Directory or file with tokenizer.json (default: the model's)");
  cmd->add_option("--host", options->host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", options->port, "Port to listen on (0: any free port)")->capture_default_str();
  cmd->add_option("--served-model-name", options->served_model_name,
                  "The model id clients use (default: the model directory's name)");
  cmd->add_option("--max-model-len", options->max_model_len,
                  "Prompt plus generated tokens per request (default: the model's max_position_embeddings, lowered "
                  "to what the KV cache holds)")
      ->transform(at_least(2, INT64_MAX));
  cmd->add_option("--max-num-seqs", options->max_num_seqs, "Sequences running at once")
      ->capture_default_str()
      ->transform(at_least(1));
  cmd->add_option("--max-num-batched-tokens", options->max_num_batched_tokens, "Tokens computed per engine step")
      ->capture_default_str()
      ->transform(at_least(1));
  CLI::Option* kv_cache_memory_option =
      cmd->add_option("--kv-cache-memory", options->kv_cache_memory, "Memory for the KV cache: bytes, or e.g. 2GiB, 512MiB")
          ->capture_default_str();
  cmd->add_option("--tensor-parallel-size", options->tensor_parallel_size,
                  "Processes (devices) per model: attention heads, MLP/expert intermediate and vocabulary split "
                  "across them, one process each, started and supervised by this one (CPU: Gloo over TCP; "
                  "--device cuda: rank r on its host's GPU r, NCCL)")
      ->capture_default_str();
  cmd->add_option("--master-addr,--data-parallel-address", options->master_addr,
                  "Address of rank 0's rendezvous store and this host's collectives (tensor and data parallel)")
      ->capture_default_str()
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->add_option("--master-port,--data-parallel-rpc-port", options->master_port,
                  "Port of rank 0's rendezvous store (tensor and data parallel; 0: any free port, tensor parallel on "
                  "one host only)")
      ->capture_default_str()
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->add_option("--data-parallel-size", options->data_parallel_size,
                  "Attention data-parallel ranks, each a server of its own started by you with --data-parallel-rank "
                  "(its scheduler, KV cache and port; `deepinfer router` in front): the routed experts spread over "
                  "them (--expert-parallel-size equal to it), each MoE layer's tokens exchanged all-to-all, the "
                  "ranks' passes in lock step (CPU: Gloo; CUDA: one GPU per rank, rank r on GPU r of those it sees, "
                  "NCCL; rank 0 serves the rendezvous at --master-addr:--master-port)")
      ->capture_default_str()
      ->transform(at_least(1));
  cmd->add_option("--data-parallel-rank", options->data_parallel_rank,
                  "This server's rank, 0 to --data-parallel-size - 1")
      ->capture_default_str();
  cmd->add_option("--internal-tp-rank", options->internal_tp_rank)
      ->group("")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->add_option("--internal-dp-master-port", options->internal_dp_master_port)
      ->group("")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->add_option("--pipeline-parallel-size", options->pipeline_parallel_size,
                  "Pipeline stages per model (only 1 in this build)")
      ->capture_default_str();
  cmd->add_option("--expert-parallel-size", options->expert_parallel_size,
                  "Ranks the routed experts are spread over: equal to --tensor-parallel-size (each tensor-parallel "
                  "rank holds whole experts, E / size of them, instead of a slice of every expert's intermediate) or "
                  "to --data-parallel-size (the experts over the data-parallel ranks, tokens exchanged all-to-all)")
      ->capture_default_str();
  cmd->add_option("--num-redundant-experts", options->num_redundant_experts,
                  "Extra expert slots for replicas of hot experts (expert parallel; placed by EPLB)")
      ->capture_default_str();
  cmd->add_option("--moe-capacity-factor", options->moe_capacity_factor,
                  "Cap per expert slot per pass: factor x tokens x top_k / slots (token, expert) pairs; the surplus "
                  "keeps its residual path for that expert (changes outputs; 0: no cap; expert parallel)")
      ->capture_default_str();
  cmd->add_flag("--enable-eplb", options->enable_eplb,
                "Expert load balancing: count each expert's tokens and move experts between ranks (DeepSeek's EPLB) "
                "every --eplb-rebalance-num-iterations steps, requests continuing");
  cmd->add_option("--eplb-rebalance-num-iterations", options->eplb_rebalance_num_iterations,
                  "Forward passes between two rebalances")
      ->capture_default_str()
      ->transform(at_least(1, INT64_MAX));
  cmd->add_option("--eplb-policy", options->eplb_policy,
                  "global: replicate and pack over all ranks; hierarchical: expert groups (n_group) to nodes first")
      ->check(CLI::IsMember({"global", "hierarchical"}))
      ->capture_default_str();
  cmd->add_option("--nnodes,--cluster-nodes", options->cluster_nodes,
                  "Hosts one model spans (tensor parallel): --tensor-parallel-size / N ranks on each; start the same "
                  "command on every host with its --node-rank and the same explicit --master-addr/--master-port")
      ->capture_default_str();
  cmd->add_option("--node-rank", options->node_rank,
                  "This host's index among --nnodes (0: rank 0, the one that serves HTTP)")
      ->capture_default_str();
  cmd->add_option("--role", options->role,
                  "both: prefill and decode in this server; prefill: serves decode workers' KV transfers (on "
                  "--kv-transfer-port); decode: takes a request's prompt KV from the prefill worker its "
                  "X-KV-Prefill-Endpoint header names (what `deepinfer router --prefill URL --decode URL` sends)")
      ->check(CLI::IsMember({"both", "prefill", "decode"}))
      ->capture_default_str();
  cmd->add_option("--kv-transfer-protocol", options->kv_transfer_protocol,
                  "tcp | ucx | rdma: how a prefill worker ships KV blocks to a decode worker (with --role prefill / "
                  "decode only; both sides alike). ucx: UCX picks shared memory, TCP or RDMA; rdma: RDMA "
                  "transports only (refused at startup without an RDMA device); default tcp");
  cmd->add_option("--rdma-device-names", options->rdma_device_names,
                  "RDMA NICs for the KV transfer, UCX_NET_DEVICES' form, e.g. mlx5_0:1,mlx5_1:1 (with "
                  "--kv-transfer-protocol rdma only)");
  cmd->add_option("--kv-transfer-timeout-ms", options->kv_transfer_timeout_ms,
                  "How long either side of a KV transfer waits (to connect, for each block, for the completion "
                  "record) before it gives up: the decode worker then computes the prompt itself (with --role "
                  "prefill / decode only; default 30000)");
  cmd->add_option("--kv-transfer-deadline-ms", options->kv_transfer_deadline_ms,
                  "--role decode: how long a whole KV transfer may take, connecting to the last block checked (a "
                  "prefill worker that trickles blocks just inside --kv-transfer-timeout-ms is cut off there; the "
                  "decode worker then computes the prompt itself; default 120000)");
  cmd->add_option("--kv-transfer-port", options->kv_transfer_port,
                  "--role prefill: the TCP port decode workers fetch KV blocks from, on --host (default 8998; 0: an "
                  "ephemeral port, shown in GET /worker/info)");
  cmd->add_option("--kv-transfer-max-connections", options->kv_transfer_max_connections,
                  "--role prefill: KV transfers served at once; more are answered with an error (the decode worker "
                  "then prefills itself) (default 256)");
  cmd->add_option("--gpu-memory-utilization", options->gpu_memory_utilization,
                  "Fraction of the GPU's memory this server may fill (weights, activations and KV cache), as vLLM's: "
                  "the KV cache gets what the fraction leaves after the weights and a step's workspace (--device cuda "
                  "only; instead of --kv-cache-memory)");
  cmd->add_flag("--swa-bounded-replay,!--no-swa-bounded-replay", options->swa_bounded_replay,
                "DeepSeek-V4 (default on): reuse a cached prefix whose last window's raw rows are gone (evicted, or "
                "from the host/disk tier) by replaying only its last sliding_window tokens, an approximation; "
                "--no-swa-bounded-replay reuses it up to where the rows are still cached (exact). Refused for models "
                "without sliding-window layers, and with --no-prefix-caching");
  cmd->add_option("--chat-format", options->chat_format,
                  "Prompt format: deepseek-v3, deepseek-r1, deepseek-v3.1, deepseek-v3.2, deepseek-v4, deepseek-v4.1 "
                  "(default: the checkpoint's config.json chat_format, else its encoding/encoding_dsv*.py, else its "
                  "model_type)");
  cmd->add_option("--chat-format-revision", options->chat_format_revision,
                  "deepseek-v4 only: 0731 (the released V4-Flash/V4-Pro effort preambles) or preview (default: what "
                  "the checkpoint's encoding/encoding_dsv4.py says, else 0731)");
  cmd->add_option("--api-key", options->api_key, "Require this key (Authorization: Bearer KEY or x-api-key: KEY)")
      ->envname("DEEPINFER_API_KEY");
  cmd->add_option("--max-body-bytes", options->max_body_bytes, "Largest request body (bytes, or e.g. 16MiB)")
      ->capture_default_str();
  cmd->add_option("--max-concurrent-requests", options->max_concurrent_requests,
                  "Generation requests in flight; more get 429 with Retry-After")
      ->capture_default_str()
      ->transform(at_least(1));
  cmd->add_option("--max-json-depth", options->max_json_depth, "Deepest JSON nesting a request may use")
      ->capture_default_str()
      ->transform(at_least(2, 100000));
  cmd->add_option("--default-max-tokens", options->default_max_tokens,
                  "max_tokens for chat and responses requests that give none (Anthropic requires it); 0: until max-model-len "
                  "(default: 0, or 256 for the built-in default model)");
  cmd->add_option("--http-threads", options->http_threads, "Threads serving HTTP")
      ->capture_default_str()
      ->transform(at_least(1, 256));
  add_device_flags(cmd, options->device);
  cmd->add_option("--kv-host-cache-memory", options->kv_host_cache_memory,
                  "Host-RAM tier of the prefix cache below the device (e.g. 8GiB; default none, or 1GiB with "
                  "--tiered-kv-storage-path). Completed blocks are written through to it and loaded back instead of "
                  "recomputed");
  cmd->add_option("--tiered-kv-storage-path", options->tiered_kv_storage_path,
                  "Directory of the durable disk tier (below host; implies a 1GiB host tier unless "
                  "--kv-host-cache-memory is set). Blocks survive restarts and crashes; corrupt ones are dropped; a "
                  "directory of another model is refused (see --kv-disk-reset)")
      ->check(
          [](const std::string& value) { return value.empty() ? std::string("must not be empty") : std::string(); });
  cmd->add_option("--kv-disk-cache-size", options->kv_disk_cache_size, "Capacity of the disk tier")
      ->capture_default_str();
  cmd->add_option("--kv-cache-ttl-hours", options->kv_cache_ttl_hours,
                  "TTL of the default retention class on the host and disk tiers (a disk block keeps its expiry across "
                  "restarts; classes chat: 7 days, agent: 3 days; a request picks one with the X-KV-Cache-Class header)")
      ->capture_default_str();
  cmd->add_option("--kv-host-evict-rate", options->kv_host_evict_rate,
                  "Bytes per second the host tier's background eviction may drop (e.g. 1GiB; unlimited)")
      ->capture_default_str();
  cmd->add_flag("--no-prefix-caching", options->no_prefix_caching,
                "Turn off automatic prefix caching (reuse of cached KV blocks of shared prompt prefixes)");
  cmd->add_option("--tokenization-cache-mb", options->tokenization_cache_mb,
                  "MiB for token ids of prompt text already seen (a growing conversation re-tokenizes only its new "
                  "turns); 0: off")
      ->capture_default_str()
      ->transform(at_least(0, int64_t{1} << 20));

  cmd->add_option("--max-header-bytes", options->max_header_bytes,
                  "Largest request line + header fields, and apart from them all trailer fields (431 beyond)")
      ->capture_default_str();
  cmd->add_option("--max-connections", options->max_connections,
                  "Open connections at once (more are answered 503 and closed); lowered to the file-descriptor "
                  "limit less 64")
      ->capture_default_str()
      ->transform(at_least(1));
  cmd->add_option("--max-connections-per-ip", options->max_connections_per_ip,
                  "Open connections one client address may hold (0: half of --max-connections; raise it behind a "
                  "gateway)")
      ->capture_default_str()
      ->transform(at_least(0));
  cmd->add_option("--idle-timeout-s", options->idle_timeout_s,
                  "Seconds a connection may wait for (or send) its next request's header")
      ->capture_default_str()
      ->transform(at_least(1, 86400));
  cmd->add_option("--body-read-timeout-s", options->body_read_timeout_s,
                  "Seconds a request body may take to arrive after its header")
      ->capture_default_str()
      ->transform(at_least(1, 86400));
  cmd->add_option("--shutdown-timeout-s", options->shutdown_timeout_s,
                  "On SIGTERM: seconds in-flight requests may take to finish; then streams end with an error "
                  "event and the server exits")
      ->capture_default_str()
      ->transform(at_least(0, 86400));
  cmd->add_option("--health-max-step-seconds", options->health_max_step_seconds,
                  "GET /health answers 503 while the engine has been in one step (or waiting on its data-parallel "
                  "peers) for longer than this: a hung peer takes the server out of the router's rotation; 0: off "
                  "(default: 20 with --tensor-parallel-size or --data-parallel-size > 1, else 0)")
      ->transform(at_least(0, 86400));
  cmd->add_option("--allowed-origins", options->allowed_origins,
                  "CORS: browser origins allowed to call the API, repeated or comma-separated (e.g. "
                  "https://a.example,https://b.example, or *); default none")
      ->delimiter(',');
  cmd->add_flag("--metrics-require-api-key", options->metrics_require_api_key,
                "Serve /metrics only with the API key (--api-key); /health stays open");
  cmd->add_flag("--kv-disk-reset", options->kv_disk_reset,
                "Delete the disk tier's blocks of another model instead of refusing to start on its directory");

  cmd->add_option("--kv-events-endpoint", options->kv_events_endpoint,
                  "Publish KV cache events (vLLM's schema: BlockStored / BlockRemoved / AllBlocksCleared, msgpack over "
                  "ZeroMQ PUB) on this ZeroMQ endpoint (tcp://HOST:PORT, e.g. tcp://*:5557, or ipc://PATH) for KV-aware "
                  "routers; off by default");
  cmd->add_option("--kv-events-replay-endpoint", options->kv_events_replay_endpoint,
                  "ZeroMQ ROUTER endpoint answering replay requests from a sequence number, e.g. tcp://*:5558 "
                  "(needs --kv-events-endpoint)");
  add_speculative_flags(cmd, options->speculative);

  return [options, kv_cache_memory_option, cmd]() -> int {
    const bool cmd_kv_cache_memory_given = kv_cache_memory_option->count() > 0;
    // The seed's flags as typed (CLI11 turns an empty value into "unset" or 0, which would accept and ignore it).
    auto typed = [cmd](const char* flag) -> std::optional<std::string> {
      const CLI::Option* option = cmd->get_option(flag);
      if (option->count() == 0 || option->results().empty()) return std::nullopt;
      return option->results().back();
    };
    namespace fs = std::filesystem;
    auto fail = [](const std::string& message) {
      std::cerr << "deepinfer serve: " << message << "\n";
      return 1;
    };
    for (const char* flag : {"--role", "--pipeline-parallel-size", "--expert-parallel-size", "--nnodes", "--node-rank",
                             "--tensor-parallel-size", "--kv-transfer-protocol", "--rdma-device-names",
                             "--kv-transfer-timeout-ms", "--kv-transfer-deadline-ms", "--gpu-memory-utilization",
                             "--kv-transfer-port",
                             "--kv-transfer-max-connections"}) {
      if (std::optional<std::string> value = typed(flag); value && value->empty()) {
        const std::string name = std::string_view(flag) == "--nnodes" ? "--nnodes/--cluster-nodes" : flag;
        return fail(name + " needs a value (it was given as an empty string)");
      }
    }
    const bool disaggregated = options->role == "prefill" || options->role == "decode";
    server::keep_freed_kv_blocks_in_the_heap();  // KV blocks in transfers and tier moves reuse freed memory
    if (options->kv_transfer_protocol) {
      if (*options->kv_transfer_protocol != "tcp" && *options->kv_transfer_protocol != "ucx" &&
          *options->kv_transfer_protocol != "rdma") {
        return fail("--kv-transfer-protocol " + *options->kv_transfer_protocol + ": one of tcp, ucx, rdma");
      }
      if (!disaggregated) return fail("--kv-transfer-protocol applies to --role prefill / decode");
    }
    if (options->rdma_device_names && options->kv_transfer_protocol.value_or("tcp") != "rdma")
      return fail("--rdma-device-names applies to --kv-transfer-protocol rdma");
    if (options->kv_transfer_timeout_ms) {
      if (!disaggregated) return fail("--kv-transfer-timeout-ms applies to --role prefill / decode");
      if (*options->kv_transfer_timeout_ms < 1) return fail("--kv-transfer-timeout-ms must be at least 1");
    }
    if (options->kv_transfer_deadline_ms) {
      if (options->role != "decode") return fail("--kv-transfer-deadline-ms applies to --role decode");
      if (*options->kv_transfer_deadline_ms < 1) return fail("--kv-transfer-deadline-ms must be at least 1");
    }
    if (options->kv_transfer_port) {
      if (options->role != "prefill") return fail("--kv-transfer-port applies to --role prefill");
      if (*options->kv_transfer_port < 0 || *options->kv_transfer_port > 65535) {
        return fail("--kv-transfer-port " + std::to_string(*options->kv_transfer_port) + ": a port, 0 to 65535");
      }
    }
    if (options->kv_transfer_max_connections) {
      if (options->role != "prefill") return fail("--kv-transfer-max-connections applies to --role prefill");
      if (*options->kv_transfer_max_connections < 1) return fail("--kv-transfer-max-connections must be at least 1");
    }
    if (options->role == "decode" && options->no_prefix_caching) {
      return fail("--role decode needs the prefix cache: the KV blocks a prefill worker sends become cached blocks "
                  "the request then reuses (drop --no-prefix-caching)");
    }
    if (options->tensor_parallel_size < 1) {
      return fail("--tensor-parallel-size " + typed("--tensor-parallel-size").value_or("?") + ": must be at least 1");
    }
    const bool data_parallel = options->data_parallel_size > 1;
    if (data_parallel || options->data_parallel_rank != 0) {
      // Attention data parallel: the experts over the data-parallel ranks, one process each, started by the user.
      const std::string dp = "--data-parallel-size " + std::to_string(options->data_parallel_size);
      if (options->data_parallel_rank < 0 || options->data_parallel_rank >= options->data_parallel_size) {
        return fail("--data-parallel-rank " + std::to_string(options->data_parallel_rank) + ": a rank, 0 to " +
                    dp + " - 1");
      }
      if (options->expert_parallel_size != options->data_parallel_size) {
        return fail(dp + " with --expert-parallel-size " + std::to_string(options->expert_parallel_size) +
                    ": the data-parallel ranks hold the routed experts between them (give both the same size)");
      }
      if (options->cluster_nodes > 1) {
        return fail(dp + " with --nnodes > 1: a data-parallel rank's tensor-parallel ranks run on its own host in "
                    "this build (start each rank where it runs, with --master-addr pointing at rank 0's host)");
      }
      if (typed("--master-port").value_or("0") == "0") {
        return fail(dp + " needs an explicit --master-port (and --master-addr): every rank meets rank 0's store "
                    "there");
      }
      if (options->master_port < 1 || options->master_port > 65535 || options->master_port == options->port) {
        return fail("--master-port " + std::to_string(options->master_port) + ": a port, 1 to 65535, not --port");
      }
      if (options->device.device == "cuda") {
        return fail(dp + " with --device cuda: expert parallel across data-parallel ranks runs on the CPU in this "
                    "build (the CUDA MoE kernels do not take given routing yet); --device cpu");
      }
    } else if (options->expert_parallel_size > 1 && options->expert_parallel_size != options->tensor_parallel_size) {
      return fail("--expert-parallel-size " + typed("--expert-parallel-size").value_or("?") + " with " +
                  "--tensor-parallel-size " + std::to_string(options->tensor_parallel_size) +
                  ": the experts spread over the tensor-parallel ranks (give both the same size) or over the "
                  "attention data-parallel ranks (--data-parallel-size, the same size)");
    }
    if (options->num_redundant_experts < 0) return fail("--num-redundant-experts must be at least 0");
    for (const char* flag : {"--eplb-rebalance-num-iterations", "--eplb-policy"}) {
      if (typed(flag) && !options->enable_eplb) return fail(std::string(flag) + " applies with --enable-eplb");
    }
    if (!(options->moe_capacity_factor >= 0.0)) return fail("--moe-capacity-factor must be at least 0");
    if ((options->num_redundant_experts > 0 || options->enable_eplb || options->moe_capacity_factor > 0.0) &&
        options->expert_parallel_size < 2) {
      return fail(std::string(options->enable_eplb               ? "--enable-eplb"
                              : options->moe_capacity_factor > 0.0 ? "--moe-capacity-factor"
                                                                   : "--num-redundant-experts") +
                  " needs expert parallel (--expert-parallel-size and --tensor-parallel-size or "
                  "--data-parallel-size 2 or more)");
    }
    const std::pair<const char*, int32_t> parallel_sizes[] = {{"--pipeline-parallel-size", options->pipeline_parallel_size},
                                                             {"--expert-parallel-size", options->expert_parallel_size},
                                                             {"--nnodes", options->cluster_nodes}};
    for (const auto& [flag, size] : parallel_sizes) {
      const std::string as_typed = typed(flag).value_or(std::to_string(size));
      if (size < 1) return fail(std::string(flag) + " " + as_typed + ": must be at least 1");
      if (std::string_view(flag) != "--pipeline-parallel-size") continue;  // checked elsewhere
      if (size != 1) {
        return fail(std::string(flag) + " " + as_typed +
                    ": this build splits a model over devices by tensor and expert parallel (--tensor-parallel-size, "
                    "--expert-parallel-size); pipeline parallelism is not in it yet; only 1 is supported");
      }
    }
    if (options->tensor_parallel_size > 1) {
      if (options->internal_tp_rank >= options->tensor_parallel_size) {
        return fail("--internal-tp-rank " + std::to_string(options->internal_tp_rank) + " outside the group");
      }
      if (options->master_port < 0 || options->master_port > 65535) {
        return fail("--master-port " + std::to_string(options->master_port) + ": a port, 0 to 65535");
      }
      if (options->master_port != 0 && options->master_port == options->port) {
        return fail("--master-port " + std::to_string(options->master_port) + " is also --port: rank 0's rendezvous "
                    "store and the HTTP server need a port each");
      }
      if (options->master_port != 0 && options->kv_transfer_port && options->master_port == *options->kv_transfer_port) {
        return fail("--master-port " + std::to_string(options->master_port) + " is also --kv-transfer-port: rank 0's "
                    "rendezvous store and the KV transfer listener need a port each");
      }
    }
    if ((options->tensor_parallel_size > 1 || data_parallel) &&
        (options->master_addr == "0.0.0.0" || options->master_addr == "::" || options->master_addr.empty())) {
      return fail("--master-addr '" + options->master_addr + "': the ranks connect to it and listen on it, so it "
                  "must be this host's address (e.g. 127.0.0.1 on one host, or its LAN address), not a wildcard");
    }
    // Hosts: --nnodes (the seed's --cluster-nodes) splits the tensor-parallel ranks evenly over them.
    const std::string nnodes_flag = "--nnodes/--cluster-nodes";
    if (options->cluster_nodes > 1) {
      if (options->tensor_parallel_size % options->cluster_nodes != 0) {
        return fail(nnodes_flag + " " + std::to_string(options->cluster_nodes) + ": the hosts hold the " +
                    "--tensor-parallel-size " + std::to_string(options->tensor_parallel_size) +
                    " ranks evenly, so it must divide it");
      }
      if (options->master_port == 0) {
        return fail(nnodes_flag + " " + std::to_string(options->cluster_nodes) +
                    " needs an explicit --master-port (and --master-addr): every host joins rank 0's store there");
      }
    }
    if (options->node_rank < 0 || options->node_rank >= options->cluster_nodes) {
      return fail("--node-rank " + std::to_string(options->node_rank) + ": a host index, 0 to " + nnodes_flag +
                  " - 1 (" + std::to_string(options->cluster_nodes - 1) + ")");
    }
    if (options->internal_tp_rank < 0) return fail("--internal-tp-rank must be at least 0");
    if (options->internal_tp_rank != 0 && options->tensor_parallel_size == 1) {
      return fail("--internal-tp-rank is for the ranks rank 0 starts (with --tensor-parallel-size)");
    }
    if (options->gpu_memory_utilization &&
        !(*options->gpu_memory_utilization > 0.0 && *options->gpu_memory_utilization <= 1.0)) {
      return fail("--gpu-memory-utilization " + typed("--gpu-memory-utilization").value_or("?") +
                  ": a fraction in (0, 1]");
    }
    if (options->gpu_memory_utilization && cmd_kv_cache_memory_given) {
      return fail("--gpu-memory-utilization and --kv-cache-memory both size the KV cache: give one");
    }
    if (options->positional_model) {
      if (options->model_path && *options->model_path != *options->positional_model) {
        return fail("two models given: " + *options->positional_model + " and --model-path " + *options->model_path);
      }
      options->model_path = options->positional_model;
    }
    const bool default_model = !options->model_path.has_value();
    const std::vector<fs::path> builtin_dirs = builtin_model_dirs();
    const fs::path model_path = options->model_path ? fs::path(*options->model_path)
                                : builtin_dirs.empty() ? fs::path("models/demo")
                                                       : builtin_dirs.front();
    if (!fs::exists(model_path / "config.json")) {
      if (default_model) {
        return fail("no built-in model at <repository>/models/demo or " + fs::absolute(model_path).string() +
                    ": run `make setup` (scripts/setup.sh unpacks the built-in demo model from assets/demo-model), or pass "
                    "--model-path DIR");
      }
      return fail("--model-path " + model_path.string() +
                  ": no config.json there (a local checkpoint directory is needed; nothing is downloaded)");
    }
    std::optional<int64_t> kv_bytes = parse_bytes(options->kv_cache_memory);
    if (!kv_bytes || *kv_bytes <= 0) return fail("--kv-cache-memory '" + options->kv_cache_memory + "' is not a size");
    std::optional<int64_t> header_bytes = parse_bytes(options->max_header_bytes);
    if (!header_bytes || *header_bytes < 1024 || *header_bytes > (16 << 20))
      return fail("--max-header-bytes '" + options->max_header_bytes + "' must be a size from 1KiB to 16MiB");
    if (!options->kv_events_replay_endpoint.empty() && options->kv_events_endpoint.empty())
      return fail("--kv-events-replay-endpoint needs --kv-events-endpoint");
    if (!options->kv_events_endpoint.empty() && options->no_prefix_caching)
      return fail("--kv-events-endpoint reports the prefix cache, which --no-prefix-caching turns off");
    if (options->kv_disk_reset && options->tiered_kv_storage_path.empty())
      return fail("--kv-disk-reset needs --tiered-kv-storage-path (it resets that directory)");
    if (options->metrics_require_api_key && options->api_key.empty())
      return fail("--metrics-require-api-key needs --api-key (or DEEPINFER_API_KEY)");
    std::optional<int64_t> body_bytes = parse_bytes(options->max_body_bytes);
    if (!body_bytes || *body_bytes <= 0)
      return fail("--max-body-bytes '" + options->max_body_bytes + "' is not a size");

    // DeepSeek-V4 checkpoints run on DeepSeekV4Model (CPU: the float32 reference path; CUDA: bf16 weights and cache)
    // without what its engine does not support yet.
    Result<model::ModelConfig> config = model::load_engine_model_config(model_path);
    if (!config.ok()) return fail(config.status().to_string());
    const bool v4 = config->model_type == "deepseek_v4";
    if (v4) {
      auto refuse = [&](const std::string& what) {
        return fail(what + ": DeepSeek-V4 does not support it yet in this build");
      };
      if (options->tensor_parallel_size > 1 || options->expert_parallel_size > 1 || options->cluster_nodes > 1) {
        return refuse("--tensor-parallel-size / --expert-parallel-size / --nnodes > 1");
      }
      if (options->role != "both") return refuse("--role " + options->role);
      if (options->speculative.algorithm != "none" && !options->speculative.algorithm.empty()) {
        return refuse("--speculative-algorithm " + options->speculative.algorithm);
      }
      if (options->speculative.dspark_enable) return refuse("--dspark-enable");
      if (options->enable_eplb) return refuse("--enable-eplb");
      if (batch_invariant_requested()) return refuse("DEEPINFER_BATCH_INVARIANT=1 (batch-invariant mode)");
      if (options->swa_bounded_replay && options->no_prefix_caching) {
        return fail("--swa-bounded-replay reuses cached prefixes, but --no-prefix-caching turns the cache off");
      }
    }
    if (Status s = model::check_tensor_parallel_shapes(*config, options->tensor_parallel_size); !s.ok()) {
      return fail(s.message());
    }
    if (options->expert_parallel_size > 1 &&
        (config->n_routed_experts + options->num_redundant_experts) % options->expert_parallel_size != 0) {
      return fail("--expert-parallel-size " + std::to_string(options->expert_parallel_size) + " does not divide the "
                  "model's n_routed_experts (" + std::to_string(config->n_routed_experts) + ") plus " +
                  std::to_string(options->num_redundant_experts) + " redundant expert slots");
    }
    if (!v4 && options->swa_bounded_replay) {
      return fail("--swa-bounded-replay: " + config->model_type +
                  " has no sliding-window attention layers (DeepSeek-V4's), so there is no window to replay");
    }
    Result<recipe::PromptFormat> checkpoint_format = server::checkpoint_chat_format(model_path, config->model_type);
    if (!checkpoint_format.ok() && checkpoint_format.status().code() == StatusCode::kInvalidArgument) {
      return fail(checkpoint_format.status().message());
    }
    recipe::PromptFormat format = recipe::PromptFormat::kDeepSeekV3;
    if (options->chat_format) {
      Result<recipe::PromptFormat> parsed = recipe::parse_format(*options->chat_format);
      if (!parsed.ok()) return fail("--chat-format: " + parsed.status().message());
      format = *parsed;
      if (checkpoint_format.ok() && *checkpoint_format != format) {
        spdlog::warn("--chat-format {} overrides {}, the format of this checkpoint",
                     recipe::format_name(format), recipe::format_name(*checkpoint_format));
      }
    } else if (!checkpoint_format.ok()) {
      return fail(checkpoint_format.status().message());
    } else {
      format = *checkpoint_format;
    }
    recipe::V4Revision revision = server::checkpoint_v4_revision(model_path).value_or(recipe::V4Revision::k0731);
    if (options->chat_format_revision) {
      Result<recipe::V4Revision> parsed = recipe::parse_v4_revision(*options->chat_format_revision);
      if (!parsed.ok()) return fail("--chat-format-revision: " + parsed.status().message());
      if (format != recipe::PromptFormat::kDeepSeekV4) {
        return fail("--chat-format-revision applies to the deepseek-v4 format only; the format is " +
                    std::string(recipe::format_name(format)));
      }
      revision = *parsed;
    }
    if (format == recipe::PromptFormat::kDeepSeekV4) {
      spdlog::info("chat format deepseek-v4, revision {}", recipe::v4_revision_name(revision));
    }
    Result<engine::SpeculativeConfig> speculative =
        speculative_config(options->speculative, config->num_nextn_predict_layers, config->dspark.has_value());
    if (!speculative.ok()) return fail(speculative.status().message() + " (" + model_path.string() + ")");
    if (options->max_model_len > config->max_position_embeddings) {
      return fail("--max-model-len " + std::to_string(options->max_model_len) + " exceeds the model's " +
                  "max_position_embeddings " + std::to_string(config->max_position_embeddings));
    }

    const fs::path tokenizer_path = options->tokenizer.value_or(model_path.string());
    Result<std::shared_ptr<const recipe::Tokenizer>> tokenizer = recipe::Tokenizer::load(tokenizer_path);
    if (!tokenizer.ok()) return fail(tokenizer.status().to_string() + " (the server needs the model's tokenizer.json)");
    if (static_cast<int64_t>((*tokenizer)->vocab_size()) > config->vocab_size) {
      return fail("the tokenizer has " + std::to_string((*tokenizer)->vocab_size()) + " tokens but the model only " +
                  std::to_string(config->vocab_size) + ": wrong tokenizer for this checkpoint?");
    }

    // Tensor parallel: rank 0 (this process, the server) starts the other ranks; they load their shards and follow.
    std::unique_ptr<TensorParallelGroup> tp_group;
    // With several hosts, host R's first rank (R * local) is the process the user started there (a node leader).
    const int local_ranks = options->tensor_parallel_size / options->cluster_nodes;
    const int tp_rank = options->internal_tp_rank > 0 ? options->internal_tp_rank : options->node_rank * local_ranks;
    const bool tp_follower = tp_rank > 0;
    if (options->tensor_parallel_size > 1) {
      // What the hosts must agree on (several hosts): checked when each node leader joins, naming the difference.
      GroupShape shape{options->tensor_parallel_size, options->cluster_nodes, local_ranks, {}, {}};
      // Inside a data-parallel rank, --master-port is the data-parallel group's store: the tensor-parallel group
      // takes any free port of its own, and its ranks are told the data-parallel store's (each joins the expert
      // exchange of its tensor-parallel index there).
      if (data_parallel) shape.rank_args = {"--internal-dp-master-port", std::to_string(options->master_port)};
      if (options->cluster_nodes > 1 && options->internal_tp_rank == 0) {
        Result<kvcache::ModelFingerprint> fingerprint = engine::checkpoint_fingerprint(model_path, "");
        if (!fingerprint.ok()) return fail(fingerprint.status().to_string());
        shape.model = fingerprint->to_hex();
      }
      Result<std::unique_ptr<TensorParallelGroup>> group =
          options->internal_tp_rank > 0 ? TensorParallelGroup::join(tp_rank, options->tensor_parallel_size,
                                                                    options->master_addr, options->master_port)
          : tp_rank > 0
              ? TensorParallelGroup::lead_node(options->node_rank, shape, options->master_addr, options->master_port)
              : TensorParallelGroup::lead(shape, options->master_addr, data_parallel ? 0 : options->master_port);
      if (!group.ok()) return fail(group.status().to_string());
      tp_group = std::move(group).value();
    }
    std::unique_ptr<DataParallelGroup> dp_group;
    if (data_parallel && tp_follower) {
      // Tensor-parallel rank t of data-parallel rank d: the experts' exchange among the ranks t of every
      // data-parallel rank (rank 0 of each tensor-parallel group is in the data-parallel group itself).
      Result<std::unique_ptr<DataParallelGroup>> link =
          DataParallelGroup::join_tensor_rank(tp_rank, options->data_parallel_rank, options->data_parallel_size,
                                              options->master_addr, options->internal_dp_master_port);
      if (!link.ok()) return fail(link.status().to_string());
      dp_group = std::move(link).value();
    } else if (data_parallel) {
      // What the ranks must agree on: the checkpoint, and every flag that places the experts or times the passes.
      Result<kvcache::ModelFingerprint> fingerprint = engine::checkpoint_fingerprint(model_path, "");
      if (!fingerprint.ok()) return fail(fingerprint.status().to_string());
      const GroupSettings settings = {
          {"the checkpoint (--model-path; its fingerprint)", fingerprint->to_hex()},
          {"--num-redundant-experts", std::to_string(options->num_redundant_experts)},
          {"--enable-eplb", options->enable_eplb ? "on" : "off"},
          {"--eplb-rebalance-num-iterations", std::to_string(options->eplb_rebalance_num_iterations)},
          {"--eplb-policy", options->eplb_policy},
          {"--moe-capacity-factor", std::to_string(options->moe_capacity_factor)},
          {"--bf16", options->device.bf16 ? "on" : "off"},
          {"--role", options->role},  // a group is one pool: its ranks all prefill, all decode or all both
          // Every data-parallel rank's tensor-parallel rank t joins the expert exchange of index t.
          {"--tensor-parallel-size", std::to_string(options->tensor_parallel_size)},
          // DSpark measures its step times at startup with target passes, which every rank must make alike.
          {"--speculative-algorithm", speculative->algorithm == engine::SpeculativeAlgorithm::kDspark
                                          ? "dspark (or --dspark-enable)"
                                      : speculative->algorithm == engine::SpeculativeAlgorithm::kMtp ? "mtp"
                                                                                                      : "none"}};
      Result<std::unique_ptr<DataParallelGroup>> group =
          DataParallelGroup::join(options->data_parallel_rank, options->data_parallel_size, options->master_addr,
                                  options->master_port, settings);
      if (!group.ok()) return fail(group.status().to_string());
      dp_group = std::move(group).value();
      // A rank asked to stop drains, then keeps making the group's passes until every rank stops, within the same
      // --shutdown-timeout-s.
      dp_group->set_stop_budget(std::chrono::seconds(options->shutdown_timeout_s));
    }
    // Rank r of a tensor-parallel group on CUDA takes its host's GPU r % (ranks per host). Data-parallel rank d's
    // ranks come after those of the d ranks before it: GPU (d * ranks per host + r) modulo the GPUs this process
    // sees, so that ranks started on one host without CUDA_VISIBLE_DEVICES take a GPU each (with it naming one GPU
    // per rank, that one).
    int device_index = tp_group ? tp_group->rank() % local_ranks : 0;
    if (dp_group && options->device.device != "cpu") {
      device_index += options->data_parallel_rank * local_ranks;
      if (const int gpus = backend::cuda_device_count(); gpus > 0) device_index %= gpus;
    }
    Result<BackendChoice> choice = make_backend(options->device, device_index);
    if (!choice.ok()) return fail(choice.status().to_string());
    auto backend = std::move(choice->backend);
    // The model's collectives: Gloo on the CPU; on CUDA, NCCL for the tensors and Gloo for the host-side ones.
    std::unique_ptr<backend::Communicator> nccl;
    if (tp_group && backend->name() == "cuda") {
      Result<std::unique_ptr<backend::Communicator>> made = backend::make_nccl_communicator(
          *backend, tp_group->store(), "tp-nccl", tp_group->rank(), options->tensor_parallel_size,
          std::chrono::seconds(60));
      if (!made.ok()) return fail(made.status().to_string());
      nccl = std::move(made).value();
    }
    const model::TensorParallel tensor_parallel{
        tp_group ? tp_group->rank() : 0, options->tensor_parallel_size,
        nccl ? nccl.get() : tp_group ? &tp_group->communicator() : nullptr,
        nccl && tp_group ? &tp_group->communicator() : nullptr};
    // Across data-parallel ranks on CUDA the experts' rows move over NCCL among the ranks of one tensor-parallel index
    // (each rank its own GPU: CUDA_VISIBLE_DEVICES per rank), the counts and routing over the group's Gloo.
    std::unique_ptr<backend::Communicator> dp_nccl;
    if (dp_group && backend->name() == "cuda") {
      Result<std::unique_ptr<backend::Communicator>> made = backend::make_nccl_communicator(
          *backend, dp_group->store(), tp_rank > 0 ? "dp-tp" + std::to_string(tp_rank) + "-nccl" : "dp-nccl",
          options->data_parallel_rank, options->data_parallel_size, std::chrono::seconds(60));
      if (!made.ok()) {
        return fail(made.status().to_string() + " (each data-parallel rank needs a GPU of its own: rank r takes GPU r "
                    "of those it sees; with CUDA_VISIBLE_DEVICES, name a different GPU for each rank on a host)");
      }
      dp_nccl = std::move(made).value();
    }
    // Expert parallel over the same ranks (ExpertParallel::replicated_tokens).
    // Or over the data-parallel ranks, each running its own tokens (all-to-all dispatch).
    const model::ExpertParallel expert_parallel =
        dp_group ? model::ExpertParallel{options->data_parallel_rank, options->data_parallel_size,
                                         dp_nccl ? dp_nccl.get() : &dp_group->communicator(),
                                         options->num_redundant_experts, false, options->moe_capacity_factor,
                                         dp_nccl ? &dp_group->communicator() : nullptr}
        : options->expert_parallel_size > 1
            ? model::ExpertParallel{tensor_parallel.rank, tensor_parallel.size, tensor_parallel.comm,
                                    options->num_redundant_experts, true, options->moe_capacity_factor,
                                    tensor_parallel.host_comm}
            : model::ExpertParallel{};
    const std::string device_name(backend->name());
    std::string compute_mode = choice->compute_mode;
    if (v4) {  // DeepSeek-V4 keeps its own cache kinds (no latent), in the activation dtype
      compute_mode = device_name != "cpu" ? "cuda: bf16/fp8 weights, bf16 cache"
                     : options->device.bf16 ? "bf16 weights, f32 cache"
                                            : "f32 weights, f32 cache";
    }
    if (options->gpu_memory_utilization && !backend->device_memory().ok()) {
      return fail("--gpu-memory-utilization: the " + device_name +
                  " backend has no device memory to take a fraction of; size the KV cache with --kv-cache-memory");
    }
    std::unique_ptr<model::DeepSeekV4Model> v4_model;
    Result<std::unique_ptr<model::DeepSeekModel>> model = std::unique_ptr<model::DeepSeekModel>();
    if (v4) {
      Result<std::unique_ptr<model::DeepSeekV4Model>> loaded = model::DeepSeekV4Model::load(model_path, *backend, choice->precision);
      if (!loaded.ok()) return fail(loaded.status().to_string());
      v4_model = std::move(loaded).value();
      if (device_name != "cpu") {
        spdlog::info("DeepSeek-V4 weights: {} matrices kept in FP8 (as stored, FP4 experts re-expressed exactly), the "
                     "rest bf16", v4_model->fp8_weights());
      }
    } else {
      model = model::DeepSeekModel::load(model_path, *backend, choice->precision,
                                         /*progress=*/isatty(STDERR_FILENO) != 0 && !tp_follower, tensor_parallel,
                                         expert_parallel);
    }
    if (!model.ok()) return fail(model.status().to_string());
    if (tp_follower) {
      Status followed = (*model)->follow();
      if (!followed.ok()) return fail("tensor-parallel rank " + std::to_string(tp_rank) + ": " + followed.to_string());
      return 0;
    }
    if (tp_group) (*model)->lead();
    if (options->enable_eplb) {
      (*model)->set_eplb_schedule(model::EplbSchedule{
          options->eplb_rebalance_num_iterations,
          options->eplb_policy == "hierarchical" ? model::EplbPolicy::kHierarchical : model::EplbPolicy::kGlobal,
          config->n_group, 1});
    }
    engine::EngineConfig engine_config;
    engine_config.max_model_len = options->max_model_len;
    engine_config.max_num_seqs = options->max_num_seqs;
    engine_config.max_num_batched_tokens = options->max_num_batched_tokens;
    engine_config.kv_cache_bytes = *kv_bytes;
    if (options->gpu_memory_utilization) {
      // vLLM's meaning: the fraction bounds everything this server puts on the GPU. The weights are there now; a
      // step's workspace (activations, logits, graphs) is kept back as max(512 MiB, 2% of the GPU); the KV cache
      // gets the rest.
      Result<backend::Backend::DeviceMemory> memory = backend->device_memory();
      if (!memory.ok()) return fail("--gpu-memory-utilization: " + memory.status().to_string());
      const int64_t used = memory->total_bytes - memory->free_bytes;
      const int64_t workspace = std::max<int64_t>(int64_t{512} << 20, memory->total_bytes / 50);
      const int64_t kv = static_cast<int64_t>(*options->gpu_memory_utilization * static_cast<double>(memory->total_bytes)) -
                         used - workspace;
      if (kv <= 0) {
        return fail("--gpu-memory-utilization " + typed("--gpu-memory-utilization").value_or("?") + ": " +
                    std::to_string(used >> 20) + " MiB of the GPU's " + std::to_string(memory->total_bytes >> 20) +
                    " MiB are in use (the weights and other processes) and a step needs " +
                    std::to_string(workspace >> 20) + " MiB: nothing is left for the KV cache");
      }
      engine_config.kv_cache_bytes = kv;
      spdlog::info("--gpu-memory-utilization {}: {} MiB for the KV cache ({} MiB of {} MiB in use, {} MiB kept for a "
                   "step's workspace)",
                   *options->gpu_memory_utilization, kv >> 20, used >> 20, memory->total_bytes >> 20, workspace >> 20);
    }
    if (Status s = set_dspark_table(*speculative, options->speculative, model_path, device_name, compute_mode); !s.ok()) {
      return fail(s.to_string());
    }
    engine_config.speculative = *speculative;
    engine_config.enable_prefix_caching = !options->no_prefix_caching;
    engine_config.swa_bounded_replay =
        cmd->get_option("--swa-bounded-replay")->count() > 0 ? options->swa_bounded_replay : true;
    if (v4 && !options->no_prefix_caching) {
      spdlog::info("DeepSeek-V4 prefix cache: SWA bounded replay {}", engine_config.swa_bounded_replay
                       ? "on (a prefix whose window rows are gone is reused, its last window replayed: approximate)"
                       : "off (a prefix is reused up to where its window rows are cached: exact)");
    }
    engine_config.kv_events_endpoint = options->kv_events_endpoint;
    engine_config.kv_events_replay_endpoint = options->kv_events_replay_endpoint;
    if (!options->kv_host_cache_memory.empty()) {
      std::optional<int64_t> host_bytes = parse_bytes(options->kv_host_cache_memory);
      if (!host_bytes) return fail("--kv-host-cache-memory '" + options->kv_host_cache_memory + "' is not a size");
      engine_config.host_cache_bytes = *host_bytes;
    }
    if (!options->tiered_kv_storage_path.empty()) {
      engine_config.disk_cache_path = options->tiered_kv_storage_path;
      engine_config.disk_cache_model_name = fs::absolute(model_path).filename().string();
      engine_config.disk_cache_reset = options->kv_disk_reset;
      if (options->kv_host_cache_memory.empty()) {
        engine_config.host_cache_bytes = 1ll << 30;
      } else if (engine_config.host_cache_bytes == 0) {
        return fail("--tiered-kv-storage-path needs a host tier (the disk tier loads through it), but "
                    "--kv-host-cache-memory is 0");
      }
      std::optional<int64_t> disk_bytes = parse_bytes(options->kv_disk_cache_size);
      if (!disk_bytes || *disk_bytes <= 0) {
        return fail("--kv-disk-cache-size '" + options->kv_disk_cache_size + "' is not a size");
      }
      engine_config.disk_cache_bytes = *disk_bytes;
    }
    // Up to 10 years: the TTL becomes milliseconds on a 64-bit clock (inf or 1e300 overflowed it).
    if (!(options->kv_cache_ttl_hours > 0) || !(options->kv_cache_ttl_hours <= 87'600.0))
      return fail("--kv-cache-ttl-hours must be positive and at most 87600 (10 years)");
    engine_config.kv_cache_ttl_hours = options->kv_cache_ttl_hours;
    if (options->kv_host_evict_rate != "unlimited") {
      std::optional<int64_t> rate = parse_bytes(options->kv_host_evict_rate);
      if (!rate || *rate <= 0) {
        return fail("--kv-host-evict-rate '" + options->kv_host_evict_rate +
                    "' must be a positive size per second (e.g. 1GiB) or 'unlimited'");
      }
      engine_config.host_evict_bytes_per_s = static_cast<double>(*rate);
    }
    {
      // The checkpoint's identity in every block hash: what the host and disk tiers check, and what a router
      // hashes prompts with (GET /worker/info). With MTP drafting every block also holds the MTP layer's KV:
      // another block layout, another identity.
      const std::string layout = speculative->enabled()
                                     ? choice->compute_mode + ", MTP layer KV"
                                     : choice->compute_mode;
      Result<kvcache::ModelFingerprint> fingerprint = engine::checkpoint_fingerprint(model_path, layout);
      if (!fingerprint.ok()) return fail(fingerprint.status().to_string());
      engine_config.fingerprint = *fingerprint;
    }
    auto engine = v4 ? engine::Engine::create(std::move(backend), std::move(v4_model), engine_config)
                     : engine::Engine::create(std::move(backend), std::move(model).value(), engine_config);
    if (!engine.ok()) return fail(engine.status().to_string());

    server::ModelInfo info;
    info.served_model_name =
        options->served_model_name.empty() ? directory_name(fs::absolute(model_path)) : options->served_model_name;
    info.model_type = config->model_type;
    info.vocab_size = config->vocab_size;
    info.max_model_len = (*engine)->max_model_len();
    info.bos_token_id = config->bos_token_id;
    info.root = fs::absolute(model_path);
    std::error_code ec;
    const bool is_builtin =
        default_model || std::any_of(builtin_dirs.begin(), builtin_dirs.end(), [&](const fs::path& dir) {
          std::error_code equivalent_error;
          return fs::equivalent(model_path, dir, equivalent_error);
        });
    if (is_builtin) {
      info.description =
          "The built-in demo model: DeepSeek-V3 architecture (MLA, MoE with the V3 router, one MTP layer), 45M "
          "parameters with DeepSeek-V3's tokenizer plus V4's added tokens, trained for 6 minutes on Debian's "
          "documentation in the deepseek-v4.1 format (assets/demo-model): it thinks when asked, calls the tools a "
          "request offers, and knows little.";
    }

    server::ServerConfig server_config;
    server_config.host = options->host;
    server_config.port = options->port;
    server_config.api_key = options->api_key;
    server_config.max_body_bytes = *body_bytes;
    server_config.max_concurrent_requests = options->max_concurrent_requests;
    server_config.max_json_depth = options->max_json_depth;
    server_config.chat_format = format;
    server_config.chat_format_revision = revision;
    server_config.default_max_tokens = options->default_max_tokens.value_or(is_builtin ? kDefaultModelMaxTokens : 0);
    server_config.http_threads = options->http_threads;
    server_config.tokenization_cache_bytes = options->tokenization_cache_mb << 20;
    server_config.handle_signals = true;
    server_config.max_header_bytes = *header_bytes;
    server_config.max_connections = options->max_connections;
    server_config.max_connections_per_ip = options->max_connections_per_ip;
    server_config.idle_timeout_seconds = options->idle_timeout_s;
    server_config.body_read_timeout_seconds = options->body_read_timeout_s;
    server_config.shutdown_timeout_seconds = options->shutdown_timeout_s;
    // A group's peer can hang mid-collective; one process's step cannot wait on anything but itself (a long CPU
    // prefill step must not fail a liveness probe).
    if (data_parallel) {
      // The engine thread may be waiting in a collective on a hung peer (up to the 60 s timeout, and a hung rank 0's
      // store after it): a stop (SIGTERM) that the drain, its force stop and the engine's own stop have not finished
      // in --shutdown-timeout-s + 15 s ends the process.
      server_config.on_shutdown = [limit = options->shutdown_timeout_s + 15, group = dp_group.get()] {
        if (group != nullptr) group->note_stopping();  // a peer's leaving from now on is part of this stop
        std::thread([limit] {
          std::this_thread::sleep_for(std::chrono::seconds(limit));
          spdlog::error("data parallel: the server did not stop within {} s of being asked (its engine waits on a "
                        "hung peer); exiting",
                        limit);
          std::_Exit(1);
        }).detach();
      };
    }
    server_config.health_max_step_seconds = options->health_max_step_seconds.value_or(
        options->tensor_parallel_size > 1 || options->data_parallel_size > 1 ? 20 : 0);
    server_config.metrics_require_api_key = options->metrics_require_api_key;
    server_config.allowed_origins = options->allowed_origins;
    server_config.role = options->role.empty() ? "both" : options->role;
    server_config.model_fingerprint_hex = engine_config.fingerprint.to_hex();
    server_config.kv_events_endpoint = options->kv_events_endpoint;
    server_config.kv_events_replay_endpoint = options->kv_events_replay_endpoint;
    server_config.kv_transfer_port = options->kv_transfer_port.value_or(8998);
    server_config.kv_transfer_timeout_ms = options->kv_transfer_timeout_ms.value_or(30000);
    server_config.kv_transfer_deadline_ms = options->kv_transfer_deadline_ms.value_or(120000);
    server_config.kv_transfer_max_connections = options->kv_transfer_max_connections.value_or(256);
    server_config.kv_transfer_protocol = options->kv_transfer_protocol.value_or("tcp");
    server_config.rdma_device_names = options->rdma_device_names.value_or("");
    server_config.kv_block_bytes = (*engine)->block_bytes();
    const engine::KvTierStats tiers = (*engine)->kv_tier_stats();
    std::unique_ptr<engine::EngineClient> engine_client =
        engine::make_in_process_client(std::move(engine).value(), dp_group.get());
    // Rank 0 of a group: a rank's failure ends the live requests with an error event before the process exits.
    if (tp_group) engine_client = tp_group->watch_requests(std::move(engine_client));
    if (dp_group) dp_group->set_leave_reason("failed to start its server (see its log)");
    auto server = server::Server::start(server_config, info, std::move(engine_client), *tokenizer);
    if (!server.ok()) return fail(server.status().to_string());
    if (dp_group) dp_group->set_leave_reason(DataParallelGroup::kStoppedBySignal);
    // The group's failure stops the server at once: the requests still waiting for KV blocks or queued get a 503.
    if (dp_group) dp_group->on_failure([s = server->get()] { s->shutdown(false); });

    const std::string host = options->host == "0.0.0.0" || options->host == "::" ? "127.0.0.1" : options->host;
    const std::string url = "http://" + (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" +
                            std::to_string((*server)->port());
    std::cout << "deepinfer serve: " << info.served_model_name << " (" << info.root.string() << ", "
              << config->model_type << ", chat format " << recipe::format_name(format) << ", max_model_len "
              << info.max_model_len << ") on " << url << "\n";
    std::cout << "  device " << device_name << " (" << compute_mode << ")\n";
    // The experts' placement over the ranks (expert parallel), for the startup lines below.
    auto experts_line = [&](const std::string& over) {
      std::string line = "experts over " + over + ": " +
                         std::to_string((config->n_routed_experts + options->num_redundant_experts) /
                                        options->expert_parallel_size) +
                         " slots each (" + std::to_string(options->num_redundant_experts) + " redundant)";
      if (options->enable_eplb) {
        line += ", EPLB (" + options->eplb_policy + ") every " +
                std::to_string(options->eplb_rebalance_num_iterations) + " passes";
      }
      return line;
    };
    if (options->tensor_parallel_size > 1) {
      std::cout << "  tensor parallel: " << options->tensor_parallel_size
                << " processes (this one serves; collectives over Gloo/TCP on " << options->master_addr << ")";
      if (options->expert_parallel_size > 1) std::cout << "; " << experts_line("them");
      std::cout << "\n";
    }
    if (dp_group) {
      std::cout << "  data parallel: rank " << options->data_parallel_rank << " of " << options->data_parallel_size
                << " (store at " << options->master_addr << ":" << options->master_port << "); "
                << experts_line("the ranks") << ", all-to-all dispatch\n";
    }
    std::cout << "  KV cache (blocks of 64 tokens): device " << tiers.device_capacity_blocks;
    if (tiers.lower) {
      std::cout << ", host " << tiers.lower->host.capacity_blocks;
      if (tiers.lower->disk.capacity_blocks > 0) {
        const kvcache::DiskRecoveryStats& r = tiers.lower->disk_recovery;
        std::cout << ", disk " << tiers.lower->disk.capacity_blocks << " at " << engine_config.disk_cache_path << " ("
                  << r.recovered_blocks << " recovered; dropped at open: " << r.corrupt_dropped << " corrupt, "
                  << r.foreign_dropped << " of another model, " << r.expired_dropped << " expired, " << r.evicted
                  << " over capacity, " << r.unchained_dropped << " whose earlier block was gone; "
                  << r.temp_files_removed << " unfinished writes removed)";
      }
    }
    std::cout << "; prefix caching " << (engine_config.enable_prefix_caching ? "on" : "off") << "\n";
    if (!options->kv_events_endpoint.empty()) {
      std::cout << "  KV events on " << options->kv_events_endpoint
                << (options->kv_events_replay_endpoint.empty() ? std::string()
                                                               : ", replay on " + options->kv_events_replay_endpoint)
                << "\n";
    }
    if (is_builtin) {
      std::cout << "  The built-in demo model: 45M parameters trained for 6 minutes on Debian's documentation in the "
                   "deepseek-v4.1 format; it thinks when asked, calls the tools a request offers, and knows little. "
                   "Requests without max_tokens stop after "
                << server_config.default_max_tokens << " tokens.\n";
    }
    std::cout << "Try it:\n  curl " << url << "/v1/chat/completions -H 'Content-Type: application/json'"
              << (options->api_key.empty() ? "" : " -H 'Authorization: Bearer YOUR_API_KEY'") << " -d '{\"model\": \""
              << info.served_model_name << "\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'\n";
    if (is_builtin) {
      std::cout << "  curl " << url << "/v1/chat/completions -H 'Content-Type: application/json'"
                << (options->api_key.empty() ? "" : " -H 'Authorization: Bearer YOUR_API_KEY'")
                << " -d '{\"model\": \"" << info.served_model_name
                << "\", \"chat_template_kwargs\": {\"thinking\": true}, \"messages\": [{\"role\": \"user\", "
                   "\"content\": \"What is the weather in Paris?\"}], \"tools\": [{\"type\": \"function\", "
                   "\"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\", "
                   "\"properties\": {\"city\": {\"type\": \"string\"}}}}}]}'\n";
    }
    std::cout << std::flush;
    (*server)->wait();
    if (dp_group) {
      dp_group->on_failure({});  // the server goes next
      if (dp_group->failed() && !dp_group->stopped_cleanly()) {
        std::cout << "deepinfer serve: stopped (its data-parallel group failed)\n" << std::flush;
        return 1;
      }
    }
    std::cout << "deepinfer serve: stopped\n";
    return 0;
  };
}

}  // namespace deepinfer::apps
