// The no-model trace replay on the committed Mooncake traces (tests/data/traces/mooncake/): the trace facts,
// the ideal infinite-cache bounds (conversation 0.366, synthetic 0.640 by block; the TTL-bounded ones of the
// traces' README), the policy reaching the bound when it has room and TTL for everything, and hit rates that
// never fall as capacity grows. Plus the JSON line, the argument parser and the PNG writer.
#include "trace_replay.h"

#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "png_plot.h"

namespace deepinfer::bench {
namespace {

std::string trace_path(const std::string& name) {
  return std::string(DEEPINFER_SOURCE_DIR) + "/tests/data/traces/mooncake/" + name + "_trace.jsonl";
}

const Trace& load(const std::string& name) {
  static std::map<std::string, Trace> cache;
  auto it = cache.find(name);
  if (it == cache.end()) {
    Result<Trace> trace = load_mooncake_trace(trace_path(name));
    EXPECT_TRUE(trace.ok()) << trace.status().to_string();
    it = cache.emplace(name, trace.ok() ? std::move(trace).value() : Trace{}).first;
  }
  return it->second;
}

// Rounded to 3 decimals, as the bound is quoted.
double round3(double value) { return std::round(value * 1000.0) / 1000.0; }

struct TraceFacts {
  std::string name;
  size_t requests;
  int64_t total_blocks;
  int64_t unique_blocks;
  double ideal_block, ideal_token;   // infinite cache, no TTL
  double ttl300_block, ttl60_block;  // infinite cache, TTL 300 s / 60 s
};

// The traces' README (shared/data/traces/README.md, section 3), computed there by an independent script.
const std::vector<TraceFacts> kFacts = {
    {"conversation", 12031, 288500, 182790, 0.366, 0.374, 0.288, 0.103},
    {"synthetic", 3993, 121877, 43924, 0.640, 0.651, 0.584, 0.322},
};

TEST(TraceReplayTest, TraceFactsAndIdealBounds) {
  for (const TraceFacts& facts : kFacts) {
    const Trace& trace = load(facts.name);
    EXPECT_EQ(trace.name, facts.name + "_trace");
    EXPECT_EQ(trace.requests.size(), facts.requests) << facts.name;
    EXPECT_EQ(trace.total_blocks, facts.total_blocks) << facts.name;
    EXPECT_EQ(trace.unique_blocks, facts.unique_blocks) << facts.name;
    const HitRates ideal = ideal_hit_rates(trace);
    EXPECT_EQ(round3(ideal.block_hit_rate), facts.ideal_block) << facts.name << ": " << ideal.block_hit_rate;
    EXPECT_EQ(round3(ideal.token_hit_rate), facts.ideal_token) << facts.name << ": " << ideal.token_hit_rate;
    EXPECT_EQ(round3(ideal_hit_rates(trace, 300 * 1000).block_hit_rate), facts.ttl300_block) << facts.name;
    EXPECT_EQ(round3(ideal_hit_rates(trace, 60 * 1000).block_hit_rate), facts.ttl60_block) << facts.name;
  }
}

TEST(TraceReplayTest, PolicyReachesTheBoundWithRoomForEverything) {
  for (const TraceFacts& facts : kFacts) {
    const Trace& trace = load(facts.name);
    struct Case {
      std::optional<double> ttl_s;
    };
    for (const Case& c : {Case{std::nullopt}, Case{300.0}, Case{60.0}}) {
      const std::string where = facts.name + ", ttl " + (c.ttl_s ? std::to_string(*c.ttl_s) : "none");
      ReplayConfig config;
      config.capacity_blocks = default_capacities(trace, config.high_watermark).back();
      config.ttl_s = c.ttl_s;
      Result<ReplayResult> result = replay_trace(trace, config);
      ASSERT_TRUE(result.ok()) << where << ": " << result.status().to_string();
      const HitRates ideal = ideal_hit_rates(
          trace, c.ttl_s ? std::optional<int64_t>(static_cast<int64_t>(*c.ttl_s * 1000)) : std::nullopt);
      EXPECT_DOUBLE_EQ(result->counters.block_hit_rate(), ideal.block_hit_rate) << where;
      EXPECT_DOUBLE_EQ(result->counters.token_hit_rate(), ideal.token_hit_rate) << where;
      EXPECT_EQ(result->counters.tiers[0].evicted_blocks, 0) << where << ": the largest default capacity never evicts";
      EXPECT_EQ(result->counters.tiers[0].refused_blocks, 0) << where;
      EXPECT_EQ(result->counters.lookup_blocks, trace.total_blocks) << where;
    }
  }
}

TEST(TraceReplayTest, HitRateGrowsWithCapacityOverTheDefaultRange) {
  for (const TraceFacts& facts : kFacts) {
    const Trace& trace = load(facts.name);
    const std::vector<int64_t> capacities = default_capacities(trace, 0.95);
    ASSERT_EQ(capacities.size(), 8u) << facts.name;
    EXPECT_EQ(capacities.back(), static_cast<int64_t>(std::ceil(trace.unique_blocks / 0.95))) << facts.name;
    double previous_block = -1, previous_token = -1;
    for (size_t i = 0; i < capacities.size(); ++i) {
      const std::string where =
          facts.name + ", step " + std::to_string(i + 1) + " (capacity " + std::to_string(capacities[i]) + ")";
      if (i > 0) {
        EXPECT_LT(capacities[i - 1], capacities[i]) << where;
      }
      ReplayConfig config;
      config.capacity_blocks = capacities[i];
      Result<ReplayResult> result = replay_trace(trace, config);
      ASSERT_TRUE(result.ok()) << where;
      const double block = result->counters.block_hit_rate(), token = result->counters.token_hit_rate();
      EXPECT_GE(block, previous_block) << where;
      EXPECT_GE(token, previous_token) << where;
      EXPECT_LE(block, ideal_hit_rates(trace).block_hit_rate + 1e-12) << where;
      if (i == 0) {
        EXPECT_LT(block, 0.5 * facts.ideal_block) << where << ": a tiny cache must lose most of the reuse";
      }
      previous_block = block;
      previous_token = token;
    }
  }
}

TEST(TraceReplayTest, LowerTiersRecoverWhatASmallDeviceTierLoses) {
  const Trace& trace = load("synthetic");
  ReplayConfig device_only;
  device_only.capacity_blocks = 2000;
  ReplayConfig tiered = device_only;
  tiered.host_blocks = 10000;
  tiered.disk_blocks = 50000;
  Result<ReplayResult> small = replay_trace(trace, device_only);
  Result<ReplayResult> large = replay_trace(trace, tiered);
  ASSERT_TRUE(small.ok() && large.ok());
  EXPECT_GT(large->counters.block_hit_rate(), small->counters.block_hit_rate());
  EXPECT_DOUBLE_EQ(large->counters.block_hit_rate(), ideal_hit_rates(trace).block_hit_rate)
      << "device + host + disk hold the whole working set";
  const kvcache::CacheCounters& c = large->counters;
  EXPECT_GT(c.tiers[1].hit_blocks, 0);
  EXPECT_GT(c.tiers[2].hit_blocks, 0);
  EXPECT_GT(c.tiers[1].demoted_blocks, 0);
  EXPECT_EQ(c.tiers[0].hit_blocks + c.tiers[1].hit_blocks + c.tiers[2].hit_blocks, c.hit_blocks);
}

TEST(TraceReplayTest, JsonLineHasTheSchemaFieldsFirst) {
  const Trace& trace = load("synthetic");
  ReplayConfig config;
  config.capacity_blocks = 1000;
  config.ttl_s = 300;
  Result<ReplayResult> result = replay_trace(trace, config);
  ASSERT_TRUE(result.ok());
  const HitRates ideal = ideal_hit_rates(trace);
  const std::string line = replay_json_line(trace, *result, ideal, ideal_hit_rates(trace, 300 * 1000));
  boost::json::value parsed = boost::json::parse(line);
  const boost::json::object& object = parsed.as_object();
  const std::vector<std::string> first = {"trace",          "capacity_blocks",      "block_hit_rate",
                                          "token_hit_rate", "ideal_block_hit_rate", "ideal_token_hit_rate"};
  size_t i = 0;
  for (auto it = object.begin(); i < first.size(); ++it, ++i) EXPECT_EQ(std::string(it->key()), first[i]);
  EXPECT_EQ(object.at("trace").as_string(), "synthetic_trace");
  EXPECT_EQ(object.at("capacity_blocks").as_int64(), 1000);
  EXPECT_NEAR(object.at("ideal_block_hit_rate").as_double(), 0.640, 0.0005);
  EXPECT_NEAR(object.at("block_hit_rate").as_double(), result->counters.block_hit_rate(), 1e-6);
  EXPECT_NEAR(object.at("ideal_ttl_block_hit_rate").as_double(), 0.584, 0.0005);
  EXPECT_TRUE(object.at("tiers").as_object().contains("device"));
  EXPECT_FALSE(object.at("tiers").as_object().contains("host"));
}

TEST(TraceReplayTest, ArgumentParsing) {
  struct Case {
    std::vector<std::string> args;
    bool ok;
    std::string message_part;  // for errors
  };
  const std::vector<Case> cases = {
      {{"--trace", "t.jsonl"}, true, ""},
      {{"--trace", "t.jsonl", "--capacity-blocks", "10,200,3000", "--ttl-s", "300", "--plot", "o.png"}, true, ""},
      {{"--trace", "t.jsonl", "--host-blocks", "100", "--disk-blocks", "1000", "--evict-blocks-per-s", "50"}, true, ""},
      {{}, false, "--trace FILE is required"},
      {{"--trace"}, false, "missing value"},
      {{"--trace", "t", "--capacity-blocks", "10,x"}, false, "not an integer"},
      {{"--trace", "t", "--capacity-blocks", "0"}, false, ">= 1"},
      {{"--trace", "t", "--ttl-s", "abc"}, false, "not a number"},
      {{"--trace", "t", "--frobnicate", "1"}, false, "unknown flag --frobnicate"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string where = "step " + std::to_string(i + 1);
    Result<ReplayOptions> options = parse_replay_args(cases[i].args);
    EXPECT_EQ(options.ok(), cases[i].ok) << where << ": " << options.status().to_string();
    if (!options.ok()) {
      EXPECT_NE(options.status().message().find(cases[i].message_part), std::string::npos)
          << where << ": " << options.status().message();
    }
  }
  Result<ReplayOptions> options = parse_replay_args(cases[1].args);
  ASSERT_TRUE(options.ok());
  EXPECT_EQ(options->capacities, (std::vector<int64_t>{10, 200, 3000}));
  EXPECT_EQ(options->ttl_s, 300.0);
  EXPECT_EQ(options->plot_path, "o.png");
}

TEST(TraceReplayTest, BadTraceLinesAreReportedWithTheirLine) {
  const std::string path = std::filesystem::temp_directory_path() / "deepinfer_bad_trace.jsonl";
  struct Case {
    std::string content;
    std::string message_part;
  };
  const std::vector<Case> cases = {
      {"{\"timestamp\":0,\"input_length\":600,\"output_length\":1,\"hash_ids\":[1,2]}\nnot json\n", ":2: not JSON"},
      {"{\"timestamp\":0,\"input_length\":600,\"output_length\":1,\"hash_ids\":[1]}\n", "needs 2 hash_ids"},
      {"{\"input_length\":6,\"output_length\":1,\"hash_ids\":[1]}\n", "no field 'timestamp'"},
      {"{\"timestamp\":5,\"input_length\":6,\"output_length\":1,\"hash_ids\":[1]}\n"
       "{\"timestamp\":4,\"input_length\":6,\"output_length\":1,\"hash_ids\":[1]}\n",
       "earlier"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    std::ofstream(path, std::ios::trunc) << cases[i].content;
    Result<Trace> trace = load_mooncake_trace(path);
    ASSERT_FALSE(trace.ok()) << "step " << i + 1;
    EXPECT_EQ(trace.status().code(), StatusCode::kCorruption) << "step " << i + 1;
    EXPECT_NE(trace.status().message().find(cases[i].message_part), std::string::npos)
        << "step " << i + 1 << ": " << trace.status().message();
  }
  std::remove(path.c_str());
  EXPECT_EQ(load_mooncake_trace("/nonexistent/trace.jsonl").status().code(), StatusCode::kIoError);
}

TEST(TraceReplayTest, RunWritesJsonLinesPngAndCsv) {
  const std::string png = std::filesystem::temp_directory_path() / "deepinfer_replay_test.png";
  const std::string csv = std::filesystem::temp_directory_path() / "deepinfer_replay_test.csv";
  const std::vector<std::string> args = {
      "--trace", trace_path("synthetic"), "--capacity-blocks", "500,5000,50000", "--plot", png};
  Result<ReplayOptions> options = parse_replay_args(args);
  ASSERT_TRUE(options.ok());
  std::ostringstream out;
  Status status = run_replay(*options, out);
  ASSERT_TRUE(status.ok()) << status.to_string();
  std::istringstream lines(out.str());
  int count = 0;
  for (std::string line; std::getline(lines, line); ++count) {
    EXPECT_TRUE(boost::json::parse(line).is_object()) << line;
  }
  EXPECT_EQ(count, 3);
  std::ifstream file(png, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 8u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_LT(bytes.size(), 200u * 1024) << "the plot compresses";
  std::ifstream csv_file(csv);
  std::string header;
  std::getline(csv_file, header);
  EXPECT_EQ(header, "capacity_blocks,block_hit_rate,token_hit_rate,ideal_block_hit_rate,ideal_token_hit_rate");
  std::remove(png.c_str());
  std::remove(csv.c_str());
}

TEST(PngTest, EncodesATinyImageWithValidChunks) {
  // 2 x 2 RGB: red, green / blue, white.
  const std::vector<uint8_t> rgb = {255, 0, 0, 0, 255, 0, 0, 0, 255, 255, 255, 255};
  const std::vector<uint8_t> png = encode_png_rgb(rgb, 2, 2);
  ASSERT_GT(png.size(), 8u + 25 + 12 + 12);
  EXPECT_EQ(std::string(png.begin() + 12, png.begin() + 16), "IHDR");
  EXPECT_EQ(png[16 + 3], 2) << "width";
  EXPECT_EQ(png[20 + 3], 2) << "height";
  EXPECT_EQ(std::string(png.end() - 8, png.end() - 4), "IEND");
  // The IEND chunk's CRC is a constant of the format.
  EXPECT_EQ(std::vector<uint8_t>(png.end() - 4, png.end()), (std::vector<uint8_t>{0xAE, 0x42, 0x60, 0x82}));
}

}  // namespace
}  // namespace deepinfer::bench
