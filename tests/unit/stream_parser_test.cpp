// Stream parser tests. A table of model outputs per format (well-formed ones produced by rendering assistant
// messages with our renderers, malformed ones written by hand) with the message expected from the format's
// grammar, written by hand: for the DSML formats these are what the reference encoders' strict
// parse_message_from_completion_text returns. Every case is replayed under many tokenizations of the same
// text (trusted, untrusted, one byte per token, and every split of the text into two separately tokenized
// parts) and must give the same message and the same concatenated deltas each time, with well-formed events.
#include "deepinfer/recipe/stream_parser.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cctype>
#include <chrono>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "deepinfer/recipe/renderer.h"
#include "test_data.h"

namespace deepinfer::recipe {
namespace {

namespace json = boost::json;
using Kind = StreamEvent::Kind;

constexpr TokenId kEosId = 1;  // <｜end▁of▁sentence｜> in the DeepSeek-V3 tokenizer
constexpr std::string_view kEos = "<｜end▁of▁sentence｜>";

std::shared_ptr<const Tokenizer> deepseek_v3_tokenizer() {
  static Result<std::shared_ptr<const Tokenizer>> tokenizer = Tokenizer::load(deepinfer::testing::tokenizer_path());
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status().to_string() << " (run scripts/setup.sh to fetch the tokenizer)";
  return tokenizer.ok() ? *tokenizer : nullptr;
}

// DeepSeek-V3's tokenizer plus V4's added tokens, `｜DSML｜` (128825), `<think>` and `</think>` among them.
std::shared_ptr<const Tokenizer> v4_tokenizer() {
  static Result<std::shared_ptr<const Tokenizer>> tokenizer = Tokenizer::load(deepinfer::testing::v4_tokenizer_path());
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status().to_string() << " (build the v4_tokenizer target)";
  return tokenizer.ok() ? *tokenizer : nullptr;
}

// RFC 3629 validity (complete characters only), written independently of the detokenizer.
bool is_valid_utf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const auto lead = static_cast<unsigned char>(text[i]);
    size_t length = lead < 0x80             ? 1
                    : (lead & 0xE0) == 0xC0 ? 2
                    : (lead & 0xF0) == 0xE0 ? 3
                    : (lead & 0xF8) == 0xF0 ? 4
                                            : 0;
    if (length == 0 || i + length > text.size()) return false;
    for (size_t k = 1; k < length; ++k) {
      if ((static_cast<unsigned char>(text[i + k]) & 0xC0) != 0x80) return false;
    }
    i += length;
  }
  return true;
}

// ---- what one run produces -------------------------------------------------------------------------------

struct CallOutcome {
  std::string name;
  std::string arguments_text;
  std::string arguments;  // the parsed object, serialized
  bool operator==(const CallOutcome&) const = default;
};

struct Outcome {
  std::string reasoning;
  std::string content;
  std::vector<CallOutcome> calls;
  bool ended_with_eos = false;
  int32_t malformed = 0;
  // The deltas, concatenated per stream.
  std::string delta_reasoning;
  std::string delta_content;
  std::vector<std::string> delta_names;
  std::vector<std::string> delta_arguments;
  bool operator==(const Outcome&) const = default;
};

std::string json_quoted(std::string_view text) { return json::serialize(json::string(text)); }

std::ostream& operator<<(std::ostream& out, const Outcome& o) {
  out << "{reasoning=" << json_quoted(o.reasoning) << " content=" << json_quoted(o.content) << " calls=[";
  for (const CallOutcome& call : o.calls) {
    out << "(" << call.name << " " << json_quoted(call.arguments_text) << " -> " << call.arguments << ")";
  }
  out << "] eos=" << o.ended_with_eos << " malformed=" << o.malformed
      << " deltas: reasoning=" << json_quoted(o.delta_reasoning) << " content=" << json_quoted(o.delta_content)
      << " names=[";
  for (const std::string& name : o.delta_names) out << name << " ";
  out << "] arguments=[";
  for (const std::string& arguments : o.delta_arguments) out << json_quoted(arguments) << " ";
  return out << "]}";
}

// Checks the event stream's own rules; returns the first violation, or "".
std::string check_events(const std::vector<StreamEvent>& events) {
  int32_t begun = 0;
  int32_t open = -1;
  for (size_t i = 0; i < events.size(); ++i) {
    const StreamEvent& e = events[i];
    std::string where = "event " + std::to_string(i) + ": ";
    switch (e.kind) {
      case Kind::kReasoning:
      case Kind::kContent:
        if (e.text.empty()) return where + "empty text";
        if (!is_valid_utf8(e.text)) return where + "text is not complete UTF-8: " + json_quoted(e.text);
        break;
      case Kind::kToolCallBegin: {
        if (open != -1) return where + "a call begins while another is open";
        if (e.tool_index != begun) return where + "call index " + std::to_string(e.tool_index);
        std::string prefix = "call_" + std::to_string(e.tool_index) + "_";
        if (!e.tool_id.starts_with(prefix) || e.tool_id.size() != prefix.size() + 16) return where + "id " + e.tool_id;
        if (e.tool_name.empty()) return where + "empty name";
        open = begun++;
        break;
      }
      case Kind::kToolArguments:
        if (e.tool_index != open || open == -1) return where + "arguments outside their call";
        if (e.text.empty()) return where + "empty arguments fragment";
        if (!is_valid_utf8(e.text)) return where + "arguments fragment is not complete UTF-8";
        break;
      case Kind::kToolCallEnd:
        if (e.tool_index != open || open == -1) return where + "end of a call that is not open";
        open = -1;
        break;
    }
  }
  if (open != -1) return "call " + std::to_string(open) + " never ended";
  return "";
}

Outcome collect(const StreamParser& parser, const std::vector<StreamEvent>& events) {
  Outcome o;
  const ParsedMessage& m = parser.result();
  o.reasoning = m.reasoning;
  o.content = m.content;
  for (const ParsedToolCall& call : m.tool_calls) {
    o.calls.push_back({call.name, call.arguments_text, json::serialize(call.arguments)});
  }
  o.ended_with_eos = m.ended_with_eos;
  o.malformed = parser.malformed_tool_calls();
  for (const StreamEvent& e : events) {
    switch (e.kind) {
      case Kind::kReasoning:
        o.delta_reasoning += e.text;
        break;
      case Kind::kContent:
        o.delta_content += e.text;
        break;
      case Kind::kToolCallBegin:
        o.delta_names.push_back(e.tool_name);
        o.delta_arguments.emplace_back();
        break;
      case Kind::kToolArguments:
        o.delta_arguments.at(e.tool_index) += e.text;
        break;
      case Kind::kToolCallEnd:
        break;
    }
  }
  return o;
}

// Non-streaming use of the streaming parser: push every token, then finish().
Outcome run_parser(PromptFormat format, StreamParserOptions options, const std::vector<TokenId>& ids,
                   std::string* violation = nullptr, std::shared_ptr<const Tokenizer> tokenizer = nullptr) {
  StreamParser parser(format, tokenizer != nullptr ? std::move(tokenizer) : deepseek_v3_tokenizer(), options);
  std::vector<StreamEvent> events;
  for (TokenId id : ids) parser.push(id, events);
  parser.finish(events);
  if (violation != nullptr) *violation = check_events(events);
  // Ids: one per call, equal in the events and the result.
  std::vector<std::string> ids_seen;
  for (const StreamEvent& e : events) {
    if (e.kind == Kind::kToolCallBegin) ids_seen.push_back(e.tool_id);
  }
  for (size_t i = 0; i < parser.result().tool_calls.size() && i < ids_seen.size(); ++i) {
    EXPECT_EQ(parser.result().tool_calls[i].id, ids_seen[i]);
  }
  return collect(parser, events);
}

// ---- the table -------------------------------------------------------------------------------------------

struct ExpectedCall {
  std::string name;
  std::string arguments_text;
  std::string arguments;  // serialized parsed object; "" means: the parse of arguments_text
};

struct Case {
  std::string name;
  PromptFormat format;
  StreamParserOptions options;
  std::string output;  // what the model wrote, without the end-of-sequence token
  bool eos = true;     // the end-of-sequence token follows (else generation stopped: finish())
  std::string reasoning;
  std::string content;
  std::vector<ExpectedCall> calls;
  int32_t malformed = 0;
};

std::ostream& operator<<(std::ostream& out, const Case& c) { return out << c.name; }

StreamParserOptions thinking() { return {.starts_in_reasoning = true, .tools_enabled = true}; }
StreamParserOptions chat() { return {.starts_in_reasoning = false, .tools_enabled = true}; }
StreamParserOptions no_tools(bool reasoning) { return {.starts_in_reasoning = reasoning, .tools_enabled = false}; }
// After a prompt that prefilled the tool-call block's opener (tool_choice required or named).
StreamParserOptions prefilled(bool tools = true) { return {.tools_enabled = tools, .starts_in_tool_calls = true}; }
// A request for JSON output (response_format).
StreamParserOptions json_output(bool reasoning) {
  return {.starts_in_reasoning = reasoning, .tools_enabled = true, .json_output = true};
}

// The tool calls used in rendered outputs, with their arguments as Python's json.dumps prints them (which is
// also what the DSML reference parser's decode_dsml_to_arguments rebuilds).
constexpr std::string_view kParisArgs = R"({"city": "Paris"})";
constexpr std::string_view kTokyoArgs =
    R"({"city": "Tokyo 東京", "days": 3, "options": {"unit": "celsius", "detail": true}, "tags": ["rain", "wind"], )"
    R"("note": "line1\nline2 \"quoted\" <b>x</b> a\\b 🌧"})";
constexpr std::string_view kSearchArgs = R"({"query": "news", "top_k": 3, "ratio": 0.5, "fresh": false, "site": null})";

ToolCall tool_call(std::string name, std::string_view arguments) {
  return ToolCall{"call_" + name, std::move(name), json::parse(arguments).as_object()};
}

std::vector<ToolCall> one_call() { return {tool_call("get_weather", kParisArgs)}; }
std::vector<ToolCall> three_calls() {
  return {tool_call("get_weather", kParisArgs), tool_call("get_weather", kTokyoArgs),
          tool_call("web_search", kSearchArgs)};
}
std::vector<ExpectedCall> expected_one_call() { return {{"get_weather", std::string(kParisArgs), ""}}; }
std::vector<ExpectedCall> expected_three_calls() {
  return {{"get_weather", std::string(kParisArgs), ""},
          {"get_weather", std::string(kTokyoArgs), ""},
          {"web_search", std::string(kSearchArgs), ""}};
}

// The assistant turn our renderer writes for `assistant` after one user message, minus `opener` (the
// generation prompt the model continues from) and the final end-of-sequence marker.
std::string rendered_turn(PromptFormat format, bool thinking_mode, Message assistant, std::string_view opener) {
  Conversation conversation;
  conversation.options.thinking = thinking_mode;
  conversation.options.add_generation_prompt = false;
  Message user;
  user.role = Role::kUser;
  user.content.push_back({ContentPart::Kind::kText, "What is the weather?", ""});
  conversation.messages.push_back(user);
  Result<RenderedPrompt> before = render_prompt(conversation, format);
  assistant.role = Role::kAssistant;
  conversation.messages.push_back(assistant);
  Result<RenderedPrompt> after = render_prompt(conversation, format);
  if (!before.ok() || !after.ok()) {
    ADD_FAILURE() << "render failed for " << format_name(format);
    return "";
  }
  std::string turn = after->text;
  if (!turn.starts_with(before->text)) ADD_FAILURE() << "turn does not extend the prompt";
  turn.erase(0, before->text.size());
  if (!turn.starts_with(opener) || !turn.ends_with(kEos)) {
    ADD_FAILURE() << format_name(format) << " turn has an unexpected frame: " << json_quoted(turn);
    return "";
  }
  return turn.substr(opener.size(), turn.size() - opener.size() - kEos.size());
}

Message assistant_message(std::string content, std::vector<ToolCall> calls = {},
                          std::optional<std::string> reasoning = std::nullopt) {
  Message m;
  if (content.empty() && !calls.empty()) {
    m.content_is_null = true;
  } else {
    m.content.push_back({ContentPart::Kind::kText, std::move(content), ""});
  }
  m.tool_calls = std::move(calls);
  m.reasoning_content = std::move(reasoning);
  return m;
}

std::vector<Case> v3_cases() {
  using P = PromptFormat;
  // V3 and R1 write tool calls alike; R1's template renders one turn's calls the way the model emits them.
  std::string one = rendered_turn(P::kDeepSeekR1, false, assistant_message("", one_call()), "<｜Assistant｜>");
  std::string three = rendered_turn(P::kDeepSeekR1, false, assistant_message("", three_calls()), "<｜Assistant｜>");
  EXPECT_EQ(one,
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>");
  std::string open_call = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n";
  return {
      {"v3_content_only",
       P::kDeepSeekV3,
       chat(),
       "Hello! 你好 🌍 How can I help? a<b \n\n",
       true,
       "",
       "Hello! 你好 🌍 How can I help? a<b \n\n",
       {},
       0},
      {"v3_one_call", P::kDeepSeekV3, chat(), one, true, "", "", expected_one_call(), 0},
      {"v3_three_calls", P::kDeepSeekV3, chat(), three, true, "", "", expected_three_calls(), 0},
      {"v3_content_then_call", P::kDeepSeekV3, chat(), "Let me check." + one, true, "", "Let me check.",
       expected_one_call(), 0},
      {"v3_call_without_fence",
       P::kDeepSeekV3,
       chat(),
       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{\"a\": [1, 2]}<｜tool▁call▁end｜>"
       "<｜tool▁calls▁end｜>",
       true,
       "",
       "",
       {{"f", R"({"a": [1, 2]})", ""}},
       0},
      // V3 and V3.1 share their tool tokens; each reads the other's call syntax too.
      {"v3_reads_v31_call_syntax", P::kDeepSeekV3, chat(),
       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜>"
       "<｜tool▁calls▁end｜>",
       true, "", "", expected_one_call(), 0},
      {"v3_tools_disabled", P::kDeepSeekV3, no_tools(false), "Sure." + one, true, "", "Sure." + one, {}, 0},
      {"v3_bad_fence_is_content",
       P::kDeepSeekV3,
       chat(),
       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```yaml\ncity: Paris\n```"
       "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       true,
       "",
       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```yaml\ncity: Paris\n```"
       "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       {},
       1},
      {"v3_bad_json_mid_arguments",
       P::kDeepSeekV3,
       chat(),
       open_call + "{\"city\": Paris}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       true,
       "",
       "Paris}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       {{"get_weather", R"({"city": )", "{}"}},
       1},
      {"v3_text_after_call_end", P::kDeepSeekV3, chat(),
       open_call + "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>oops", true, "", "oops", expected_one_call(), 1},
      {"v3_empty_block",
       P::kDeepSeekV3,
       chat(),
       "Hi<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>",
       true,
       "",
       "Hi<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>",
       {},
       1},
      // R1: the prompt opened <think>, so the output starts in reasoning even without the option.
      {"r1_reasoning_content",
       P::kDeepSeekR1,
       chat(),
       "Let me think: 2+2.\n</think>\n\nThe answer is 4.",
       true,
       "Let me think: 2+2.\n",
       "\n\nThe answer is 4.",
       {},
       0},
      {"r1_reasoning_call", P::kDeepSeekR1, thinking(), "Need the weather.\n</think>\n\n" + one, true,
       "Need the weather.\n", "\n\n", expected_one_call(), 0},
      {"r1_calls_end_missing", P::kDeepSeekR1, thinking(),
       "ok</think>" + open_call + "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n", true, "ok", "",
       expected_one_call(), 0},
      {"r1_repeated_think_open", P::kDeepSeekR1, thinking(), "<think>\nhmm</think>ok", true, "\nhmm", "ok", {}, 0},
      {"r1_truncated_reasoning",
       P::kDeepSeekR1,
       thinking(),
       "still thinking </thi",
       false,
       "still thinking </thi",
       "",
       {},
       0},
  };
}

std::vector<Case> v31_cases() {
  using P = PromptFormat;
  std::string one =
      rendered_turn(P::kDeepSeekV31, false, assistant_message("Checking.", one_call()), "<｜Assistant｜></think>");
  std::string three =
      rendered_turn(P::kDeepSeekV31, false, assistant_message("", three_calls()), "<｜Assistant｜></think>");
  EXPECT_EQ(one,
            "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>");
  std::string calls_only = one.substr(std::string_view("Checking.").size());
  std::string open_call = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>";
  return {
      {"v31_chat_content", P::kDeepSeekV31, chat(), "Hi there, 東京 is 🌸.", true, "", "Hi there, 東京 is 🌸.", {}, 0},
      {"v31_chat_model_opens_think",
       P::kDeepSeekV31,
       chat(),
       "<think>quick check</think>Answer.",
       true,
       "quick check",
       "Answer.",
       {},
       0},
      {"v31_chat_leading_think_end", P::kDeepSeekV31, chat(), "</think>Answer.", true, "", "Answer.", {}, 0},
      {"v31_chat_think_not_leading",
       P::kDeepSeekV31,
       chat(),
       "A <think>x</think> B",
       true,
       "",
       "A <think>x</think> B",
       {},
       0},
      {"v31_thinking",
       P::kDeepSeekV31,
       thinking(),
       "First, 東京.\n</think>Answer: 🌸",
       true,
       "First, 東京.\n",
       "Answer: 🌸",
       {},
       0},
      {"v31_literal_think_end_in_content",
       P::kDeepSeekV31,
       thinking(),
       "r</think>a </think> b <think>",
       true,
       "r",
       "a </think> b <think>",
       {},
       0},
      {"v31_one_call", P::kDeepSeekV31, chat(), one, true, "", "Checking.", expected_one_call(), 0},
      {"v31_three_calls", P::kDeepSeekV31, chat(), three, true, "", "", expected_three_calls(), 0},
      {"v31_call_inside_reasoning", P::kDeepSeekV31, thinking(), "I need data." + calls_only, true, "I need data.", "",
       expected_one_call(), 0},
      {"v31_text_after_block", P::kDeepSeekV31, chat(), calls_only + "\nDone.", true, "", "\nDone.",
       expected_one_call(), 0},
      {"v31_reads_v3_call_syntax", P::kDeepSeekV31, chat(),
       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}"
       "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       true, "", "", expected_one_call(), 0},
      {"v31_function_named_function",
       P::kDeepSeekV31,
       chat(),
       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜>"
       "<｜tool▁calls▁end｜>",
       true,
       "",
       "",
       {{"function", R"({"a": 1})", ""}},
       0},
      {"v31_tools_disabled", P::kDeepSeekV31, no_tools(false), one, true, "", one, {}, 0},
      {"v31_bad_json",
       P::kDeepSeekV31,
       chat(),
       open_call + "{\"city\": \"Paris\",}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       true,
       "",
       "}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       {{"get_weather", R"({"city": "Paris",)", "{}"}},
       1},
      {"v31_arguments_not_an_object",
       P::kDeepSeekV31,
       chat(),
       "Sure." + open_call + "[\"Paris\"]<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       true,
       "",
       "Sure." + open_call + "[\"Paris\"]<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       {},
       1},
      {"v31_truncated_in_name",
       P::kDeepSeekV31,
       chat(),
       "Sure<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_wea",
       false,
       "",
       "Sure<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_wea",
       {},
       1},
      {"v31_truncated_in_arguments",
       P::kDeepSeekV31,
       chat(),
       open_call + "{\"city\": \"Par",
       true,
       "",
       "",
       {{"get_weather", R"({"city": "Par)", "{}"}},
       1},
      {"v31_second_call_broken", P::kDeepSeekV31, chat(),
       open_call + "{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>bad name<x<｜tool▁sep｜>{}"
                   "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       true, "", "<｜tool▁call▁begin｜>bad name<x<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       expected_one_call(), 1},
  };
}

// DSML markup for one call, as the encoders write it (used for hand-made variants).
std::string dsml_block(std::string_view block, std::string_view invoke, std::string_view params) {
  return "\n\n<｜DSML｜" + std::string(block) + ">\n<｜DSML｜" + std::string(invoke) + " name=\"get_weather\">\n" +
         std::string(params) + "\n</｜DSML｜" + std::string(invoke) + ">\n</｜DSML｜" + std::string(block) + ">";
}

std::vector<Case> dsml_cases() {
  using P = PromptFormat;
  std::vector<Case> cases;
  Message reasoning_only = assistant_message("The weather is mild: 東京 <b>18°C</b>.\n\nAnything else?", {},
                                             "The user asks about weather </thi no wait.");
  Message empty_arguments = assistant_message("", {tool_call("now", "{}")});
  for (P format : {P::kDeepSeekV32, P::kDeepSeekV4, P::kDeepSeekV41}) {
    std::string f(format_name(format));
    bool v41 = format == P::kDeepSeekV41;
    std::string block = format == P::kDeepSeekV32  ? "function_calls"
                        : format == P::kDeepSeekV4 ? "tool_calls"
                                                   : " calls";
    std::string invoke = v41 ? " invoke" : "invoke";
    std::string parameter = v41 ? " parameter" : "parameter";
    std::string p_open = "<｜DSML｜" + parameter;
    std::string p_close = "</｜DSML｜" + parameter + ">";
    std::string think_open = "<｜Assistant｜><think>";
    std::string chat_open = "<｜Assistant｜></think>";

    std::string reasoning_content = rendered_turn(format, true, reasoning_only, think_open);
    std::string one =
        rendered_turn(format, true, assistant_message("Checking.", one_call(), "Look it up."), think_open);
    std::string three = rendered_turn(format, false, assistant_message("", three_calls()), chat_open);
    std::string zero = rendered_turn(format, false, empty_arguments, chat_open);
    std::string paris = p_open + " name=\"city\" string=\"true\">Paris" + p_close;
    std::string one_block = dsml_block(block, invoke, paris);
    EXPECT_EQ(one, "Look it up.</think>Checking." + one_block) << f;

    cases.push_back({f + "_reasoning_content",
                     format,
                     thinking(),
                     reasoning_content,
                     true,
                     "The user asks about weather </thi no wait.",
                     "The weather is mild: 東京 <b>18°C</b>.\n\nAnything else?",
                     {},
                     0});
    cases.push_back({f + "_chat_content",
                     format,
                     chat(),
                     "Use a < b and\n\nnew <｜not a tag｜> text\n",
                     true,
                     "",
                     "Use a < b and\n\nnew <｜not a tag｜> text\n",
                     {},
                     0});
    cases.push_back(
        {f + "_one_call", format, thinking(), one, true, "Look it up.", "Checking.", expected_one_call(), 0});
    cases.push_back({f + "_three_calls", format, chat(), three, true, "", "", expected_three_calls(), 0});
    // The encoders write an empty parameter list as a blank line, which their own strict parser rejects;
    // we accept it.
    cases.push_back({f + "_no_arguments", format, chat(), zero, true, "", "", {{"now", "{}", ""}}, 0});
    cases.push_back({f + "_block_before_think_end", format, thinking(), "I will call the tool." + one_block, true,
                     "I will call the tool.", "", expected_one_call(), 0});
    cases.push_back(
        {f + "_text_after_block", format, chat(), "A" + one_block + "\nB", true, "", "A\nB", expected_one_call(), 0});
    cases.push_back({f + "_single_newline_before_block", format, chat(), "A\n" + one_block.substr(2), true, "", "A\n",
                     expected_one_call(), 0});
    cases.push_back({f + "_calls_end_missing", format, chat(),
                     one_block.substr(0, one_block.size() - ("\n</｜DSML｜" + block + ">").size()), true, "", "",
                     expected_one_call(), 0});
    cases.push_back({f + "_tools_disabled",
                     format,
                     no_tools(true),
                     "r</think>" + one.substr(one.find("Checking")),
                     true,
                     "r",
                     "Checking." + one_block,
                     {},
                     0});
    cases.push_back({f + "_tools_disabled_block_in_reasoning",
                     format,
                     no_tools(true),
                     "I will call." + one_block,
                     true,
                     "I will call." + one_block,
                     "",
                     {},
                     0});
    // Malformed markup.
    std::string unknown_block = "\n\n<｜DSML｜" + block + ">\n<｜DSML｜call name=\"f\">\n</｜DSML｜" + block + ">";
    cases.push_back(
        {f + "_unknown_tag_in_block", format, chat(), "Hi" + unknown_block, true, "", "Hi" + unknown_block, {}, 1});
    std::string unknown_param = "<｜DSML｜param name=\"city\" string=\"true\">Paris</｜DSML｜param>";
    cases.push_back({f + "_unknown_tag_in_invoke",
                     format,
                     chat(),
                     dsml_block(block, invoke, unknown_param),
                     true,
                     "",
                     "\n" + unknown_param + "\n</｜DSML｜" + invoke + ">\n</｜DSML｜" + block + ">",
                     {{"get_weather", "{", "{}"}},
                     1});
    std::string bad_raw = p_open + " name=\"days\" string=\"false\">three" + p_close;
    cases.push_back({f + "_raw_value_not_json",
                     format,
                     chat(),
                     dsml_block(block, invoke, paris + "\n" + bad_raw),
                     true,
                     "",
                     "\n" + bad_raw + "\n</｜DSML｜" + invoke + ">\n</｜DSML｜" + block + ">",
                     {{"get_weather", R"({"city": "Paris")", "{}"}},
                     1});
    cases.push_back({f + "_duplicate_parameter",
                     format,
                     chat(),
                     dsml_block(block, invoke, paris + "\n" + paris),
                     true,
                     "",
                     "\n" + paris + "\n</｜DSML｜" + invoke + ">\n</｜DSML｜" + block + ">",
                     {{"get_weather", R"({"city": "Paris")", "{}"}},
                     1});
    cases.push_back(
        {f + "_missing_string_attribute",
         format,
         chat(),
         dsml_block(block, invoke, p_open + " name=\"city\">Paris" + p_close),
         true,
         "",
         "\n" + p_open + " name=\"city\">Paris" + p_close + "\n</｜DSML｜" + invoke + ">\n</｜DSML｜" + block + ">",
         {{"get_weather", "{", "{}"}},
         1});
    std::string truncated = "Let me check.\n\n<｜DSML｜" + block + ">\n<｜DSML｜" + invoke.substr(0, 3);
    cases.push_back({f + "_truncated_block", format, chat(), truncated, true, "", truncated, {}, 1});
    std::string in_value = "\n\n<｜DSML｜" + block + ">\n<｜DSML｜" + invoke + " name=\"write\">\n" + p_open +
                           " name=\"text\" string=\"true\">Hello 世界 ";
    std::string partial_close = p_close.substr(0, p_close.size() - 5);  // "</｜DSML｜[ ]para"
    cases.push_back({f + "_truncated_in_string_value",
                     format,
                     chat(),
                     in_value + partial_close,
                     false,
                     "",
                     partial_close,
                     {{"write", R"({"text": "Hello 世界 )", "{}"}},
                     1});
    cases.push_back({f + "_empty_block",
                     format,
                     chat(),
                     "x\n\n<｜DSML｜" + block + ">\n</｜DSML｜" + block + ">",
                     true,
                     "",
                     "x\n\n<｜DSML｜" + block + ">\n</｜DSML｜" + block + ">",
                     {},
                     1});
  }
  // Each DSML version recognises only its own block name.
  std::string v32_block = dsml_block("function_calls", "invoke",
                                     "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>");
  cases.push_back({"deepseek-v4_other_versions_block_is_content",
                   P::kDeepSeekV4,
                   chat(),
                   "x" + v32_block,
                   true,
                   "",
                   "x" + v32_block,
                   {},
                   0});
  std::string v4_block =
      dsml_block("tool_calls", "invoke", "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>");
  cases.push_back({"deepseek-v4.1_other_versions_block_is_content",
                   P::kDeepSeekV41,
                   chat(),
                   "x" + v4_block,
                   true,
                   "",
                   "x" + v4_block,
                   {},
                   0});
  return cases;
}

// tool_choice required / named: the prompt ends with the block's opener ("\n\n<｜DSML｜BLOCK>\n"), the model
// writes the calls from there.
std::vector<Case> prefilled_cases() {
  using P = PromptFormat;
  std::vector<Case> cases;
  for (P format : {P::kDeepSeekV32, P::kDeepSeekV4, P::kDeepSeekV41}) {
    std::string f(format_name(format));
    const bool v41 = format == P::kDeepSeekV41;
    const std::string block = format == P::kDeepSeekV32  ? "function_calls"
                              : format == P::kDeepSeekV4 ? "tool_calls"
                                                         : " calls";
    const std::string parameter = v41 ? " parameter" : "parameter";
    const std::string one_block =
        dsml_block(block, v41 ? " invoke" : "invoke",
                   "<｜DSML｜" + parameter + " name=\"city\" string=\"true\">Paris</｜DSML｜" + parameter + ">");
    const std::string opener = "\n\n<｜DSML｜" + block + ">\n";
    EXPECT_TRUE(one_block.starts_with(opener)) << f;
    const std::string calls = one_block.substr(opener.size());
    cases.push_back({f + "_prefilled_block_one_call", format, prefilled(), calls, true, "", "", expected_one_call(), 0});
    if (format != P::kDeepSeekV4) continue;  // the rest does not depend on the block's name
    std::string three =
        rendered_turn(format, false, assistant_message("", three_calls()), "<｜Assistant｜></think>");
    EXPECT_TRUE(three.starts_with(opener)) << f;
    cases.push_back({f + "_prefilled_block_three_calls", format, prefilled(), three.substr(opener.size()), true, "", "",
                     expected_three_calls(), 0});
    cases.push_back(
        {f + "_prefilled_block_repeated_opener", format, prefilled(), one_block, true, "", "", expected_one_call(), 0});
    cases.push_back(
        {f + "_prefilled_block_no_call", format, prefilled(), "Sorry, I cannot.", true, "", "Sorry, I cannot.", {}, 1});
    cases.push_back({f + "_prefilled_block_nothing", format, prefilled(), "", true, "", "", {}, 1});
    // A committed call stays; the markup after it is content from the model's first unrepresented byte.
    cases.push_back({f + "_prefilled_block_breaks_mid_call", format, prefilled(),
                     calls.substr(0, calls.find('\n') + 1) + "<oops>", true, "", "\n<oops>",
                     {{"get_weather", "{", "{}"}}, 1});
    cases.push_back(
        {f + "_prefilled_block_without_tools_is_content", format, prefilled(false), calls, true, "", calls, {}, 0});
  }
  return cases;
}

// JSON output (response_format): only the JSON text is content, as deepseek-recipe's parse_json_output finds it.
std::vector<Case> json_cases() {
  using P = PromptFormat;
  const std::string call =
      dsml_block("tool_calls", "invoke", "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>");
  return {
      {"json_fenced",
       P::kDeepSeekV4,
       json_output(false),
       "Here:\n```json\n{\"a\": [1, 2]}\n```\nDone.",
       true,
       "",
       "{\"a\": [1, 2]}",
       {},
       0},
      {"json_plain_fence", P::kDeepSeekV4, json_output(false), "```\n[1]\n```", true, "", "[1]", {}, 0},
      {"json_raw_object",
       P::kDeepSeekV4,
       json_output(false),
       "{\"a\": \"x```\"}",
       true,
       "",
       "{\"a\": \"x```\"}",
       {},
       0},
      {"json_after_prose",
       P::kDeepSeekV41,
       json_output(false),
       "Sure: [1, {\"b\": null}]",
       true,
       "",
       "[1, {\"b\": null}]",
       {},
       0},
      {"json_none", P::kDeepSeekV32, json_output(false), "No JSON here.", true, "", "", {}, 0},
      {"json_after_reasoning",
       P::kDeepSeekV4,
       json_output(true),
       "Think {x}.</think>\n```json\n{}\n```",
       true,
       "Think {x}.",
       "{}",
       {},
       0},
      {"json_tool_call_outside_json", P::kDeepSeekV4, json_output(false), "x" + call, true, "", "", expected_one_call(),
       0},
  };
}

// The table, one test per case.
std::vector<Case> table_cases() {
  std::vector<Case> cases = v3_cases();
  for (std::vector<Case> more : {v31_cases(), dsml_cases()}) cases.insert(cases.end(), more.begin(), more.end());
  return cases;
}

// Everything, for the mutation test.
std::vector<Case> all_cases() {
  std::vector<Case> cases = table_cases();
  for (std::vector<Case> more : {prefilled_cases(), json_cases()}) cases.insert(cases.end(), more.begin(), more.end());
  return cases;
}

Outcome expected_outcome(const Case& c) {
  Outcome o;
  o.reasoning = o.delta_reasoning = c.reasoning;
  o.content = o.delta_content = c.content;
  for (const ExpectedCall& call : c.calls) {
    std::string parsed = call.arguments.empty() ? json::serialize(json::parse(call.arguments_text)) : call.arguments;
    o.calls.push_back({call.name, call.arguments_text, parsed});
    o.delta_names.push_back(call.name);
    o.delta_arguments.push_back(call.arguments_text);
  }
  o.ended_with_eos = c.eos;
  o.malformed = c.malformed;
  return o;
}

std::vector<TokenId> with_eos(std::vector<TokenId> ids, bool eos) {
  if (eos) ids.push_back(kEosId);
  return ids;
}

// The reference tokenization: the text tokenized trusted (markers that are tokens become their ids), fed one
// token at a time, gives exactly the message the grammar says.
void expect_parses_to_the_expected_message(const Case& c) {
  auto tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  std::string violation;
  Outcome got =
      run_parser(c.format, c.options, with_eos(tokenizer->encode(c.output, TextTrust::kTrusted), c.eos), &violation);
  EXPECT_EQ(violation, "");
  EXPECT_EQ(got, expected_outcome(c)) << "output: " << json_quoted(c.output);
}

// The same text under other tokenizations gives the same message and the same concatenated deltas.
void expect_every_tokenization_gives_the_same_result(const Case& c) {
  auto tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  const Outcome expected = expected_outcome(c);
  auto check = [&](const std::string& how, const std::vector<TokenId>& ids) {
    std::string violation;
    Outcome got = run_parser(c.format, c.options, with_eos(ids, c.eos), &violation);
    EXPECT_EQ(violation, "") << how;
    EXPECT_EQ(got, expected) << how;
    return got == expected && violation.empty();
  };
  check("untrusted (every marker as ordinary pieces)", tokenizer->encode(c.output, TextTrust::kUntrusted));
  // One byte per token: every multi-byte character arrives split.
  std::vector<TokenId> bytes;
  for (char byte : c.output) tokenizer->encode(std::string_view(&byte, 1), TextTrust::kUntrusted, bytes);
  ASSERT_EQ(tokenizer->decode(bytes), c.output);
  check("one byte per token", bytes);
  // Random cuts into many pieces, each tokenized trusted on its own.
  std::mt19937 random(static_cast<uint32_t>(std::hash<std::string>{}(c.name)));
  for (int round = 0; round < 20; ++round) {
    std::vector<TokenId> ids;
    for (size_t at = 0; at < c.output.size();) {
      size_t length = 1 + random() % 12;
      tokenizer->encode(std::string_view(c.output).substr(at, length), TextTrust::kTrusted, ids);
      at += length;
    }
    if (!check("random cuts, round " + std::to_string(round), ids)) break;
  }
  // Every split point: the two halves tokenized separately, so markers and characters straddle tokens.
  for (size_t split = 1; split < c.output.size(); ++split) {
    std::vector<TokenId> ids = tokenizer->encode(std::string_view(c.output).substr(0, split), TextTrust::kTrusted);
    tokenizer->encode(std::string_view(c.output).substr(split), TextTrust::kTrusted, ids);
    if (!check("split at byte " + std::to_string(split), ids)) break;  // one failure says enough
  }
}

// V4's tokenizer has `｜DSML｜`, `<think>` and `</think>` as added tokens: an output as that tokenizer writes it
// (every DSML tag's marker one id) parses exactly as its text does.
void expect_v4_token_ids_parse_as_the_text(const Case& c) {
  auto tokenizer = v4_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  const std::vector<TokenId> ids = tokenizer->encode(c.output, TextTrust::kTrusted);
  const TokenId dsml = *tokenizer->added_token_id("｜DSML｜");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), dsml) > 0, c.output.find("｜DSML｜") != std::string::npos);
  std::string violation;
  EXPECT_EQ(run_parser(c.format, c.options, with_eos(ids, c.eos), &violation, tokenizer), expected_outcome(c))
      << "output: " << json_quoted(c.output);
  EXPECT_EQ(violation, "");
}

class StreamParserCaseTest : public ::testing::TestWithParam<Case> {};

TEST_P(StreamParserCaseTest, ParsesToTheExpectedMessage) { expect_parses_to_the_expected_message(GetParam()); }

TEST_P(StreamParserCaseTest, EveryTokenizationGivesTheSameResult) {
  expect_every_tokenization_gives_the_same_result(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Formats, StreamParserCaseTest, ::testing::ValuesIn(table_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string name = info.param.name;
                           for (char& ch : name) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return name;
                         });

// Issue 16's cases run in one process each (one tokenizer load, not one per case): CI time.
void expect_all(const std::vector<Case>& cases, bool v4_ids) {
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    expect_parses_to_the_expected_message(c);
    expect_every_tokenization_gives_the_same_result(c);
    if (v4_ids) expect_v4_token_ids_parse_as_the_text(c);
  }
}

// tool_choice required / named prefill the tool-call block's opener: the parser starts inside the block.
TEST(StreamParserTest, APrefilledToolCallBlockParsesFromTheModelsFirstByte) { expect_all(prefilled_cases(), true); }

// response_format json_object / json_schema: content is the JSON text only.
TEST(StreamParserTest, JsonOutputKeepsOnlyTheJsonText) { expect_all(json_cases(), true); }

// Every DSML case of the table as V4's tokenizer writes it (｜DSML｜ as 128825, <think> and </think> as ids)
// parses exactly as its text does (issue 16).
TEST(StreamParserTest, DsmlOutputsAsV4TokenIdsParseAsTheirText) {
  for (const Case& c : dsml_cases()) {
    SCOPED_TRACE(c.name);
    expect_v4_token_ids_parse_as_the_text(c);
  }
}

// Mutated outputs: every case of the table with random pieces of markup inserted, bytes deleted or the text
// cut short. Whatever the text, every tokenization gives the same result and a well-formed event stream.
TEST(StreamParserTest, MutatedOutputsGiveTheSameResultUnderEveryTokenization) {
  auto tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  const std::vector<std::string> pieces = {"<｜tool▁calls▁begin｜>",
                                           "<｜tool▁call▁begin｜>",
                                           "<｜tool▁sep｜>",
                                           "<｜tool▁call▁end｜>",
                                           "<｜tool▁calls▁end｜>",
                                           "function",
                                           "\n",
                                           "\n\n",
                                           "```json",
                                           "```",
                                           "{",
                                           "}",
                                           "[",
                                           "]",
                                           "\"",
                                           ": ",
                                           "1",
                                           ",",
                                           "</think>",
                                           "<think>",
                                           "<｜DSML｜",
                                           "</｜DSML｜",
                                           "invoke",
                                           " invoke",
                                           "parameter",
                                           " parameter",
                                           " name=\"x\"",
                                           " string=\"true\"",
                                           " string=\"false\"",
                                           ">",
                                           "東京",
                                           "🌧",
                                           "<",
                                           " ",
                                           "\\"};
  const std::vector<Case> cases = all_cases();
  std::mt19937 random(20240601);
  int runs = 0;
  int with_calls = 0;
  int with_malformed = 0;
  for (int round = 0; round < 3000; ++round) {
    const Case& base = cases[random() % cases.size()];
    std::string text = base.output;
    for (int mutations = static_cast<int>(random() % 4); mutations > 0 && !text.empty(); --mutations) {
      size_t at = random() % (text.size() + 1);
      switch (random() % 3) {
        case 0:
          text.insert(at, pieces[random() % pieces.size()]);
          break;
        case 1:
          text.erase(std::min(at, text.size() - 1), 1 + random() % 8);
          break;
        case 2:
          text.resize(at);
          break;
      }
    }
    bool eos = random() % 4 != 0;
    std::string violation;
    Outcome reference =
        run_parser(base.format, base.options, with_eos(tokenizer->encode(text, TextTrust::kTrusted), eos), &violation);
    ASSERT_EQ(violation, "") << base.name << " " << json_quoted(text);
    std::vector<TokenId> bytes;
    for (char byte : text) tokenizer->encode(std::string_view(&byte, 1), TextTrust::kUntrusted, bytes);
    std::vector<TokenId> chunks;
    for (size_t at = 0; at < text.size();) {
      size_t length = 1 + random() % 7;
      tokenizer->encode(std::string_view(text).substr(at, length), TextTrust::kTrusted, chunks);
      at += length;
    }
    for (const auto& [how, ids] : {std::pair{"one byte per token", bytes}, std::pair{"random chunks", chunks}}) {
      Outcome got = run_parser(base.format, base.options, with_eos(ids, eos), &violation);
      ASSERT_EQ(violation, "") << how << " " << base.name << " " << json_quoted(text);
      ASSERT_EQ(got, reference) << how << " " << base.name << " " << json_quoted(text);
    }
    ++runs;
    with_calls += reference.calls.empty() ? 0 : 1;
    with_malformed += reference.malformed > 0 ? 1 : 0;
  }
  EXPECT_EQ(runs, 3000);
  // The mutations reach both outcomes: calls that survive and markup that breaks.
  EXPECT_GT(with_calls, 500);
  EXPECT_GT(with_malformed, 500);
}

// ---- streaming behaviour ---------------------------------------------------------------------------------

// Pushes `text` as its trusted tokens and returns the events of this push only.
std::vector<StreamEvent> push_text(StreamParser& parser, std::string_view text) {
  std::vector<StreamEvent> events;
  for (TokenId id : deepseek_v3_tokenizer()->encode(text, TextTrust::kTrusted)) parser.push(id, events);
  return events;
}

std::string joined(const std::vector<StreamEvent>& events, Kind kind) {
  std::string out;
  for (const StreamEvent& e : events) {
    if (e.kind == kind) out += e.text;
  }
  return out;
}

TEST(StreamParserTest, HoldsBackOnlyWhatMayBeginAMarker) {
  ASSERT_NE(deepseek_v3_tokenizer(), nullptr);
  StreamParser parser(PromptFormat::kDeepSeekV32, deepseek_v3_tokenizer(), thinking());
  EXPECT_EQ(joined(push_text(parser, "Step one </th"), Kind::kReasoning), "Step one ");
  EXPECT_EQ(joined(push_text(parser, "ought"), Kind::kReasoning), "</thought");
  // "\n" may begin "\n\n<｜DSML｜function_calls": held; so is a second "\n" and the tag's beginning.
  std::vector<StreamEvent> events = push_text(parser, " done</think>Answer\n");
  EXPECT_EQ(joined(events, Kind::kReasoning), " done");
  EXPECT_EQ(joined(events, Kind::kContent), "Answer");
  events = push_text(parser, "\n");
  EXPECT_TRUE(events.empty());
  events = push_text(parser, "<｜DSML｜func");
  EXPECT_TRUE(events.empty()) << "the block opener must stay held";
  events = push_text(parser, "tion_call");
  EXPECT_TRUE(events.empty());
  events = push_text(parser, "ed that?");
  EXPECT_EQ(joined(events, Kind::kContent), "\n\n<｜DSML｜function_called that?");
  std::vector<StreamEvent> rest;
  parser.finish(rest);
  EXPECT_TRUE(rest.empty());
  EXPECT_EQ(parser.result().reasoning, "Step one </thought done");
  EXPECT_EQ(parser.result().content, "Answer\n\n<｜DSML｜function_called that?");
  EXPECT_FALSE(parser.result().ended_with_eos);
}

// A turn marker written as its added token ends the answer: it and what follows never reach the client (the
// demo model wrote "<｜Assistant｜>" mid-answer in 3 of 8 replies, issue 16). As text pieces it stays text.
TEST(StreamParserTest, ATurnMarkerTokenEndsTheMessage) {
  const std::shared_ptr<const Tokenizer> tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  const std::vector<TokenId> markers = turn_marker_ids(*tokenizer, PromptFormat::kDeepSeekV3);
  ASSERT_EQ(markers.size(), 2u);  // <｜User｜>, <｜Assistant｜>
  EXPECT_EQ(markers[0], *tokenizer->added_token_id("<｜User｜>"));
  EXPECT_EQ(markers[1], *tokenizer->added_token_id("<｜Assistant｜>"));
  for (PromptFormat format : all_formats()) {
    for (TokenId marker : markers) {
      StreamParser parser(format, tokenizer, {});
      std::vector<StreamEvent> events = push_text(parser, "Paris is the capital.");
      parser.push(marker, events);
      for (TokenId id : tokenizer->encode(" More text", TextTrust::kUntrusted)) parser.push(id, events);
      parser.finish(events);
      // deepseek-r1's output starts in reasoning.
      EXPECT_EQ(parser.result().content + parser.result().reasoning, "Paris is the capital.") << format_name(format);
      EXPECT_TRUE(parser.result().ended_with_turn_marker);
      EXPECT_FALSE(parser.result().ended_with_eos);
    }
  }
  StreamParser parser(PromptFormat::kDeepSeekV3, tokenizer, {});
  std::vector<StreamEvent> events;
  for (TokenId id : tokenizer->encode("a <｜User｜> b", TextTrust::kUntrusted)) parser.push(id, events);  // pieces
  parser.finish(events);
  EXPECT_EQ(parser.result().content, "a <｜User｜> b");
  EXPECT_FALSE(parser.result().ended_with_turn_marker);
}

TEST(StreamParserTest, StreamsArgumentsAsTheyArrive) {
  ASSERT_NE(deepseek_v3_tokenizer(), nullptr);
  // DSML: the call begins at its invoke tag, a string value streams JSON-escaped, `}` ends it.
  StreamParser dsml(PromptFormat::kDeepSeekV32, deepseek_v3_tokenizer(), chat());
  std::vector<StreamEvent> events = push_text(dsml, "\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"write\">\n");
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Kind::kToolCallBegin);
  EXPECT_EQ(events[0].tool_name, "write");
  EXPECT_EQ(events[1].text, "{");
  events = push_text(dsml, "<｜DSML｜parameter name=\"text\" string=\"true\">He said \"hi\"\nthen");
  EXPECT_EQ(joined(events, Kind::kToolArguments), R"("text": "He said \"hi\"\nthen)");
  events = push_text(dsml, " left.</｜DSML｜parameter>\n<｜DSML｜parameter name=\"n\" string=\"false\">[1,");
  EXPECT_EQ(joined(events, Kind::kToolArguments), R"( left.")") << "a raw value is held until it closes";
  events = push_text(dsml, " 2]</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>");
  EXPECT_EQ(joined(events, Kind::kToolArguments), R"(, "n": [1, 2]})");
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().kind, Kind::kToolCallEnd);
  EXPECT_EQ(dsml.result().tool_calls.at(0).arguments_text, R"({"text": "He said \"hi\"\nthen left.", "n": [1, 2]})");
  EXPECT_EQ(json::serialize(dsml.result().tool_calls.at(0).arguments),
            R"({"text":"He said \"hi\"\nthen left.","n":[1,2]})");

  // V3.1: the model's JSON streams byte for byte once it starts with '{'.
  StreamParser v31(PromptFormat::kDeepSeekV31, deepseek_v3_tokenizer(), chat());
  events = push_text(v31, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>");
  EXPECT_TRUE(events.empty()) << "no call before its arguments start";
  events = push_text(v31, "{\"a\": \"x");
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events[0].kind, Kind::kToolCallBegin);
  EXPECT_EQ(joined(events, Kind::kToolArguments), R"({"a": "x)");
}

TEST(StreamParserTest, MultiByteCharacterSplitAcrossTokensIsNeverEmittedPartially) {
  auto tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  // "🌧" is four bytes; pushed as four byte tokens, it appears once, whole, with the fourth.
  StreamParser parser(PromptFormat::kDeepSeekV3, tokenizer, chat());
  const std::string rain = "🌧";
  for (size_t i = 0; i < rain.size(); ++i) {
    std::vector<StreamEvent> events;
    for (TokenId id : tokenizer->encode(std::string_view(rain).substr(i, 1), TextTrust::kUntrusted)) {
      parser.push(id, events);
    }
    if (i + 1 < rain.size()) {
      EXPECT_TRUE(events.empty()) << "after byte " << i;
    } else {
      ASSERT_EQ(events.size(), 1u);
      EXPECT_EQ(events[0].text, rain);
    }
  }
  // A character cut off by the end of generation becomes U+FFFD, never raw bytes.
  std::vector<StreamEvent> events;
  for (TokenId id : tokenizer->encode(std::string_view(rain).substr(0, 2), TextTrust::kUntrusted)) {
    parser.push(id, events);
  }
  parser.finish(events);
  EXPECT_EQ(parser.result().content, rain + "\xEF\xBF\xBD");
}

// Regression (a break-it pass, 2026-12-06): max_tokens cutting a tool call sent its markup to the client as
// content ("<｜DSML｜invoke name=\"get_wea"). Cut by the length limit (finish(events, true)) after every token of a
// one-call answer, in the V3 and the V4 formats: no markup in the content, nothing counted malformed, the content a
// prefix of the whole answer's, and a call whose name was read kept with the arguments streamed so far (V4.1 too).
// The same prefix ended without the flag (the model's own end inside a call) still gives the markup back as content.
TEST(StreamParserTest, OutputCutByTheLengthLimitInsideACallShowsNoMarkup) {
  using P = PromptFormat;
  struct Variant {
    P format;
    std::shared_ptr<const Tokenizer> tokenizer;
    std::string output;
  };
  const std::vector<Variant> variants = {
      {P::kDeepSeekV3, deepseek_v3_tokenizer(),
       "Checking." + rendered_turn(P::kDeepSeekR1, false, assistant_message("", one_call()), "<｜Assistant｜>")},
      {P::kDeepSeekV4, v4_tokenizer(),
       rendered_turn(P::kDeepSeekV4, false, assistant_message("Checking.", one_call()), "<｜Assistant｜></think>")},
      {P::kDeepSeekV41, v4_tokenizer(),
       rendered_turn(P::kDeepSeekV41, false, assistant_message("Checking.", one_call()), "<｜Assistant｜></think>")},
  };
  for (const Variant& v : variants) {
    ASSERT_NE(v.tokenizer, nullptr);
    const std::vector<TokenId> ids = v.tokenizer->encode(v.output, TextTrust::kTrusted);
    const Outcome whole = run_parser(v.format, {}, ids, nullptr, v.tokenizer);
    ASSERT_EQ(whole.calls.size(), 1u) << v.output;
    int kept_calls = 0, marked_up_without_flag = 0;
    for (size_t cut = 1; cut < ids.size(); ++cut) {
      const std::vector<TokenId> prefix(ids.begin(), ids.begin() + static_cast<ptrdiff_t>(cut));
      StreamParser parser(v.format, v.tokenizer, {});
      std::vector<StreamEvent> events;
      for (TokenId id : prefix) parser.push(id, events);
      parser.finish(events, /*cut_off=*/true);
      EXPECT_EQ(check_events(events), "") << "cut after " << cut;
      const Outcome got = collect(parser, events);
      const std::string where = std::string(format_name(v.format)) + ", cut after token " + std::to_string(cut);
      for (std::string_view marker : {"｜DSML｜", "<｜tool", "｜tool▁", "```json"})
        EXPECT_EQ(got.content.find(marker), std::string::npos) << where << ": " << json_quoted(got.content);
      EXPECT_TRUE(whole.content.starts_with(got.content)) << where << ": " << json_quoted(got.content);
      EXPECT_EQ(got.malformed, 0) << where;
      ASSERT_LE(got.calls.size(), 1u) << where;
      if (!got.calls.empty()) {
        ++kept_calls;
        EXPECT_EQ(got.calls[0].name, "get_weather") << where;
        EXPECT_TRUE(whole.calls[0].arguments_text.starts_with(got.calls[0].arguments_text)) << where;
      }
      const Outcome plain = run_parser(v.format, {}, prefix, nullptr, v.tokenizer);
      if (plain.malformed > 0) ++marked_up_without_flag;
    }
    EXPECT_GT(kept_calls, 0) << format_name(v.format);
    EXPECT_GT(marked_up_without_flag, 0) << format_name(v.format);
  }
}

TEST(StreamParserTest, EndOfSequenceEndsTheMessage) {
  auto tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  StreamParser parser(PromptFormat::kDeepSeekV3, tokenizer, chat());
  std::vector<StreamEvent> events;
  for (TokenId id : tokenizer->encode("Done. <", TextTrust::kTrusted)) parser.push(id, events);
  parser.push(kEosId, events);
  EXPECT_EQ(joined(events, Kind::kContent), "Done. <") << "the end flushes what was held back";
  for (TokenId id : tokenizer->encode("after the end", TextTrust::kTrusted)) parser.push(id, events);
  parser.finish(events);
  parser.finish(events);
  EXPECT_EQ(parser.result().content, "Done. <");
  EXPECT_TRUE(parser.result().ended_with_eos);
}

// Regression: the default model (random weights) emitted `<｜place▁holder▁no▁34｜>` into content.
TEST(StreamParserTest, SpecialTokensOtherThanEosAreNotText) {
  auto tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  StreamParser parser(PromptFormat::kDeepSeekV3, tokenizer, chat());
  std::vector<StreamEvent> events;
  const TokenId placeholder = *tokenizer->added_token_id("<｜place▁holder▁no▁34｜>");
  const TokenId bos = *tokenizer->added_token_id("<｜begin▁of▁sentence｜>");
  ASSERT_TRUE(tokenizer->is_special_token(placeholder));
  for (TokenId id : tokenizer->encode("Hello", TextTrust::kTrusted)) parser.push(id, events);
  parser.push(placeholder, events);
  parser.push(bos, events);
  for (TokenId id : tokenizer->encode(" world", TextTrust::kTrusted)) parser.push(id, events);
  parser.push(kEosId, events);
  EXPECT_EQ(parser.result().content, "Hello world");
  EXPECT_EQ(joined(events, Kind::kContent), "Hello world");
}

TEST(StreamParserTest, CallIdsAreUniqueAndIndexed) {
  auto tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  std::string call = "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>";
  std::string output = "<｜tool▁calls▁begin｜>" + call + call + call + "<｜tool▁calls▁end｜>";
  StreamParser first(PromptFormat::kDeepSeekV31, tokenizer, chat());
  StreamParser second(PromptFormat::kDeepSeekV31, tokenizer, chat());
  std::vector<StreamEvent> events;
  for (TokenId id : tokenizer->encode(output, TextTrust::kTrusted)) {
    first.push(id, events);
    second.push(id, events);
  }
  std::set<std::string> ids;
  for (const StreamParser* parser : {&first, &second}) {
    ASSERT_EQ(parser->result().tool_calls.size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_TRUE(parser->result().tool_calls[i].id.starts_with("call_" + std::to_string(i) + "_"));
      ids.insert(parser->result().tool_calls[i].id);
    }
  }
  EXPECT_EQ(ids.size(), 6u);
}

// A regression guard for O(N): a long output full of near-markers ("<", "\n", "</thin") parsed one token at a
// time finishes quickly. Re-scanning the whole output per token would take minutes here.
TEST(StreamParserTest, LongOutputIsLinear) {
  auto tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  std::string unit = "a < b\n</thin\n<｜DSML｜func 東京 ";
  std::string reasoning;
  while (reasoning.size() < 600'000) reasoning += unit;
  std::vector<TokenId> ids = tokenizer->encode(reasoning, TextTrust::kTrusted);
  std::vector<TokenId> tail = tokenizer->encode("</think>" + reasoning, TextTrust::kTrusted);
  ids.insert(ids.end(), tail.begin(), tail.end());
  auto start = std::chrono::steady_clock::now();
  StreamParser parser(PromptFormat::kDeepSeekV4, tokenizer, thinking());
  std::vector<StreamEvent> events;
  size_t events_seen = 0;
  for (TokenId id : ids) {
    parser.push(id, events);
    events_seen += events.size();
    events.clear();
  }
  parser.finish(events);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // (Boolean checks: gtest's diff of two long strings would itself be quadratic.)
  EXPECT_TRUE(parser.result().reasoning == reasoning);
  EXPECT_TRUE(parser.result().content == reasoning);
  EXPECT_GT(events_seen, ids.size() / 4) << "text is emitted as it arrives";
  EXPECT_LT(seconds, 20.0) << ids.size() << " tokens";
}

}  // namespace
}  // namespace deepinfer::recipe
