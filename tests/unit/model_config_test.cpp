// ModelConfig tests: the three fixture checkpoints' config.json, the field sets of the real DeepSeek-V3,
// V2 and V2-Lite releases, transformers' defaults for absent fields, and a table of broken configs whose
// errors must name the file, the field and the value.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <boost/json.hpp>
#include <filesystem>
#include <fstream>
#include <functional>

#include "deepinfer/model/config.h"

namespace deepinfer::model {
namespace {

namespace json = boost::json;
namespace fs = std::filesystem;

constexpr const char* kModelsDir = DEEPINFER_SOURCE_DIR "/tests/data/models";

// A temporary directory removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("deepinfer_config_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  fs::path write(const std::string& name, const std::string& text) const {
    fs::path file = path_ / name;
    std::ofstream(file, std::ios::binary) << text;
    return file;
  }

 private:
  fs::path path_;
};

// The real DeepSeek-V3 config.json (deepseek-ai/DeepSeek-V3; R1 and V3.1 share the field set).
constexpr const char* kDeepSeekV3Config = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"
  },
  "aux_loss_alpha": 0.001,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "ep_size": 1,
  "first_k_dense_replace": 3,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 8,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128]
  },
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 10000,
  "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 4,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 129280
})";

// The real DeepSeek-V2-Lite config.json.
constexpr const char* kDeepSeekV2LiteConfig = R"({
  "architectures": ["DeepseekV2ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "aux_loss_alpha": 0.001,
  "bos_token_id": 100000,
  "eos_token_id": 100001,
  "first_k_dense_replace": 1,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 10944,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v2",
  "moe_intermediate_size": 1408,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 64,
  "n_shared_experts": 2,
  "norm_topk_prob": false,
  "num_attention_heads": 16,
  "num_experts_per_tok": 6,
  "num_hidden_layers": 27,
  "num_key_value_heads": 16,
  "pretraining_tp": 1,
  "q_lora_rank": null,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 10000,
  "routed_scaling_factor": 1.0,
  "scoring_func": "softmax",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "greedy",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.39.3",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 102400
})";

// The fields of the real DeepSeek-V2 (236B) config.json that differ from V2-Lite: q-LoRA and
// group-limited routing.
json::object deepseek_v2_config() {
  json::object config = json::parse(kDeepSeekV2LiteConfig).as_object();
  config["hidden_size"] = 5120;
  config["intermediate_size"] = 12288;
  config["moe_intermediate_size"] = 1536;
  config["n_group"] = 8;
  config["topk_group"] = 3;
  config["topk_method"] = "group_limited_greedy";
  config["n_routed_experts"] = 160;
  config["num_attention_heads"] = 128;
  config["num_key_value_heads"] = 128;
  config["num_hidden_layers"] = 60;
  config["q_lora_rank"] = 1536;
  config["routed_scaling_factor"] = 16.0;
  return config;
}

ModelConfig load_ok(const fs::path& path) {
  Result<ModelConfig> config = load_model_config(path);
  EXPECT_TRUE(config.ok()) << config.status().to_string();
  return config.ok() ? *config : ModelConfig{};
}

ModelConfig load_text_ok(const std::string& text) {
  TempDir dir;
  return load_ok(dir.write("config.json", text));
}

TEST(ModelConfigTest, TinyDeepSeekV3Fixture) {
  ModelConfig c = load_ok(fs::path(kModelsDir) / "tiny-deepseek-v3");  // a directory: reads its config.json
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.vocab_size, 1024);
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.intermediate_size, 128);
  EXPECT_EQ(c.moe_intermediate_size, 32);
  EXPECT_EQ(c.num_hidden_layers, 3);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.n_routed_experts, 16);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.kv_lora_rank, 64);
  ASSERT_TRUE(c.q_lora_rank.has_value());
  EXPECT_EQ(*c.q_lora_rank, 96);
  EXPECT_EQ(c.qk_rope_head_dim, 16);
  EXPECT_EQ(c.qk_nope_head_dim, 32);
  EXPECT_EQ(c.v_head_dim, 32);
  EXPECT_EQ(c.qk_head_dim(), 48);
  EXPECT_EQ(c.kv_cache_dim(), 80);
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.moe_layer_freq, 1);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_EQ(c.max_position_embeddings, 1024);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->type, "yarn");
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 4.0);
  EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 128);
  EXPECT_DOUBLE_EQ(c.rope_scaling->beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale_all_dim, 1.0);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({1}));
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_TRUE(c.quant_method.empty());
  EXPECT_TRUE(c.weight_block_size.empty());
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  EXPECT_TRUE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));  // the MTP layer
}

TEST(ModelConfigTest, TinyDeepSeekV2LiteFixture) {
  ModelConfig c = load_ok(fs::path(kModelsDir) / "tiny-deepseek-v2-lite" / "config.json");  // the file itself
  EXPECT_EQ(c.model_type, "deepseek_v2");
  EXPECT_FALSE(c.q_lora_rank.has_value());
  EXPECT_EQ(c.n_shared_experts, 2);
  EXPECT_EQ(c.num_experts_per_tok, 6);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 1.0);
  EXPECT_EQ(c.scoring_func, "softmax");
  EXPECT_EQ(c.topk_method, "greedy");
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 8.0);
  EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 128);
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale, 0.707);
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale_all_dim, 0.707);
  EXPECT_EQ(c.num_nextn_predict_layers, 0);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({1}));
}

TEST(ModelConfigTest, TinyDeepSeekV3Fp8Fixture) {
  ModelConfig c = load_ok(fs::path(kModelsDir) / "tiny-deepseek-v3-fp8");
  EXPECT_EQ(c.quant_method, "fp8");
  EXPECT_EQ(c.weight_block_size, std::vector<int64_t>({128, 128}));
  EXPECT_EQ(c.num_nextn_predict_layers, 0);
  EXPECT_EQ(c.kv_lora_rank, 128);
  EXPECT_EQ(*c.q_lora_rank, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 32);
  EXPECT_EQ(c.qk_nope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 64);
  EXPECT_EQ(c.intermediate_size, 256);
  EXPECT_EQ(c.moe_intermediate_size, 128);
}

TEST(ModelConfigTest, RealDeepSeekV3Config) {
  ModelConfig c = load_text_ok(kDeepSeekV3Config);
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.intermediate_size, 18432);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 61);
  EXPECT_EQ(c.num_attention_heads, 128);
  EXPECT_EQ(c.num_key_value_heads, 128);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.q_lora_rank, std::optional<int64_t>(1536));
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.qk_head_dim(), 192);
  EXPECT_EQ(c.kv_cache_dim(), 576);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_EQ(c.moe_layer_freq, 1);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_EQ(c.max_position_embeddings, 163840);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->type, "yarn");
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 40.0);
  EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rope_scaling->beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale_all_dim, 1.0);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({1}));
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_EQ(c.quant_method, "fp8");
  EXPECT_EQ(c.weight_block_size, std::vector<int64_t>({128, 128}));
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));
  EXPECT_TRUE(c.is_moe_layer(60));
  EXPECT_TRUE(c.is_moe_layer(61));  // MTP layer model.layers.61
}

TEST(ModelConfigTest, RealDeepSeekV2LiteConfig) {
  ModelConfig c = load_text_ok(kDeepSeekV2LiteConfig);
  EXPECT_EQ(c.model_type, "deepseek_v2");
  EXPECT_FALSE(c.q_lora_rank.has_value());
  EXPECT_EQ(c.vocab_size, 102400);
  EXPECT_EQ(c.n_routed_experts, 64);
  EXPECT_EQ(c.num_experts_per_tok, 6);
  EXPECT_EQ(c.scoring_func, "softmax");
  EXPECT_EQ(c.topk_method, "greedy");
  EXPECT_EQ(c.bos_token_id, 100000);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({100001}));
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale, 0.707);
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale_all_dim, 0.707);
  EXPECT_EQ(c.num_nextn_predict_layers, 0);
  EXPECT_TRUE(c.quant_method.empty());
}

TEST(ModelConfigTest, RealDeepSeekV2ConfigWithGroupLimitedGreedy) {
  ModelConfig c = load_text_ok(json::serialize(deepseek_v2_config()));
  EXPECT_EQ(c.topk_method, "group_limited_greedy");
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 3);
  EXPECT_EQ(c.n_routed_experts, 160);
  EXPECT_EQ(c.q_lora_rank, std::optional<int64_t>(1536));
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 16.0);
}

// Absent optional fields take transformers' defaults for the model type.
TEST(ModelConfigTest, AbsentFieldsTakeTransformersDefaults) {
  json::object minimal_v3 = {{"model_type", "deepseek_v3"}, {"vocab_size", 1024},      {"hidden_size", 64},
                             {"intermediate_size", 128},    {"num_hidden_layers", 4},  {"num_attention_heads", 2},
                             {"kv_lora_rank", 16},          {"q_lora_rank", 32},       {"qk_rope_head_dim", 8},
                             {"qk_nope_head_dim", 16},      {"v_head_dim", 16},        {"n_routed_experts", 16},
                             {"moe_intermediate_size", 32}, {"num_experts_per_tok", 4}};
  ModelConfig v3 = load_text_ok(json::serialize(minimal_v3));
  EXPECT_EQ(v3.num_key_value_heads, 2);  // = num_attention_heads
  EXPECT_EQ(v3.n_shared_experts, 1);
  EXPECT_DOUBLE_EQ(v3.routed_scaling_factor, 2.5);
  EXPECT_EQ(v3.n_group, 8);
  EXPECT_EQ(v3.topk_group, 4);
  EXPECT_EQ(v3.first_k_dense_replace, 3);
  EXPECT_EQ(v3.moe_layer_freq, 1);
  EXPECT_TRUE(v3.norm_topk_prob);
  EXPECT_EQ(v3.scoring_func, "sigmoid");
  EXPECT_EQ(v3.topk_method, "noaux_tc");
  EXPECT_EQ(v3.hidden_act, "silu");
  EXPECT_EQ(v3.max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(v3.rope_theta, 10000.0);
  EXPECT_FALSE(v3.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(v3.rms_norm_eps, 1e-6);
  EXPECT_FALSE(v3.tie_word_embeddings);
  EXPECT_EQ(v3.bos_token_id, 0);
  EXPECT_EQ(v3.eos_token_ids, std::vector<int64_t>({1}));
  EXPECT_EQ(v3.num_nextn_predict_layers, 0);
  EXPECT_TRUE(v3.quant_method.empty());

  json::object minimal_v2 = minimal_v3;
  minimal_v2["model_type"] = "deepseek_v2";
  minimal_v2["q_lora_rank"] = nullptr;
  ModelConfig v2 = load_text_ok(json::serialize(minimal_v2));
  EXPECT_FALSE(v2.q_lora_rank.has_value());
  EXPECT_EQ(v2.n_shared_experts, 2);
  EXPECT_DOUBLE_EQ(v2.routed_scaling_factor, 1.0);
  EXPECT_EQ(v2.n_group, 1);
  EXPECT_EQ(v2.topk_group, 1);
  EXPECT_EQ(v2.first_k_dense_replace, 0);
  EXPECT_FALSE(v2.norm_topk_prob);
  EXPECT_EQ(v2.scoring_func, "softmax");
  EXPECT_EQ(v2.topk_method, "greedy");
  EXPECT_EQ(v2.max_position_embeddings, 2048);
  EXPECT_EQ(v2.bos_token_id, 1);
  EXPECT_EQ(v2.eos_token_ids, std::vector<int64_t>({2}));

  // Null optional fields behave like absent ones (transformers' None).
  json::object nulls = minimal_v3;
  nulls["n_group"] = nullptr;
  nulls["topk_group"] = nullptr;
  nulls["rope_scaling"] = nullptr;
  nulls["quantization_config"] = nullptr;
  ModelConfig with_nulls = load_text_ok(json::serialize(nulls));
  EXPECT_EQ(with_nulls.n_group, 8);
  EXPECT_FALSE(with_nulls.rope_scaling.has_value());

  // n_routed_experts null: a dense model; no MoE fields needed.
  json::object dense = minimal_v3;
  dense["n_routed_experts"] = nullptr;
  dense.erase("moe_intermediate_size");
  dense.erase("num_experts_per_tok");
  ModelConfig dense_config = load_text_ok(json::serialize(dense));
  EXPECT_EQ(dense_config.n_routed_experts, 0);
  EXPECT_FALSE(dense_config.is_moe_layer(3));
}

TEST(ModelConfigTest, EosTokenIdListAndRopeScalingSpellings) {
  json::object config = json::parse(kDeepSeekV3Config).as_object();
  config["eos_token_id"] = json::array{1, 128};
  config["rope_scaling"].as_object().erase("type");
  config["rope_scaling"].as_object()["rope_type"] = "yarn";
  config["rope_scaling"].as_object().erase("mscale_all_dim");
  config["rope_scaling"].as_object().erase("original_max_position_embeddings");
  config["original_max_position_embeddings"] = 1;  // top-level: not the rope field
  ModelConfig c = load_text_ok(json::serialize(config));
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>({1, 128}));
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->type, "yarn");
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale_all_dim, 0.0);  // DeepSeek's YaRN default
  EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 4096);

  // transformers 5 writes rope_parameters, with rope_theta inside.
  json::object v5 = json::parse(kDeepSeekV3Config).as_object();
  json::object rope = v5["rope_scaling"].as_object();
  rope.erase("type");
  rope["rope_type"] = "yarn";
  rope["rope_theta"] = 50000.0;
  v5.erase("rope_scaling");
  v5.erase("rope_theta");
  v5["rope_parameters"] = rope;
  ModelConfig c5 = load_text_ok(json::serialize(v5));
  ASSERT_TRUE(c5.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c5.rope_scaling->factor, 40.0);
  EXPECT_DOUBLE_EQ(c5.rope_theta, 50000.0);

  v5["rope_parameters"] = json::object{{"rope_type", "default"}, {"rope_theta", 10000.0}};
  ModelConfig plain = load_text_ok(json::serialize(v5));
  EXPECT_FALSE(plain.rope_scaling.has_value());
}

// One broken config: a change to the real V3 config, the expected code, and the text the message must hold
// (besides the file path, which every message holds).
struct BrokenConfigCase {
  std::string label;
  std::function<void(json::object&)> mutate;
  StatusCode code;
  std::vector<std::string> message_parts;
};

TEST(ModelConfigTest, BrokenConfigsNameFileFieldAndValue) {
  auto rope = [](json::object& c) -> json::object& { return c["rope_scaling"].as_object(); };
  auto quant = [](json::object& c) -> json::object& { return c["quantization_config"].as_object(); };
  const std::vector<BrokenConfigCase> cases = {
      {"missing model_type",
       [](json::object& c) { c.erase("model_type"); },
       StatusCode::kInvalidArgument,
       {"model_type", "missing"}},
      {"unsupported model_type",
       [](json::object& c) { c["model_type"] = "llama"; },
       StatusCode::kUnsupported,
       {"model_type", "\"llama\""}},
      {"missing hidden_size",
       [](json::object& c) { c.erase("hidden_size"); },
       StatusCode::kInvalidArgument,
       {"hidden_size", "missing"}},
      {"missing q_lora_rank",
       [](json::object& c) { c.erase("q_lora_rank"); },
       StatusCode::kInvalidArgument,
       {"q_lora_rank", "missing"}},
      {"string hidden_size",
       [](json::object& c) { c["hidden_size"] = "7168"; },
       StatusCode::kInvalidArgument,
       {"hidden_size", "\"7168\"", "integer"}},
      {"fractional hidden_size",
       [](json::object& c) { c["hidden_size"] = 7168.5; },
       StatusCode::kInvalidArgument,
       {"hidden_size", "7168.5"}},
      {"negative vocab_size",
       [](json::object& c) { c["vocab_size"] = -1; },
       StatusCode::kInvalidArgument,
       {"vocab_size", "-1", "positive"}},
      {"zero q_lora_rank",
       [](json::object& c) { c["q_lora_rank"] = 0; },
       StatusCode::kInvalidArgument,
       {"q_lora_rank", "0"}},
      {"odd qk_rope_head_dim",
       [](json::object& c) { c["qk_rope_head_dim"] = 63; },
       StatusCode::kInvalidArgument,
       {"qk_rope_head_dim", "63", "even"}},
      {"top-k above experts",
       [](json::object& c) { c["num_experts_per_tok"] = 300; },
       StatusCode::kInvalidArgument,
       {"num_experts_per_tok", "300", "n_routed_experts = 256"}},
      {"top-k above reachable groups",
       [](json::object& c) {
         c["topk_group"] = 1;
         c["num_experts_per_tok"] = 40;
       },
       StatusCode::kInvalidArgument,
       {"num_experts_per_tok", "40", "topk_group = 1"}},
      {"n_group does not divide experts",
       [](json::object& c) { c["n_group"] = 7; },
       StatusCode::kInvalidArgument,
       {"n_group", "7", "divide"}},
      {"topk_group above n_group",
       [](json::object& c) { c["topk_group"] = 9; },
       StatusCode::kInvalidArgument,
       {"topk_group", "9", "n_group = 8"}},
      {"missing num_experts_per_tok",
       [](json::object& c) { c.erase("num_experts_per_tok"); },
       StatusCode::kInvalidArgument,
       {"num_experts_per_tok", "missing"}},
      {"first_k_dense_replace past the layers",
       [](json::object& c) { c["first_k_dense_replace"] = 62; },
       StatusCode::kInvalidArgument,
       {"first_k_dense_replace", "62"}},
      {"unknown scoring_func",
       [](json::object& c) { c["scoring_func"] = "tanh"; },
       StatusCode::kUnsupported,
       {"scoring_func", "\"tanh\""}},
      {"unknown topk_method",
       [](json::object& c) { c["topk_method"] = "random"; },
       StatusCode::kUnsupported,
       {"topk_method", "\"random\""}},
      {"unsupported hidden_act",
       [](json::object& c) { c["hidden_act"] = "gelu"; },
       StatusCode::kUnsupported,
       {"hidden_act", "\"gelu\""}},
      {"bool as string",
       [](json::object& c) { c["norm_topk_prob"] = "true"; },
       StatusCode::kInvalidArgument,
       {"norm_topk_prob", "\"true\""}},
      {"eos outside vocab",
       [](json::object& c) { c["eos_token_id"] = 200000; },
       StatusCode::kInvalidArgument,
       {"eos_token_id", "200000", "vocab_size = 129280"}},
      {"eos not an id",
       [](json::object& c) {
         c["eos_token_id"] = json::array{1, "x"};
       },
       StatusCode::kInvalidArgument,
       {"eos_token_id", "[1,\"x\"]"}},
      {"rope_scaling linear",
       [&](json::object& c) { rope(c)["type"] = "linear"; },
       StatusCode::kUnsupported,
       {"rope_scaling.type", "\"linear\""}},
      {"rope_scaling without factor",
       [&](json::object& c) { rope(c).erase("factor"); },
       StatusCode::kInvalidArgument,
       {"rope_scaling.factor", "missing"}},
      {"rope_scaling factor below 1",
       [&](json::object& c) { rope(c)["factor"] = 0.5; },
       StatusCode::kInvalidArgument,
       {"rope_scaling.factor", "0.5"}},
      {"rope_scaling mscale string",
       [&](json::object& c) { rope(c)["mscale"] = "0.707"; },
       StatusCode::kInvalidArgument,
       {"rope_scaling.mscale", "\"0.707\""}},
      {"rope_scaling not an object",
       [](json::object& c) { c["rope_scaling"] = 40; },
       StatusCode::kInvalidArgument,
       {"rope_scaling", "40"}},
      {"quant_method awq",
       [&](json::object& c) { quant(c)["quant_method"] = "awq"; },
       StatusCode::kUnsupported,
       {"quantization_config.quant_method", "\"awq\""}},
      {"fp8 e5m2",
       [&](json::object& c) { quant(c)["fmt"] = "e5m2"; },
       StatusCode::kUnsupported,
       {"quantization_config.fmt", "\"e5m2\""}},
      {"static activations",
       [&](json::object& c) { quant(c)["activation_scheme"] = "static"; },
       StatusCode::kUnsupported,
       {"quantization_config.activation_scheme", "\"static\""}},
      {"per-tensor fp8",
       [&](json::object& c) { quant(c).erase("weight_block_size"); },
       StatusCode::kUnsupported,
       {"quantization_config.weight_block_size"}},
      {"one block dimension",
       [&](json::object& c) { quant(c)["weight_block_size"] = json::array{128}; },
       StatusCode::kInvalidArgument,
       {"quantization_config.weight_block_size", "[128]"}},
      {"zero block",
       [&](json::object& c) {
         quant(c)["weight_block_size"] = json::array{0, 128};
       },
       StatusCode::kInvalidArgument,
       {"quantization_config.weight_block_size", "[0,128]"}},
  };
  for (const BrokenConfigCase& test_case : cases) {
    SCOPED_TRACE(test_case.label);
    json::object config = json::parse(kDeepSeekV3Config).as_object();
    test_case.mutate(config);
    TempDir dir;
    fs::path file = dir.write("config.json", json::serialize(config));
    Result<ModelConfig> result = load_model_config(dir.path());
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.status().code(), test_case.code) << result.status().to_string();
    const std::string message = result.status().message();
    EXPECT_NE(message.find(file.string()), std::string::npos) << message;
    for (const std::string& part : test_case.message_parts) {
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
    }
  }
}

TEST(ModelConfigTest, DefaultValueInErrorIsLabelled) {
  json::object config = json::parse(kDeepSeekV3Config).as_object();
  config.erase("n_group");  // default 8
  config["n_routed_experts"] = 12;
  config["num_experts_per_tok"] = 2;
  Result<ModelConfig> result = load_model_config(TempDir().write("config.json", json::serialize(config)));
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("'n_group' = 8 (absent, the default)"), std::string::npos)
      << result.status().message();
}

TEST(ModelConfigTest, UnreadableFiles) {
  TempDir dir;
  Result<ModelConfig> missing = load_model_config(dir.path());  // no config.json in it
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find((dir.path() / "config.json").string()), std::string::npos);

  for (const std::string text : {"{\"model_type\": ", "", "[1, 2]", "{\"a\": 1} trailing", "\"deepseek_v3\""}) {
    SCOPED_TRACE(text);
    fs::path file = dir.write("config.json", text);
    Result<ModelConfig> result = load_model_config(file);
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.status().code(), StatusCode::kCorruption) << result.status().to_string();
    EXPECT_NE(result.status().message().find(file.string()), std::string::npos);
  }
}

}  // namespace
}  // namespace deepinfer::model
