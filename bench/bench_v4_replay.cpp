// DeepSeek-V4's SWA bounded replay, measured: a turn of M new tokens after a conversation of N cached tokens
// (issue 20: 3,000 after 70,000), on a random-weight V4 at demo size (model::random_v4_model_config with room for the
// positions), through the engine the server runs. Four ways the turn can find its prefix:
//   (first the conversation's own prefill of N tokens, for scale)
//   window_resident  the same engine right after: the prefix and its last window's rows on the device (exact);
//   replay           a new engine on the disk tier (a restart): the block payloads come back, the window rows do
//                    not; --swa-bounded-replay recomputes the last 128 tokens (an approximation);
//   no_replay        the same with --no-swa-bounded-replay: the prefix is recomputed from the last point whose
//                    window rows are cached - here position 0 (exact).
// Each line: tokens cached, replayed and computed, the turn's time to first token, and the prefill FLOPs of the
// tokens computed (linear layers over the active parameters + attention over the keys each query reads), so that
// the saving can be compared with the seed's claim (-85% redundant recompute).
// Usage: bench_v4_replay [--cached N] [--new M]. Prints JSON lines; reports, never fails on numbers.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <unistd.h>

#include <boost/json.hpp>

#include "deepinfer/backend/backend.h"
#include "deepinfer/engine/engine.h"
#include "deepinfer/kvcache/block_hash.h"
#include "deepinfer/model/deepseek_v4.h"
#include "deepinfer/model/random_checkpoint.h"
#include "deepinfer/recipe/response_builder.h"

namespace fs = std::filesystem;
using namespace deepinfer;

namespace {

// Prefill FLOPs of positions [from, to) of one sequence (multiply-adds x 2). Linear layers: every weight a token
// touches (attention projections, compressors, indexer, gate, the routed experts it picks and the shared ones);
// attention: q.k and p.v over the window and the compressed entries the query reads (CSA: the indexer's top-k after
// scoring every visible entry; HCA: every visible entry). The mHC mixes and norms are left out (< 1%).
double prefill_flops(const model::V4Config& c, int64_t from, int64_t to) {
  const double d = static_cast<double>(c.hidden_size), H = static_cast<double>(c.num_attention_heads);
  const double D = static_cast<double>(c.head_dim), I = static_cast<double>(c.moe_intermediate_size);
  const double q = static_cast<double>(c.q_lora_rank), L = static_cast<double>(c.o_lora_rank);
  const double G = static_cast<double>(c.o_groups), HI = static_cast<double>(c.index_n_heads);
  const double DI = static_cast<double>(c.index_head_dim);
  double total = 0.0;
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const int64_t m = c.compress_ratios[static_cast<size_t>(layer)];
    double per_token = d * q + q * H * D + d * D + H * D * L + G * L * d;  // wq_a, wq_b, wkv, wo_a, wo_b
    per_token += d * static_cast<double>(c.n_routed_experts);                // gate
    per_token += static_cast<double>(c.num_experts_per_tok + c.n_shared_experts) * 3.0 * d * I;
    if (m != 0) per_token += 2.0 * d * (m == 4 ? 2.0 : 1.0) * D;  // compressor wkv, wgate
    if (m == 4) per_token += q * HI * DI + d * HI + 2.0 * d * 2.0 * DI;  // indexer wq_b, weights, its compressor
    total += 2.0 * per_token * static_cast<double>(to - from);
    for (int64_t p = from; p < to; ++p) {
      double keys = static_cast<double>(std::min<int64_t>(c.sliding_window, p + 1));
      const int64_t visible = m == 0 ? 0 : (p + 1) / m;
      if (m == 4) {
        keys += static_cast<double>(std::min<int64_t>(visible, c.index_topk));
        total += 2.0 * HI * DI * static_cast<double>(visible);  // indexer scores
      } else if (m == 128) {
        keys += static_cast<double>(visible);
      }
      total += 2.0 * 2.0 * H * D * keys;  // q.k and p.v
    }
  }
  return total;
}

struct Turn {
  int64_t cached = 0, replayed = 0;
  double ttft_s = 0.0;
};

Result<Turn> run_turn(engine::Engine& engine, const std::vector<int32_t>& prompt) {
  engine::SamplingParams params;
  params.temperature = 0.0f;
  params.max_tokens = 1;
  params.ignore_eos = true;
  const int64_t replayed_before = engine.num_replayed_tokens();
  const auto start = std::chrono::steady_clock::now();
  Result<engine::SequenceId> id = engine.submit(prompt, params);
  if (!id.ok()) return id.status();
  Turn turn;
  while (engine.has_pending_work()) {
    Result<std::vector<engine::TokenEvent>> events = engine.step();
    if (!events.ok()) return events.status();
    for (const engine::TokenEvent& event : *events) {
      if (event.id == *id && event.finished) turn.cached = event.num_cached_tokens;
    }
  }
  turn.ttft_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  turn.replayed = engine.num_replayed_tokens() - replayed_before;
  return turn;
}

// The value, or the error on stderr and exit 1 (a benchmark has nothing to recover).
template <class T>
T value_or_exit(Result<T> result) {
  if (!result.ok()) {
    std::cerr << result.status().to_string() << "\n";
    std::exit(1);
  }
  return std::move(result).value();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t cached = 70000, fresh = 3000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--cached") {
      cached = std::stoll(argv[i + 1]);
    } else if (flag == "--new") {
      fresh = std::stoll(argv[i + 1]);
    } else {
      std::cerr << "usage: bench_v4_replay [--cached N] [--new M]\n";
      return 2;
    }
  }
  const fs::path dir = fs::temp_directory_path() / ("deepinfer-bench-v4-replay-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  boost::json::object config = model::random_v4_model_config();
  config["max_position_embeddings"] = 131072;
  if (Status s = model::write_random_v4_checkpoint(dir / "model", config, /*seed=*/20261203); !s.ok()) {
    std::cerr << s.to_string() << "\n";
    return 1;
  }
  // The conversation: N tokens, then the turn's M (deterministic, not the special ids).
  std::vector<int32_t> prompt(static_cast<size_t>(cached + fresh));
  uint64_t state = 0x9E3779B97F4A7C15ull;
  for (int32_t& id : prompt) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    id = static_cast<int32_t>(1000 + (state >> 33) % 120000);
  }
  const std::vector<int32_t> conversation(prompt.begin(), prompt.begin() + cached);

  engine::EngineConfig engine_config;
  engine_config.max_num_seqs = 4;
  engine_config.kv_cache_bytes = 1ll << 30;
  engine_config.host_cache_bytes = 1ll << 30;
  engine_config.disk_cache_path = (dir / "kv").string();
  engine_config.disk_cache_bytes = 4ll << 30;
  engine_config.fingerprint = kvcache::model_fingerprint("bench_v4_replay", "f32");
  auto make_engine = [&](bool replay) -> Result<std::unique_ptr<engine::Engine>> {
    std::unique_ptr<backend::Backend> backend = backend::make_cpu_backend();
    Result<std::unique_ptr<model::DeepSeekV4Model>> model = model::DeepSeekV4Model::load(dir / "model", *backend);
    if (!model.ok()) return model.status();
    engine::EngineConfig c = engine_config;
    c.swa_bounded_replay = replay;
    return engine::Engine::create(std::move(backend), std::move(model).value(), c);
  };
  const model::V4Config v4 = value_or_exit(model::load_v4_config(dir / "model"));
  const int64_t total = cached + fresh;
  auto report = [&](const char* mode, const Turn& turn) {
    const int64_t from = turn.cached;  // the first position computed (cached tokens exclude the replayed ones)
    const double flops = prefill_flops(v4, from, total);
    boost::json::object line{{"bench", "v4_bounded_replay"},
                             {"mode", mode},
                             {"conversation_tokens", cached},
                             {"turn_tokens", fresh},
                             {"matched_tokens", turn.cached + turn.replayed},
                             {"cached_tokens", turn.cached},
                             {"replayed_tokens", turn.replayed},
                             {"computed_tokens", total - from},
                             {"ttft_s", turn.ttft_s},
                             {"prefill_gflop", flops / 1e9},
                             {"redundant_gflop", prefill_flops(v4, from, cached) / 1e9}};
    std::cout << recipe::to_json_text(line) << std::endl;
  };
  {
    std::unique_ptr<engine::Engine> engine = value_or_exit(make_engine(true));
    const Turn first = value_or_exit(run_turn(*engine, conversation));
    boost::json::object line{{"bench", "v4_bounded_replay"}, {"mode", "conversation_prefill"},
                             {"tokens", cached}, {"ttft_s", first.ttft_s},
                             {"prefill_gflop", prefill_flops(v4, 0, cached) / 1e9}};
    std::cout << recipe::to_json_text(line) << std::endl;
    report("window_resident", value_or_exit(run_turn(*engine, prompt)));
    engine->flush_kv_tiers();
  }
  for (bool replay : {true, false}) {
    // A restart: the disk tier has the conversation's (and the turn's) block payloads; the window rows are gone.
    // Each run asks for the turn's prompt with its last block's worth changed, so it reuses exactly the
    // conversation's blocks.
    std::vector<int32_t> turn = prompt;
    for (int64_t p = cached; p < total; ++p) turn[static_cast<size_t>(p)] = (turn[static_cast<size_t>(p)] + (replay ? 7 : 11)) % 120000 + 1000;
    std::unique_ptr<engine::Engine> engine = value_or_exit(make_engine(replay));
    report(replay ? "replay" : "no_replay", value_or_exit(run_turn(*engine, turn)));
  }
  std::error_code ignored;
  fs::remove_all(dir, ignored);
  return 0;
}
