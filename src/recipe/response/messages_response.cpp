// Anthropic Messages shapes: the reply as thinking, text and tool_use blocks, streamed as message_start,
// content_block_start/delta/stop, message_delta and message_stop events.
#include <boost/json.hpp>

#include "deepinfer/recipe/response_builder.h"

namespace deepinfer::recipe {
namespace json = boost::json;
using Kind = StreamEvent::Kind;

namespace {

std::string_view stop_reason(const FinishInfo& info, const OutputMessage& message) {
  if (info.kind == FinishInfo::Kind::kLength) return "max_tokens";
  if (info.kind == FinishInfo::Kind::kStopString) return "stop_sequence";
  if (!message.tool_calls.empty()) return "tool_use";
  return "end_turn";
}

// A call's arguments as the `input` object; {} when they are not a JSON object (a broken call).
json::object tool_input(const OutputToolCall& call) {
  boost::system::error_code ec;
  json::value parsed = json::parse(call.arguments_text, ec);
  if (ec || !parsed.is_object()) return {};
  return std::move(parsed.get_object());
}

class MessagesBuilder final : public ResponseBuilder {
 public:
  explicit MessagesBuilder(ResponseIdentity identity) : identity_(std::move(identity)) {}

  void start(const FinishInfo& info, std::vector<StreamChunk>& out) override {
    json::object message{{"id", identity_.id},       {"type", "message"},        {"role", "assistant"},
                         {"model", identity_.model}, {"content", json::array{}}, {"stop_reason", nullptr},
                         {"stop_sequence", nullptr}, {"usage", usage(info, 0)}};
    event("message_start", {{"type", "message_start"}, {"message", std::move(message)}}, out);
  }

  void deltas(std::span<const StreamEvent> events, std::vector<TokenLogprobs>& logprobs,
              std::vector<StreamChunk>& out) override {
    logprobs.clear();
    for (const StreamEvent& e : events) {
      switch (e.kind) {
        case Kind::kReasoning:
          open(Block::kThinking, {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}, out);
          delta({{"type", "thinking_delta"}, {"thinking", e.text}}, out);
          break;
        case Kind::kContent:
          open(Block::kText, {{"type", "text"}, {"text", ""}}, out);
          delta({{"type", "text_delta"}, {"text", e.text}}, out);
          break;
        case Kind::kToolCallBegin:
          close(out);
          open(Block::kToolUse,
               {{"type", "tool_use"}, {"id", e.tool_id}, {"name", e.tool_name}, {"input", json::object{}}}, out);
          break;
        case Kind::kToolArguments:
          if (open_ == Block::kToolUse) delta({{"type", "input_json_delta"}, {"partial_json", e.text}}, out);
          break;
        case Kind::kToolCallEnd:
          close(out);
          break;
      }
    }
  }

  void finish(const OutputMessage& message, const FinishInfo& info, std::vector<TokenLogprobs>&,
              std::vector<StreamChunk>& out) override {
    close(out);
    event("message_delta",
          {{"type", "message_delta"},
           {"delta", {{"stop_reason", stop_reason(info, message)}, {"stop_sequence", stop_sequence(info)}}},
           {"usage", {{"output_tokens", info.completion_tokens}}}},
          out);
    event("message_stop", {{"type", "message_stop"}}, out);
  }

  json::object response(const OutputMessage& message, const FinishInfo& info, std::vector<TokenLogprobs>&) override {
    json::array content;
    if (!message.reasoning.empty())
      content.push_back({{"type", "thinking"}, {"thinking", message.reasoning}, {"signature", ""}});
    if (!message.content.empty()) content.push_back({{"type", "text"}, {"text", message.content}});
    for (const OutputToolCall& call : message.tool_calls) {
      content.push_back({{"type", "tool_use"}, {"id", call.id}, {"name", call.name}, {"input", tool_input(call)}});
    }
    return {{"id", identity_.id},
            {"type", "message"},
            {"role", "assistant"},
            {"model", identity_.model},
            {"content", std::move(content)},
            {"stop_reason", stop_reason(info, message)},
            {"stop_sequence", stop_sequence(info)},
            {"usage", usage(info, info.completion_tokens)}};
  }

  void stream_error(const ErrorInfo& error, std::vector<StreamChunk>& out) override {
    out.push_back({"error", error_object(error, ErrorDialect::kAnthropic), false});
  }

 private:
  enum class Block { kNone, kThinking, kText, kToolUse };

  // Anthropic's accounting: input_tokens are the prompt tokens not read from the cache (cache_read_input_tokens are
  // the others; count_tokens gives their sum), unlike OpenAI's prompt_tokens, which include the cached ones.
  static json::object usage(const FinishInfo& info, int64_t output_tokens) {
    return {{"input_tokens", info.prompt_tokens - info.cached_tokens},
            {"output_tokens", output_tokens},
            {"cache_creation_input_tokens", 0},
            {"cache_read_input_tokens", info.cached_tokens}};
  }

  static json::value stop_sequence(const FinishInfo& info) {
    if (info.stop_string) return json::string(*info.stop_string);
    return nullptr;
  }

  static void event(std::string_view name, json::object data, std::vector<StreamChunk>& out) {
    out.push_back({std::string(name), std::move(data), false});
  }

  // Opens a block of `kind` unless one is open already.
  void open(Block kind, json::object content_block, std::vector<StreamChunk>& out) {
    if (open_ == kind && kind != Block::kToolUse) return;
    close(out);
    open_ = kind;
    event("content_block_start",
          {{"type", "content_block_start"}, {"index", index_}, {"content_block", std::move(content_block)}}, out);
  }

  void delta(json::object delta, std::vector<StreamChunk>& out) {
    event("content_block_delta", {{"type", "content_block_delta"}, {"index", index_}, {"delta", std::move(delta)}},
          out);
  }

  void close(std::vector<StreamChunk>& out) {
    if (open_ == Block::kNone) return;
    event("content_block_stop", {{"type", "content_block_stop"}, {"index", index_}}, out);
    open_ = Block::kNone;
    ++index_;
  }

  ResponseIdentity identity_;
  Block open_ = Block::kNone;
  int64_t index_ = 0;
};

}  // namespace

std::unique_ptr<ResponseBuilder> messages_builder(ResponseIdentity identity) {
  return std::make_unique<MessagesBuilder>(std::move(identity));
}

}  // namespace deepinfer::recipe
