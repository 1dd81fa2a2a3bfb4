// The offline replay through the engine's scheduler and prefix cache (see engine_replay.h).
#include "engine_replay.h"

#include <boost/json.hpp>
#include <chrono>
#include <cmath>
#include <deque>
#include <memory>
#include <unordered_map>

#include "deepinfer/engine/engine.h"
#include "deepinfer/engine/executor.h"
#include "deepinfer/engine/scheduler.h"

namespace deepinfer::bench {
namespace {

namespace json = boost::json;

// Device blocks nobody computes: the cache's transfers copy zeros.
class NullDevice final : public kvcache::transfer::DeviceBlockIo {
 public:
  Status read(kvcache::BlockId, std::span<std::byte> out) override {
    std::fill(out.begin(), out.end(), std::byte{0});
    return Status::ok_status();
  }
  Status write(kvcache::BlockId, std::span<const std::byte>) override { return Status::ok_status(); }
};

double r4(double x) { return std::round(x * 1e4) / 1e4; }

}  // namespace

Result<EngineReplayOptions> parse_engine_replay_args(std::span<const std::string> args) {
  EngineReplayOptions options;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& flag = args[i];
    if (flag == "--engine-replay") continue;
    if (i + 1 >= args.size()) return Status::invalid_argument(flag + " needs a value");
    const std::string& value = args[++i];
    if (flag == "--trace") {
      options.trace_path = value;
      continue;
    }
    int64_t n = 0;
    try {
      size_t used = 0;
      n = std::stoll(value, &used);
      if (used != value.size()) throw std::invalid_argument(value);
    } catch (const std::exception&) {
      return Status::invalid_argument(flag + ": '" + value + "' is not an integer");
    }
    auto positive = [&](int64_t limit) -> Status {
      if (n < 1 || n > limit) return Status::invalid_argument(flag + " must be in [1, " + std::to_string(limit) + "]");
      return Status::ok_status();
    };
    Status status;
    if (flag == "--requests") options.requests = n;
    else if (flag == "--device-blocks") status = positive(1 << 30), options.device_blocks = n;
    else if (flag == "--host-blocks") options.host_blocks = std::max<int64_t>(n, 0);
    else if (flag == "--block-bytes") status = positive(int64_t{1} << 32), options.block_bytes = n;
    else if (flag == "--block-tokens") status = positive(1 << 20), options.prompts.block_tokens = static_cast<int32_t>(n);
    else if (flag == "--max-prompt-tokens") status = positive(int64_t{1} << 30), options.prompts.max_prompt_tokens = n;
    else if (flag == "--max-tokens") status = positive(1 << 20), options.prompts.max_tokens = static_cast<int32_t>(n);
    else if (flag == "--concurrency") status = positive(4096), options.concurrency = static_cast<int32_t>(n);
    else if (flag == "--warmup") options.warmup_requests = static_cast<int32_t>(std::clamp<int64_t>(n, 0, 1000));
    else if (flag == "--seed") options.prompts.seed = static_cast<uint64_t>(n);
    else if (flag == "--max-num-batched-tokens") status = positive(1 << 24), options.max_num_batched_tokens = static_cast<int32_t>(n);
    else if (flag == "--max-num-seqs") status = positive(1 << 20), options.max_num_seqs = static_cast<int32_t>(n);
    else return Status::invalid_argument("unknown flag " + flag);
    if (!status.ok()) return status;
  }
  if (options.trace_path.empty()) return Status::invalid_argument("--engine-replay needs --trace FILE");
  return options;
}

Status run_engine_replay(const EngineReplayOptions& options, std::ostream& out) {
  Result<Trace> trace = load_mooncake_trace(options.trace_path);
  if (!trace.ok()) return trace.status();
  Result<std::vector<LivePrompt>> built = make_live_prompts(*trace, options.requests, options.prompts);
  if (!built.ok()) return built.status();
  std::vector<LivePrompt> prompts;
  // The live replay's warm-up prompts first.
  for (int32_t w = 0; w < options.warmup_requests; ++w) {
    Result<LivePrompt> prompt = make_warmup_prompt(w, options.prompts);
    if (!prompt.ok()) return prompt.status();
    prompts.push_back(std::move(prompt).value());
  }
  prompts.insert(prompts.end(), built->begin(), built->end());

  // The server's configuration, planned by the engine's own code.
  engine::EngineConfig config;
  config.max_num_batched_tokens = options.max_num_batched_tokens;
  config.max_num_seqs = options.max_num_seqs;
  config.kv_cache_bytes = options.device_blocks * options.block_bytes;
  config.host_cache_bytes = options.host_blocks * options.block_bytes;
  if (options.block_bytes % kvcache::kBlockTokens != 0) {
    return Status::invalid_argument("--block-bytes must be a multiple of 64 (one block of 64 tokens)");
  }
  Result<engine::KvCachePlan> plan =
      engine::plan_kv_cache(config, kvcache::CacheLayout::latent_only(1, options.block_bytes / kvcache::kBlockTokens));
  if (!plan.ok()) return plan.status();
  Result<std::unique_ptr<kvcache::KvCacheManager>> cache = kvcache::KvCacheManager::create(plan->cache);
  if (!cache.ok()) return cache.status();
  NullDevice device;
  (*cache)->set_device_io(&device);
  Result<engine::Scheduler> created = engine::Scheduler::create(plan->scheduler, std::move(cache).value());
  if (!created.ok()) return created.status();
  engine::Scheduler& scheduler = *created;

  const auto start = std::chrono::steady_clock::now();
  kvcache::KvCacheCounters before;
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;
  std::unordered_map<engine::SequenceId, int64_t> prompt_len;
  size_t next = 0;
  size_t finished = 0;
  int64_t in_flight = 0;
  const size_t warmups = static_cast<size_t>(options.warmup_requests);
  auto submit = [&]() -> Status {
    const LivePrompt& prompt = prompts[next];
    engine::SequenceRequest request;
    request.id = static_cast<engine::SequenceId>(next + 1);
    request.prompt_token_ids = prompt.token_ids;
    request.max_tokens = prompt.max_tokens;  // ignore_eos, as the live replay asks
    prompt_len[request.id] = static_cast<int64_t>(prompt.token_ids.size());
    ++next;
    ++in_flight;
    return scheduler.add(std::move(request));
  };
  while (finished < prompts.size()) {
    // The warm-up runs alone and to its end; then closed loop with `concurrency` requests in flight.
    const int64_t limit = next < warmups ? 1 : options.concurrency;
    while (next < prompts.size() && in_flight < limit && (next >= warmups || in_flight == 0)) {
      if (next == warmups && finished < warmups) break;
      if (Status status = submit(); !status.ok()) return status;
    }
    engine::ScheduledBatch batch = scheduler.schedule();
    for (const engine::FinishedSequence& done : batch.finished) {
      ++finished;
      --in_flight;
      if (static_cast<size_t>(done.id) > warmups) {
        prompt_tokens += prompt_len[done.id];
        cached_tokens += done.num_cached_tokens;
      }
      if (finished == warmups) before = scheduler.cache().counters();
    }
    if (batch.empty()) {
      if (scheduler.num_loading() > 0) scheduler.cache().wait_for_transfers(std::chrono::milliseconds(20));
      continue;
    }
    std::vector<engine::TokenId> sampled(static_cast<size_t>(batch.num_sampling_entries()),
                                         options.prompts.first_token_id);
    if (Status status = scheduler.update(batch, sampled); !status.ok()) return status;
  }
  if (warmups == 0) before = {};
  const kvcache::KvCacheCounters after = scheduler.cache().counters();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  json::object server{{"prompt_tokens", prompt_tokens},
                      {"cached_prompt_tokens", cached_tokens},
                      {"token_hit_rate", prompt_tokens > 0 ? r4(static_cast<double>(cached_tokens) / prompt_tokens) : 0.0},
                      {"loaded_blocks", (after.completed_loads - before.completed_loads)}};
  auto tier = [&](const char* name, int64_t capacity, int64_t hits, int64_t misses, int64_t evicted) {
    server[name] = json::object{{"capacity_blocks", capacity},
                                {"hit_blocks", hits},
                                {"miss_blocks", misses},
                                {"block_hit_rate", hits + misses > 0 ? r4(static_cast<double>(hits) / (hits + misses)) : 0.0},
                                {"evicted_blocks", evicted}};
  };
  tier("device", after.device_capacity_blocks, after.device_hit_blocks - before.device_hit_blocks,
       after.device_miss_blocks - before.device_miss_blocks, after.device_evicted_blocks - before.device_evicted_blocks);
  if (after.lower.has_value()) {
    const kvcache::OffloadCounters zero;
    const kvcache::OffloadCounters& b = before.lower.has_value() ? *before.lower : zero;
    tier("host", after.lower->host.capacity_blocks, after.lower->host.hit_blocks - b.host.hit_blocks,
         after.lower->host.miss_blocks - b.host.miss_blocks, after.lower->host.evicted_blocks - b.host.evicted_blocks);
  }
  json::object line{{"bench", "engine_replay"},
                    {"command", options.command_line},
                    {"trace", trace->name},
                    {"requests", static_cast<int64_t>(prompts.size() - warmups)},
                    {"block_tokens", options.prompts.block_tokens},
                    {"max_prompt_tokens", options.prompts.max_prompt_tokens},
                    {"max_tokens", options.prompts.max_tokens},
                    {"concurrency", options.concurrency},
                    {"device_blocks", options.device_blocks},
                    {"host_blocks", options.host_blocks},
                    {"server", std::move(server)},
                    {"seconds", r4(seconds)}};
  out << json::serialize(line) << std::endl;
  return Status::ok_status();
}

}  // namespace deepinfer::bench
