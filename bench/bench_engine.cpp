// Engine benchmark on the CPU: prefill and decode tokens/s at batch 1, 16 and 64, plus peak memory, on a
// checkpoint directory (default: the tiny DeepSeek-V3 fixture) or on a random-weight DeepSeek-V3-shaped
// checkpoint this program writes first (--random-v3 DIR: real config.json + bf16 safetensors, loaded through
// the same path as a release). Prints one JSON line per measurement (median of --reps).
//
// Usage: bench_engine [--model DIR | --random-v3 DIR [--layers N]] [--bf16] [--prompt-len N]
//                     [--decode-tokens N] [--batches 1,16,64] [--reps N]
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <boost/json.hpp>

#include "deepinfer/engine/engine.h"
#include "deepinfer/model/random_checkpoint.h"

namespace {

using namespace deepinfer;
using Clock = std::chrono::steady_clock;

// The DeepSeek-V3 architecture scaled to fit a 2-core, 24 GiB machine: V3's attention shapes (kv_lora 512,
// q_lora 1536, rope 64, nope 128, v 128), 64 experts in 8 groups (top-4 groups, top-8 experts), 1 shared.
boost::json::object random_v3_config(int layers) {
  return {{"architectures", boost::json::array{"DeepseekV3ForCausalLM"}},
          {"model_type", "deepseek_v3"}, {"vocab_size", 129280}, {"hidden_size", 2048},
          {"intermediate_size", 5632}, {"moe_intermediate_size", 704}, {"num_hidden_layers", layers},
          {"num_attention_heads", 16}, {"num_key_value_heads", 16}, {"n_shared_experts", 1},
          {"n_routed_experts", 64}, {"routed_scaling_factor", 2.5}, {"kv_lora_rank", 512}, {"q_lora_rank", 1536},
          {"qk_rope_head_dim", 64}, {"v_head_dim", 128}, {"qk_nope_head_dim", 128}, {"n_group", 8},
          {"topk_group", 4}, {"num_experts_per_tok", 8}, {"first_k_dense_replace", 1}, {"moe_layer_freq", 1},
          {"norm_topk_prob", true}, {"scoring_func", "sigmoid"}, {"topk_method", "noaux_tc"},
          {"hidden_act", "silu"}, {"max_position_embeddings", 16384}, {"rope_theta", 10000.0},
          {"rope_scaling", {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 4096},
                            {"beta_fast", 32}, {"beta_slow", 1}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}}},
          {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false}, {"bos_token_id", 0}, {"eos_token_id", 1},
          {"num_nextn_predict_layers", 0}, {"torch_dtype", "bfloat16"}};
}

double peak_rss_gib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / (1024.0 * 1024.0);
}

void print(boost::json::object line) { std::cout << boost::json::serialize(line) << std::endl; }

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir = std::string(DEEPINFER_SOURCE_DIR) + "/tests/data/models/tiny-deepseek-v3";
  std::string random_dir;
  int layers = 8, prompt_len = 128, decode_tokens = 16, reps = 3;
  bool bf16 = false;
  std::vector<int> batches = {1, 16, 64};
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (flag == "--model") model_dir = next();
    else if (flag == "--random-v3") random_dir = next();
    else if (flag == "--layers") layers = std::stoi(next());
    else if (flag == "--bf16") bf16 = true;
    else if (flag == "--prompt-len") prompt_len = std::stoi(next());
    else if (flag == "--decode-tokens") decode_tokens = std::stoi(next());
    else if (flag == "--reps") reps = std::stoi(next());
    else if (flag == "--batches") {
      batches.clear();
      std::stringstream list(next());
      for (std::string item; std::getline(list, item, ',');) batches.push_back(std::stoi(item));
    } else {
      std::cerr << "unknown flag " << flag << "\n";
      return 2;
    }
  }
  if (!random_dir.empty()) {
    model_dir = random_dir;
    if (!std::filesystem::exists(std::filesystem::path(random_dir) / "model.safetensors")) {
      auto start = Clock::now();
      if (Status s = model::write_random_checkpoint(random_dir, random_v3_config(layers), 42); !s.ok()) {
        std::cerr << s.to_string() << "\n";
        return 1;
      }
      print({{"bench", "write_random_checkpoint"}, {"dir", random_dir},
             {"seconds", std::chrono::duration<double>(Clock::now() - start).count()}});
    }
  }
  auto load_start = Clock::now();
  auto backend = backend::make_cpu_backend();
  auto precision = bf16 ? backend::Precision::kBF16 : backend::Precision::kF32;
  auto model = model::DeepSeekModel::load(model_dir, *backend, precision);
  if (!model.ok()) {
    std::cerr << model.status().to_string() << "\n";
    return 1;
  }
  const model::ModelConfig config = (*model)->config();
  const size_t weight_bytes = (*model)->weight_bytes();
  engine::EngineConfig engine_config;
  int max_batch = *std::max_element(batches.begin(), batches.end());
  engine_config.max_num_seqs = max_batch;
  engine_config.max_num_batched_tokens = std::max(2048, prompt_len * max_batch);  // one prefill step per batch
  engine_config.kv_cache_bytes = static_cast<int64_t>(max_batch) * (prompt_len + decode_tokens + 64) * config.num_hidden_layers *
                                 config.kv_cache_dim() * 4;
  auto engine = engine::Engine::create(std::move(backend), std::move(model).value(), engine_config);
  if (!engine.ok()) {
    std::cerr << engine.status().to_string() << "\n";
    return 1;
  }
  print({{"bench", "load"}, {"model", model_dir}, {"weights", bf16 ? "bf16" : "f32"},
         {"weight_GB", weight_bytes / 1e9}, {"kv_cache_GB", (*engine)->kv_cache_bytes() / 1e9},
         {"seconds", std::chrono::duration<double>(Clock::now() - load_start).count()},
         {"hidden", config.hidden_size}, {"layers", config.num_hidden_layers}, {"experts", config.n_routed_experts},
         {"top_k", config.num_experts_per_tok}, {"vocab", config.vocab_size},
         {"cpu_features", backend::cpu_features()}});

  std::mt19937 rng(7);
  for (int batch : batches) {
    std::vector<double> prefill_tps, decode_tps;
    for (int rep = 0; rep < reps; ++rep) {
      engine::SamplingParams params;
      params.temperature = 0.0f;
      params.max_tokens = decode_tokens;
      params.ignore_eos = true;
      for (int b = 0; b < batch; ++b) {
        std::vector<engine::TokenId> prompt(static_cast<size_t>(prompt_len));
        for (auto& id : prompt) id = static_cast<engine::TokenId>(3 + rng() % (config.vocab_size - 3));
        if (!(*engine)->submit(prompt, params).ok()) return 1;
      }
      // Prefill steps run until every request has its first token; the rest is decode.
      int64_t first_tokens = 0, decode_count = 0;
      double prefill_s = 0, decode_s = 0;
      while ((*engine)->has_pending_work()) {
        auto start = Clock::now();
        auto events = (*engine)->step();
        double seconds = std::chrono::duration<double>(Clock::now() - start).count();
        if (!events.ok()) {
          std::cerr << events.status().to_string() << "\n";
          return 1;
        }
        int64_t tokens = 0;
        for (const auto& e : *events) tokens += e.token ? 1 : 0;
        if (first_tokens < batch) {
          prefill_s += seconds;
          first_tokens += tokens;
        } else {
          decode_s += seconds;
          decode_count += tokens;
        }
      }
      prefill_tps.push_back(static_cast<double>(batch) * prompt_len / prefill_s);
      if (decode_s > 0) decode_tps.push_back(decode_count / decode_s);
    }
    auto median = [](std::vector<double> v) {
      if (v.empty()) return 0.0;
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    print({{"bench", "engine"}, {"batch", batch}, {"prompt_len", prompt_len}, {"decode_tokens", decode_tokens},
           {"prefill_tokens_per_s", median(prefill_tps)}, {"decode_tokens_per_s", median(decode_tps)},
           {"reps", reps}, {"peak_rss_GiB", peak_rss_gib()}});
  }
  return 0;
}
