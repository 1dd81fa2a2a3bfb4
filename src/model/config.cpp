// config.json -> ModelConfig: one validating pass over the fields DeepSeek's releases write, defaults from
// transformers' DeepseekV2Config / DeepseekV3Config, and consistency checks. Every error names the file,
// the field and the value.
#include "deepinfer/model/config.h"

#include "deepinfer/model/deepseek_v4.h"

#include <algorithm>
#include <boost/json.hpp>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <system_error>

#include "json_text.h"

namespace deepinfer::model {
namespace {

namespace json = boost::json;

constexpr uintmax_t kMaxConfigBytes = 16u << 20;  // real config.json files are a few KiB

std::string shown(const json::value& value) { return detail::json_text(value); }

std::optional<int64_t> as_int64(const json::value& value) {
  if (value.is_int64()) return value.get_int64();
  if (value.is_uint64()) {
    uint64_t v = value.get_uint64();
    if (v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return static_cast<int64_t>(v);
    return std::nullopt;
  }
  if (value.is_double()) {  // 4096.0 is written by some tools; 4096.5 is not an integer
    double v = value.get_double();
    if (std::isfinite(v) && std::floor(v) == v && std::fabs(v) < 9.0e18) return static_cast<int64_t>(v);
  }
  return std::nullopt;
}

std::optional<double> as_double(const json::value& value) {
  if (value.is_int64()) return static_cast<double>(value.get_int64());
  if (value.is_uint64()) return static_cast<double>(value.get_uint64());
  if (value.is_double()) return value.get_double();
  return std::nullopt;
}

// Reads the fields of one JSON object of config.json; `prefix` names the object ("" or "rope_scaling.").
class FieldReader {
 public:
  FieldReader(const std::string& file, const json::object& object, std::string prefix = "")
      : file_(file), object_(object), prefix_(std::move(prefix)) {}

  const json::value* find(std::string_view key) const { return object_.if_contains(key); }
  bool present(std::string_view key) const {
    const json::value* v = find(key);
    return v != nullptr && !v->is_null();
  }

  Status missing(std::string_view key) const {
    return Status::invalid_argument(file_ + ": missing required field '" + name(key) + "'");
  }
  Status bad(std::string_view key, const json::value& value, std::string_view problem) const {
    return Status::invalid_argument(file_ + ": field '" + name(key) + "' = " + shown(value) + ": " +
                                    std::string(problem));
  }
  Status unsupported(std::string_view key, const json::value& value, std::string_view problem) const {
    return Status::unsupported(file_ + ": field '" + name(key) + "' = " + shown(value) + ": " + std::string(problem));
  }
  // For checks on a value already read: shows the JSON value when present, else the default in effect.
  template <class T>
  Status bad_value(std::string_view key, T effective, std::string_view problem) const {
    const json::value* v = find(key);
    if (v != nullptr && !v->is_null()) return bad(key, *v, problem);
    std::ostringstream value;
    value << effective;
    return Status::invalid_argument(file_ + ": field '" + name(key) + "' = " + value.str() +
                                    " (absent, the default): " + std::string(problem));
  }

  // Absent or null keeps `out` unless `required`.
  Status read_int(std::string_view key, int64_t& out, bool required = false) const {
    const json::value* v = find(key);
    if (v == nullptr || v->is_null()) return required ? missing(key) : Status();
    std::optional<int64_t> parsed = as_int64(*v);
    if (!parsed) return bad(key, *v, "expected an integer");
    out = *parsed;
    return Status();
  }
  Status read_double(std::string_view key, double& out, bool required = false) const {
    const json::value* v = find(key);
    if (v == nullptr || v->is_null()) return required ? missing(key) : Status();
    std::optional<double> parsed = as_double(*v);
    if (!parsed || !std::isfinite(*parsed)) return bad(key, *v, "expected a finite number");
    out = *parsed;
    return Status();
  }
  Status read_bool(std::string_view key, bool& out) const {
    const json::value* v = find(key);
    if (v == nullptr || v->is_null()) return Status();
    if (!v->is_bool()) return bad(key, *v, "expected true or false");
    out = v->get_bool();
    return Status();
  }
  Status read_string(std::string_view key, std::string& out, bool required = false) const {
    const json::value* v = find(key);
    if (v == nullptr || v->is_null()) return required ? missing(key) : Status();
    if (!v->is_string()) return bad(key, *v, "expected a string");
    out = v->get_string();
    return Status();
  }

  std::string name(std::string_view key) const { return prefix_ + std::string(key); }
  const std::string& file() const { return file_; }

 private:
  const std::string& file_;
  const json::object& object_;
  std::string prefix_;
};

// Defaults of transformers' config class for the model type (DeepSeek's remote code for the fields
// transformers does not have).
void apply_defaults(ModelConfig& c) {
  if (c.model_type == "deepseek_v2") {
    c.n_shared_experts = 2;
    c.routed_scaling_factor = 1.0;
    c.n_group = 1;     // None in transformers: one group
    c.topk_group = 1;  // None in transformers
    c.first_k_dense_replace = 0;
    c.norm_topk_prob = false;
    c.scoring_func = "softmax";
    c.topk_method = "greedy";
    c.max_position_embeddings = 2048;
    c.bos_token_id = 1;
    c.eos_token_ids = {2};
  } else {
    c.n_shared_experts = 1;
    c.routed_scaling_factor = 2.5;
    c.n_group = 8;
    c.topk_group = 4;
    c.first_k_dense_replace = 3;
    c.norm_topk_prob = true;
    c.scoring_func = "sigmoid";
    c.topk_method = "noaux_tc";
    c.max_position_embeddings = 4096;
    c.bos_token_id = 0;
    c.eos_token_ids = {1};
  }
  c.moe_layer_freq = 1;
  c.hidden_act = "silu";
  c.rope_theta = 10000.0;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = false;
  c.num_nextn_predict_layers = 0;
}

// `rope_scaling` (or transformers 5's `rope_parameters`): `object_name` is the field it came from.
Status parse_rope(const std::string& file, const json::value& value, std::string_view object_name, ModelConfig& c) {
  if (value.is_null()) return Status();
  if (!value.is_object()) {
    return Status::invalid_argument(file + ": field '" + std::string(object_name) + "' = " + shown(value) +
                                    ": expected an object or null");
  }
  FieldReader r(file, value.get_object(), std::string(object_name) + ".");
  if (object_name == "rope_parameters") DEEPINFER_RETURN_IF_ERROR(r.read_double("rope_theta", c.rope_theta));
  // DeepSeek's configs write "type"; transformers writes "rope_type".
  std::string_view type_key = r.present("type")                  ? "type"
                              : r.present("rope_type")           ? "rope_type"
                              : object_name == "rope_parameters" ? "rope_type"
                                                                 : "type";
  std::string type;
  DEEPINFER_RETURN_IF_ERROR(r.read_string(type_key, type, /*required=*/true));
  if (type == "default") return Status();  // plain rope, no scaling
  if (type != "yarn") return r.unsupported(type_key, *r.find(type_key), "only \"yarn\" rope scaling is supported");
  RopeScaling rope;
  rope.type = type;
  DEEPINFER_RETURN_IF_ERROR(r.read_double("factor", rope.factor, /*required=*/true));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("original_max_position_embeddings", rope.original_max_position_embeddings));
  DEEPINFER_RETURN_IF_ERROR(r.read_double("beta_fast", rope.beta_fast));
  DEEPINFER_RETURN_IF_ERROR(r.read_double("beta_slow", rope.beta_slow));
  DEEPINFER_RETURN_IF_ERROR(r.read_double("mscale", rope.mscale));
  DEEPINFER_RETURN_IF_ERROR(r.read_double("mscale_all_dim", rope.mscale_all_dim));
  if (rope.factor < 1.0) return r.bad_value("factor", rope.factor, "must be >= 1");
  if (rope.original_max_position_embeddings <= 0) {
    return r.bad_value("original_max_position_embeddings", rope.original_max_position_embeddings, "must be positive");
  }
  if (rope.beta_fast <= 0.0) return r.bad_value("beta_fast", rope.beta_fast, "must be positive");
  if (rope.beta_slow <= 0.0) return r.bad_value("beta_slow", rope.beta_slow, "must be positive");
  if (rope.mscale < 0.0) return r.bad_value("mscale", rope.mscale, "must be >= 0");
  if (rope.mscale_all_dim < 0.0) return r.bad_value("mscale_all_dim", rope.mscale_all_dim, "must be >= 0");
  c.rope_scaling = std::move(rope);
  return Status();
}

Status parse_quantization(const std::string& file, const json::value& value, ModelConfig& c) {
  if (value.is_null()) return Status();
  if (!value.is_object()) {
    return Status::invalid_argument(file + ": field 'quantization_config' = " + shown(value) +
                                    ": expected an object or null");
  }
  FieldReader r(file, value.get_object(), "quantization_config.");
  std::string method;
  DEEPINFER_RETURN_IF_ERROR(r.read_string("quant_method", method, /*required=*/true));
  if (method != "fp8") {
    return r.unsupported("quant_method", *r.find("quant_method"),
                         "only DeepSeek's block-scaled \"fp8\" is supported; use a bf16 or fp8 checkpoint");
  }
  std::string fmt = "e4m3";
  DEEPINFER_RETURN_IF_ERROR(r.read_string("fmt", fmt));
  if (fmt != "e4m3") return r.unsupported("fmt", *r.find("fmt"), "only \"e4m3\" (float8_e4m3fn) weights are supported");
  std::string activation_scheme = "dynamic";
  DEEPINFER_RETURN_IF_ERROR(r.read_string("activation_scheme", activation_scheme));
  if (activation_scheme != "dynamic") {
    return r.unsupported("activation_scheme", *r.find("activation_scheme"), "only \"dynamic\" is supported");
  }
  const json::value* block = r.find("weight_block_size");
  if (block == nullptr || block->is_null()) {
    return Status::unsupported(file +
                               ": field 'quantization_config.weight_block_size' is missing: per-tensor FP8 "
                               "scales are not supported, only DeepSeek's per-block weight_scale_inv");
  }
  if (!block->is_array() || block->get_array().size() != 2) {
    return r.bad("weight_block_size", *block, "expected [rows, cols]");
  }
  std::vector<int64_t> sizes;
  for (const json::value& element : block->get_array()) {
    std::optional<int64_t> size = as_int64(element);
    if (!size || *size <= 0) return r.bad("weight_block_size", *block, "expected two positive integers");
    sizes.push_back(*size);
  }
  c.quant_method = method;
  c.weight_block_size = std::move(sizes);
  return Status();
}

Status parse_eos(const FieldReader& r, ModelConfig& c) {
  const json::value* v = r.find("eos_token_id");
  if (v == nullptr) return Status();
  if (v->is_null()) {
    c.eos_token_ids.clear();
    return Status();
  }
  std::vector<int64_t> ids;
  if (v->is_array()) {
    for (const json::value& element : v->get_array()) {
      std::optional<int64_t> id = as_int64(element);
      if (!id) return r.bad("eos_token_id", *v, "expected an integer or a list of integers");
      ids.push_back(*id);
    }
  } else {
    std::optional<int64_t> id = as_int64(*v);
    if (!id) return r.bad("eos_token_id", *v, "expected an integer or a list of integers");
    ids.push_back(*id);
  }
  c.eos_token_ids = std::move(ids);
  return Status();
}

Status validate(const FieldReader& r, const ModelConfig& c) {
  auto positive = [&](std::string_view key, int64_t value) -> Status {
    return value > 0 ? Status() : r.bad_value(key, value, "must be positive");
  };
  DEEPINFER_RETURN_IF_ERROR(positive("vocab_size", c.vocab_size));
  DEEPINFER_RETURN_IF_ERROR(positive("hidden_size", c.hidden_size));
  DEEPINFER_RETURN_IF_ERROR(positive("intermediate_size", c.intermediate_size));
  DEEPINFER_RETURN_IF_ERROR(positive("num_hidden_layers", c.num_hidden_layers));
  DEEPINFER_RETURN_IF_ERROR(positive("num_attention_heads", c.num_attention_heads));
  DEEPINFER_RETURN_IF_ERROR(positive("num_key_value_heads", c.num_key_value_heads));
  DEEPINFER_RETURN_IF_ERROR(positive("kv_lora_rank", c.kv_lora_rank));
  DEEPINFER_RETURN_IF_ERROR(positive("qk_rope_head_dim", c.qk_rope_head_dim));
  DEEPINFER_RETURN_IF_ERROR(positive("qk_nope_head_dim", c.qk_nope_head_dim));
  DEEPINFER_RETURN_IF_ERROR(positive("v_head_dim", c.v_head_dim));
  DEEPINFER_RETURN_IF_ERROR(positive("max_position_embeddings", c.max_position_embeddings));
  if (c.qk_rope_head_dim % 2 != 0)
    return r.bad_value("qk_rope_head_dim", c.qk_rope_head_dim, "must be even (rotary pairs)");
  if (c.q_lora_rank && *c.q_lora_rank <= 0)
    return r.bad_value("q_lora_rank", *c.q_lora_rank, "must be positive or null");
  if (c.n_shared_experts < 0) return r.bad_value("n_shared_experts", c.n_shared_experts, "must be >= 0");
  if (c.n_routed_experts < 0) return r.bad_value("n_routed_experts", c.n_routed_experts, "must be >= 0 or null");
  if (c.num_nextn_predict_layers < 0)
    return r.bad_value("num_nextn_predict_layers", c.num_nextn_predict_layers, "must be >= 0");
  if (c.first_k_dense_replace < 0 || c.first_k_dense_replace > c.num_hidden_layers) {
    return r.bad_value("first_k_dense_replace", c.first_k_dense_replace,
                       "must be in [0, num_hidden_layers = " + std::to_string(c.num_hidden_layers) + "]");
  }
  if (c.moe_layer_freq <= 0) return r.bad_value("moe_layer_freq", c.moe_layer_freq, "must be positive");
  if (c.rope_theta <= 0.0) return r.bad_value("rope_theta", c.rope_theta, "must be positive");
  if (c.rms_norm_eps <= 0.0) return r.bad_value("rms_norm_eps", c.rms_norm_eps, "must be positive");
  if (c.bos_token_id < 0 || c.bos_token_id >= c.vocab_size) {
    return r.bad_value("bos_token_id", c.bos_token_id,
                       "must be a token id in [0, vocab_size = " + std::to_string(c.vocab_size) + ")");
  }
  for (int64_t id : c.eos_token_ids) {
    if (id < 0 || id >= c.vocab_size) {
      return r.bad_value("eos_token_id", id,
                         "must be token ids in [0, vocab_size = " + std::to_string(c.vocab_size) + ")");
    }
  }
  if (c.hidden_act != "silu") return r.unsupported("hidden_act", *r.find("hidden_act"), "only \"silu\" is supported");
  if (c.scoring_func != "softmax" && c.scoring_func != "sigmoid") {
    return r.unsupported("scoring_func", *r.find("scoring_func"), "expected \"softmax\" or \"sigmoid\"");
  }
  if (c.topk_method != "greedy" && c.topk_method != "group_limited_greedy" && c.topk_method != "noaux_tc") {
    return r.unsupported("topk_method", *r.find("topk_method"),
                         "expected \"greedy\", \"group_limited_greedy\" or \"noaux_tc\"");
  }
  if (c.n_routed_experts > 0) {
    DEEPINFER_RETURN_IF_ERROR(positive("moe_intermediate_size", c.moe_intermediate_size));
    if (!std::isfinite(c.routed_scaling_factor) || c.routed_scaling_factor <= 0.0) {
      return r.bad_value("routed_scaling_factor", c.routed_scaling_factor, "must be positive");
    }
    const std::string experts = "n_routed_experts = " + std::to_string(c.n_routed_experts);
    if (c.num_experts_per_tok <= 0 || c.num_experts_per_tok > c.n_routed_experts) {
      return r.bad_value("num_experts_per_tok", c.num_experts_per_tok, "must be in [1, " + experts + "]");
    }
    if (c.n_group <= 0 || c.n_routed_experts % c.n_group != 0) {
      return r.bad_value("n_group", c.n_group, "must be positive and divide " + experts);
    }
    if (c.topk_group <= 0 || c.topk_group > c.n_group) {
      return r.bad_value("topk_group", c.topk_group, "must be in [1, n_group = " + std::to_string(c.n_group) + "]");
    }
    const bool group_limited = c.topk_method != "greedy";
    const int64_t reachable = c.topk_group * (c.n_routed_experts / c.n_group);
    if (group_limited && c.num_experts_per_tok > reachable) {
      return r.bad_value("num_experts_per_tok", c.num_experts_per_tok,
                         "exceeds the " + std::to_string(reachable) + " experts in topk_group = " +
                             std::to_string(c.topk_group) + " of n_group = " + std::to_string(c.n_group) + " groups");
    }
  }
  return Status();
}

Result<std::string> read_config_text(const std::filesystem::path& file) {
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) return Status::not_found(file.string() + ": no such file");
  if (!std::filesystem::is_regular_file(file, ec)) return Status::io_error(file.string() + ": not a regular file");
  uintmax_t size = std::filesystem::file_size(file, ec);
  if (ec) return Status::io_error(file.string() + ": cannot stat: " + ec.message());
  if (size > kMaxConfigBytes) {
    return Status::invalid_argument(file.string() + ": " + std::to_string(size) + " bytes, over the " +
                                    std::to_string(kMaxConfigBytes) + "-byte limit for a config.json");
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) return Status::io_error(file.string() + ": cannot open for reading");
  std::ostringstream text;
  text << in.rdbuf();
  if (!in.good() && !in.eof()) return Status::io_error(file.string() + ": read failed");
  return text.str();
}

// The DSpark draft module's keys (DsparkDraftConfig), all or none.
Status parse_dspark(const FieldReader& r, ModelConfig& c) {
  constexpr std::string_view kKeys[] = {"dspark_target_layer_ids", "dspark_block_size", "dspark_markov_rank",
                                        "dspark_noise_token_id"};
  bool any = false;
  for (std::string_view key : kKeys) any = any || r.present(key);
  for (std::string_view key : {"dspark_config", "dspark_n_routed_experts"}) {
    if (r.present(key)) {
      return r.unsupported(key, *r.find(key),
                           "this build runs DSpark draft modules with dense stages whose keys are top-level "
                           "dspark_target_layer_ids / dspark_block_size / dspark_markov_rank / dspark_noise_token_id");
    }
  }
  if (!any) return Status();
  DsparkDraftConfig d;
  const json::value* ids = r.find("dspark_target_layer_ids");
  if (ids == nullptr || ids->is_null()) return r.missing("dspark_target_layer_ids");
  if (!ids->is_array() || ids->as_array().empty()) return r.bad("dspark_target_layer_ids", *ids, "expected a non-empty list of layer indices");
  for (const json::value& id : ids->as_array()) {
    std::optional<int64_t> layer = as_int64(id);
    if (!layer || *layer < 0 || *layer >= c.num_hidden_layers ||
        std::find(d.target_layer_ids.begin(), d.target_layer_ids.end(), *layer) != d.target_layer_ids.end()) {
      return r.bad("dspark_target_layer_ids", *ids,
                   "expected distinct layer indices below num_hidden_layers (" + std::to_string(c.num_hidden_layers) + ")");
    }
    d.target_layer_ids.push_back(*layer);
  }
  DEEPINFER_RETURN_IF_ERROR(r.read_int("dspark_block_size", d.block_size, true));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("dspark_markov_rank", d.markov_rank, true));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("dspark_noise_token_id", d.noise_token_id, true));
  if (d.block_size < 1 || d.block_size > 16) return r.bad("dspark_block_size", *r.find("dspark_block_size"), "expected 1..16");
  if (d.markov_rank < 1) return r.bad("dspark_markov_rank", *r.find("dspark_markov_rank"), "expected >= 1");
  if (d.noise_token_id < 0 || d.noise_token_id >= c.vocab_size) {
    return r.bad("dspark_noise_token_id", *r.find("dspark_noise_token_id"), "expected a token id below vocab_size");
  }
  c.dspark = std::move(d);
  return Status();
}

Result<ModelConfig> parse_config(const std::string& file, const std::string& text) {
  json::error_code ec;
  json::value root = json::parse(text, ec);
  if (ec) return Status::corruption(file + ": not valid JSON: " + ec.message());
  if (!root.is_object()) return Status::corruption(file + ": expected a JSON object at the top level");
  FieldReader r(file, root.get_object());

  ModelConfig c;
  DEEPINFER_RETURN_IF_ERROR(r.read_string("model_type", c.model_type, /*required=*/true));
  if (c.model_type != "deepseek_v2" && c.model_type != "deepseek_v3") {
    return r.unsupported("model_type", *r.find("model_type"),
                         c.model_type == "deepseek_v4"
                             ? "DeepSeek-V4 loads through load_v4_config / DeepSeekV4Model, not this loader"
                             : "expected \"deepseek_v2\", \"deepseek_v3\" or \"deepseek_v4\"");
  }
  apply_defaults(c);

  DEEPINFER_RETURN_IF_ERROR(r.read_int("vocab_size", c.vocab_size, true));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("hidden_size", c.hidden_size, true));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("intermediate_size", c.intermediate_size, true));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("num_hidden_layers", c.num_hidden_layers, true));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("num_attention_heads", c.num_attention_heads, true));
  c.num_key_value_heads = c.num_attention_heads;
  DEEPINFER_RETURN_IF_ERROR(r.read_int("num_key_value_heads", c.num_key_value_heads));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("kv_lora_rank", c.kv_lora_rank, true));
  if (r.find("q_lora_rank") == nullptr) return r.missing("q_lora_rank");
  if (r.present("q_lora_rank")) {
    int64_t rank = 0;
    DEEPINFER_RETURN_IF_ERROR(r.read_int("q_lora_rank", rank));
    c.q_lora_rank = rank;
  }
  DEEPINFER_RETURN_IF_ERROR(r.read_int("qk_rope_head_dim", c.qk_rope_head_dim, true));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("qk_nope_head_dim", c.qk_nope_head_dim, true));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("v_head_dim", c.v_head_dim, true));

  if (r.find("n_routed_experts") == nullptr) return r.missing("n_routed_experts");
  DEEPINFER_RETURN_IF_ERROR(r.read_int("n_routed_experts", c.n_routed_experts));  // null: dense
  if (c.n_routed_experts > 0) {
    DEEPINFER_RETURN_IF_ERROR(r.read_int("moe_intermediate_size", c.moe_intermediate_size, true));
    DEEPINFER_RETURN_IF_ERROR(r.read_int("num_experts_per_tok", c.num_experts_per_tok, true));
  } else {
    DEEPINFER_RETURN_IF_ERROR(r.read_int("moe_intermediate_size", c.moe_intermediate_size));
    DEEPINFER_RETURN_IF_ERROR(r.read_int("num_experts_per_tok", c.num_experts_per_tok));
  }
  DEEPINFER_RETURN_IF_ERROR(r.read_int("n_shared_experts", c.n_shared_experts));
  DEEPINFER_RETURN_IF_ERROR(r.read_double("routed_scaling_factor", c.routed_scaling_factor));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("n_group", c.n_group));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("topk_group", c.topk_group));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("first_k_dense_replace", c.first_k_dense_replace));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("moe_layer_freq", c.moe_layer_freq));
  DEEPINFER_RETURN_IF_ERROR(r.read_bool("norm_topk_prob", c.norm_topk_prob));
  DEEPINFER_RETURN_IF_ERROR(r.read_string("scoring_func", c.scoring_func));
  DEEPINFER_RETURN_IF_ERROR(r.read_string("topk_method", c.topk_method));
  DEEPINFER_RETURN_IF_ERROR(r.read_string("hidden_act", c.hidden_act));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("max_position_embeddings", c.max_position_embeddings));
  DEEPINFER_RETURN_IF_ERROR(r.read_double("rope_theta", c.rope_theta));
  DEEPINFER_RETURN_IF_ERROR(r.read_double("rms_norm_eps", c.rms_norm_eps));
  DEEPINFER_RETURN_IF_ERROR(r.read_bool("tie_word_embeddings", c.tie_word_embeddings));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("bos_token_id", c.bos_token_id));
  DEEPINFER_RETURN_IF_ERROR(parse_eos(r, c));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("num_nextn_predict_layers", c.num_nextn_predict_layers));
  DEEPINFER_RETURN_IF_ERROR(parse_dspark(r, c));

  if (r.present("rope_scaling")) {
    DEEPINFER_RETURN_IF_ERROR(parse_rope(file, *r.find("rope_scaling"), "rope_scaling", c));
  } else if (r.present("rope_parameters")) {
    DEEPINFER_RETURN_IF_ERROR(parse_rope(file, *r.find("rope_parameters"), "rope_parameters", c));
  }
  if (const json::value* quantization = r.find("quantization_config")) {
    DEEPINFER_RETURN_IF_ERROR(parse_quantization(file, *quantization, c));
  }
  DEEPINFER_RETURN_IF_ERROR(validate(r, c));
  return c;
}

Status read_int_list(const FieldReader& r, std::string_view key, std::vector<int64_t>& out) {
  const json::value* v = r.find(key);
  if (v == nullptr || v->is_null()) return r.missing(key);
  if (!v->is_array()) return r.bad(key, *v, "expected a list of integers");
  out.clear();
  for (const json::value& element : v->get_array()) {
    std::optional<int64_t> value = as_int64(element);
    if (!value) return r.bad(key, *v, "expected a list of integers");
    out.push_back(*value);
  }
  return Status();
}

Result<V4Config> parse_v4_config(const std::string& file, const std::string& text) {
  json::error_code ec;
  json::value root = json::parse(text, ec);
  if (ec) return Status::corruption(file + ": not valid JSON: " + ec.message());
  if (!root.is_object()) return Status::corruption(file + ": expected a JSON object at the top level");
  FieldReader r(file, root.get_object());

  V4Config c;
  DEEPINFER_RETURN_IF_ERROR(r.read_string("model_type", c.model_type, /*required=*/true));
  if (c.model_type != "deepseek_v4") {
    return r.unsupported("model_type", *r.find("model_type"), "expected \"deepseek_v4\"");
  }
  for (std::string_view key : {"vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank",
                               "o_groups", "n_routed_experts", "num_experts_per_tok"}) {
    if (!r.present(key)) return r.missing(key);
  }
  DEEPINFER_RETURN_IF_ERROR(r.read_int("vocab_size", c.vocab_size));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("hidden_size", c.hidden_size));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("moe_intermediate_size", c.moe_intermediate_size));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("num_hidden_layers", c.num_hidden_layers));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("num_attention_heads", c.num_attention_heads));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("head_dim", c.head_dim));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("qk_rope_head_dim", c.qk_rope_head_dim));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("q_lora_rank", c.q_lora_rank));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("o_lora_rank", c.o_lora_rank));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("o_groups", c.o_groups));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("n_routed_experts", c.n_routed_experts));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("num_experts_per_tok", c.num_experts_per_tok));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("n_shared_experts", c.n_shared_experts));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("num_nextn_predict_layers", c.num_nextn_predict_layers));
  DEEPINFER_RETURN_IF_ERROR(read_int_list(r, "compress_ratios", c.compress_ratios));
  DEEPINFER_RETURN_IF_ERROR(r.read_double("rope_theta", c.rope_theta));
  DEEPINFER_RETURN_IF_ERROR(r.read_double("compress_rope_theta", c.compress_rope_theta));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("sliding_window", c.sliding_window));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("index_n_heads", c.index_n_heads));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("index_head_dim", c.index_head_dim));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("index_topk", c.index_topk));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("hc_mult", c.hc_mult));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("hc_sinkhorn_iters", c.hc_sinkhorn_iters));
  DEEPINFER_RETURN_IF_ERROR(r.read_double("hc_eps", c.hc_eps));
  DEEPINFER_RETURN_IF_ERROR(r.read_string("scoring_func", c.scoring_func));
  DEEPINFER_RETURN_IF_ERROR(r.read_double("routed_scaling_factor", c.routed_scaling_factor));
  DEEPINFER_RETURN_IF_ERROR(r.read_double("swiglu_limit", c.swiglu_limit));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("num_hash_layers", c.num_hash_layers));
  DEEPINFER_RETURN_IF_ERROR(r.read_double("rms_norm_eps", c.rms_norm_eps));
  c.max_position_embeddings = 1048576;
  DEEPINFER_RETURN_IF_ERROR(r.read_int("max_position_embeddings", c.max_position_embeddings));
  DEEPINFER_RETURN_IF_ERROR(r.read_int("bos_token_id", c.bos_token_id));
  ModelConfig eos;
  eos.eos_token_ids = {1};
  DEEPINFER_RETURN_IF_ERROR(parse_eos(r, eos));
  c.eos_token_ids = eos.eos_token_ids;

  // Keys whose other values the V4 code hard-wires (DeepSeek's inference/model.py).
  int64_t kv_heads = 1;
  DEEPINFER_RETURN_IF_ERROR(r.read_int("num_key_value_heads", kv_heads));
  if (kv_heads != 1) return r.bad_value("num_key_value_heads", kv_heads, "DeepSeek-V4 attention has one shared KV head");
  std::string topk_method = "noaux_tc";
  DEEPINFER_RETURN_IF_ERROR(r.read_string("topk_method", topk_method));
  if (topk_method != "noaux_tc") return r.unsupported("topk_method", *r.find("topk_method"), "expected \"noaux_tc\"");
  bool tie = false;
  DEEPINFER_RETURN_IF_ERROR(r.read_bool("tie_word_embeddings", tie));
  if (tie) return r.unsupported("tie_word_embeddings", *r.find("tie_word_embeddings"), "V4 has a separate head");
  if (c.n_shared_experts != 1) {
    return r.bad_value("n_shared_experts", c.n_shared_experts, "DeepSeek-V4 has exactly one shared expert");
  }
  if (c.scoring_func != "sqrtsoftplus" && c.scoring_func != "sigmoid" && c.scoring_func != "softmax") {
    return r.unsupported("scoring_func", *r.find("scoring_func"), "expected \"sqrtsoftplus\", \"sigmoid\" or \"softmax\"");
  }
  if (r.present("quantization_config")) {
    ModelConfig quantization;
    DEEPINFER_RETURN_IF_ERROR(parse_quantization(file, *r.find("quantization_config"), quantization));
    c.weight_block_size = quantization.weight_block_size;
  }
  DEEPINFER_RETURN_IF_ERROR(r.read_string("expert_dtype", c.expert_dtype));
  if (!c.expert_dtype.empty() && c.expert_dtype != "fp4" && c.expert_dtype != "fp8") {
    return r.unsupported("expert_dtype", *r.find("expert_dtype"), "expected \"fp4\", \"fp8\" or null");
  }
  if (!c.expert_dtype.empty() && c.weight_block_size.empty()) {
    return r.bad("expert_dtype", *r.find("expert_dtype"), "quantized experts need a quantization_config");
  }
  if (r.present("rope_scaling")) {
    ModelConfig rope;
    DEEPINFER_RETURN_IF_ERROR(parse_rope(file, *r.find("rope_scaling"), "rope_scaling", rope));
    if (!rope.rope_scaling) return r.unsupported("rope_scaling", *r.find("rope_scaling"), "V4's compressed layers use \"yarn\"");
    c.rope_scaling = *rope.rope_scaling;
  } else {
    c.rope_scaling.type = "yarn";
    c.rope_scaling.factor = 16.0;
    c.rope_scaling.original_max_position_embeddings = 65536;
  }

  auto positive = [&](std::string_view key, int64_t value) -> Status {
    return value > 0 ? Status() : r.bad_value(key, value, "must be positive");
  };
  for (auto [key, value] : std::initializer_list<std::pair<std::string_view, int64_t>>{
           {"vocab_size", c.vocab_size}, {"hidden_size", c.hidden_size},
           {"moe_intermediate_size", c.moe_intermediate_size}, {"num_hidden_layers", c.num_hidden_layers},
           {"num_attention_heads", c.num_attention_heads}, {"head_dim", c.head_dim},
           {"qk_rope_head_dim", c.qk_rope_head_dim}, {"q_lora_rank", c.q_lora_rank}, {"o_lora_rank", c.o_lora_rank},
           {"o_groups", c.o_groups}, {"n_routed_experts", c.n_routed_experts},
           {"num_experts_per_tok", c.num_experts_per_tok}, {"sliding_window", c.sliding_window},
           {"hc_mult", c.hc_mult}, {"hc_sinkhorn_iters", c.hc_sinkhorn_iters},
           {"max_position_embeddings", c.max_position_embeddings}}) {
    DEEPINFER_RETURN_IF_ERROR(positive(key, value));
  }
  if (c.qk_rope_head_dim % 2 != 0) return r.bad_value("qk_rope_head_dim", c.qk_rope_head_dim, "must be even (rotary pairs)");
  if (c.qk_rope_head_dim >= c.head_dim) return r.bad_value("qk_rope_head_dim", c.qk_rope_head_dim, "must be below head_dim");
  if (c.num_attention_heads % c.o_groups != 0) {
    return r.bad_value("o_groups", c.o_groups, "must divide num_attention_heads");
  }
  if (c.num_experts_per_tok > c.n_routed_experts) {
    return r.bad_value("num_experts_per_tok", c.num_experts_per_tok, "must be <= n_routed_experts");
  }
  if (c.num_hash_layers < 0 || c.num_hash_layers > c.num_hidden_layers) {
    return r.bad_value("num_hash_layers", c.num_hash_layers, "must be in 0..num_hidden_layers");
  }
  if (c.num_nextn_predict_layers < 0) {
    return r.bad_value("num_nextn_predict_layers", c.num_nextn_predict_layers, "must be >= 0");
  }
  if (static_cast<int64_t>(c.compress_ratios.size()) != c.num_hidden_layers + c.num_nextn_predict_layers) {
    return r.bad("compress_ratios", *r.find("compress_ratios"),
                 "expected one ratio per layer: num_hidden_layers + num_nextn_predict_layers = " +
                     std::to_string(c.num_hidden_layers + c.num_nextn_predict_layers) + " values");
  }
  bool any_csa = false;
  for (int64_t ratio : c.compress_ratios) {
    if (ratio != 0 && ratio != 4 && ratio != 128) {
      return r.bad("compress_ratios", *r.find("compress_ratios"), "expected values 0, 4 or 128 (V4)");
    }
    any_csa = any_csa || ratio == 4;
  }
  if (any_csa) {
    DEEPINFER_RETURN_IF_ERROR(positive("index_n_heads", c.index_n_heads));
    DEEPINFER_RETURN_IF_ERROR(positive("index_head_dim", c.index_head_dim));
    DEEPINFER_RETURN_IF_ERROR(positive("index_topk", c.index_topk));
    if (c.index_head_dim <= c.qk_rope_head_dim) {
      return r.bad_value("index_head_dim", c.index_head_dim, "must exceed qk_rope_head_dim");
    }
  }
  if (c.rms_norm_eps <= 0.0) return r.bad_value("rms_norm_eps", c.rms_norm_eps, "must be positive");
  if (c.hc_eps < 0.0) return r.bad_value("hc_eps", c.hc_eps, "must be >= 0");
  if (c.swiglu_limit < 0.0) return r.bad_value("swiglu_limit", c.swiglu_limit, "must be >= 0 (0: no clamp)");
  return c;
}

Result<std::string> parse_model_type(const std::string& file, const std::string& text) {
  json::error_code ec;
  json::value root = json::parse(text, ec);
  if (ec) return Status::corruption(file + ": not valid JSON: " + ec.message());
  if (!root.is_object()) return Status::corruption(file + ": expected a JSON object at the top level");
  FieldReader r(file, root.get_object());
  std::string type;
  DEEPINFER_RETURN_IF_ERROR(r.read_string("model_type", type, /*required=*/true));
  return type;
}

template <class T>
Result<T> load_config_file(const std::filesystem::path& path,
                           Result<T> (*parse)(const std::string& file, const std::string& text)) {
  std::error_code ec;
  std::filesystem::path file = std::filesystem::is_directory(path, ec) ? path / "config.json" : path;
  try {
    Result<std::string> text = read_config_text(file);
    if (!text.ok()) return text.status();
    return parse(file.string(), *text);
  } catch (const std::exception& e) {  // allocation failure; Boost.JSON reports syntax errors by error_code
    return Status::internal(file.string() + ": " + e.what());
  }
}

}  // namespace

Result<ModelConfig> load_model_config(const std::filesystem::path& path) {
  return load_config_file<ModelConfig>(path, &parse_config);
}

Result<V4Config> load_v4_config(const std::filesystem::path& path) {
  return load_config_file<V4Config>(path, &parse_v4_config);
}

Result<std::string> read_model_type(const std::filesystem::path& path) {
  return load_config_file<std::string>(path, &parse_model_type);
}

}  // namespace deepinfer::model

