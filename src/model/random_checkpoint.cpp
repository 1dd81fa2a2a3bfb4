// Random-weight DeepSeek checkpoints in the release layout, written tensor by tensor (constant memory).
#include "deepinfer/model/random_checkpoint.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <boost/json.hpp>

#include "deepinfer/model/config.h"
#include "deepinfer/model/deepseek_v4.h"
#include "deepinfer/model/tensor_names.h"

namespace deepinfer::model {
namespace {

// SplitMix64 (Steele et al., "Fast splittable pseudorandom number generators", 2014): portable and exact.
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

boost::json::object random_model_config() {
  return {{"architectures", boost::json::array{"DeepseekV3ForCausalLM"}},
          {"model_type", "deepseek_v3"}, {"vocab_size", 129280}, {"hidden_size", 256},
          {"intermediate_size", 512}, {"moe_intermediate_size", 128}, {"num_hidden_layers", 3},
          {"num_attention_heads", 4}, {"num_key_value_heads", 4}, {"n_shared_experts", 1},
          {"n_routed_experts", 16}, {"routed_scaling_factor", 2.5}, {"kv_lora_rank", 128}, {"q_lora_rank", 192},
          {"qk_rope_head_dim", 32}, {"v_head_dim", 64}, {"qk_nope_head_dim", 64}, {"n_group", 4},
          {"topk_group", 2}, {"num_experts_per_tok", 4}, {"first_k_dense_replace", 1}, {"moe_layer_freq", 1},
          {"norm_topk_prob", true}, {"scoring_func", "sigmoid"}, {"topk_method", "noaux_tc"},
          {"hidden_act", "silu"}, {"max_position_embeddings", 16384}, {"rope_theta", 10000.0},
          {"rope_scaling", {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 4096},
                            {"beta_fast", 32}, {"beta_slow", 1}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}}},
          {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false}, {"bos_token_id", 0}, {"eos_token_id", 1},
          {"num_nextn_predict_layers", 1}, {"torch_dtype", "bfloat16"}};
}

namespace {

// One tensor of a random checkpoint: its header entry and how its values are made.
struct RandomTensor {
  std::string name;
  std::vector<int64_t> shape;
  enum class Fill { kUniform, kOnes, kZeros, kTokenTable } fill = Fill::kUniform;
  int64_t experts = 0;  // kTokenTable: row t holds experts (t + j) mod experts (I64)
};

// Writes dir/config.json (and checks it with `check`, which returns the tensors it implies), then every tensor into
// dir/model.safetensors: bf16 uniform values with standard deviation `stddev` from SplitMix64(seed), ones, zeros,
// or an I64 token table; 8-byte aligned data, as safetensors writes; renamed into place when complete.
Status write_random_tensors(const std::filesystem::path& dir, const boost::json::object& config, uint64_t seed,
                            float stddev,
                            const std::function<Result<std::vector<RandomTensor>>()>& tensors_of_config) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::io_error(dir.string() + ": cannot create: " + ec.message());
  {
    std::ofstream out(dir / "config.json");
    out << boost::json::serialize(config) << "\n";
    if (!out) return Status::io_error((dir / "config.json").string() + ": write failed");
  }
  Result<std::vector<RandomTensor>> tensors = tensors_of_config();
  if (!tensors.ok()) return tensors.status();
  boost::json::object header;
  uint64_t offset = 0;
  for (const RandomTensor& t : *tensors) {
    const bool table = t.fill == RandomTensor::Fill::kTokenTable;
    uint64_t bytes = table ? 8 : 2;
    for (int64_t d : t.shape) bytes *= static_cast<uint64_t>(d);
    header[t.name] = {{"dtype", table ? "I64" : "BF16"},
                      {"shape", boost::json::array(t.shape.begin(), t.shape.end())},
                      {"data_offsets", boost::json::array{offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header_text = boost::json::serialize(header);
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // 8-byte aligned data, as safetensors writes
  const std::filesystem::path path = dir / "model.safetensors";
  const std::filesystem::path partial = dir / "model.safetensors.partial";
  std::ofstream out(partial, std::ios::binary);
  uint64_t header_size = header_text.size();
  out.write(reinterpret_cast<const char*>(&header_size), sizeof(header_size));
  out << header_text;
  uint64_t state = seed;
  // Uniform in [-a, a] has standard deviation a / sqrt(3).
  const float amplitude = stddev * std::sqrt(3.0f);
  std::vector<uint16_t> buffer;
  for (const RandomTensor& t : *tensors) {
    if (t.fill == RandomTensor::Fill::kTokenTable) {
      const int64_t rows = t.shape[0], k = t.shape[1];
      std::vector<int64_t> table(static_cast<size_t>(rows * k));
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < k; ++j) table[r * k + j] = (r + j) % t.experts;
      }
      out.write(reinterpret_cast<const char*>(table.data()), static_cast<std::streamsize>(table.size() * 8));
      continue;
    }
    size_t n = 1;
    for (int64_t d : t.shape) n *= static_cast<size_t>(d);
    buffer.resize(n);
    for (size_t i = 0; i < n; ++i) {
      float value = t.fill == RandomTensor::Fill::kOnes ? 1.0f : 0.0f;
      if (t.fill == RandomTensor::Fill::kUniform) {
        double unit = static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53;  // [0, 1)
        value = static_cast<float>((2.0 * unit - 1.0) * amplitude);
      }
      buffer[i] = to_bf16(value);
    }
    out.write(reinterpret_cast<const char*>(buffer.data()), static_cast<std::streamsize>(n * sizeof(uint16_t)));
  }
  out.close();
  if (!out) return Status::io_error(partial.string() + ": write failed");
  std::filesystem::rename(partial, path, ec);  // atomic: a killed setup never leaves a truncated checkpoint
  if (ec) return Status::io_error(path.string() + ": " + ec.message());
  return Status();
}

}  // namespace

Status write_random_checkpoint(const std::filesystem::path& dir, const boost::json::object& config, uint64_t seed,
                               float stddev) {
  return write_random_tensors(dir, config, seed, stddev, [&]() -> Result<std::vector<RandomTensor>> {
    Result<ModelConfig> parsed = load_model_config(dir);
    if (!parsed.ok()) return parsed.status();
    std::vector<RandomTensor> tensors;
    for (const ExpectedTensor& t : expected_tensors(*parsed)) {
      if (!t.required) continue;
      RandomTensor::Fill fill = t.name.find("norm") != std::string::npos ? RandomTensor::Fill::kOnes
                                : t.name.find("e_score_correction_bias") != std::string::npos
                                    ? RandomTensor::Fill::kZeros
                                    : RandomTensor::Fill::kUniform;
      tensors.push_back({t.name, t.shape, fill});
    }
    return tensors;
  });
}

boost::json::object random_v4_model_config() {
  return {{"architectures", boost::json::array{"DeepseekV4ForCausalLM"}},
          {"model_type", "deepseek_v4"}, {"vocab_size", 129280}, {"hidden_size", 128},
          {"moe_intermediate_size", 64}, {"num_hidden_layers", 3}, {"num_attention_heads", 4},
          {"num_key_value_heads", 1}, {"head_dim", 64}, {"qk_rope_head_dim", 16}, {"q_lora_rank", 64},
          {"o_lora_rank", 32}, {"o_groups", 2}, {"compress_ratios", boost::json::array{0, 4, 128}},
          {"compress_rope_theta", 160000.0}, {"rope_theta", 10000.0}, {"sliding_window", 128},
          {"index_n_heads", 4}, {"index_head_dim", 32}, {"index_topk", 16}, {"hc_mult", 4},
          {"hc_sinkhorn_iters", 20}, {"hc_eps", 1e-6}, {"n_routed_experts", 8}, {"num_experts_per_tok", 2},
          {"n_shared_experts", 1}, {"scoring_func", "sqrtsoftplus"}, {"topk_method", "noaux_tc"},
          {"norm_topk_prob", true}, {"routed_scaling_factor", 1.5}, {"swiglu_limit", 10.0},
          {"num_hash_layers", 1}, {"rms_norm_eps", 1e-6}, {"num_nextn_predict_layers", 0},
          {"tie_word_embeddings", false}, {"bos_token_id", 0}, {"eos_token_id", 1},
          {"max_position_embeddings", 16384}, {"torch_dtype", "bfloat16"},
          {"rope_scaling", {{"type", "yarn"}, {"factor", 16.0}, {"original_max_position_embeddings", 4096},
                            {"beta_fast", 32}, {"beta_slow", 1}}}};
}

Status write_random_v4_checkpoint(const std::filesystem::path& dir, const boost::json::object& config, uint64_t seed,
                                  float stddev) {
  return write_random_tensors(dir, config, seed, stddev, [&]() -> Result<std::vector<RandomTensor>> {
    Result<V4Config> parsed = load_v4_config(dir);
    if (!parsed.ok()) return parsed.status();
    std::vector<RandomTensor> tensors;
    for (const V4TensorSpec& t : v4_tensors(*parsed)) {
      RandomTensor::Fill fill = t.token_table                             ? RandomTensor::Fill::kTokenTable
                                : t.name.find("norm") != std::string::npos ? RandomTensor::Fill::kOnes
                                : t.name.ends_with("gate.bias")            ? RandomTensor::Fill::kZeros
                                                                           : RandomTensor::Fill::kUniform;
      tensors.push_back({t.name, t.shape, fill, parsed->n_routed_experts});
    }
    return tensors;
  });
}

}  // namespace deepinfer::model
