// The offline replay of a live trace through the engine's scheduler and prefix cache (bench/replay/engine_replay.h):
// with room for everything it reaches the ideal bound exactly; with a small device tier it falls short, and a host
// tier behind it wins the difference back.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <sstream>

#include "engine_replay.h"
#include "live_prompts.h"

namespace deepinfer::bench {
namespace {

boost::json::object replay(int64_t device_blocks, int64_t host_blocks) {
  EngineReplayOptions options;
  options.trace_path = std::string(DEEPINFER_SOURCE_DIR) + "/tests/data/traces/mooncake/conversation_trace.jsonl";
  options.requests = 200;
  options.prompts.max_prompt_tokens = 512;
  options.prompts.max_tokens = 4;
  options.block_bytes = 64;
  options.device_blocks = device_blocks;
  options.host_blocks = host_blocks;
  std::ostringstream out;
  Status status = run_engine_replay(options, out);
  EXPECT_TRUE(status.ok()) << status.to_string();
  return boost::json::parse(out.str()).as_object();
}

double number(const boost::json::value& v) { return v.is_double() ? v.as_double() : static_cast<double>(v.as_int64()); }

TEST(EngineReplay, RoomForEverythingReachesTheIdealBoundAndASmallDeviceTierNeedsTheHostTier) {
  Result<Trace> trace =
      load_mooncake_trace(std::string(DEEPINFER_SOURCE_DIR) + "/tests/data/traces/mooncake/conversation_trace.jsonl");
  ASSERT_TRUE(trace.ok());
  LivePromptConfig config;
  config.max_prompt_tokens = 512;
  config.max_tokens = 4;
  Result<std::vector<LivePrompt>> prompts = make_live_prompts(*trace, 200, config);
  ASSERT_TRUE(prompts.ok());
  std::vector<int64_t> reusable;
  ideal_prompt_hit_rates(*prompts, 64, &reusable);
  int64_t ideal_tokens = 0;
  for (int64_t tokens : reusable) ideal_tokens += tokens;

  const boost::json::object unbounded = replay(100000, 0);
  const boost::json::object& server = unbounded.at("server").as_object();
  EXPECT_EQ(number(server.at("cached_prompt_tokens")), static_cast<double>(ideal_tokens));
  EXPECT_EQ(number(server.at("device").at("evicted_blocks")), 0);

  const boost::json::object small = replay(96, 0);
  const double small_hits = number(small.at("server").at("device").at("hit_blocks"));
  EXPECT_LT(number(small.at("server").at("cached_prompt_tokens")), static_cast<double>(ideal_tokens));
  EXPECT_GT(number(small.at("server").at("device").at("evicted_blocks")), 0);

  const boost::json::object tiered = replay(96, 100000);
  const boost::json::object& t = tiered.at("server").as_object();
  EXPECT_EQ(number(t.at("device").at("hit_blocks")), small_hits) << "host does not change what device holds";
  EXPECT_EQ(number(t.at("device").at("hit_blocks")) + number(t.at("host").at("hit_blocks")),
            static_cast<double>(ideal_tokens / 64))
      << "device + host hold everything";
  EXPECT_EQ(number(t.at("cached_prompt_tokens")), static_cast<double>(ideal_tokens));
}

}  // namespace
}  // namespace deepinfer::bench
