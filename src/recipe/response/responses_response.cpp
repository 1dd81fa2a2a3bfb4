// OpenAI Responses shapes: the reply as reasoning, message and function_call output items, streamed as
// response.created / output_item / content_part / *.delta / *.done events ending in response.completed (or
// response.incomplete when max_output_tokens ran out).
#include <boost/json.hpp>

#include "deepinfer/recipe/response_builder.h"

namespace deepinfer::recipe {
namespace json = boost::json;
using Kind = StreamEvent::Kind;

namespace {

class ResponsesBuilder final : public ResponseBuilder {
 public:
  ResponsesBuilder(ResponseIdentity identity, json::object echo)
      : identity_(std::move(identity)), echo_(std::move(echo)) {}

  void start(const FinishInfo& info, std::vector<StreamChunk>& out) override {
    event("response.created", {{"response", response_object("in_progress", json::array{}, info, false)}}, out);
    event("response.in_progress", {{"response", response_object("in_progress", json::array{}, info, false)}}, out);
  }

  void deltas(std::span<const StreamEvent> events, std::vector<TokenLogprobs>& logprobs,
              std::vector<StreamChunk>& out) override {
    logprobs.clear();
    for (const StreamEvent& e : events) {
      switch (e.kind) {
        case Kind::kReasoning:
          if (open_ != Item::kReasoning) {
            close(out);
            open(Item::kReasoning,
                 {{"type", "reasoning"},
                  {"id", random_id("rs_")},
                  {"summary", json::array{}},
                  {"content", json::array{}}},
                 out);
            part_event("response.content_part.added", {{"type", "reasoning_text"}, {"text", ""}}, out);
          }
          text_ += e.text;
          item_event("response.reasoning_text.delta", {{"content_index", 0}, {"delta", e.text}}, out);
          break;
        case Kind::kContent:
          if (open_ != Item::kMessage) {
            close(out);
            open(Item::kMessage,
                 {{"type", "message"},
                  {"id", random_id("msg_")},
                  {"status", "in_progress"},
                  {"role", "assistant"},
                  {"content", json::array{}}},
                 out);
            part_event("response.content_part.added", output_text(""), out);
          }
          text_ += e.text;
          item_event("response.output_text.delta",
                     {{"content_index", 0}, {"delta", e.text}, {"logprobs", json::array{}}}, out);
          break;
        case Kind::kToolCallBegin:
          close(out);
          open(Item::kFunctionCall,
               {{"type", "function_call"},
                {"id", random_id("fc_")},
                {"call_id", e.tool_id},
                {"name", e.tool_name},
                {"arguments", ""},
                {"status", "in_progress"}},
               out);
          break;
        case Kind::kToolArguments:
          if (open_ != Item::kFunctionCall) break;
          text_ += e.text;
          item_event("response.function_call_arguments.delta", {{"delta", e.text}}, out);
          break;
        case Kind::kToolCallEnd:
          if (open_ == Item::kFunctionCall) close(out);
          break;
      }
    }
  }

  void finish(const OutputMessage&, const FinishInfo& info, std::vector<TokenLogprobs>&,
              std::vector<StreamChunk>& out) override {
    const bool incomplete = info.kind == FinishInfo::Kind::kLength;
    close(out, incomplete ? "incomplete" : "completed");
    event(incomplete ? "response.incomplete" : "response.completed",
          {{"response", response_object(incomplete ? "incomplete" : "completed", output_, info, true)}}, out);
  }

  json::object response(const OutputMessage& message, const FinishInfo& info, std::vector<TokenLogprobs>&) override {
    const bool incomplete = info.kind == FinishInfo::Kind::kLength;
    json::array items = output_items(message);
    // The item the length limit cut off is incomplete, as the response is (those before it were completed).
    if (incomplete && !items.empty() && items.back().as_object().contains("status")) {
      items.back().as_object()["status"] = "incomplete";
    }
    return response_object(incomplete ? "incomplete" : "completed", std::move(items), info, true);
  }

  void stream_error(const ErrorInfo& error, std::vector<StreamChunk>& out) override {
    json::object data{{"code", error.code.empty() ? json::value(nullptr) : json::value(error.code)},
                      {"message", error.message},
                      {"param", error.param.empty() ? json::value(nullptr) : json::value(error.param)}};
    event("error", std::move(data), out);
  }

 private:
  enum class Item { kNone, kReasoning, kMessage, kFunctionCall };

  static json::object output_text(std::string_view text) {
    return {{"type", "output_text"}, {"text", text}, {"annotations", json::array{}}};
  }

  // The non-streaming output: reasoning, then the message, then the function calls.
  static json::array output_items(const OutputMessage& message) {
    json::array items;
    if (!message.reasoning.empty()) {
      items.push_back({{"type", "reasoning"},
                       {"id", random_id("rs_")},
                       {"summary", json::array{}},
                       {"content", json::array{{{"type", "reasoning_text"}, {"text", message.reasoning}}}}});
    }
    if (!message.content.empty() || message.tool_calls.empty()) {
      items.push_back({{"type", "message"},
                       {"id", random_id("msg_")},
                       {"status", "completed"},
                       {"role", "assistant"},
                       {"content", json::array{output_text(message.content)}}});
    }
    for (const OutputToolCall& call : message.tool_calls) {
      items.push_back({{"type", "function_call"},
                       {"id", random_id("fc_")},
                       {"call_id", call.id},
                       {"name", call.name},
                       {"arguments", call.arguments_text},
                       {"status", "completed"}});
    }
    return items;
  }

  json::object response_object(std::string_view status, json::array output, const FinishInfo& info, bool final) const {
    json::object out{{"id", identity_.id},       {"object", "response"},       {"created_at", identity_.created},
                     {"status", status},         {"error", nullptr},           {"incomplete_details", nullptr},
                     {"model", identity_.model}, {"output", std::move(output)}};
    if (status == "incomplete") out["incomplete_details"] = json::object{{"reason", "max_output_tokens"}};
    for (const auto& [key, value] : echo_) out[key] = value;
    if (final) {
      out["usage"] = json::object{{"input_tokens", info.prompt_tokens},
                                  {"input_tokens_details", {{"cached_tokens", info.cached_tokens}}},
                                  {"output_tokens", info.completion_tokens},
                                  {"output_tokens_details", {{"reasoning_tokens", info.reasoning_tokens}}},
                                  {"total_tokens", info.prompt_tokens + info.completion_tokens}};
    } else {
      out["usage"] = nullptr;
    }
    return out;
  }

  void event(std::string_view type, json::object data, std::vector<StreamChunk>& out) {
    json::object object{{"type", type}, {"sequence_number", sequence_number_++}};
    for (auto& [key, value] : data) object[key] = std::move(value);
    out.push_back({std::string(type), std::move(object), false});
  }

  // An event about the open item (item_id, output_index).
  void item_event(std::string_view type, json::object data, std::vector<StreamChunk>& out) {
    json::object object{{"item_id", item_["id"]}, {"output_index", static_cast<int64_t>(output_.size())}};
    for (auto& [key, value] : data) object[key] = std::move(value);
    event(type, std::move(object), out);
  }

  void part_event(std::string_view type, json::object part, std::vector<StreamChunk>& out) {
    item_event(type, {{"content_index", 0}, {"part", std::move(part)}}, out);
  }

  void open(Item kind, json::object item, std::vector<StreamChunk>& out) {
    open_ = kind;
    item_ = std::move(item);
    text_.clear();
    event("response.output_item.added", {{"output_index", static_cast<int64_t>(output_.size())}, {"item", item_}}, out);
  }

  // Closes the open item: its *.done events, and it joins the final output. `status` is the item's final status:
  // "completed", or "incomplete" for the item open when the length limit ended the response.
  void close(std::vector<StreamChunk>& out, std::string_view status = "completed") {
    switch (open_) {
      case Item::kNone:
        return;
      case Item::kReasoning: {
        json::object part{{"type", "reasoning_text"}, {"text", text_}};
        item_event("response.reasoning_text.done", {{"content_index", 0}, {"text", text_}}, out);
        part_event("response.content_part.done", part, out);
        item_["content"] = json::array{std::move(part)};
        break;
      }
      case Item::kMessage: {
        item_event("response.output_text.done", {{"content_index", 0}, {"text", text_}, {"logprobs", json::array{}}},
                   out);
        part_event("response.content_part.done", output_text(text_), out);
        item_["content"] = json::array{output_text(text_)};
        item_["status"] = status;
        break;
      }
      case Item::kFunctionCall:
        item_event("response.function_call_arguments.done", {{"name", item_["name"]}, {"arguments", text_}}, out);
        item_["arguments"] = text_;
        item_["status"] = status;
        break;
    }
    event("response.output_item.done", {{"output_index", static_cast<int64_t>(output_.size())}, {"item", item_}}, out);
    output_.push_back(std::move(item_));
    item_ = {};
    open_ = Item::kNone;
  }

  ResponseIdentity identity_;
  json::object echo_;  // request fields the response object repeats (instructions, tools, ...)
  int64_t sequence_number_ = 0;
  Item open_ = Item::kNone;
  json::object item_;  // the open item
  std::string text_;   // the open item's text or arguments so far
  json::array output_;
};

}  // namespace

std::unique_ptr<ResponseBuilder> responses_builder(ResponseIdentity identity, json::object echo) {
  return std::make_unique<ResponsesBuilder>(std::move(identity), std::move(echo));
}

}  // namespace deepinfer::recipe
