// Engine step: schedule, execute (forward + sample), update; plus request admission and cancellation.
#include "deepinfer/core/check.h"
#include "deepinfer/engine/engine.h"
#include "deepinfer/backend/kv_block_copy.h"

#include "model_executor.h"
#include "v4_executor.h"
#include "mtp_executor.h"

#include <omp.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

namespace deepinfer::engine {

void Engine::StepGate::lock() {
  std::unique_lock lock(mu_);
  const uint64_t ticket = next_ticket_++;
  cv_.wait(lock, [&] { return serving_ == ticket; });
}

void Engine::StepGate::unlock() {
  {
    std::lock_guard lock(mu_);
    ++serving_;
  }
  cv_.notify_all();
}


Status Engine::DeviceBlocks::read(kvcache::BlockId block, std::span<std::byte> out) {
  std::byte* const payload[] = {out.data()};
  return read_blocks(std::span(&block, 1), payload);
}

Status Engine::DeviceBlocks::write(kvcache::BlockId block, std::span<const std::byte> in) {
  const std::byte* const payload[] = {in.data()};
  return write_blocks(std::span(&block, 1), payload);
}

Status Engine::DeviceBlocks::read_blocks(std::span<const kvcache::BlockId> blocks, std::span<std::byte* const> out) {
  GateTurn turn(gate_);
  return backend::download_kv_blocks(backend_, layer_caches_, layer_bytes_, blocks, out);
}

Status Engine::DeviceBlocks::write_blocks(std::span<const kvcache::BlockId> blocks,
                                          std::span<const std::byte* const> in) {
  GateTurn turn(gate_);
  if (replicas_ != nullptr) {
    const int64_t layers = static_cast<int64_t>(layer_caches_.size());
    if (Status s = replicas_->replicate_cache_blocks(blocks, in, layers); !s.ok()) return s;
  }
  return backend::upload_kv_blocks(backend_, layer_caches_, layer_bytes_, blocks, in);
}

Engine::Engine(std::unique_ptr<backend::Backend> backend, std::unique_ptr<model::DeepSeekModel> model,
               const EngineConfig& config, Scheduler scheduler, std::vector<backend::Buffer> layer_caches,
               std::unique_ptr<DraftPlanner> planner)
    : backend_(std::move(backend)),
      model_(std::move(model)),
      model_config_(model_ ? model_->config() : model::ModelConfig{}),
      config_(config),
      scheduler_(std::move(scheduler)),
      layer_caches_(std::move(layer_caches)) {
  for (const backend::Buffer& layer : layer_caches_) kv_cache_bytes_ += layer.bytes;
  // Sampling threads: one Sampler each (a Sampler keeps per-row scratch and is single-threaded), at most 16.
  const int32_t threads = config.sampling_threads > 0 ? config.sampling_threads : std::clamp(omp_get_max_threads(), 1, 16);
  if (model_ == nullptr) return;  // V4: create() sets the executor
  if (config.speculative.enabled()) {
    const bool module =
        config.speculative.algorithm == SpeculativeAlgorithm::kDspark && model_->config().dspark.has_value();
    auto mtp = std::make_unique<MtpExecutor>(*model_, layer_caches_, scheduler_.config().num_blocks,
                                             scheduler_.config().max_num_seqs, config.speculative.num_draft_tokens,
                                             std::move(planner), module);
    mtp_executor_ = mtp.get();
    executor_ = std::move(mtp);
  } else {
    executor_ = std::make_unique<ModelExecutor>(*model_, layer_caches_, threads, config.parallel_sampling_min_logits);
  }
}

namespace {

// The planner's times on this backend: decode-shaped target passes (min(rows, max_num_seqs) sequences at position
// 64 of the main layers' caches, which hold nothing yet; the rows split evenly among them; every row a greedy
// logits row, as a verify's) at 1, 2, 4, ... rows up to `max_rows`; and, where each sequence has one row, the MTP
// pass over those rows with a logits row each and their confidences (a draft pass of that many chains). Median of 3
// runs after a warm-up.
// With a DSpark module (`module`) the draft pass is the module's block pass (one block per sequence) with its greedy
// heads (on the device where the backend has them, else on the host), and "KV only" its injection pass.
Result<StepTimes> measure_step_times(model::DeepSeekModel& model, std::span<const backend::Buffer> caches,
                                     int32_t num_blocks, int32_t max_num_seqs, int32_t max_rows, bool module) {
  constexpr int32_t kContext = 64;
  const std::span<const backend::Buffer> main_caches =
      caches.first(static_cast<size_t>(model.config().num_hidden_layers));
  std::vector<int32_t> sizes;
  for (int32_t rows = 1; rows < max_rows; rows *= 2) sizes.push_back(rows);
  sizes.push_back(std::max(max_rows, 1));
  if (max_num_seqs < max_rows && !std::binary_search(sizes.begin(), sizes.end(), max_num_seqs)) {
    sizes.insert(std::upper_bound(sizes.begin(), sizes.end(), max_num_seqs), max_num_seqs);
  }
  std::vector<std::pair<int32_t, double>> verify_points, draft_points, kv_points;
  std::string heads_points;  // the host heads' share of a module's draft pass, for the log
  std::vector<int32_t> ids;
  std::vector<float> probabilities;
  auto median = [](std::vector<double> times) {
    std::sort(times.begin(), times.end());
    return std::max(times[times.size() / 2], 1e-3);
  };
  // A noisy point below the one before it would make extra rows look free: keep each table non-decreasing.
  auto add = [](std::vector<std::pair<int32_t, double>>& points, int32_t rows, double ms) {
    points.emplace_back(rows, points.empty() ? ms : std::max(ms, points.back().second));
  };
  for (int32_t rows : sizes) {
    const int32_t sequences = std::min(rows, std::max(max_num_seqs, 1));
    const int32_t per_sequence = (rows + sequences - 1) / sequences;
    const int32_t blocks_per_sequence = (kContext + per_sequence + kBlockTokens - 1) / kBlockTokens;
    if (int64_t{sequences} * blocks_per_sequence > num_blocks) break;
    model::ForwardBatch batch;
    const bool drafts = caches.size() > main_caches.size() && per_sequence == 1;
    batch.keep_hidden = drafts && !module;
    batch.keep_dspark_context = drafts && module;
    model::MtpBatch draft;
    model::DsparkInjectBatch inject;
    model::DsparkBlockBatch block;
    int32_t row = 0;
    for (int32_t s = 0; s < sequences && row < rows; ++s) {
      const int32_t n = std::min(per_sequence, rows - row);
      model::SequenceChunk chunk;
      chunk.num_tokens = n;
      chunk.start_position = kContext;
      for (int32_t b = 0; b < blocks_per_sequence; ++b) chunk.block_table.push_back(s * blocks_per_sequence + b);
      for (int32_t k = 0; k < n; ++k, ++row) {
        const int32_t token = (row * 7919 + 11) % static_cast<int32_t>(model.config().vocab_size);
        batch.token_ids.push_back(token);
        batch.logits_rows.push_back(row);
        draft.token_ids.push_back(token);
        draft.hidden_rows.push_back(row);
        draft.logits_rows.push_back(row);
      }
      draft.sequences.push_back(chunk);
      if (module) {
        for (int32_t k = 0; k < n; ++k) inject.context_rows.push_back(row - n + k);
        inject.sequences.push_back(chunk);
        const int32_t gamma = static_cast<int32_t>(model.config().dspark->block_size);
        for (int32_t k = 0; k < gamma; ++k) block.token_ids.push_back(draft.token_ids[static_cast<size_t>(row - n)]);
        block.sequences.push_back({gamma, kContext + n, chunk.block_table});
      }
      batch.sequences.push_back(std::move(chunk));
    }
    std::vector<double> verify_times, draft_times, kv_times, heads_times;
    model::MtpBatch kv_only = draft;  // the same pass without logits rows: keeping the MTP KV current
    kv_only.logits_rows.clear();
    auto elapsed_ms = [](std::chrono::steady_clock::time_point start) {
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    };
    // Reps 0 and 1 warm up: a shape that runs as a recorded graph (DeepSeekModel::kGraphMaxRows) runs eagerly the
    // first time and is captured the second, as in serving; the table must hold the replays' times.
    constexpr int kWarmUp = 2;
    std::vector<float> logits, hidden;  // reused, as the executor reuses its own (no page faults in the times)
    for (int rep = 0; rep < kWarmUp + 3; ++rep) {
      const bool timed = rep >= kWarmUp;
      auto start = std::chrono::steady_clock::now();
      if (Status s = model.forward_greedy(batch, main_caches, ids); !s.ok()) return s;
      if (timed) verify_times.push_back(elapsed_ms(start));
      if (!drafts) continue;
      if (module) {
        start = std::chrono::steady_clock::now();
        if (Status s = model.forward_dspark_inject(inject, caches.subspan(main_caches.size())); !s.ok()) return s;
        if (Status s = model.synchronize(); !s.ok()) return s;  // the pass's whole time (it does not wait itself)
        if (timed) kv_times.push_back(elapsed_ms(start));
        start = std::chrono::steady_clock::now();
        if (model.has_device_dspark_heads()) {  // the heads where the logits are, as the executor runs them
          const int32_t gamma = static_cast<int32_t>(model.config().dspark->block_size);
          std::vector<int32_t> previous, lengths(block.sequences.size(), gamma);
          for (size_t chain = 0; chain < block.sequences.size(); ++chain) {
            previous.push_back(block.token_ids[chain * static_cast<size_t>(gamma)]);
          }
          std::vector<double> confidences;
          if (Status s = model.forward_dspark_block_greedy(block, caches.subspan(main_caches.size()), previous,
                                                           lengths, ids, confidences);
              !s.ok()) {
            return s;
          }
          if (timed) draft_times.push_back(elapsed_ms(start));
          continue;
        }
        if (Status s = model.forward_dspark_block(block, caches.subspan(main_caches.size()), logits, hidden); !s.ok()) {
          return s;
        }
        // The host heads belong to the draft's cost (the executor runs them between the block pass and the next
        // verify, chains in parallel): every row of every chain, as a greedy chain of the block's length does.
        const model::DeepSeekModel::DsparkHeads& heads = *model.dspark_heads();
        const size_t draft_vocab = static_cast<size_t>(heads.draft_vocab());
        const size_t width = static_cast<size_t>(model.config().hidden_size);
        const size_t gamma = static_cast<size_t>(model.config().dspark->block_size);
        std::vector<int32_t> chain_drafts(block.token_ids.size());
        std::vector<double> chain_confidences(block.token_ids.size());
        const auto heads_start = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(static)
        for (size_t chain = 0; chain < block.sequences.size(); ++chain) {
          const size_t first = chain * gamma;
          heads.greedy_chain(std::span<const float>(logits).subspan(first * draft_vocab, gamma * draft_vocab),
                             std::span<const float>(hidden).subspan(first * width, gamma * width),
                             block.token_ids[first], std::span(chain_drafts).subspan(first, gamma),
                             std::span(chain_confidences).subspan(first, gamma));
        }
        if (timed) {
          heads_times.push_back(elapsed_ms(heads_start));
          draft_times.push_back(elapsed_ms(start));
        }
        continue;
      }
      start = std::chrono::steady_clock::now();
      if (Status s = model.forward_mtp(0, draft, caches.back(), nullptr, &ids, &probabilities); !s.ok()) return s;
      if (timed) draft_times.push_back(elapsed_ms(start));
      // Chained on the draft pass's kept hidden state, as a chain's next pass reads it (same rows, same cost).
      start = std::chrono::steady_clock::now();
      if (Status s = model.forward_mtp(0, kv_only, caches.back(), nullptr, &ids); !s.ok()) return s;
      if (timed) kv_times.push_back(elapsed_ms(start));
    }
    add(verify_points, rows, median(verify_times));
    if (!draft_times.empty()) add(draft_points, rows, median(draft_times));
    if (!kv_times.empty()) add(kv_points, rows, median(kv_times));
    if (!heads_times.empty()) heads_points += fmt::format(" {}:{:.2f}", rows, median(heads_times));
  }
  if (!heads_points.empty()) spdlog::info("dspark: of the draft pass, the host heads (chains:ms){}", heads_points);
  Result<StepTimeTable> verify = StepTimeTable::create(std::move(verify_points));
  if (!verify.ok()) return verify.status();
  Result<StepTimeTable> draft = StepTimeTable::create(std::move(draft_points));
  if (!draft.ok()) return draft.status();
  Result<StepTimeTable> kv = StepTimeTable::create(std::move(kv_points));
  if (!kv.ok()) return kv.status();
  return StepTimes{std::move(verify).value(), std::move(draft).value(), std::move(kv).value()};
}

std::string describe(const StepTimeTable& table) {
  std::string points;
  for (const auto& [rows, ms] : table.points()) points += " " + std::to_string(rows) + ":" + fmt::format("{:.2f}", ms);
  return points;
}

}  // namespace

// A step-time table's file is a few hundred bytes; one far larger is not one.
constexpr uintmax_t kMaxStepTimeFileBytes = 1 << 20;

Result<StepTimes> step_times(const DsparkConfig& config, model::DeepSeekModel& model,
                             std::span<const backend::Buffer> layer_caches, int32_t num_blocks, int32_t max_num_seqs,
                             int32_t max_rows, bool dspark_module) {
  namespace fs = std::filesystem;
  // What this rank would do: 0 nothing ('const'), 1 use the file's table, 2 measure.
  int mode = 2;
  Result<StepTimes> loaded = Status::not_found("no step-time table file");
  const fs::path path = config.step_time_table == "const" ? fs::path() : fs::path(config.step_time_table);
  if (config.step_time_table == "const") {
    mode = 0;
  } else if (!path.empty() && fs::exists(path)) {
    // Only a regular file (or a link to one) of a table's size: a device, a FIFO or a directory would block the
    // read, never end it, or be replaced by the table written below.
    std::error_code error;
    if (!fs::is_regular_file(path, error)) {
      return Status::invalid_argument("--dspark-step-time-table " + path.string() +
                                      ": not a regular file (the step-time table is a JSON file DeepInfer writes "
                                      "there, or 'const')");
    }
    const uintmax_t size = fs::file_size(path, error);
    if (error || size > kMaxStepTimeFileBytes) {
      return Status::invalid_argument("--dspark-step-time-table " + path.string() + ": " +
                                      (error ? error.message()
                                             : std::to_string(size) + " bytes, more than a step-time table's " +
                                                   std::to_string(kMaxStepTimeFileBytes)));
    }
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    loaded = StepTimes::from_json(text.str(), config.identity);
    if (loaded.ok() && !loaded->verify.empty() && !loaded->draft.empty() && !loaded->mtp_kv.empty() &&
        loaded->verify.points().back().first >= max_rows) {
      mode = 1;
    } else {
      spdlog::info("dspark: measuring the step times again, {} ({})", path.string(),
                   loaded.ok() ? "the file has an empty table or stops short of " + std::to_string(max_rows) + " rows"
                               : loaded.status().message());
    }
  }
  // Data-parallel ranks in lock step (expert parallel, tokens exchanged): the measurement's target passes exchange
  // tokens in every MoE layer, so either every rank measures, making the same passes, or none does. The ranks agree
  // first: a rank whose table file is missing or stale makes all of them measure.
  const model::ExpertParallel& ep = model.expert_parallel();
  if (ep.size > 1 && ep.comm != nullptr && !ep.replicated_tokens) {
    const int size = ep.comm->size();
    std::array<float, 4> mine{static_cast<float>(mode), static_cast<float>(num_blocks),
                              static_cast<float>(max_num_seqs), static_cast<float>(max_rows)};
    std::vector<float> all(static_cast<size_t>(size) * mine.size());
    ep.comm->all_gather_rows(backend::Tensor{mine.data(), backend::DType::kF32, 1, 4, 4},
                             backend::Tensor{all.data(), backend::DType::kF32, size, 4, 4});
    if (Status s = ep.comm->status(); !s.ok()) return s;
    static constexpr const char* kWhat[4] = {"--dspark-step-time-table const", "KV cache blocks", "--max-num-seqs",
                                             "rows per step"};
    for (int r = 0; r < size; ++r) {
      for (size_t k = 0; k < mine.size(); ++k) {
        const float theirs = all[static_cast<size_t>(r) * mine.size() + k];
        const bool differs = k == 0 ? (theirs == 0.0f) != (mine[0] == 0.0f) : theirs != mine[k];
        if (!differs) continue;
        auto value = [&](float v) { return k == 0 ? std::string(v == 0.0f ? "on" : "off") : fmt::format("{}", v); };
        return Status::failed_precondition(
            fmt::format("dspark: the data-parallel ranks must measure the step times alike, but {} is {} on rank {} "
                        "and {} on rank {}",
                        kWhat[k], value(theirs), r, value(mine[k]), ep.comm->rank()));
      }
      if (all[static_cast<size_t>(r) * mine.size()] == 2.0f) mode = mode == 0 ? 0 : 2;
    }
  }
  if (mode == 0) {
    spdlog::info("dspark: step times 'const' (every draft made and verified)");
    return StepTimes{};
  }
  if (mode == 1) {
    spdlog::info("dspark: step times from {}", path.string());
    return loaded;
  }
  const auto start = std::chrono::steady_clock::now();
  Result<StepTimes> measured = measure_step_times(model, layer_caches, num_blocks, max_num_seqs, max_rows, dspark_module);
  if (!measured.ok()) return measured.status();
  if (measured->verify.empty() || measured->draft.empty()) {
    spdlog::warn("dspark: the KV cache ({} blocks) is too small to measure the step times; every draft will be "
                 "made and verified (as --dspark-step-time-table const)",
                 num_blocks);
    return StepTimes{};
  }
  spdlog::info("dspark: step times measured in {:.1f} s; verify (rows:ms){}; draft pass (chains:ms){}; MTP KV only "
               "(rows:ms){}",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
               describe(measured->verify), describe(measured->draft), describe(measured->mtp_kv));
  if (!path.empty()) {
    std::error_code error;
    if (path.has_parent_path()) fs::create_directories(path.parent_path(), error);
    // Per process: data-parallel ranks on one host measure at once and write the same file.
    const fs::path temporary = path.string() + ".tmp." + std::to_string(::getpid());
    if (!error) {
      std::ofstream out(temporary, std::ios::trunc);
      out << measured->to_json(config.identity) << "\n";
      if (!out) error = std::make_error_code(std::errc::io_error);
    }
    if (!error) fs::rename(temporary, path, error);
    if (error) {
      std::error_code ignored;
      fs::remove(temporary, ignored);
      spdlog::warn("dspark: could not write the step times to {}: {}", path.string(), error.message());
    } else {
      spdlog::info("dspark: step times written to {}", path.string());
    }
  }
  return measured;
}

Result<KvCachePlan> plan_kv_cache(const EngineConfig& resolved, const kvcache::CacheLayout& layout,
                                  int64_t sequence_bytes) {
  if (Status status = layout.validate(); !status.ok()) return status;
  const int64_t ring_bytes = sequence_bytes * resolved.max_num_seqs;
  if (ring_bytes > 0 && resolved.kv_cache_bytes <= ring_bytes) {
    return Status::invalid_argument("kv_cache_bytes (--kv-cache-memory) " + std::to_string(resolved.kv_cache_bytes) +
                                    " does not hold the window rings of max_num_seqs (--max-num-seqs) " +
                                    std::to_string(resolved.max_num_seqs) + " sequences (" +
                                    std::to_string(ring_bytes) + " bytes, then at least one block)");
  }
  // The main pool's blocks hold the kinds that keep every token; each window kind has a pool of its own:
  // twice what the running sequences can hold at once (the rest caches finished prefixes' last windows).
  const int64_t block_bytes = layout.full_block_bytes();
  SchedulerConfig limits;
  limits.max_num_batched_tokens = resolved.max_num_batched_tokens;
  int64_t window_blocks = 0;
  int64_t window_bytes = 0;
  for (const kvcache::CacheKindSpec& spec : layout.window_specs()) {
    const int64_t per_sequence = Scheduler::min_window_blocks(limits, spec.window_tokens);
    window_blocks = std::max<int64_t>(window_blocks, 2 * (per_sequence + int64_t{resolved.max_num_seqs} *
                                                                           kvcache::blocks_for_tokens(spec.window_tokens)));
  }
  for (const kvcache::CacheKindSpec& spec : layout.window_specs()) window_bytes += window_blocks * spec.block_bytes();
  const int64_t num_blocks = (resolved.kv_cache_bytes - ring_bytes - window_bytes) / block_bytes;
  if (num_blocks < 1) {
    const std::string rings =
        ring_bytes == 0 ? std::string() : ", less " + std::to_string(ring_bytes) + " bytes for the window rings";
    const std::string windows =
        window_bytes == 0 ? std::string()
                          : ", less " + std::to_string(window_bytes) + " bytes for the sliding-window pool (" +
                                std::to_string(window_blocks) + " window blocks for max_num_seqs " +
                                std::to_string(resolved.max_num_seqs) + " and max_num_batched_tokens " +
                                std::to_string(resolved.max_num_batched_tokens) + "),";
    return Status::invalid_argument("kv_cache_bytes (--kv-cache-memory) " + std::to_string(resolved.kv_cache_bytes) +
                                    rings + windows +
                                    " holds no KV block; one block needs " + std::to_string(block_bytes) +
                                    " bytes: raise --kv-cache-memory");
  }
  SchedulerConfig scheduler_config;
  scheduler_config.max_num_batched_tokens = resolved.max_num_batched_tokens;
  scheduler_config.max_num_seqs = resolved.max_num_seqs;
  scheduler_config.num_blocks = static_cast<int32_t>(std::min<int64_t>(num_blocks, INT32_MAX));
  scheduler_config.enable_prefix_caching = resolved.enable_prefix_caching;
  // Without the checkpoint's identity the cache cannot outlive this engine: a fixed value serves the device
  // and host tiers, which live and die with it and its one model; the disk tier requires the real one.
  const bool has_fingerprint = resolved.fingerprint != kvcache::ModelFingerprint{};
  scheduler_config.fingerprint =
      has_fingerprint ? resolved.fingerprint : kvcache::model_fingerprint("deepinfer-engine-device-tier", "");
  if (!resolved.disk_cache_path.empty() && !has_fingerprint) {
    return Status::invalid_argument("the disk KV tier (" + resolved.disk_cache_path +
                                    ") needs the checkpoint's fingerprint in EngineConfig.fingerprint");
  }
  if (!resolved.disk_cache_path.empty() && resolved.host_cache_bytes <= 0) {
    return Status::invalid_argument("the disk KV tier (" + resolved.disk_cache_path +
                                    ") loads through the host tier: set a host cache size too");
  }
  if (resolved.host_cache_bytes > 0 && !resolved.enable_prefix_caching) {
    return Status::invalid_argument("the host/disk KV tiers need prefix caching; it is off");
  }
  kvcache::KvCacheConfig cache_config;
  cache_config.num_device_blocks = scheduler_config.num_blocks;
  cache_config.enable_prefix_caching = resolved.enable_prefix_caching;
  cache_config.block_bytes = static_cast<size_t>(block_bytes);
  cache_config.window_blocks = static_cast<int32_t>(std::min<int64_t>(window_blocks, INT32_MAX));
  cache_config.bounded_replay = resolved.swa_bounded_replay && !layout.window_specs().empty();
  if (!(resolved.kv_cache_ttl_hours > 0)) {
    return Status::invalid_argument("kv_cache_ttl_hours must be > 0, got " + std::to_string(resolved.kv_cache_ttl_hours));
  }
  cache_config.retention = kvcache::RetentionConfig::defaults(resolved.kv_cache_ttl_hours);
  if (resolved.host_cache_bytes > 0) {
    cache_config.host_blocks = resolved.host_cache_bytes / block_bytes;
    if (cache_config.host_blocks < 1) {
      return Status::invalid_argument("host KV cache of " + std::to_string(resolved.host_cache_bytes) +
                                      " bytes holds no block; one block needs " + std::to_string(block_bytes));
    }
    cache_config.host_evict_bytes_per_s = resolved.host_evict_bytes_per_s;
    if (!resolved.disk_cache_path.empty()) {
      kvcache::DiskBlockStoreOptions disk;
      disk.directory = resolved.disk_cache_path;
      disk.fingerprint = scheduler_config.fingerprint;
      disk.model_name = resolved.disk_cache_model_name;
      disk.reset_foreign = resolved.disk_cache_reset;
      disk.block_bytes = cache_config.block_bytes;
      disk.capacity_blocks = resolved.disk_cache_bytes / block_bytes;
      if (disk.capacity_blocks < 1) {
        return Status::invalid_argument("disk KV cache of " + std::to_string(resolved.disk_cache_bytes) +
                                        " bytes holds no block; one block needs " + std::to_string(block_bytes));
      }
      cache_config.disk = std::move(disk);
    }
  }
  cache_config.layout = layout;
  return KvCachePlan{scheduler_config, std::move(cache_config)};
}

Engine::~Engine() { scheduler_.cache().shutdown(); }

KvTierStats Engine::kv_tier_stats() const {
  KvTierStats stats = scheduler_.cache().counters();
  stats.loaded_blocks = scheduler_.num_prefix_loaded_tokens() / kvcache::kBlockTokens;
  return stats;
}

std::map<std::string, std::vector<kvcache::BlockHash>> Engine::kv_blocks_by_medium() const {
  std::map<std::string, std::vector<kvcache::BlockHash>> out;
  const kvcache::KvCacheManager& cache = scheduler_.cache();
  out[std::string(device_medium())] = cache.blocks_in(kvcache::Tier::kDevice);
  if (cache.has_lower_tiers()) {
    out[std::string(kvcache::kMediumHost)] = cache.blocks_in(kvcache::Tier::kHost);
    out[std::string(kvcache::kMediumDisk)] = cache.blocks_in(kvcache::Tier::kDisk);
  }
  return out;
}

std::string_view Engine::device_medium() const {
  return backend_->name() == "cuda" ? kvcache::kMediumGpu : kvcache::kMediumDevice;
}

void Engine::flush_kv_tiers() { scheduler_.cache().flush(); }

namespace {

// The longest request the KV cache holds when it runs alone (every other one preempted): max_model_len must
// not exceed it, or a request is accepted and fails once it has outgrown the cache. Given explicitly, a larger
// max_model_len is refused naming both flags (as vLLM refuses it); left to default, it is lowered to the cache's
// capacity (as SGLang caps its max request length) and the log says so.
Status fit_max_model_len(EngineConfig& resolved, bool given, int32_t num_blocks, int32_t lookahead_tokens) {
  const int64_t capacity = int64_t{num_blocks} * kvcache::kBlockTokens - lookahead_tokens;
  if (resolved.max_model_len <= capacity) return Status();
  if (given || capacity < 2) {
    return Status::invalid_argument(
        "max_model_len (--max-model-len) " + std::to_string(resolved.max_model_len) + " does not fit the KV cache: " +
        "kv_cache_bytes (--kv-cache-memory) " + std::to_string(resolved.kv_cache_bytes) + " holds " +
        std::to_string(num_blocks) + " blocks = " + std::to_string(std::max<int64_t>(capacity, 0)) +
        " tokens of one request; raise --kv-cache-memory (or --gpu-memory-utilization) or lower --max-model-len");
  }
  spdlog::info("max_model_len {} (max_position_embeddings) is lowered to {}: the KV cache ({} blocks) holds no "
               "longer request; raise --kv-cache-memory for more",
               resolved.max_model_len, capacity, num_blocks);
  resolved.max_model_len = capacity;
  return Status();
}

}  // namespace

Result<std::unique_ptr<Engine>> Engine::create(std::unique_ptr<backend::Backend> backend,
                                               std::unique_ptr<model::DeepSeekModel> model,
                                               const EngineConfig& config) {
  const model::ModelConfig& c = model->config();
  EngineConfig resolved = config;
  if (resolved.max_model_len <= 0) resolved.max_model_len = c.max_position_embeddings;
  if (Status s = resolved.speculative.validate(c.num_nextn_predict_layers, c.dspark.has_value()); !s.ok()) return s;
  // MTP drafting caches the MTP layer's KV as one more layer of every block (rolled back and prefix-cached with
  // the main layers'; the chains use layer 0, as the checkpoints ship one); DSpark with a draft module caches its S
  // stages' instead.
  const bool dspark_module = resolved.speculative.algorithm == SpeculativeAlgorithm::kDspark && c.dspark.has_value();
  const int32_t mtp_cached_layers =
      !resolved.speculative.enabled() ? 0 : dspark_module ? static_cast<int32_t>(c.dspark->num_stages()) : 1;
  // One block of every layer's cache, in the backend's cache dtype (float32 on CPU, bf16 on CUDA).
  const int64_t block_bytes =
      static_cast<int64_t>(model->layer_block_bytes()) * (c.num_hidden_layers + mtp_cached_layers);
  kvcache::CacheLayout layout;
  for (const model::DeepSeekModel::CachedKind& kind : model->cached_kinds(mtp_cached_layers)) {
    Result<kvcache::CacheKind> id = kvcache::CacheLayout::kind_from_name(kind.name);
    if (!id.ok()) return id.status();
    layout.kinds.push_back({*id, kind.name, kind.num_layers, kind.token_bytes, kind.window_tokens});
  }
  DEEPINFER_CHECK(layout.block_bytes() == block_bytes, "the layout sizes the blocks the model writes");
  if (!layout.window_kinds().empty()) {
    return Status::unsupported("the model caches a sliding-window kind; its forward pass (V4) does not run yet");
  }
  Result<KvCachePlan> plan = plan_kv_cache(resolved, layout);
  if (!plan.ok()) return plan.status();
  SchedulerConfig scheduler_config = plan->scheduler;
  scheduler_config.num_lookahead_slots = resolved.speculative.enabled() ? resolved.speculative.num_draft_tokens : 0;
  if (Status s = fit_max_model_len(resolved, config.max_model_len > 0, scheduler_config.num_blocks,
                                   scheduler_config.num_lookahead_slots);
      !s.ok()) {
    return s;
  }
  if (!resolved.kv_events_endpoint.empty() && !resolved.enable_prefix_caching) {
    return Status::invalid_argument("KV events need prefix caching; it is off");
  }
  Result<std::unique_ptr<kvcache::KvCacheManager>> cache = kvcache::KvCacheManager::create(std::move(plan->cache));
  if (!cache.ok()) return cache.status();
  Result<Scheduler> scheduler = Scheduler::create(scheduler_config, std::move(cache).value());
  if (!scheduler.ok()) return scheduler.status();
  Result<std::vector<backend::Buffer>> layer_caches = model->make_layer_caches(scheduler_config.num_blocks);
  if (!layer_caches.ok()) return layer_caches.status();
  for (int32_t i = 0; i < mtp_cached_layers; ++i) {
    // Indexed like the main layers' block for block; the draft chains' (blocks') scratch blocks after them.
    const int64_t mtp_blocks = int64_t{scheduler_config.num_blocks} + scheduler_config.max_num_seqs;
    Result<backend::Buffer> mtp_cache = model->make_draft_layer_cache(mtp_blocks);
    if (!mtp_cache.ok()) return mtp_cache.status();
    layer_caches->push_back(std::move(mtp_cache).value());
  }
  std::unique_ptr<DraftPlanner> planner;
  if (resolved.speculative.algorithm == SpeculativeAlgorithm::kDspark) {
    const int32_t max_rows = std::min<int32_t>(
        scheduler_config.max_num_batched_tokens,
        scheduler_config.max_num_seqs * (resolved.speculative.num_draft_tokens + 1));
    Result<StepTimes> times = step_times(resolved.speculative.dspark, *model, *layer_caches,
                                         scheduler_config.num_blocks, scheduler_config.max_num_seqs, max_rows,
                                         dspark_module);
    if (!times.ok()) return times.status();
    const int32_t longest =
        dspark_module ? std::min<int32_t>(resolved.speculative.num_draft_tokens, static_cast<int32_t>(c.dspark->block_size))
                      : resolved.speculative.num_draft_tokens;
    planner = std::make_unique<DsparkPlanner>(resolved.speculative.dspark, std::move(times).value(), longest,
                                              dspark_module);
  }
  auto engine = std::unique_ptr<Engine>(new Engine(std::move(backend), std::move(model), resolved,
                                                   std::move(scheduler).value(), std::move(layer_caches).value(),
                                                   std::move(planner)));
  if (Status s = engine->attach_cache_io(static_cast<size_t>(block_bytes)); !s.ok()) return s;
  return engine;
}

bool Engine::idle_tick() {
  scheduler_.cache().tick();
  return scheduler_.cache().has_background_work();
}

Status Engine::set_lockstep(bool on) {
  // Speculative decoding keeps one target pass per step (the verify); its draft passes (the MTP layer, whose experts
  // every rank holds whole, or the dense DSpark module) exchange nothing, so the ranks may draft differently.
  if (on && model_ == nullptr) {
    return Status::failed_precondition("lock-step passes need a V2/V3 model (DeepSeekModel)");
  }
  lockstep_ = on;
  return Status();
}

int64_t Engine::num_replayed_tokens() const { return v4_executor_ ? v4_executor_->replayed_tokens() : -1; }

Status Engine::attach_cache_io(size_t block_bytes) {
  // Tensor parallel: a block write is a command to the other ranks, on the channel the passes use, so it takes
  // turns with the steps on the CPU backend too.
  model::DeepSeekModel* replicas = model_ && model_->tensor_parallel().size > 1 ? model_.get() : nullptr;
  if (backend_->name() != "cpu" || replicas != nullptr) step_gate_ = std::make_unique<StepGate>();
  block_bytes_ = block_bytes;
  device_blocks_ =
      std::make_unique<DeviceBlocks>(*backend_, layer_caches_, block_bytes, step_gate_.get(), replicas);
  scheduler_.cache().set_device_io(device_blocks_.get());
  if (!config_.kv_events_endpoint.empty()) {
    kvcache::KvEventPublisherConfig events;
    events.endpoint = config_.kv_events_endpoint;
    events.replay_endpoint = config_.kv_events_replay_endpoint;
    Result<std::unique_ptr<kvcache::KvEventPublisher>> publisher = kvcache::KvEventPublisher::start(events);
    if (!publisher.ok()) return publisher.status();
    kv_events_ = std::move(publisher).value();
    // A fresh worker holds nothing on device and host: subscribers drop what they knew, then learn the disk.
    kv_events_->publish(kvcache::KvEvent::all_cleared());
    scheduler_.cache().set_event_sink(kv_events_.get(), std::string(device_medium()));
    kv_events_->flush();
  }
  return Status();
}

Result<std::unique_ptr<Engine>> Engine::create(std::unique_ptr<backend::Backend> backend,
                                               std::unique_ptr<model::DeepSeekV4Model> model,
                                               const EngineConfig& config) {
  if (config.speculative.enabled()) {
    return Status::unsupported("speculative decoding does not run DeepSeek-V4 yet (its MTP layer is not loaded)");
  }
  const model::V4Config& v = model->config();
  EngineConfig resolved = config;
  const model::ModelConfig c = model->engine_config();
  if (resolved.max_model_len <= 0) resolved.max_model_len = c.max_position_embeddings;
  // The hybrid layout: a block of the main pool = one block payload (DeepSeekV4Model::block_payload_floats: the
  // compressed kinds, kept for every block and in the tiers); a block of the window pool = one window payload (the
  // raw rows and compressor rows of every layer, kept only for the last window). Each running sequence's
  // V4 cache keeps its window rings besides (window_bytes_per_sequence). Elements of the backend's activation dtype
  // (CPU: float32, CUDA: bf16).
  const int64_t payload_bytes = model->block_payload_floats() * model->payload_element_bytes();
  const int64_t window_payload_bytes = model->window_payload_floats() * model->payload_element_bytes();
  const kvcache::CacheLayout layout{{
      {kvcache::CacheKind::kCompressed, "compressed", 1,
       (payload_bytes + kvcache::kBlockTokens - 1) / kvcache::kBlockTokens, 0},
      {kvcache::CacheKind::kSlidingWindow, "sliding_window", 1,
       (window_payload_bytes + kvcache::kBlockTokens - 1) / kvcache::kBlockTokens, static_cast<int32_t>(v.sliding_window)}}};
  const int64_t window_stride = layout.window_specs()[0].block_bytes();  // >= window_payload_bytes
  Result<KvCachePlan> plan = plan_kv_cache(resolved, layout, model->window_bytes_per_sequence());
  if (!plan.ok()) return plan.status();
  if (Status s = fit_max_model_len(resolved, config.max_model_len > 0, plan->scheduler.num_blocks, 0); !s.ok()) {
    return s;
  }
  Result<std::unique_ptr<kvcache::KvCacheManager>> cache = kvcache::KvCacheManager::create(std::move(plan->cache));
  if (!cache.ok()) return cache.status();
  Result<Scheduler> scheduler = Scheduler::create(plan->scheduler, std::move(cache).value());
  if (!scheduler.ok()) return scheduler.status();
  const size_t block_bytes = static_cast<size_t>(layout.full_block_bytes());
  Result<backend::Buffer> blocks = backend->alloc(block_bytes * static_cast<size_t>(plan->scheduler.num_blocks));
  if (!blocks.ok()) return blocks.status();
  Result<backend::Buffer> window_pool =
      backend->alloc(static_cast<size_t>(window_stride) * static_cast<size_t>(plan->cache.window_blocks));
  if (!window_pool.ok()) return window_pool.status();
  std::vector<backend::Buffer> layer_caches;
  layer_caches.push_back(std::move(blocks).value());
  auto engine = std::unique_ptr<Engine>(new Engine(std::move(backend), nullptr, resolved, std::move(scheduler).value(),
                                                   std::move(layer_caches), nullptr));
  engine->v4_model_ = std::move(model);
  engine->v4_windows_ = std::move(window_pool).value();
  engine->kv_cache_bytes_ += engine->v4_windows_.bytes;
  engine->model_config_ = c;
  const int32_t threads = config.sampling_threads > 0 ? config.sampling_threads : std::clamp(omp_get_max_threads(), 1, 16);
  engine->executor_ = std::make_unique<V4Executor>(*engine->v4_model_, engine->layer_caches_[0], block_bytes,
                                                   engine->v4_windows_, static_cast<size_t>(window_stride),
                                                   threads, config.parallel_sampling_min_logits);
  engine->v4_executor_ = static_cast<V4Executor*>(engine->executor_.get());
  if (Status s = engine->attach_cache_io(block_bytes); !s.ok()) return s;
  return engine;
}

Result<SequenceId> Engine::submit(std::vector<TokenId> prompt, const SamplingParams& params, KvHandoff handoff) {
  // A reservation ends with this submit, whatever its outcome (import_reserved consumes it on the way).
  struct EndReservation {
    Engine& engine;
    uint64_t id;
    ~EndReservation() {
      if (id != 0) engine.release_kv_blocks(id);
    }
  } end_reservation{*this, handoff.reservation};
  const model::ModelConfig& c = model_config_;
  if (v4_model_ && !handoff.empty()) {
    return Status::failed_precondition("KV handoff (prefill/decode disaggregation) does not run DeepSeek-V4 yet");
  }
  if (prompt.empty()) return Status::invalid_argument("the prompt has no tokens");
  if (!handoff.import_blocks.empty() && handoff.reservation == 0) {
    return Status::invalid_argument("KV blocks from a prefill worker go into a reservation (reserve_kv_blocks)");
  }
  if (Status s = params.validate(c.vocab_size); !s.ok()) return s;
  static const size_t classes = kvcache::RetentionConfig::defaults().classes.size();
  if (params.kv_ttl_class >= classes) {
    return Status::invalid_argument("kv_ttl_class " + std::to_string(params.kv_ttl_class) +
                                    " is not a retention class (0.." + std::to_string(classes - 1) + ")");
  }
  for (TokenId id : prompt) {
    if (id < 0 || id >= c.vocab_size) {
      return Status::invalid_argument("prompt token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                      std::to_string(c.vocab_size) + ")");
    }
  }
  const int64_t room = config_.max_model_len - static_cast<int64_t>(prompt.size());
  if (room < 1) {
    return Status::invalid_argument("the prompt has " + std::to_string(prompt.size()) + " tokens; max_model_len is " +
                                    std::to_string(config_.max_model_len));
  }
  SequenceRequest request;
  request.id = next_id_++;
  request.prompt_token_ids = prompt;
  request.max_tokens = std::min(params.max_tokens.value_or(room), room);
  request.stop_token_ids = params.stop_token_ids;
  request.ttl_class = params.kv_ttl_class;
  if (!params.ignore_eos) {
    for (int64_t eos : c.eos_token_ids) request.stop_token_ids.push_back(static_cast<TokenId>(eos));
  }
  const SequenceId id = request.id;
  if (handoff.reservation != 0) {
    if (Status s = import_reserved(handoff.reservation, handoff.import_blocks, handoff.import_first_block,
                                   params.kv_ttl_class);
        !s.ok()) {
      return s;
    }
  }
  if (Status s = executor_->add_request(id, prompt, params); !s.ok()) return s;
  if (Status s = scheduler_.add(std::move(request)); !s.ok()) {
    executor_->remove_request(id);
    return s;
  }
  if (handoff.export_block) {
    exports_[id] = Export{std::move(handoff.export_block), std::max<int64_t>(handoff.export_from_block, 0),
                          static_cast<int64_t>(prompt.size()) / kvcache::kBlockTokens};
  }
  return id;
}

Result<KvReservation> Engine::reserve_kv_blocks(std::span<const TokenId> tokens) {
  kvcache::KvCacheManager& cache = scheduler_.cache();
  if (v4_model_) return Status::failed_precondition("KV handoff does not run DeepSeek-V4 yet");
  if (!cache.prefix_caching()) {
    return Status::failed_precondition("KV blocks from a prefill worker need the prefix cache (not --no-prefix-caching)");
  }
  if (cache.num_window_pools() > 0) {
    return Status::failed_precondition("KV blocks from a prefill worker: models with sliding-window caches are not "
                                       "handed over yet");
  }
  const size_t n = tokens.size() / kvcache::kBlockTokens;
  Reservation r;
  r.tokens.assign(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(n * kvcache::kBlockTokens));
  r.chain = kvcache::block_hash_chain(r.tokens, scheduler_.config().fingerprint);
  for (size_t i = 0; i < n; ++i) {
    std::optional<kvcache::BlockId> held = cache.device_block_of(r.chain[i]);
    if (!held) break;
    cache.retain(*held);
    r.held.push_back(*held);
  }
  const size_t wanted = n - r.held.size();
  // Room: the transfer's blocks, and one more block per running request, so that a reservation never makes the
  // scheduler preempt a running request for the next block it grows into.
  const int64_t headroom = scheduler_.num_running();
  if (static_cast<int64_t>(cache.num_free_blocks()) < static_cast<int64_t>(wanted) + headroom) {
    const int64_t free_blocks = cache.num_free_blocks();
    release_reservation_blocks(r);
    return Status::resource_exhausted("the KV cache has " + std::to_string(free_blocks) + " free blocks; a transfer of " +
                                      std::to_string(wanted) + " needs them plus one per running request (" +
                                      std::to_string(headroom) + ")");
  }
  for (size_t i = 0; i < wanted; ++i) {
    std::optional<kvcache::BlockId> block = cache.allocate();
    if (!block) break;
    r.blocks.push_back(*block);
  }
  if (r.blocks.size() < wanted) {
    const size_t got = r.blocks.size();
    release_reservation_blocks(r);
    return Status::resource_exhausted("the KV cache has room for " + std::to_string(got) + " of the " +
                                      std::to_string(wanted) + " blocks a transfer would bring");
  }
  KvReservation out;
  out.id = next_reservation_++;
  out.first_block = static_cast<int64_t>(r.held.size());
  out.blocks = r.blocks;
  reservations_.emplace(out.id, std::move(r));
  return out;
}

void Engine::release_kv_blocks(uint64_t reservation) {
  auto it = reservations_.find(reservation);
  if (it == reservations_.end()) return;
  release_reservation_blocks(it->second);
  reservations_.erase(it);
}

void Engine::release_reservation_blocks(const Reservation& r) {
  kvcache::KvCacheManager& cache = scheduler_.cache();
  for (kvcache::BlockId block : r.held) cache.release(block);
  for (kvcache::BlockId block : r.blocks) cache.release(block);
}

Status Engine::import_reserved(uint64_t reservation, std::vector<std::vector<std::byte>>& payloads,
                               int64_t first_block, kvcache::TtlClassId ttl_class) {
  auto it = reservations_.find(reservation);
  if (it == reservations_.end()) return Status::invalid_argument("KV reservation " + std::to_string(reservation) +
                                                                 " is not open (released, or used by a submit)");
  Reservation& r = it->second;
  if (first_block != static_cast<int64_t>(r.held.size()) || payloads.size() != r.blocks.size()) {
    return Status::invalid_argument("KV blocks from a prefill worker: " + std::to_string(payloads.size()) +
                                    " blocks from block " + std::to_string(first_block) + ", but the reservation is " +
                                    std::to_string(r.blocks.size()) + " from block " + std::to_string(r.held.size()));
  }
  std::vector<const std::byte*> sources;
  for (const std::vector<std::byte>& payload : payloads) {
    if (payload.size() != block_bytes_) {
      return Status::invalid_argument("a KV block from the prefill worker has " + std::to_string(payload.size()) +
                                      " bytes; this worker's blocks have " + std::to_string(block_bytes_) +
                                      " (another model, cache dtype or speculative setting)");
    }
    sources.push_back(payload.data());
  }
  if (Status s = device_blocks_->write_blocks(r.blocks, sources); !s.ok()) return s;
  payloads.clear();
  if (!r.blocks.empty()) {
    kvcache::KvCacheManager& cache = scheduler_.cache();
    std::vector<kvcache::BlockId> all = r.held;
    all.insert(all.end(), r.blocks.begin(), r.blocks.end());
    std::vector<kvcache::NodeId> nodes = cache.insert(
        r.chain, all, cache.publishes_events() ? std::span<const TokenId>(r.tokens) : std::span<const TokenId>{},
        ttl_class);
    cache.release_nodes(nodes);
    if (kv_events_) kv_events_->flush();
  }
  return Status::ok_status();  // the caller's EndReservation releases the holds: cached blocks stay cached
}

void Engine::export_blocks(const ScheduledBatch& batch) {
  // Every block this step completed, of every exporting entry, read in one batch.
  struct Pending {
    SequenceId sequence;
    int64_t index;  // the block's position in the prompt
  };
  std::vector<Pending> pending;
  std::vector<kvcache::BlockId> blocks;
  for (const ScheduledEntry& entry : batch.entries) {
    auto it = exports_.find(entry.sequence_id);
    if (it == exports_.end()) continue;
    Export& out = it->second;
    const int64_t done = std::min(entry.end_position() / kvcache::kBlockTokens, out.prompt_blocks);
    for (; out.next_block < done; ++out.next_block) {
      pending.push_back({entry.sequence_id, out.next_block});
      blocks.push_back(entry.block_table[static_cast<size_t>(out.next_block)]);
    }
  }
  if (blocks.empty()) return;
  std::vector<std::vector<std::byte>> payloads(blocks.size());
  std::vector<std::byte*> targets(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    payloads[i].resize(block_bytes_);
    targets[i] = payloads[i].data();
  }
  if (Status s = device_blocks_->read_blocks(blocks, targets); !s.ok()) {
    // The receivers' checksums and timeouts end those transfers; the requests go on.
    spdlog::error("reading {} KV blocks to send: {}", blocks.size(), s.to_string());
    for (const Pending& p : pending) exports_.erase(p.sequence);
    return;
  }
  for (size_t i = 0; i < pending.size(); ++i) {
    auto it = exports_.find(pending[i].sequence);
    if (it != exports_.end()) it->second.send(pending[i].index, std::move(payloads[i]));
  }
}

Status Engine::cancel(SequenceId id) { return scheduler_.cancel(id); }

Result<std::vector<TokenEvent>> Engine::step() {
  ScheduledBatch batch = scheduler_.schedule();
  num_preemptions_ += static_cast<int64_t>(batch.preempted.size());
  std::vector<TokenEvent> events;
  // Prompt tokens reused from the cache; V4: those a restore recomputed (bounded replay) were matched but not reused.
  auto reused = [&](SequenceId id, int64_t cached) {
    return std::max<int64_t>(cached - (v4_executor_ ? v4_executor_->replayed_tokens(id) : 0), 0);
  };
  for (const FinishedSequence& finished : batch.finished) {
    events.push_back({finished.id, std::nullopt, std::nullopt, {}, true, finished.reason, finished.message,
                      reused(finished.id, finished.num_cached_tokens)});
    executor_->remove_request(finished.id);
    exports_.erase(finished.id);
  }
  if (mtp_executor_ != nullptr && !batch.finished.empty()) mtp_executor_->add_counters(speculative_stats_);
  if (batch.empty() && lockstep_) {
    // Data parallel: the other ranks' MoE layers exchange tokens with this one, so it passes too, with none.
    GateTurn turn(step_gate_.get());
    if (Status s = model_->forward_greedy(model::ForwardBatch{}, layer_caches_, idle_ids_); !s.ok()) return s;
  }
  if (batch.empty()) {
    // Only requests waiting for their KV to arrive: sleep until a transfer completes instead of spinning.
    if (scheduler_.num_loading() > 0) scheduler_.cache().wait_for_transfers(std::chrono::milliseconds(20));
    if (kv_events_) kv_events_->flush();
    return events;
  }
  Result<StepOutput> out = [&] {
    GateTurn turn(step_gate_.get());
    return executor_->run(batch);
  }();
  if (!out.ok()) return out.status();
  if (!exports_.empty()) export_blocks(batch);
  // Speculative decoding's counters: the executor's verdicts, before update() trims tokens past a finish.
  for (size_t i = 0; i < out->drafts_verified.size() && i < out->entries.size(); ++i) {
    const int32_t drafts = out->drafts_verified[i];
    if (drafts > 0) speculative_stats_.record(drafts, static_cast<int32_t>(out->entries[i].size()) - 1);
  }
  if (mtp_executor_ != nullptr) mtp_executor_->add_counters(speculative_stats_);
  if (Status s = scheduler_.update(batch, *out); !s.ok()) return s;
  if (kv_events_) kv_events_->flush();  // one batch of KV events per step, as vLLM publishes them
  // Each kept token is one event, in order; a finish (stop token, length) is reported once, by the next step's
  // `finished` list.
  for (size_t i = 0; i < batch.entries.size(); ++i) {
    const SequenceId id = batch.entries[i].sequence_id;
    const SequenceState* seq = out->entries[i].empty() ? nullptr : scheduler_.find(id);
    const int64_t cached = seq != nullptr ? reused(id, seq->num_cached_tokens) : 0;
    for (SampledToken& token : out->entries[i]) {
      events.push_back({id, token.token_id, token.logprob, std::move(token.top_logprobs), false, FinishReason::kNone,
                        {}, cached});
    }
  }
  return events;
}

}  // namespace deepinfer::engine
