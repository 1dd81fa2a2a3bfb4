// DeepSeek-V3.2, V4 and V4.1 prompt formats, written from DeepSeek's reference encoders
// (encoding_dsv32.py, encoding_dsv4.py, encoding_dsv41.py): tool calls in DSML text, thinking markers after
// each user turn, reasoning dropped from turns before the last user message.
//   V3.2: tool results follow the call as `<function_results><result>...</result></function_results>`.
//   V4:   no tool role: results merge into the next user turn as `<tool_result>...</tool_result>` blocks,
//         sorted by call order; consecutive user turns merge; history reasoning is kept when tools exist;
//         `reasoning_effort: max` adds a preamble.
//   V4.1: V4 with leading-space DSML names, `<｜System｜>`, numeric reasoning effort and image placeholders.
// Tools (and response_format) are attached to the first message when it is a system message, else to a
// synthetic empty system message put in front (what the goldens and vLLM do). Every `｜DSML｜` the template
// writes is a control segment (one added token in V4's tokenizers); tool_choice required or named prefills
// the tool-call block after the generation prompt, as deepseek-recipe does (renderer.h).
#include <algorithm>
#include <array>
#include <map>
#include <string>

#include "deepinfer/recipe/python_json.h"
#include "prompt_builder.h"

namespace deepinfer::recipe {
namespace {

constexpr std::string_view kSystemToken = "<｜System｜>";
constexpr std::string_view kLatestReminderToken = "<｜latest_reminder｜>";
constexpr std::string_view kImagePlaceholder = "<｜deepseek_image｜>";

constexpr std::string_view kV32ToolsTemplate =
    "## Tools\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    "You can invoke functions by writing a \"<｜DSML｜function_calls>\" block like the following as part of "
    "your reply to the user:\n"
    "<｜DSML｜function_calls>\n"
    "<｜DSML｜invoke name=\"$FUNCTION_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$FUNCTION_NAME2\">\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜function_calls>\n"
    "String and scalar parameters should be specified as is without any escaping or quotes, while lists and "
    "objects should use JSON format. The \"string\" attribute should be set to \"true\" for string type "
    "parameters and \"false\" for other types (numbers, booleans, arrays, objects).\n"
    "If the thinking_mode is enabled, then after function results you should strongly consider outputting a "
    "thinking block. Here is an example:\n"
    "<｜DSML｜function_calls>\n"
    "...\n"
    "</｜DSML｜function_calls>\n"
    "<function_results>\n"
    "...\n"
    "</function_results>\n"
    "<think>...thinking about results</think>\n"
    "Here are the functions available in JSONSchema format:\n"
    "<functions>\n";
constexpr std::string_view kV32ToolsEnd = "\n</functions>\n";

// V4 and V4.1 share one text; `{B}`, `{I}`, `{P}` stand for the block, invoke and parameter tag names.
constexpr std::string_view kV4ToolsTemplate =
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    "\"<｜DSML｜{B}>\" block like the following:\n\n"
    "<｜DSML｜{B}>\n"
    "<｜DSML｜{I} name=\"$TOOL_NAME\">\n"
    "<｜DSML｜{P} name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜{P}>\n"
    "...\n"
    "</｜DSML｜{I}>\n"
    "<｜DSML｜{I} name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜{I}>\n"
    "</｜DSML｜{B}>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n";
constexpr std::string_view kV4ToolsEnd =
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

constexpr std::string_view kResponseFormatTemplate =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

// The preview's `max` preamble; the 0731 revision's `high`.
constexpr std::string_view kV4EffortMax =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";
// The 0731 revision's `max` (and `xhigh`) preamble (U+2014 em dash).
constexpr std::string_view kV4EffortBeyondMax =
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n";

struct Dialect {
  PromptFormat format;
  std::string_view block;      // DSML tool-calls block name
  std::string_view invoke;     // DSML invoke tag name
  std::string_view parameter;  // DSML parameter tag name
  std::vector<std::string_view> plain_text_markers;
  bool merges_tool_results;  // V4+: tool results become <tool_result> blocks of a user turn
  bool system_token;         // V4.1: <｜System｜>, and a later system message opens an answer
};

const Dialect& dialect_of(PromptFormat format) {
  static const Dialect v32{PromptFormat::kDeepSeekV32, "function_calls", "invoke", "parameter",
                           {"｜DSML｜", "<function_results>", "</function_results>", "<result>", "</result>"},
                           false, false};
  static const Dialect v4{PromptFormat::kDeepSeekV4, "tool_calls", "invoke", "parameter",
                          {"｜DSML｜", "<tool_result>", "</tool_result>"}, true, false};
  static const Dialect v41{PromptFormat::kDeepSeekV41, " calls", " invoke", " parameter",
                           {"｜DSML｜", "<tool_result>", "</tool_result>", kImagePlaceholder}, true, true};
  switch (format) {
    case PromptFormat::kDeepSeekV32: return v32;
    case PromptFormat::kDeepSeekV4: return v4;
    default: return v41;
  }
}

// One piece of a user turn after tool results are merged in (V4+), or a whole message (V3.2).
struct Block {
  const Message* message;  // text of this message (user) or its result (tool)
  bool is_tool_result;
};

// A message as the encoders see it after their preprocessing.
struct Turn {
  Role role;
  const Message* message = nullptr;  // null for the synthetic system message that only carries tools
  std::vector<Block> blocks;         // V4+ user turns
  bool keep_reasoning = true;
  bool carries_tools = false;
  size_t source_index = 0;  // for error messages
};

std::string path_of(size_t index) { return "messages[" + std::to_string(index) + "]"; }

// The plain-text marker rule (renderer.h): without the DSML token, request text may not contain the format's
// text markers.
Status check_markers(std::string_view text, const Dialect& dialect, const std::string& where) {
  for (std::string_view marker : dialect.plain_text_markers) {
    if (text.find(marker) != std::string_view::npos) {
      return Status::invalid_argument(where + " contains '" + std::string(marker) + "', which " +
                                      std::string(format_name(dialect.format)) +
                                      " writes as plain text to mark its structure; with a tokenizer that has no "
                                      "'｜DSML｜' token (DeepSeek-V4's has one) request text may not contain it, "
                                      "since the model could not tell it from the prompt's own markup");
    }
  }
  return Status();
}

Status check_conversation(const Conversation& conversation, const Dialect& dialect, RenderOptions options) {
  for (size_t i = 0; i < conversation.messages.size(); ++i) {
    const Message& message = conversation.messages[i];
    std::string path = path_of(i);
    for (const ContentPart& part : message.content) {
      if (part.kind == ContentPart::Kind::kImage && dialect.format != PromptFormat::kDeepSeekV41) {
        return Status::invalid_argument(path + ".content has an image; " + std::string(format_name(dialect.format)) +
                                        " has no image input (deepseek-v4.1 has)");
      }
      if (options.dsml_token) continue;
      if (Status s = check_markers(part.text, dialect, path + ".content"); !s.ok()) return s;
    }
    if (options.dsml_token) continue;
    if (message.reasoning_content) {
      if (Status s = check_markers(*message.reasoning_content, dialect, path + ".reasoning_content"); !s.ok()) return s;
    }
    for (size_t c = 0; c < message.tool_calls.size(); ++c) {
      std::string call_path = path + ".tool_calls[" + std::to_string(c) + "].function";
      if (Status s = check_markers(message.tool_calls[c].name, dialect, call_path + ".name"); !s.ok()) return s;
      for (const auto& [key, value] : message.tool_calls[c].arguments) {
        std::string arg_path = call_path + ".arguments." + std::string(key);
        if (Status s = check_markers(key, dialect, arg_path); !s.ok()) return s;
        if (value.is_string()) {
          if (Status s = check_markers(value.get_string(), dialect, arg_path); !s.ok()) return s;
        }
      }
    }
  }
  return Status();
}

class DsmlRenderer {
 public:
  DsmlRenderer(const Conversation& conversation, const Dialect& dialect, RenderOptions options)
      : conversation_(conversation), dialect_(dialect), options_(options), thinking_(conversation.options.thinking) {}

  Result<RenderedPrompt> render() {
    if (Status s = check_conversation(conversation_, dialect_, options_); !s.ok()) return s;
    if (Status s = resolve_effort(); !s.ok()) return s;
    build_turns();
    if (dialect_.merges_tool_results) sort_tool_results();
    // History reasoning: V3.2 always drops it before the last user turn (thinking mode); V4+ keep it when
    // the request has tools.
    drop_thinking_ = !(dialect_.merges_tool_results && !conversation_.tools.empty());
    if (thinking_ && drop_thinking_) drop_history_reasoning();
    last_user_ = last_user_index();

    out_.control(kBos);
    for (size_t i = 0; i < turns_.size(); ++i) {
      if (Status s = render_turn(i); !s.ok()) return s;
    }
    // tool_choice required or named: the answer starts inside the tool-call block (check_capabilities refused
    // it with thinking on).
    const bool prefill = answer_opened_ && conversation_.tool_choice.mode != ToolChoice::Mode::kAuto;
    if (prefill) {
      out_.fixed("\n\n<");
      out_.control(kDsml);
      out_.fixed(std::string(dialect_.block) + ">\n");
    }
    RenderedPrompt prompt = std::move(out_).finish();
    prompt.opens_tool_calls = prefill;
    // A named function: the answer begins with its invoke header, written as put_tool_calls writes a call. So does
    // "required" with one tool, the only function it can mean (a break-it pass: the demo model, offered one tool,
    // called another it knew from training).
    const bool one_tool =
        conversation_.tool_choice.mode == ToolChoice::Mode::kRequired && conversation_.tools.size() == 1;
    auto invoke_header = [&](const std::string& name) {
      PromptBuilder header;
      header.fixed("<");
      header.control(kDsml);
      header.fixed(dialect_.invoke);
      header.fixed(" name=\"");
      header.content(name);
      header.fixed("\">\n");
      return std::move(header).finish().segments;
    };
    if (prefill && (conversation_.tool_choice.mode == ToolChoice::Mode::kNamed || one_tool)) {
      prompt.answer_prefix =
          invoke_header(one_tool ? conversation_.tools.front().name : conversation_.tool_choice.name);
    } else if (prefill && conversation_.tool_choice.mode == ToolChoice::Mode::kRequired) {
      // Several tools: the call names one of them (the model chooses which). Without this a model called a tool it
      // knew from training that the request did not offer.
      for (const auto& tool : conversation_.tools) prompt.answer_prefix_choices.push_back(invoke_header(tool.name));
    }
    return prompt;
  }

 private:
  bool is_user_like(size_t i) const {
    Role role = turns_[i].role;
    return role == Role::kUser || role == Role::kDeveloper ||
           (dialect_.system_token && role == Role::kSystem && i > 0);
  }

  size_t last_user_index() const {
    for (size_t i = turns_.size(); i-- > 0;) {
      if (is_user_like(i)) return i;
    }
    return kNone;
  }

  Status resolve_effort() {
    const std::optional<std::string>& effort = conversation_.options.reasoning_effort;
    if (dialect_.format == PromptFormat::kDeepSeekV41) {
      std::string value = effort.value_or("high");
      static const std::map<std::string, int, std::less<>> kNamed = {
          {"low", 25}, {"medium", 50}, {"high", 50}, {"xhigh", 75}, {"max", 100}};
      if (auto it = kNamed.find(value); it != kNamed.end()) {
        effort_budget_ = it->second;
      } else {
        int budget = 0;
        bool digits = !value.empty() && value.size() <= 3 &&
                      std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; });
        if (digits) budget = std::stoi(value);
        if (!digits || budget < 1 || budget > 100) {
          return Status::invalid_argument("reasoning_effort '" + value +
                                          "' is not valid for deepseek-v4.1: use an integer 1-100 or low, "
                                          "medium, high, xhigh, max");
        }
        effort_budget_ = budget;
      }
      return Status();
    }
    if (dialect_.format == PromptFormat::kDeepSeekV4 && conversation_.options.v4_revision == V4Revision::kPreview &&
        effort) {
      if (*effort == "max") {
        effort_preamble_ = kV4EffortMax;
      } else if (*effort != "high" && *effort != "medium" && *effort != "low") {
        return Status::invalid_argument("reasoning_effort '" + *effort +
                                        "' is not valid for deepseek-v4 (preview revision): use low, medium, high or max");
      }
    }
    if (dialect_.format == PromptFormat::kDeepSeekV4 && conversation_.options.v4_revision == V4Revision::k0731 &&
        effort) {
      if (*effort == "high") {
        effort_preamble_ = kV4EffortMax;
      } else if (*effort == "max" || *effort == "xhigh") {
        effort_preamble_ = kV4EffortBeyondMax;
      } else if (*effort != "low") {
        return Status::invalid_argument("reasoning_effort '" + *effort +
                                        "' is not valid for deepseek-v4 (0731 revision): use low, high, xhigh or max");
      }
    }
    return Status();  // V3.2 has no effort control; the option is ignored.
  }

  void build_turns() {
    const auto& messages = conversation_.messages;
    bool attach_to_first = !messages.empty() && messages[0].role == Role::kSystem;
    bool needs_carrier = !conversation_.tools.empty() || conversation_.options.response_format.has_value();
    if (needs_carrier && !attach_to_first) turns_.push_back({Role::kSystem, nullptr, {}, true, true, 0});
    for (size_t i = 0; i < messages.size(); ++i) {
      const Message& message = messages[i];
      bool carries = needs_carrier && attach_to_first && i == 0;
      if (!dialect_.merges_tool_results) {
        turns_.push_back({message.role, &message, {}, true, carries, i});
        continue;
      }
      bool into_previous = !turns_.empty() && turns_.back().role == Role::kUser && !turns_.back().blocks.empty();
      if (message.role == Role::kTool || message.role == Role::kUser) {
        Block block{&message, message.role == Role::kTool};
        if (into_previous) {
          turns_.back().blocks.push_back(block);
        } else {
          turns_.push_back({Role::kUser, &message, {block}, true, false, i});
        }
        continue;
      }
      turns_.push_back({message.role, &message, {}, true, carries, i});
    }
  }

  // V4+: within a user turn, tool results follow the order of the calls of the last assistant turn.
  void sort_tool_results() {
    std::map<std::string, size_t, std::less<>> call_order;
    for (Turn& turn : turns_) {
      if (turn.role == Role::kAssistant && turn.message != nullptr && !turn.message->tool_calls.empty()) {
        call_order.clear();
        for (size_t i = 0; i < turn.message->tool_calls.size(); ++i) {
          if (!turn.message->tool_calls[i].id.empty()) call_order[turn.message->tool_calls[i].id] = i;
        }
        continue;
      }
      if (turn.role != Role::kUser || call_order.empty()) continue;
      std::vector<Block> results;
      for (const Block& block : turn.blocks) {
        if (block.is_tool_result) results.push_back(block);
      }
      if (results.size() < 2) continue;
      auto order = [&](const Block& block) {
        auto it = call_order.find(block.message->tool_call_id);
        return it == call_order.end() ? size_t{0} : it->second;
      };
      std::stable_sort(results.begin(), results.end(),
                       [&](const Block& a, const Block& b) { return order(a) < order(b); });
      size_t next = 0;
      for (Block& block : turn.blocks) {
        if (block.is_tool_result) block = results[next++];
      }
    }
  }

  void drop_history_reasoning() {
    size_t last_user = last_user_index();
    if (last_user == kNone) return;
    std::vector<Turn> kept;
    for (size_t i = 0; i < turns_.size(); ++i) {
      Turn turn = turns_[i];
      if (i < last_user) {
        if (turn.role == Role::kAssistant) {
          turn.keep_reasoning = false;
        } else if (turn.role == Role::kDeveloper && dialect_.merges_tool_results) {
          continue;  // V4+ drop developer turns before the last user turn
        }
      }
      kept.push_back(std::move(turn));
    }
    turns_ = std::move(kept);
  }

  // Message text; in V4.1 each image becomes the image placeholder token.
  void put_text(const Message& message) {
    std::string_view separator = dialect_.merges_tool_results ? "\n\n" : "\n";
    bool first = true;
    for (const ContentPart& part : message.content) {
      if (!first) out_.fixed(separator);
      first = false;
      if (part.kind == ContentPart::Kind::kImage) {
        out_.control(kImagePlaceholder);
      } else {
        out_.content(part.text);
      }
    }
  }

  void put_tools_and_format(const Turn& turn) {
    if (!turn.carries_tools) return;
    bool v32 = dialect_.format == PromptFormat::kDeepSeekV32;
    if (!conversation_.tools.empty()) {
      out_.fixed("\n\n");
      std::string tools_text(v32 ? kV32ToolsTemplate : kV4ToolsTemplate);
      if (!v32) {
        replace_all(tools_text, "{B}", dialect_.block);
        replace_all(tools_text, "{I}", dialect_.invoke);
        replace_all(tools_text, "{P}", dialect_.parameter);
      }
      fixed_with_markers(tools_text);
      // A named tool_choice shows the model only that function, as deepseek-recipe does.
      const ToolChoice& choice = conversation_.tool_choice;
      bool first = true;
      for (const ToolDefinition& tool : conversation_.tools) {
        if (choice.mode == ToolChoice::Mode::kNamed && tool.name != choice.name) continue;
        if (!first) out_.fixed("\n");
        first = false;
        out_.content(python_json(tool.function));
      }
      out_.fixed(v32 ? kV32ToolsEnd : kV4ToolsEnd);
    }
    if (conversation_.options.response_format) {
      out_.fixed("\n\n");
      out_.fixed(kResponseFormatTemplate);
      out_.content(python_json(*conversation_.options.response_format));
    }
  }

  // Template text that mentions <think>, </think> or ｜DSML｜: those are control tokens in the tokenizers that
  // have them, exactly as when the reference tokenizes the whole rendered string.
  void fixed_with_markers(std::string_view text) {
    static constexpr std::array<std::string_view, 3> kMarkers = {kThinkStart, kThinkEnd, kDsml};
    while (!text.empty()) {
      size_t at = std::string_view::npos;
      std::string_view marker;
      for (std::string_view candidate : kMarkers) {
        size_t position = text.find(candidate);
        if (position < at) {
          at = position;
          marker = candidate;
        }
      }
      if (at == std::string_view::npos) {
        out_.fixed(text);
        return;
      }
      out_.fixed(text.substr(0, at));
      out_.control(marker);
      text.remove_prefix(at + marker.size());
    }
  }

  // One DSML tag: `<｜DSML｜NAME` (`</｜DSML｜NAME` when closing), the marker a control segment.
  void dsml_tag(bool closing, std::string_view name) {
    out_.fixed(closing ? "</" : "<");
    out_.control(kDsml);
    out_.fixed(name);
  }

  void put_tool_calls(const Message& message) {
    if (message.tool_calls.empty()) return;
    out_.fixed("\n\n");
    dsml_tag(false, dialect_.block);
    out_.fixed(">\n");
    for (size_t c = 0; c < message.tool_calls.size(); ++c) {
      const ToolCall& call = message.tool_calls[c];
      if (c > 0) out_.fixed("\n");
      dsml_tag(false, dialect_.invoke);
      out_.fixed(" name=\"");
      out_.content(call.name);
      out_.fixed("\">\n");
      bool first = true;
      for (const auto& [key, value] : call.arguments) {
        if (!first) out_.fixed("\n");
        first = false;
        dsml_tag(false, dialect_.parameter);
        out_.fixed(" name=\"");
        out_.content(key);
        out_.fixed(value.is_string() ? "\" string=\"true\">" : "\" string=\"false\">");
        out_.content(value.is_string() ? std::string(value.get_string()) : python_json(value));
        dsml_tag(true, dialect_.parameter);
        out_.fixed(">");
      }
      out_.fixed("\n");
      dsml_tag(true, dialect_.invoke);
      out_.fixed(">");
    }
    out_.fixed("\n");
    dsml_tag(true, dialect_.block);
    out_.fixed(">");
  }

  void put_assistant(const Turn& turn, size_t index) {
    const Message& message = *turn.message;
    bool after_last_user = last_user_ == kNone || index > last_user_;
    bool with_reasoning = thinking_ && (after_last_user || (dialect_.merges_tool_results && !drop_thinking_));
    if (with_reasoning) {
      if (turn.keep_reasoning && message.reasoning_content) out_.content(*message.reasoning_content);
      out_.control(kThinkEnd);
    }
    out_.content(message.text(dialect_.merges_tool_results ? "\n\n" : "\n"));
    put_tool_calls(message);
    out_.control(kEos);
  }

  void put_think_opener(bool open) { out_.control(open ? kThinkStart : kThinkEnd); }

  Status render_turn_v32(size_t i) {
    const Turn& turn = turns_[i];
    bool last = i + 1 == turns_.size();
    switch (turn.role) {
      case Role::kSystem:
        if (turn.message != nullptr) put_text(*turn.message);
        put_tools_and_format(turn);
        return Status();
      case Role::kDeveloper:
      case Role::kUser:
      case Role::kLatestReminder: {
        out_.control(kUser);
        if (turn.role == Role::kDeveloper) {
          put_tools_and_format(turn);
          out_.fixed("\n\n# The user's message is: ");
        }
        put_text(*turn.message);
        PromptBuilder::Mark mark = out_.mark();
        out_.control(kAssistant);
        put_think_opener(i == last_user_ && thinking_);
        if (last && !conversation_.options.add_generation_prompt) out_.truncate(mark);
        answer_opened_ = last && conversation_.options.add_generation_prompt;
        return Status();
      }
      case Role::kTool: {
        size_t assistant = i;
        while (assistant > 0 && turns_[assistant - 1].role == Role::kTool) --assistant;
        if (assistant == 0 || turns_[assistant - 1].role != Role::kAssistant) {
          return Status::invalid_argument(path_of(turn.source_index) +
                                          " is a tool result that does not follow an assistant message with tool_calls");
        }
        const Message& call_message = *turns_[assistant - 1].message;
        size_t order = i - assistant + 1;
        if (order > call_message.tool_calls.size()) {
          return Status::invalid_argument(path_of(turn.source_index) + " is tool result " + std::to_string(order) +
                                          " but the assistant message before it made " +
                                          std::to_string(call_message.tool_calls.size()) + " tool call(s)");
        }
        if (order == 1) out_.fixed("\n\n<function_results>");
        out_.fixed("\n<result>");
        put_text(*turn.message);
        out_.fixed("</result>");
        if (order == call_message.tool_calls.size()) {
          out_.fixed("\n</function_results>");
          PromptBuilder::Mark mark = out_.mark();
          out_.fixed("\n\n");
          put_think_opener(thinking_ && (last_user_ == kNone || i >= last_user_));
          if (last && !conversation_.options.add_generation_prompt) out_.truncate(mark);
          answer_opened_ = last && conversation_.options.add_generation_prompt;
        }
        return Status();
      }
      case Role::kAssistant:
        put_assistant(turn, i);
        return Status();
    }
    return Status();
  }

  Status render_turn_v4(size_t i) {
    const Turn& turn = turns_[i];
    if (i == 0) {
      bool has_effort = thinking_ && (!effort_preamble_.empty() || effort_budget_ > 0);
      if (dialect_.system_token && (has_effort || turn.role == Role::kSystem)) out_.control(kSystemToken);
      if (has_effort && !effort_preamble_.empty()) out_.fixed(effort_preamble_);
      if (has_effort && effort_budget_ > 0) {
        out_.fixed("Reasoning Effort: " + std::to_string(effort_budget_) +
                   " (range 1-100, the higher the value, the more thorough the reasoning)\n\n");
      }
    }
    switch (turn.role) {
      case Role::kSystem:
        if (dialect_.system_token && i > 0) out_.control(kSystemToken);
        if (turn.message != nullptr) put_text(*turn.message);
        put_tools_and_format(turn);
        break;
      case Role::kDeveloper:
        out_.control(kUser);
        put_text(*turn.message);
        put_tools_and_format(turn);
        break;
      case Role::kUser:
        out_.control(kUser);
        for (size_t b = 0; b < turn.blocks.size(); ++b) {
          if (b > 0) out_.fixed("\n\n");
          if (turn.blocks[b].is_tool_result) out_.fixed("<tool_result>");
          put_text(*turn.blocks[b].message);
          if (turn.blocks[b].is_tool_result) out_.fixed("</tool_result>");
        }
        break;
      case Role::kLatestReminder:
        out_.control(kLatestReminderToken);
        put_text(*turn.message);
        break;
      case Role::kTool:  // merged into user turns by build_turns()
        break;
      case Role::kAssistant:
        put_assistant(turn, i);
        break;
    }
    // The answer opener goes after a user-like turn that is last or followed by the assistant.
    bool last = i + 1 == turns_.size();
    if (!last && turns_[i + 1].role != Role::kAssistant && turns_[i + 1].role != Role::kLatestReminder) {
      return Status();
    }
    if (!is_user_like(i)) return Status();
    if (last && !conversation_.options.add_generation_prompt) return Status();
    out_.control(kAssistant);
    put_think_opener(thinking_ && (!drop_thinking_ || i >= last_user_));
    answer_opened_ = last;
    return Status();
  }

  Status render_turn(size_t i) { return dialect_.merges_tool_results ? render_turn_v4(i) : render_turn_v32(i); }

  static void replace_all(std::string& text, std::string_view from, std::string_view to) {
    for (size_t pos = text.find(from); pos != std::string::npos; pos = text.find(from, pos + to.size())) {
      text.replace(pos, from.size(), to);
    }
  }

  static constexpr size_t kNone = static_cast<size_t>(-1);
  const Conversation& conversation_;
  const Dialect& dialect_;
  const RenderOptions options_;
  const bool thinking_;
  bool answer_opened_ = false;  // the prompt ends with the generation prompt (the answer's opener)
  bool drop_thinking_ = true;
  std::string_view effort_preamble_;  // V4: the effort preamble of message 0 in thinking mode, or empty
  int effort_budget_ = 0;
  size_t last_user_ = kNone;
  std::vector<Turn> turns_;
  PromptBuilder out_;
};

}  // namespace

Result<RenderedPrompt> render_dsml(const Conversation& conversation, PromptFormat format, RenderOptions options) {
  return DsmlRenderer(conversation, dialect_of(format), options).render();
}

}  // namespace deepinfer::recipe
