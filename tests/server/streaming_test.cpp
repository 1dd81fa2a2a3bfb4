// Streaming under stress: a client that disconnects mid-stream (its sequence is cancelled and its KV blocks
// return), 200 concurrent streams with exact usage, stop strings that never leak a partial match, and a
// graceful drain.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "server_fixture.h"

namespace deepinfer::server::testing {
namespace {

namespace json = boost::json;
using namespace std::chrono_literals;

class StreamingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = start_server().release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static std::string metrics() { return TestClient(server_->port()).get("/metrics").body; }
  static Server* server_;
};
Server* StreamingTest::server_ = nullptr;

// Content and usage of an OpenAI chat stream.
struct ChatStream {
  std::string content;
  std::vector<std::string> deltas;
  std::string finish_reason;
  int64_t prompt_tokens = -1;
  int64_t completion_tokens = -1;
  int64_t logprob_tokens = 0;
  bool done = false;
};

ChatStream read_chat_stream(const std::string& body) {
  ChatStream out;
  for (const SseEvent& event : parse_sse(body)) {
    if (event.data == "[DONE]") {
      out.done = true;
      continue;
    }
    json::object chunk = json::parse(event.data).as_object();
    if (chunk["usage"].is_object()) {
      out.prompt_tokens = chunk["usage"].at("prompt_tokens").as_int64();
      out.completion_tokens = chunk["usage"].at("completion_tokens").as_int64();
    }
    if (chunk["choices"].as_array().empty()) continue;
    json::object& choice = chunk["choices"].at(0).as_object();
    if (const json::value* text = choice["delta"].as_object().if_contains("content");
        text && !text->as_string().empty()) {
      out.deltas.emplace_back(text->as_string());
      out.content += text->as_string();
    }
    if (choice["logprobs"].is_object())
      out.logprob_tokens += static_cast<int64_t>(choice["logprobs"].at("content").as_array().size());
    if (choice["finish_reason"].is_string()) out.finish_reason = choice["finish_reason"].as_string();
  }
  return out;
}

TEST_F(StreamingTest, ClientDisconnectCancelsTheSequenceAndFreesItsBlocks) {
  const std::string before = metrics();
  const double free_blocks = metric_value(before, "deepinfer_kv_cache_blocks_free");
  const double disconnects = metric_value(before, "deepinfer_client_disconnects_total");
  ASSERT_GT(free_blocks, 0);
  {
    TestClient client(server_->port());
    std::string partial = client.stream_until(
        "/v1/chat/completions",
        R"({"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 3000,
            "ignore_eos": true, "stream": true})",
        [](const std::string& body) { return std::count(body.begin(), body.end(), '\n') >= 8; });  // a few chunks
    EXPECT_NE(partial.find("data: "), std::string::npos);
    EXPECT_GT(metric_value(metrics(), "deepinfer_kv_cache_blocks_used"), 0);
    client.close();
  }
  std::string after;
  for (int attempt = 0; attempt < 400; ++attempt) {
    after = metrics();
    if (metric_value(after, "deepinfer_kv_cache_blocks_used") == 0 &&
        metric_value(after, "deepinfer_num_requests_running") == 0) {
      break;
    }
    std::this_thread::sleep_for(25ms);
  }
  EXPECT_EQ(metric_value(after, "deepinfer_kv_cache_blocks_used"), 0) << after;
  EXPECT_EQ(metric_value(after, "deepinfer_kv_cache_blocks_free"), free_blocks);
  EXPECT_EQ(metric_value(after, "deepinfer_client_disconnects_total"), disconnects + 1);
  EXPECT_GE(metric_value(after, "deepinfer_requests_total{outcome=\"client_disconnect\"}"), 1);
  // Still serving.
  EXPECT_EQ(TestClient(server_->port())
                .post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})")
                .status,
            200);
}

TEST_F(StreamingTest, TwoHundredConcurrentStreamsCompleteWithExactUsage) {
  constexpr int kStreams = 200;  // more than max_num_seqs (64): most wait in the queue first
  constexpr int kMaxTokens = 4;
  std::vector<std::thread> threads;
  std::vector<ChatStream> results(kStreams);
  std::vector<int64_t> expected_prompt(kStreams);
  std::vector<int> statuses(kStreams, 0);
  for (int i = 0; i < kStreams; ++i) {
    // Different prompt lengths, so the batch mixes prefill chunks of several sizes.
    std::string words;
    for (int w = 0; w < i % 7; ++w) words += " again";
    const std::string request = R"({"model": "default", "messages": [{"role": "user", "content": "Request )" +
                                std::to_string(i) + words + R"("}], "max_tokens": )" + std::to_string(kMaxTokens) +
                                R"(, "ignore_eos": true, "temperature": 0.7, "seed": )" + std::to_string(i) +
                                R"(, "logprobs": true, "stream": true, "stream_options": {"include_usage": true}})";
    expected_prompt[i] = rendered_prompt_tokens(request);
    threads.emplace_back([&, i, request] {
      TestClient client(server_->port());
      HttpResponse response = client.post("/v1/chat/completions", request);
      statuses[i] = response.status;
      results[i] = read_chat_stream(response.body);
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int i = 0; i < kStreams; ++i) {
    SCOPED_TRACE("stream " + std::to_string(i));
    EXPECT_EQ(statuses[i], 200);
    EXPECT_TRUE(results[i].done);
    EXPECT_EQ(results[i].finish_reason, "length");
    EXPECT_EQ(results[i].prompt_tokens, expected_prompt[i]);
    EXPECT_EQ(results[i].completion_tokens, kMaxTokens);
    EXPECT_EQ(results[i].logprob_tokens, kMaxTokens);  // one logprob entry per generated token
  }
  EXPECT_EQ(metric_value(metrics(), "deepinfer_kv_cache_blocks_used"), 0);
}

TEST_F(StreamingTest, StopStringsNeverLeakAPartialMatch) {
  TestClient client(server_->port());
  const std::string base = R"({"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 40,
                               "temperature": 0, "ignore_eos": true)";
  HttpResponse reference = client.post("/v1/chat/completions", base + "}");
  ASSERT_EQ(reference.status, 200);
  const std::string text(reference.json().at("choices").at(0).at("message").at("content").as_string());
  ASSERT_GT(text.size(), 24u);
  // A stop string that straddles tokens in the middle of the output (cut at UTF-8 character boundaries).
  auto boundary = [&](size_t at) {
    while (at < text.size() && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80) ++at;
    return at;
  };
  const size_t stop_begin = boundary(text.size() / 3);
  const size_t stop_end = boundary(stop_begin + 7);
  const std::string stop = text.substr(stop_begin, stop_end - stop_begin);
  const size_t first = text.find(stop);
  const std::string expected = text.substr(0, first);
  // A second stop string that shares the first one's first character but never completes.
  const std::string decoy = text.substr(stop_begin, boundary(stop_begin + 1) - stop_begin) + "\x01";
  const std::string stops = json::serialize(json::array{json::string(decoy), json::string(stop)});

  HttpResponse plain = client.post("/v1/chat/completions", base + R"(, "stop": )" + stops + "}");
  ASSERT_EQ(plain.status, 200) << plain.body;
  EXPECT_EQ(str(plain.json().at("choices").at(0).at("message").at("content")), expected);
  EXPECT_EQ(plain.json().at("choices").at(0).at("finish_reason"), "stop");
  EXPECT_LT(plain.json().at("usage").at("completion_tokens").as_int64(), 40);

  HttpResponse streamed =
      client.post("/v1/chat/completions",
                  base + R"(, "stop": )" + stops + R"(, "stream": true, "stream_options": {"include_usage": true}})");
  ASSERT_EQ(streamed.status, 200);
  ChatStream stream = read_chat_stream(streamed.body);
  // Deltas only ever append: their concatenation is exactly the text before the stop string, so no piece of
  // the stop string went out and came back.
  EXPECT_EQ(stream.content, expected);
  EXPECT_EQ(stream.finish_reason, "stop");
  EXPECT_EQ(stream.completion_tokens, plain.json().at("usage").at("completion_tokens").as_int64());

  // Completions and Anthropic honour stop strings the same way.
  HttpResponse anthropic = client.post("/v1/messages", R"({"model": "default", "max_tokens": 40, "temperature": 0,
                          "messages": [{"role": "user", "content": "Count to ten."}], "stop_sequences": )" +
                                                           stops + "}");
  ASSERT_EQ(anthropic.status, 200) << anthropic.body;
  const json::value message = anthropic.json();
  EXPECT_EQ(message.at("stop_reason"), "stop_sequence");
  EXPECT_EQ(str(message.at("stop_sequence")), stop);
  const json::array& blocks = message.at("content").as_array();
  ASSERT_FALSE(blocks.empty());
  EXPECT_EQ(str(blocks.back().at("text")), expected);
}

TEST(DrainTest, ShutdownFinishesInFlightStreamsAndRefusesNewWork) {
  std::unique_ptr<Server> server = start_server();
  const uint16_t port = server->port();
  std::atomic<bool> started{false};
  ChatStream result;
  int status = 0;
  std::thread streamer([&] {
    TestClient client(port);
    HttpResponse response = client.post(
        "/v1/chat/completions",
        R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "ignore_eos": true, "stream": true,
            "stream_options": {"include_usage": true}})");
    status = response.status;
    result = read_chat_stream(response.body);
  });
  // Wait until the engine runs the request, then ask for a drain.
  for (int attempt = 0; attempt < 400; ++attempt) {
    if (metric_value(TestClient(port).get("/metrics").body, "deepinfer_num_requests_running") == 1) break;
    std::this_thread::sleep_for(10ms);
  }
  server->shutdown(/*drain=*/true);
  streamer.join();
  server->wait();
  EXPECT_EQ(status, 200);
  EXPECT_TRUE(result.done);
  EXPECT_EQ(result.finish_reason, "length");
  EXPECT_EQ(result.completion_tokens, 40);
  EXPECT_THROW(TestClient(port).get("/health"), boost::system::system_error);  // no longer listening
}

}  // namespace
}  // namespace deepinfer::server::testing
