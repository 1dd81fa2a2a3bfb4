// OpenAI shapes: Chat Completions (chat.completion, chat.completion.chunk) and the legacy Completions
// (text_completion), streamed as data-only SSE chunks ended by [DONE].
#include <boost/json.hpp>
#include <cmath>

#include "deepinfer/recipe/response_builder.h"

namespace deepinfer::recipe {
namespace json = boost::json;
using Kind = StreamEvent::Kind;

namespace {

// JSON has no -inf: a token the model rules out gets OpenAI's floor instead.
double finite_logprob(float logprob) { return std::isfinite(logprob) ? static_cast<double>(logprob) : -9999.0; }

json::array byte_values(const std::string& bytes) {
  json::array out;
  for (char c : bytes) out.push_back(static_cast<unsigned char>(c));
  return out;
}

json::object usage_object(const FinishInfo& info) {
  return {{"prompt_tokens", info.prompt_tokens},
          {"completion_tokens", info.completion_tokens},
          {"total_tokens", info.prompt_tokens + info.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", info.cached_tokens}}}};
}

std::string_view finish_reason(const FinishInfo& info, const OutputMessage& message) {
  if (info.kind == FinishInfo::Kind::kLength) return "length";
  if (!message.tool_calls.empty()) return "tool_calls";
  return "stop";
}

StreamChunk data_chunk(json::object data) { return {{}, std::move(data), false}; }

// What the chat and completions builders share: the response identity, the logprobs held for the next chunk,
// the usage chunk and the error shape.
class OpenAIBuilder : public ResponseBuilder {
 public:
  void stream_error(const ErrorInfo& error, std::vector<StreamChunk>& out) override {
    out.push_back(data_chunk(error_object(error, ErrorDialect::kOpenAI)));
    out.push_back({{}, {}, true});
  }

 protected:
  OpenAIBuilder(ResponseIdentity identity, std::string_view object, bool include_usage, bool logprobs,
                std::shared_ptr<const Tokenizer> tokenizer)
      : tokenizer_(std::move(tokenizer)),
        identity_(std::move(identity)),
        object_(object),
        include_usage_(include_usage),
        logprobs_(logprobs) {}

  // Keeps the step's token logprobs for the next chunk when they were asked for.
  void take(std::vector<TokenLogprobs>& logprobs) {
    if (logprobs_)
      pending_.insert(pending_.end(), std::make_move_iterator(logprobs.begin()),
                      std::make_move_iterator(logprobs.end()));
    logprobs.clear();
  }

  json::object head(std::string_view object) const {
    return {{"id", identity_.id}, {"object", object}, {"created", identity_.created}, {"model", identity_.model}};
  }

  // The stream's last chunks: the finish reason, the usage (with include_usage), [DONE].
  void close_stream(json::object last, const FinishInfo& info, std::vector<StreamChunk>& out) {
    out.push_back(data_chunk(std::move(last)));
    if (include_usage_) {
      json::object usage = head(object_);
      usage["choices"] = json::array{};
      usage["usage"] = usage_object(info);
      out.push_back(data_chunk(std::move(usage)));
    }
    out.push_back({{}, {}, true});
  }

  json::object body(json::object choice, const FinishInfo& info) const {
    json::object out = head(object_ == "chat.completion.chunk" ? "chat.completion" : object_);
    out["choices"] = json::array{std::move(choice)};
    out["usage"] = usage_object(info);
    return out;
  }

  json::object chunk_of(json::object choice) const {
    json::object out = head(object_);
    out["choices"] = json::array{std::move(choice)};
    if (include_usage_) out["usage"] = nullptr;
    return out;
  }

  std::shared_ptr<const Tokenizer> tokenizer_;
  ResponseIdentity identity_;
  std::string object_;  // the streamed chunks' object
  bool include_usage_;
  bool logprobs_;
  std::vector<TokenLogprobs> pending_;
};

// ---- Chat completions -----------------------------------------------------------------------------------

class ChatBuilder final : public OpenAIBuilder {
 public:
  ChatBuilder(ResponseIdentity identity, bool include_usage, bool logprobs, std::shared_ptr<const Tokenizer> tokenizer)
      : OpenAIBuilder(std::move(identity), "chat.completion.chunk", include_usage, logprobs, std::move(tokenizer)) {}

  void start(const FinishInfo&, std::vector<StreamChunk>& out) override {
    out.push_back(data_chunk(chunk(json::object{{"role", "assistant"}, {"content", ""}}, nullptr)));
  }

  void deltas(std::span<const StreamEvent> events, std::vector<TokenLogprobs>& logprobs,
              std::vector<StreamChunk>& out) override {
    take(logprobs);
    // Consecutive pieces of one kind share a chunk.
    enum class Last { kNone, kReasoning, kContent, kToolName, kToolArguments };
    std::vector<json::object> deltas;
    Last last = Last::kNone;
    int32_t last_tool = -1;
    for (const StreamEvent& event : events) {
      switch (event.kind) {
        case Kind::kReasoning:
        case Kind::kContent: {
          const Last kind = event.kind == Kind::kReasoning ? Last::kReasoning : Last::kContent;
          const char* key = kind == Last::kReasoning ? "reasoning_content" : "content";
          if (last == kind) {
            deltas.back()[key].as_string().append(event.text);
          } else {
            deltas.push_back({{key, event.text}});
          }
          last = kind;
          break;
        }
        case Kind::kToolCallBegin:
          deltas.push_back(
              {{"tool_calls", json::array{{{"index", event.tool_index},
                                           {"id", event.tool_id},
                                           {"type", "function"},
                                           {"function", {{"name", event.tool_name}, {"arguments", ""}}}}}}});
          last = Last::kToolName;
          last_tool = event.tool_index;
          break;
        case Kind::kToolArguments:
          if ((last == Last::kToolName || last == Last::kToolArguments) && last_tool == event.tool_index) {
            deltas.back()["tool_calls"]
                .as_array()[0]
                .as_object()["function"]
                .as_object()["arguments"]
                .as_string()
                .append(event.text);
          } else {
            deltas.push_back({{"tool_calls",
                               json::array{{{"index", event.tool_index}, {"function", {{"arguments", event.text}}}}}}});
          }
          last = Last::kToolArguments;
          last_tool = event.tool_index;
          break;
        case Kind::kToolCallEnd:
          break;
      }
    }
    for (json::object& delta : deltas) out.push_back(data_chunk(chunk(std::move(delta), nullptr)));
  }

  void finish(const OutputMessage& message, const FinishInfo& info, std::vector<TokenLogprobs>& logprobs,
              std::vector<StreamChunk>& out) override {
    take(logprobs);
    close_stream(chunk(json::object{}, json::string(finish_reason(info, message))), info, out);
  }

  json::object response(const OutputMessage& message, const FinishInfo& info,
                        std::vector<TokenLogprobs>& logprobs) override {
    take(logprobs);
    json::object reply{{"role", "assistant"}, {"content", nullptr}, {"reasoning_content", nullptr}};
    if (!message.content.empty() || message.tool_calls.empty()) reply["content"] = message.content;
    if (!message.reasoning.empty()) reply["reasoning_content"] = message.reasoning;
    if (!message.tool_calls.empty()) {
      json::array calls;
      for (const OutputToolCall& call : message.tool_calls) {
        calls.push_back({{"id", call.id},
                         {"type", "function"},
                         {"function", {{"name", call.name}, {"arguments", call.arguments_text}}}});
      }
      reply["tool_calls"] = std::move(calls);
    }
    return body({{"index", 0},
                 {"message", std::move(reply)},
                 {"logprobs", logprobs_value()},
                 {"finish_reason", finish_reason(info, message)}},
                info);
  }

 private:
  json::object entry(TokenId token, float logprob) const {
    const std::string bytes = tokenizer_->token_bytes(token);
    const TokenId ids[] = {token};
    return {{"token", tokenizer_->decode(ids)}, {"logprob", finite_logprob(logprob)}, {"bytes", byte_values(bytes)}};
  }

  // {"content": [...]} for the pending tokens (and clears them), or null when there are none.
  json::value logprobs_value() {
    if (!logprobs_ || pending_.empty()) return nullptr;
    json::array content;
    for (const TokenLogprobs& token : pending_) {
      json::object item = entry(token.token, token.logprob);
      json::array top;
      for (const TokenLogprob& alternative : token.top) top.push_back(entry(alternative.token_id, alternative.logprob));
      item["top_logprobs"] = std::move(top);
      content.push_back(std::move(item));
    }
    pending_.clear();
    return json::object{{"content", std::move(content)}};
  }

  json::object chunk(json::object delta, json::value finish) {
    return chunk_of({{"index", 0},
                     {"delta", std::move(delta)},
                     {"logprobs", logprobs_value()},
                     {"finish_reason", std::move(finish)}});
  }
};

// ---- Completions ----------------------------------------------------------------------------------------

class CompletionBuilder final : public OpenAIBuilder {
 public:
  CompletionBuilder(ResponseIdentity identity, bool include_usage, bool logprobs,
                    std::shared_ptr<const Tokenizer> tokenizer)
      : OpenAIBuilder(std::move(identity), "text_completion", include_usage, logprobs, std::move(tokenizer)) {}

  void start(const FinishInfo&, std::vector<StreamChunk>&) override {}

  void deltas(std::span<const StreamEvent> events, std::vector<TokenLogprobs>& logprobs,
              std::vector<StreamChunk>& out) override {
    take(logprobs);
    std::string text;
    for (const StreamEvent& event : events) text += event.text;
    if (text.empty()) return;
    out.push_back(data_chunk(chunk(std::move(text), nullptr)));
  }

  void finish(const OutputMessage&, const FinishInfo& info, std::vector<TokenLogprobs>& logprobs,
              std::vector<StreamChunk>& out) override {
    take(logprobs);
    close_stream(chunk("", json::string(reason(info))), info, out);
  }

  json::object response(const OutputMessage& message, const FinishInfo& info,
                        std::vector<TokenLogprobs>& logprobs) override {
    take(logprobs);
    return body(
        {{"index", 0}, {"text", message.content}, {"logprobs", logprobs_value()}, {"finish_reason", reason(info)}},
        info);
  }

 private:
  static std::string_view reason(const FinishInfo& info) {
    return info.kind == FinishInfo::Kind::kLength ? "length" : "stop";
  }

  std::string piece(TokenId token) const {
    const TokenId ids[] = {token};
    return tokenizer_->decode(ids);
  }

  // The legacy shape: parallel arrays of tokens, their logprobs, {token: logprob} alternatives, offsets.
  json::value logprobs_value() {
    if (!logprobs_ || pending_.empty()) return nullptr;
    json::array tokens, token_logprobs, top_logprobs, text_offset;
    for (const TokenLogprobs& token : pending_) {
      std::string text = piece(token.token);
      text_offset.push_back(text_offset_);
      text_offset_ += static_cast<int64_t>(text.size());
      tokens.push_back(json::string(text));
      token_logprobs.push_back(finite_logprob(token.logprob));
      json::object top;
      for (const TokenLogprob& alternative : token.top) {
        top[piece(alternative.token_id)] = finite_logprob(alternative.logprob);
      }
      top_logprobs.push_back(std::move(top));
    }
    pending_.clear();
    return json::object{{"tokens", std::move(tokens)},
                        {"token_logprobs", std::move(token_logprobs)},
                        {"top_logprobs", std::move(top_logprobs)},
                        {"text_offset", std::move(text_offset)}};
  }

  json::object chunk(std::string text, json::value finish) {
    return chunk_of({{"index", 0},
                     {"text", std::move(text)},
                     {"logprobs", logprobs_value()},
                     {"finish_reason", std::move(finish)}});
  }

  int64_t text_offset_ = 0;
};

}  // namespace

std::unique_ptr<ResponseBuilder> chat_completion_builder(ResponseIdentity identity, bool include_usage, bool logprobs,
                                                         std::shared_ptr<const Tokenizer> tokenizer) {
  return std::make_unique<ChatBuilder>(std::move(identity), include_usage, logprobs, std::move(tokenizer));
}

std::unique_ptr<ResponseBuilder> completion_builder(ResponseIdentity identity, bool include_usage, bool logprobs,
                                                    std::shared_ptr<const Tokenizer> tokenizer) {
  return std::make_unique<CompletionBuilder>(std::move(identity), include_usage, logprobs, std::move(tokenizer));
}

}  // namespace deepinfer::recipe
