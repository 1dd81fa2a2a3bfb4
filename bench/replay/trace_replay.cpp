// Mooncake trace loading, the ideal infinite-cache bound, and the replay through TierPolicy. Trace hash ids
// stand in for chained block hashes: the traces' ids are already prefix-chained (an id always follows the
// same parent id), so they key the radix tree exactly as our XXH3 chain would.
#include "trace_replay.h"

#include <algorithm>
#include <boost/json.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "png_plot.h"

namespace deepinfer::bench {
namespace {

using kvcache::BlockHash;
using kvcache::CacheCounters;
using kvcache::Tier;
using kvcache::TierPolicy;
using kvcache::TierPolicyConfig;

// Tokens of block `j` of `request`: 512, except the last one, which holds the remainder.
int64_t block_tokens(const TraceRequest& request, size_t j) {
  if (j + 1 < request.hash_ids.size()) return kMooncakeBlockTokens;
  return request.input_length - static_cast<int64_t>(kMooncakeBlockTokens) * static_cast<int64_t>(j);
}

Result<int64_t> int_field(const boost::json::object& object, const char* field, const std::string& where) {
  const boost::json::value* value = object.if_contains(field);
  if (value == nullptr) return Status::corruption(where + ": no field '" + field + "'");
  if (value->is_int64()) return value->as_int64();
  if (value->is_uint64() && value->as_uint64() <= static_cast<uint64_t>(INT64_MAX)) {
    return static_cast<int64_t>(value->as_uint64());
  }
  return Status::corruption(where + ": field '" + field + "' is not an integer");
}

std::string format_double(double value, int decimals) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*f", decimals, value);
  return buffer;
}

// One JSON object with its fields in insertion order and rates in fixed notation (6 decimals), which
// people read more easily than the shortest round-trip form.
class JsonFields {
 public:
  void add(const std::string& key, const std::string& raw_value) {
    text_ += text_.empty() ? "{" : ",";
    text_ += "\"" + key + "\":" + raw_value;
  }
  void add(const std::string& key, int64_t value) { add(key, std::to_string(value)); }
  void add(const std::string& key, int32_t value) { add(key, std::to_string(value)); }
  void add(const std::string& key, double value) { add(key, format_double(value, 6)); }
  std::string str() const { return text_.empty() ? "{}" : text_ + "}"; }

 private:
  std::string text_;
};

}  // namespace

Result<Trace> load_mooncake_trace(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::io_error("cannot read trace " + path);
  Trace trace;
  trace.name = std::filesystem::path(path).stem().string();
  std::unordered_set<int64_t> unique;
  std::string line;
  int64_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_number);
    boost::system::error_code error;
    boost::json::value value = boost::json::parse(line, error);
    if (error) return Status::corruption(where + ": not JSON (" + error.message() + ")");
    if (!value.is_object()) return Status::corruption(where + ": not a JSON object");
    const boost::json::object& object = value.as_object();
    TraceRequest request;
    for (auto [field, target] :
         {std::pair{"timestamp", &request.timestamp_ms}, std::pair{"input_length", &request.input_length},
          std::pair{"output_length", &request.output_length}}) {
      Result<int64_t> number = int_field(object, field, where);
      if (!number.ok()) return number.status();
      *target = *number;
    }
    const boost::json::value* ids = object.if_contains("hash_ids");
    if (ids == nullptr || !ids->is_array())
      return Status::corruption(where + ": 'hash_ids' is missing or not an array");
    for (const boost::json::value& id : ids->as_array()) {
      if (!id.is_int64()) return Status::corruption(where + ": 'hash_ids' holds a non-integer");
      request.hash_ids.push_back(id.as_int64());
      unique.insert(id.as_int64());
    }
    const int64_t expected = (request.input_length + kMooncakeBlockTokens - 1) / kMooncakeBlockTokens;
    if (request.input_length <= 0 || static_cast<int64_t>(request.hash_ids.size()) != expected) {
      return Status::corruption(where + ": input_length " + std::to_string(request.input_length) + " needs " +
                                std::to_string(expected) + " hash_ids of 512 tokens, found " +
                                std::to_string(request.hash_ids.size()));
    }
    if (!trace.requests.empty() && request.timestamp_ms < trace.requests.back().timestamp_ms) {
      return Status::corruption(where + ": timestamp " + std::to_string(request.timestamp_ms) +
                                " is earlier than the previous request's");
    }
    trace.total_blocks += static_cast<int64_t>(request.hash_ids.size());
    trace.requests.push_back(std::move(request));
  }
  trace.unique_blocks = static_cast<int64_t>(unique.size());
  return trace;
}

HitRates ideal_hit_rates(const Trace& trace, std::optional<int64_t> ttl_ms) {
  std::unordered_map<int64_t, int64_t> last_touch_ms;
  last_touch_ms.reserve(static_cast<size_t>(trace.unique_blocks));
  int64_t blocks = 0, hit_blocks = 0, tokens = 0, hit_tokens = 0;
  for (const TraceRequest& request : trace.requests) {
    const int64_t now = request.timestamp_ms;
    bool prefix_hits = true;
    for (size_t j = 0; j < request.hash_ids.size(); ++j) {
      auto it = last_touch_ms.find(request.hash_ids[j]);
      const bool seen = it != last_touch_ms.end() && (!ttl_ms.has_value() || now - it->second <= *ttl_ms);
      prefix_hits = prefix_hits && seen;
      if (prefix_hits) {
        ++hit_blocks;
        hit_tokens += block_tokens(request, j);
      }
    }
    for (int64_t id : request.hash_ids) last_touch_ms[id] = now;
    blocks += static_cast<int64_t>(request.hash_ids.size());
    tokens += request.input_length;
  }
  HitRates rates;
  rates.block_hit_rate = blocks == 0 ? 0.0 : static_cast<double>(hit_blocks) / blocks;
  rates.token_hit_rate = tokens == 0 ? 0.0 : static_cast<double>(hit_tokens) / tokens;
  return rates;
}

Result<ReplayResult> replay_trace(const Trace& trace, const ReplayConfig& config) {
  TierPolicyConfig policy_config;
  policy_config.block_tokens = kMooncakeBlockTokens;
  policy_config.bytes_per_block = config.bytes_per_block;
  if (config.ttl_s.has_value()) {
    if (!(*config.ttl_s > 0)) {
      return Status::invalid_argument("--ttl-s is " + std::to_string(*config.ttl_s) + "; it must be positive");
    }
    policy_config.retention = kvcache::RetentionConfig::defaults(*config.ttl_s / 3600.0);
  }
  const std::array<int64_t, kvcache::kNumTiers> capacities = {config.capacity_blocks, config.host_blocks,
                                                              config.disk_blocks};
  for (size_t t = 0; t < capacities.size(); ++t) {
    kvcache::TierConfig& tier = policy_config.tiers[t];
    tier.capacity_blocks = capacities[t];
    tier.high_watermark = config.high_watermark;
    tier.low_watermark = config.low_watermark;
    tier.evict_bytes_per_s = config.evict_blocks_per_s == kvcache::kUnlimited
                                 ? kvcache::kUnlimited
                                 : config.evict_blocks_per_s * static_cast<double>(config.bytes_per_block);
  }
  Result<TierPolicy> policy = TierPolicy::create(std::move(policy_config));
  if (!policy.ok()) return policy.status();

  const auto start = std::chrono::steady_clock::now();
  std::vector<BlockHash> chain;
  for (const TraceRequest& request : trace.requests) {
    const int64_t now = request.timestamp_ms;
    policy->tick(now);
    chain.clear();
    for (int64_t id : request.hash_ids) chain.push_back(BlockHash{static_cast<uint64_t>(id), 0x6d6f6f6e63616b65ull});
    kvcache::LookupResult hit = policy->lookup(chain, request.input_length, now);
    kvcache::InsertResult inserted = policy->insert(chain, now);
    if (Status status = policy->release(hit.nodes); !status.ok()) return status;
    if (Status status = policy->release(inserted.nodes); !status.ok()) return status;
  }
  ReplayResult result;
  result.config = config;
  result.counters = policy->counters();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

std::vector<int64_t> default_capacities(const Trace& trace, double high_watermark) {
  const int64_t full =
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(static_cast<double>(trace.unique_blocks) / high_watermark)));
  std::vector<int64_t> capacities;
  for (int shift = 7; shift >= 0; --shift) {
    const int64_t capacity = std::max<int64_t>(1, full >> shift);
    if (capacities.empty() || capacities.back() != capacity) capacities.push_back(capacity);
  }
  capacities.back() = full;
  return capacities;
}

std::string replay_json_line(const Trace& trace, const ReplayResult& result, const HitRates& ideal,
                             const std::optional<HitRates>& ideal_with_ttl) {
  const CacheCounters& counters = result.counters;
  JsonFields line;
  line.add("trace", boost::json::serialize(boost::json::string(trace.name)));
  line.add("capacity_blocks", result.config.capacity_blocks);
  line.add("block_hit_rate", counters.block_hit_rate());
  line.add("token_hit_rate", counters.token_hit_rate());
  line.add("ideal_block_hit_rate", ideal.block_hit_rate);
  line.add("ideal_token_hit_rate", ideal.token_hit_rate);
  line.add("ttl_s", result.config.ttl_s.has_value() ? format_double(*result.config.ttl_s, 3) : "null");
  if (ideal_with_ttl.has_value()) {
    line.add("ideal_ttl_block_hit_rate", ideal_with_ttl->block_hit_rate);
    line.add("ideal_ttl_token_hit_rate", ideal_with_ttl->token_hit_rate);
  }
  line.add("block_tokens", kMooncakeBlockTokens);
  line.add("requests", static_cast<int64_t>(trace.requests.size()));
  line.add("lookup_blocks", counters.lookup_blocks);
  line.add("hit_blocks", counters.hit_blocks);
  line.add("unique_blocks", trace.unique_blocks);
  JsonFields tiers;
  for (Tier tier : kvcache::kAllTiers) {
    const kvcache::TierCounters& t = counters.tiers[static_cast<size_t>(kvcache::tier_index(tier))];
    if (t.capacity_blocks == 0) continue;
    JsonFields fields;
    fields.add("capacity_blocks", t.capacity_blocks);
    fields.add("usage_blocks", t.usage_blocks);
    fields.add("hit_blocks", t.hit_blocks);
    fields.add("miss_blocks", t.miss_blocks);
    fields.add("admitted_blocks", t.admitted_blocks);
    fields.add("refused_blocks", t.refused_blocks);
    fields.add("evicted_blocks", t.evicted_blocks);
    fields.add("expired_blocks", t.expired_blocks);
    fields.add("demoted_blocks", t.demoted_blocks);
    fields.add("bytes_written", t.bytes_written);
    fields.add("bytes_read", t.bytes_read);
    tiers.add(std::string(kvcache::tier_name(tier)), fields.str());
  }
  line.add("tiers", tiers.str());
  line.add("seconds", format_double(result.seconds, 4));
  return line.str();
}

std::string replay_usage() {
  return "usage: bench_replay --trace FILE [--capacity-blocks N,M,...] [--ttl-s S] [--plot OUT.png]\n"
         "                    [--host-blocks N] [--disk-blocks N] [--evict-blocks-per-s R]\n"
         "                    [--high-watermark F] [--low-watermark F]\n"
         "Replays a Mooncake trace (512-token blocks) through the KV cache policy, no model; one JSON line per\n"
         "device capacity (in 512-token blocks; default: 8 sizes up to one holding the whole working set).\n"
         "With --live URL it replays the trace against a running server instead (bench_replay --live URL --help).\n";
}

Result<ReplayOptions> parse_replay_args(std::span<const std::string> args) {
  ReplayOptions options;
  auto number = [](const std::string& flag, const std::string& text, bool integer) -> Result<double> {
    try {
      size_t used = 0;
      const double value = integer ? static_cast<double>(std::stoll(text, &used)) : std::stod(text, &used);
      if (used != text.size()) throw std::invalid_argument(text);
      return value;
    } catch (const std::exception&) {
      return Status::invalid_argument(flag + ": '" + text + "' is not " + (integer ? "an integer" : "a number"));
    }
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& flag = args[i];
    if (flag == "--help" || flag == "-h") return Status::invalid_argument(replay_usage());
    if (i + 1 >= args.size())
      return Status::invalid_argument(flag + ": missing value (or unknown flag)\n" + replay_usage());
    const std::string& value = args[++i];
    if (flag == "--trace") {
      options.trace_path = value;
    } else if (flag == "--plot") {
      options.plot_path = value;
    } else if (flag == "--capacity-blocks") {
      std::stringstream list(value);
      for (std::string item; std::getline(list, item, ',');) {
        Result<double> capacity = number(flag, item, true);
        if (!capacity.ok()) return capacity.status();
        if (*capacity < 1) return Status::invalid_argument(flag + ": capacity " + item + " must be >= 1 block");
        options.capacities.push_back(static_cast<int64_t>(*capacity));
      }
    } else if (flag == "--ttl-s" || flag == "--evict-blocks-per-s" || flag == "--high-watermark" ||
               flag == "--low-watermark" || flag == "--host-blocks" || flag == "--disk-blocks") {
      const bool integer = flag == "--host-blocks" || flag == "--disk-blocks";
      Result<double> parsed = number(flag, value, integer);
      if (!parsed.ok()) return parsed.status();
      if (flag == "--ttl-s") options.ttl_s = *parsed;
      if (flag == "--evict-blocks-per-s") options.base.evict_blocks_per_s = *parsed;
      if (flag == "--high-watermark") options.base.high_watermark = *parsed;
      if (flag == "--low-watermark") options.base.low_watermark = *parsed;
      if (flag == "--host-blocks") options.base.host_blocks = static_cast<int64_t>(*parsed);
      if (flag == "--disk-blocks") options.base.disk_blocks = static_cast<int64_t>(*parsed);
    } else {
      return Status::invalid_argument("unknown flag " + flag + "\n" + replay_usage());
    }
  }
  if (options.trace_path.empty()) return Status::invalid_argument("--trace FILE is required\n" + replay_usage());
  options.base.ttl_s = options.ttl_s;
  return options;
}

Status run_replay(const ReplayOptions& options, std::ostream& out) {
  Result<Trace> trace = load_mooncake_trace(options.trace_path);
  if (!trace.ok()) return trace.status();
  std::vector<int64_t> capacities = options.capacities;
  if (capacities.empty()) capacities = default_capacities(*trace, options.base.high_watermark);
  const HitRates ideal = ideal_hit_rates(*trace);
  std::optional<HitRates> ideal_with_ttl;
  if (options.ttl_s.has_value()) {
    ideal_with_ttl = ideal_hit_rates(*trace, static_cast<int64_t>(std::llround(*options.ttl_s * 1000.0)));
  }
  std::vector<ReplayResult> results;
  for (int64_t capacity : capacities) {
    ReplayConfig config = options.base;
    config.capacity_blocks = capacity;
    config.ttl_s = options.ttl_s;
    Result<ReplayResult> result = replay_trace(*trace, config);
    if (!result.ok()) return result.status();
    out << replay_json_line(*trace, *result, ideal, ideal_with_ttl) << std::endl;
    results.push_back(std::move(result).value());
  }
  if (options.plot_path.empty()) return Status::ok_status();

  // The same numbers as CSV beside the PNG, for other plotting tools and for the docs.
  const std::string csv_path = std::filesystem::path(options.plot_path).replace_extension(".csv").string();
  std::ofstream csv(csv_path, std::ios::trunc);
  if (!csv) return Status::io_error("cannot write " + csv_path);
  csv << "capacity_blocks,block_hit_rate,token_hit_rate,ideal_block_hit_rate,ideal_token_hit_rate\n";
  PlotSpec spec;
  spec.title = trace->name + " (512-token blocks" +
               (options.ttl_s.has_value() ? ", TTL " + std::to_string(std::llround(*options.ttl_s)) + " s" : "") + ")";
  spec.x_label = "device capacity (blocks, log scale)";
  spec.y_label = "hit rate";
  PlotSeries block{"block hit rate", {31, 119, 180}, false, true, {}};
  PlotSeries token{"token hit rate", {255, 127, 14}, false, true, {}};
  PlotSeries ideal_block{
      "ideal (infinite), blocks " + format_double(ideal.block_hit_rate, 3), {31, 119, 180}, true, false, {}};
  PlotSeries ideal_token{
      "ideal (infinite), tokens " + format_double(ideal.token_hit_rate, 3), {255, 127, 14}, true, false, {}};
  for (const ReplayResult& result : results) {
    const double x = static_cast<double>(result.config.capacity_blocks);
    csv << result.config.capacity_blocks << ',' << format_double(result.counters.block_hit_rate(), 6) << ','
        << format_double(result.counters.token_hit_rate(), 6) << ',' << format_double(ideal.block_hit_rate, 6) << ','
        << format_double(ideal.token_hit_rate, 6) << '\n';
    block.points.emplace_back(x, result.counters.block_hit_rate());
    token.points.emplace_back(x, result.counters.token_hit_rate());
    spec.x_ticks.push_back(x);
  }
  if (!csv) return Status::io_error("writing " + csv_path + " failed");
  const auto [x_first, x_last] = std::minmax_element(capacities.begin(), capacities.end());
  ideal_block.points = {{*x_first, ideal.block_hit_rate}, {*x_last, ideal.block_hit_rate}};
  ideal_token.points = {{*x_first, ideal.token_hit_rate}, {*x_last, ideal.token_hit_rate}};
  spec.series = {block, token, ideal_block, ideal_token};
  return write_plot_png(options.plot_path, spec);
}

}  // namespace deepinfer::bench
