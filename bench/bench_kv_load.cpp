// Decode step time while another request pulls its KV from the disk tier (the engine-core issue's item 3):
// 8 sequences decode on the real engine (the demo model by default); we time their steps alone, then while a
// request whose prefix (--pull-gib of KV, written to the disk tier first and dropped from the page cache) is
// loaded disk -> host -> device by the KV cache's mover. The pulling request is cancelled the moment its blocks
// have arrived, so the steps timed are the 8 decoders' only. Prints JSON lines: the setup, then one line per
// phase (p50/p99/max step ms: alone, while pulling, alone again after), then the comparison (p99 while pulling
// against the larger of the two alone phases: the decoders' contexts grow during a long pull).
//
// Usage: bench_kv_load [--model DIR] [--pull-gib 1.0] [--decoders 8] [--steps 200] [--threads N] [--dir PATH]
#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include <boost/json.hpp>

#include "deepinfer/engine/engine.h"
#include "deepinfer/kvcache/disk_block_store.h"

namespace {

using namespace deepinfer;
using Clock = std::chrono::steady_clock;

void print(boost::json::object line) { std::cout << boost::json::serialize(line) << std::endl; }

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5));
  return v[i];
}

boost::json::object summary(const std::string& phase, const std::vector<double>& ms) {
  double sum = 0;
  for (double x : ms) sum += x;
  return {{"bench", "kv_load_decode_steps"}, {"phase", phase}, {"steps", static_cast<int64_t>(ms.size())},
          {"p50_ms", percentile(ms, 0.5)}, {"p99_ms", percentile(ms, 0.99)},
          {"max_ms", ms.empty() ? 0.0 : *std::max_element(ms.begin(), ms.end())},
          {"mean_ms", ms.empty() ? 0.0 : sum / static_cast<double>(ms.size())}};
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir = std::string(DEEPINFER_SOURCE_DIR) + "/models/demo";
  double pull_gib = 1.0;
  int decoders = 8;
  int steps = 200;
  int threads = 0;
  std::string dir = (std::filesystem::temp_directory_path() / "deepinfer-bench-kv-load").string();
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << flag << " needs a value\n";
        std::exit(2);
      }
      return argv[++i];
    };
    if (flag == "--model") model_dir = next();
    else if (flag == "--pull-gib") pull_gib = std::stod(next());
    else if (flag == "--decoders") decoders = std::stoi(next());
    else if (flag == "--steps") steps = std::stoi(next());
    else if (flag == "--threads") threads = std::stoi(next());
    else if (flag == "--dir") dir = next();
    else {
      std::cerr << "unknown flag " << flag << "\n";
      return 2;
    }
  }
  if (threads > 0) omp_set_num_threads(threads);

  auto backend = backend::make_cpu_backend();
  auto model = model::DeepSeekModel::load(model_dir, *backend, backend::Precision::kF32);
  if (!model.ok()) {
    std::cerr << model.status().to_string() << "\n";
    return 1;
  }
  const model::ModelConfig mc = (*model)->config();
  const int64_t block_bytes = static_cast<int64_t>((*model)->layer_block_bytes()) * mc.num_hidden_layers;
  const int64_t pull_blocks = static_cast<int64_t>(pull_gib * (1 << 30) / static_cast<double>(block_bytes)) + 1;
  const int64_t pull_tokens = pull_blocks * kBlockTokens + 1;  // the last token is computed, never loaded
  const kvcache::ModelFingerprint fingerprint = kvcache::model_fingerprint("bench_kv_load", model_dir);

  // The pulling request's prompt, and its blocks on disk (random bytes: nothing reads them but the loader).
  std::mt19937 rng(11);
  auto random_prompt = [&](int64_t n) {
    std::vector<engine::TokenId> ids(static_cast<size_t>(n));
    for (auto& id : ids) id = static_cast<engine::TokenId>(3 + rng() % (mc.vocab_size - 3));
    return ids;
  };
  const std::vector<engine::TokenId> pull_prompt = random_prompt(pull_tokens);
  std::filesystem::remove_all(dir);
  const auto write_start = Clock::now();
  {
    kvcache::DiskBlockStoreOptions options;
    options.directory = dir;
    options.fingerprint = fingerprint;
    options.model_name = "bench_kv_load";
    options.block_bytes = static_cast<size_t>(block_bytes);
    options.capacity_blocks = pull_blocks + 1024;
    options.sync = false;
    auto store = kvcache::DiskBlockStore::open(options);
    if (!store.ok()) {
      std::cerr << store.status().to_string() << "\n";
      return 1;
    }
    const std::vector<kvcache::BlockHash> chain = kvcache::block_hash_chain(pull_prompt, fingerprint);
    std::vector<std::byte> payload(static_cast<size_t>(block_bytes));
    for (size_t b = 0; b < chain.size(); ++b) {
      for (size_t k = 0; k < payload.size(); k += 64) payload[k] = static_cast<std::byte>(rng());
      if (Status s = (*store)->put(chain[b], b == 0 ? kvcache::kRootBlockHash : chain[b - 1], payload); !s.ok()) {
        std::cerr << s.to_string() << "\n";
        return 1;
      }
    }
  }
  // Out of the page cache, so the load reads the disk (best effort: the kernel may keep some).
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    int fd = ::open(entry.path().c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  const double write_s = std::chrono::duration<double>(Clock::now() - write_start).count();

  engine::EngineConfig config;
  config.max_num_seqs = decoders + 1;
  config.max_num_batched_tokens = 2048;
  config.max_model_len = pull_tokens + 64;
  // Room for the decoders to run the whole benchmark without preemption (up to 4,000 steps while pulling).
  config.kv_cache_bytes = (pull_blocks + decoders * ((64 + 20 + steps + 4000) / kBlockTokens + 2) + 64) * block_bytes;
  config.host_cache_bytes = (pull_blocks + 64) * block_bytes;
  config.disk_cache_path = dir;
  config.disk_cache_bytes = (pull_blocks + 1024) * block_bytes;
  config.disk_cache_model_name = "bench_kv_load";
  config.fingerprint = fingerprint;
  auto engine = engine::Engine::create(std::move(backend), std::move(model).value(), config);
  if (!engine.ok()) {
    std::cerr << engine.status().to_string() << "\n";
    return 1;
  }
  print({{"bench", "kv_load_setup"}, {"model", model_dir}, {"block_bytes", block_bytes},
         {"pull_blocks", pull_blocks}, {"pull_GiB", static_cast<double>(pull_blocks * block_bytes) / (1 << 30)},
         {"decoders", decoders}, {"omp_threads", omp_get_max_threads()}, {"cpus", static_cast<int64_t>(std::thread::hardware_concurrency())},
         {"disk_write_s", write_s},
         {"recovered_blocks", (*engine)->kv_tier_stats().lower->disk_recovery.recovered_blocks}});

  engine::SamplingParams params;
  params.temperature = 0.0f;
  params.ignore_eos = true;
  params.max_tokens = 100000;
  for (int d = 0; d < decoders; ++d) {
    if (!(*engine)->submit(random_prompt(64), params).ok()) return 1;
  }
  auto timed_step = [&](std::vector<double>& out) {
    const auto start = Clock::now();
    auto events = (*engine)->step();
    if (!events.ok()) {
      std::cerr << events.status().to_string() << "\n";
      std::exit(1);
    }
    out.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  };
  std::vector<double> warm, alone, loading;
  for (int i = 0; i < 20; ++i) timed_step(warm);  // prefills and the first decode steps
  for (int i = 0; i < steps; ++i) timed_step(alone);

  engine::SamplingParams pull_params = params;
  pull_params.max_tokens = 1;
  auto pull = (*engine)->submit(pull_prompt, pull_params);
  if (!pull.ok()) {
    std::cerr << pull.status().to_string() << "\n";
    return 1;
  }
  const auto pull_start = Clock::now();
  double admit_ms = 0;
  double first_compute_ms = 0;
  while (true) {
    timed_step(loading);
    if (loading.size() == 1) admit_ms = loading.back();  // lookup, reservation, queueing the loads (kept)
    const engine::SequenceState* seq = (*engine)->scheduler().find(*pull);
    if (seq == nullptr || seq->status != engine::SequenceStatus::kLoadingKv) {
      // Its blocks arrived and this step computed its last prompt token over the whole prefix: that is the
      // pulling request's own prefill, not KV movement; reported apart.
      first_compute_ms = loading.back();
      loading.pop_back();
      break;
    }
  }
  const double load_s = std::chrono::duration<double>(Clock::now() - pull_start).count();
  if (!(*engine)->cancel(*pull).ok()) return 1;
  const engine::KvTierStats stats = (*engine)->kv_tier_stats();
  // Alone again, at the decoders' longer contexts (a long pull lets them grow: compare with both).
  std::vector<double> after;
  timed_step(warm);  // reports the cancellation
  for (int i = 0; i < steps; ++i) timed_step(after);

  print(summary("alone", alone));
  print(summary("while_pulling", loading));
  print(summary("alone_after", after));
  const double p99_alone = std::max(percentile(alone, 0.99), percentile(after, 0.99));
  const double p99_loading = percentile(loading, 0.99);
  print({{"bench", "kv_load"}, {"pull_GiB", static_cast<double>(pull_blocks * block_bytes) / (1 << 30)},
         {"load_s", load_s}, {"load_GiB_per_s", static_cast<double>(pull_blocks * block_bytes) / (1 << 30) / load_s},
         {"admit_step_ms", admit_ms}, {"pull_first_step_ms", first_compute_ms}, {"completed_loads", stats.completed_loads}, {"failed_loads", stats.failed_loads},
         {"disk_hit_blocks", stats.lower->disk.hit_blocks},
         {"p99_alone_ms", p99_alone}, {"p99_alone_before_ms", percentile(alone, 0.99)},
         {"p99_alone_after_ms", percentile(after, 0.99)}, {"p99_while_pulling_ms", p99_loading},
         {"p99_ratio", p99_alone > 0 ? p99_loading / p99_alone : 0.0}});
  std::filesystem::remove_all(dir);
  return 0;
}
