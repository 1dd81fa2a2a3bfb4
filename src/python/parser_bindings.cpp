// StreamOutputParser: the recipe's StreamParser fed one token id at a time. Each step returns a StepEvent with
// everything that token completed (reasoning text, content text, tool-call deltas and completed calls), so the
// per-token cost is one call and one small object.
#include <pybind11/stl.h>

#include <boost/json.hpp>

#include "bindings.h"
#include "deepinfer/recipe/stream_parser.h"

namespace deepinfer::python {
namespace {

namespace json = boost::json;
using Kind = recipe::StreamEvent::Kind;
using recipe::TokenId;

struct PyToolCall {
  recipe::ParsedToolCall call;
  int32_t index = 0;
};

struct PyStepEvent {
  std::vector<recipe::StreamEvent> events;
  std::vector<PyToolCall> completed;  // the calls whose kToolCallEnd is among `events`
  bool finished = false;              // the stream has ended (end-of-sequence token or finish())
};

struct PyParsedMessage {
  recipe::ParsedMessage message;
  int32_t malformed_tool_calls = 0;
};

struct PyStreamParser {
  PyStreamParser(std::shared_ptr<TokenizerHandle> tokenizer_in, recipe::PromptFormat format_in,
                 recipe::StreamParserOptions options)
      : tokenizer(std::move(tokenizer_in)), format(format_in), parser(format, tokenizer->tokenizer, options) {}

  std::shared_ptr<TokenizerHandle> tokenizer;
  recipe::PromptFormat format;
  recipe::StreamParser parser;
  bool finish_called = false;
};

// The same rule as the server's: a generated token id must lie in the tokenizer's vocabulary.
void check_token_id(const PyStreamParser& self, TokenId token_id) {
  const size_t vocab = self.tokenizer->tokenizer->vocab_size();
  if (token_id < 0 || static_cast<size_t>(token_id) >= vocab) {
    throw py::value_error("token id " + std::to_string(token_id) + " is outside the vocabulary [0, " +
                          std::to_string(vocab) + ")");
  }
}

std::string_view kind_name(Kind kind) {
  switch (kind) {
    case Kind::kReasoning:
      return "reasoning";
    case Kind::kContent:
      return "content";
    case Kind::kToolCallBegin:
      return "tool_call_begin";
    case Kind::kToolArguments:
      return "tool_arguments";
    case Kind::kToolCallEnd:
      return "tool_call_end";
  }
  return "unknown";
}

PyStepEvent complete(PyStreamParser& self, PyStepEvent event) {
  const recipe::ParsedMessage& message = self.parser.result();
  for (const recipe::StreamEvent& e : event.events) {
    if (e.kind == Kind::kToolCallEnd) event.completed.push_back({message.tool_calls.at(e.tool_index), e.tool_index});
  }
  event.finished = self.finish_called || message.ended_with_eos;
  return event;
}

// Appends `event`, merging it into the last one when both are text of one kind or arguments of one call.
void append_merged(std::vector<recipe::StreamEvent>& events, recipe::StreamEvent event) {
  if (!events.empty()) {
    recipe::StreamEvent& last = events.back();
    const bool text = event.kind == Kind::kReasoning || event.kind == Kind::kContent;
    const bool arguments = event.kind == Kind::kToolArguments && last.tool_index == event.tool_index;
    if (last.kind == event.kind && (text || arguments)) {
      last.text += event.text;
      return;
    }
  }
  events.push_back(std::move(event));
}

std::string joined_text(const PyStepEvent& self, bool reasoning, bool content) {
  std::string out;
  for (const recipe::StreamEvent& e : self.events) {
    if ((reasoning && e.kind == Kind::kReasoning) || (content && e.kind == Kind::kContent)) out += e.text;
  }
  return out;
}

bool has_kind(const PyStepEvent& self, Kind kind) {
  for (const recipe::StreamEvent& e : self.events) {
    if (e.kind == kind) return true;
  }
  return false;
}

json::object openai_tool_call(const PyToolCall& self) {
  return {{"id", self.call.id},
          {"type", "function"},
          {"function", {{"name", self.call.name}, {"arguments", self.call.arguments_text}}}};
}

py::str to_py(std::string_view text) { return py::str(text.data(), text.size()); }

}  // namespace

py::object new_stream_parser(std::shared_ptr<TokenizerHandle> tokenizer, recipe::PromptFormat format,
                             recipe::StreamParserOptions options) {
  return py::cast(std::make_unique<PyStreamParser>(std::move(tokenizer), format, options));
}

recipe::StreamParserOptions parser_options(bool starts_in_reasoning, bool tools_enabled, bool starts_in_tool_calls,
                                           bool json_output) {
  if (starts_in_tool_calls && !tools_enabled) {
    throw py::value_error(
        "starts_in_tool_calls (the prompt prefilled the tool-call block) needs tools=True: "
        "without tools the parser reads tool-call markup as text");
  }
  recipe::StreamParserOptions options;
  options.starts_in_reasoning = starts_in_reasoning;
  options.tools_enabled = tools_enabled;
  options.starts_in_tool_calls = starts_in_tool_calls;
  options.json_output = json_output;
  return options;
}

std::optional<json::object> tool_call_json(py::handle object) {
  if (!py::isinstance<PyToolCall>(object)) return std::nullopt;
  const PyToolCall& call = object.cast<const PyToolCall&>();
  // The parsed arguments object keeps the model's key order; a call whose arguments did not parse keeps its
  // text, which the OpenAI validator then rejects with the field's path.
  json::object out = openai_tool_call(call);
  if (!call.call.arguments.empty() || call.call.arguments_text.find_first_not_of(" \t\r\n") == std::string::npos) {
    out["function"].as_object()["arguments"] = call.call.arguments;
  }
  return out;
}

void bind_parser(py::module_& module) {
  py::class_<recipe::StreamEvent>(module, "StreamEvent",
                                  "One delta: kind 'reasoning' | 'content' (text), 'tool_call_begin' (tool_index, "
                                  "tool_id, tool_name), 'tool_arguments' (a JSON text fragment), 'tool_call_end'.")
      .def_property_readonly("kind", [](const recipe::StreamEvent& self) { return kind_name(self.kind); })
      .def_property_readonly("text", [](const recipe::StreamEvent& self) { return to_py(self.text); })
      .def_readonly("tool_index", &recipe::StreamEvent::tool_index)
      .def_readonly("tool_id", &recipe::StreamEvent::tool_id)
      .def_readonly("tool_name", &recipe::StreamEvent::tool_name)
      .def("__repr__", [](const recipe::StreamEvent& self) {
        std::string out = "StreamEvent(kind='" + std::string(kind_name(self.kind)) + "'";
        if (!self.text.empty()) out += ", text=" + py::repr(to_py(self.text)).cast<std::string>();
        if (self.tool_index >= 0) out += ", tool_index=" + std::to_string(self.tool_index);
        if (!self.tool_name.empty()) out += ", tool_name='" + self.tool_name + "'";
        return out + ")";
      });

  py::class_<PyToolCall>(module, "ToolCall",
                         "A tool call: one the model wrote (StreamOutputParser), or one built for an earlier "
                         "assistant turn: ToolCall(name, arguments, id=None) with arguments a dict or JSON text.")
      .def(py::init([](const std::string& name, py::handle arguments, std::optional<std::string> id) {
             PyToolCall out;
             out.call.name = name;
             out.call.id = id.value_or("");
             json::value value;
             if (PyUnicode_Check(arguments.ptr())) {
               boost::system::error_code ec;
               value = json::parse(arguments.cast<std::string>(), ec);
               if (ec) throw py::value_error("arguments is not valid JSON: " + ec.message());
             } else if (!arguments.is_none()) {
               value = to_json(arguments, "arguments");
             } else {
               value = json::object{};
             }
             if (!value.is_object()) throw py::value_error("arguments must be a JSON object");
             out.call.arguments = std::move(value.get_object());
             out.call.arguments_text = json::serialize(out.call.arguments);
             return out;
           }),
           py::arg("name"), py::arg("arguments") = py::none(), py::arg("id") = py::none())
      .def_property_readonly(
          "id", [](const PyToolCall& self) { return self.call.id; }, "Generated: \"call_<index>_<16 hex digits>\".")
      .def_property_readonly("name", [](const PyToolCall& self) { return self.call.name; })
      .def_property_readonly(
          "arguments", [](const PyToolCall& self) { return from_json(self.call.arguments); },
          "The arguments as a dict (empty when the model's JSON did not parse as an object).")
      .def_property_readonly(
          "arguments_text", [](const PyToolCall& self) { return to_py(self.call.arguments_text); },
          "The arguments exactly as streamed (JSON text).")
      .def_readonly("index", &PyToolCall::index, "0-based index of the call in the message.")
      .def(
          "to_openai", [](const PyToolCall& self) { return from_json(openai_tool_call(self)); },
          "{\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\": JSON text}}")
      .def(
          "to_anthropic",
          [](const PyToolCall& self) {
            return from_json(json::object{
                {"type", "tool_use"}, {"id", self.call.id}, {"name", self.call.name}, {"input", self.call.arguments}});
          },
          "{\"type\": \"tool_use\", \"id\", \"name\", \"input\": dict}")
      .def("__repr__", [](const PyToolCall& self) {
        return "ToolCall(index=" + std::to_string(self.index) + ", name='" + self.call.name +
               "', arguments=" + py::repr(to_py(self.call.arguments_text)).cast<std::string>() + ")";
      });

  py::class_<PyStepEvent>(module, "StepEvent",
                          "What one step (one token, or finish()) completed. Text that may still turn out to be "
                          "part of a marker (a partial </think>) or of a UTF-8 character is held back and comes "
                          "with a later step; nothing is ever retracted.")
      .def(
          "is_reasoning", [](const PyStepEvent& self) { return has_kind(self, Kind::kReasoning); },
          "This step produced reasoning text.")
      .def(
          "is_content", [](const PyStepEvent& self) { return has_kind(self, Kind::kContent); },
          "This step produced content text.")
      .def(
          "is_tool_call_started", [](const PyStepEvent& self) { return has_kind(self, Kind::kToolCallBegin); },
          "A tool call's header (its name) was read in this step.")
      .def(
          "is_tool_call_completed", [](const PyStepEvent& self) { return !self.completed.empty(); },
          "A tool call ended in this step: get_tool_call() returns it.")
      .def(
          "is_finished", [](const PyStepEvent& self) { return self.finished; },
          "The stream has ended (the end-of-sequence token, or finish()).")
      .def(
          "text", [](const PyStepEvent& self) { return to_py(joined_text(self, true, true)); },
          "The reasoning and content text of this step, in order. A step normally carries one kind only (the "
          "model writes </think> as one token); for a step that carries both, use .reasoning and .content.")
      .def_property_readonly("reasoning", [](const PyStepEvent& self) { return to_py(joined_text(self, true, false)); })
      .def_property_readonly("content", [](const PyStepEvent& self) { return to_py(joined_text(self, false, true)); })
      .def(
          "get_tool_call",
          [](const PyStepEvent& self) -> py::object {
            if (self.completed.empty()) return py::none();
            return py::cast(self.completed.front());
          },
          "The tool call completed in this step (the first, if several), or None.")
      .def_property_readonly(
          "tool_calls", [](const PyStepEvent& self) { return self.completed; },
          "Every tool call completed in this step.")
      .def_property_readonly(
          "events", [](const PyStepEvent& self) { return self.events; },
          "The fine-grained deltas (StreamEvent), in order: OpenAI streaming semantics, tool-call "
          "id and name first, then argument fragments.")
      .def("__bool__", [](const PyStepEvent& self) { return !self.events.empty(); })
      .def("__repr__", [](const PyStepEvent& self) {
        std::string out = "StepEvent([";
        for (size_t i = 0; i < self.events.size(); ++i) {
          out += (i ? ", " : "") + py::repr(py::cast(self.events[i])).cast<std::string>();
        }
        return out + "]" + (self.finished ? ", finished" : "") + ")";
      });

  py::class_<PyParsedMessage>(module, "ParsedMessage", "The whole assistant message parsed so far.")
      .def_property_readonly("reasoning", [](const PyParsedMessage& self) { return to_py(self.message.reasoning); })
      .def_property_readonly("content", [](const PyParsedMessage& self) { return to_py(self.message.content); })
      .def_property_readonly("tool_calls",
                             [](const PyParsedMessage& self) {
                               std::vector<PyToolCall> calls;
                               for (size_t i = 0; i < self.message.tool_calls.size(); ++i) {
                                 calls.push_back({self.message.tool_calls[i], static_cast<int32_t>(i)});
                               }
                               return calls;
                             })
      .def_property_readonly("ended_with_eos", [](const PyParsedMessage& self) { return self.message.ended_with_eos; })
      .def_readonly("malformed_tool_calls", &PyParsedMessage::malformed_tool_calls,
                    "Tool-call markup that could not be parsed (emitted as content, verbatim).")
      .def(
          "to_openai",
          [](const PyParsedMessage& self) {
            json::object message{{"role", "assistant"}};
            message["content"] = self.message.content.empty() && !self.message.tool_calls.empty()
                                     ? json::value(nullptr)
                                     : json::value(self.message.content);
            if (!self.message.reasoning.empty()) message["reasoning_content"] = self.message.reasoning;
            if (!self.message.tool_calls.empty()) {
              json::array calls;
              for (size_t i = 0; i < self.message.tool_calls.size(); ++i) {
                calls.push_back(openai_tool_call({self.message.tool_calls[i], static_cast<int32_t>(i)}));
              }
              message["tool_calls"] = std::move(calls);
            }
            return from_json(message);
          },
          "The OpenAI assistant message: role, content (None when only tool calls), reasoning_content, "
          "tool_calls.")
      .def("__repr__", [](const PyParsedMessage& self) {
        return "ParsedMessage(reasoning=" + std::to_string(self.message.reasoning.size()) +
               " bytes, content=" + std::to_string(self.message.content.size()) +
               " bytes, tool_calls=" + std::to_string(self.message.tool_calls.size()) + ")";
      });

  py::class_<PyStreamParser>(
      module, "StreamOutputParser",
      "Incremental parser of a DeepSeek model's output token ids into reasoning, content and tool calls "
      "(C++ state machine per prompt format). One per generated sequence; not thread-safe.\n\n"
      "StreamOutputParser(tokenizer_model=None, *, format=None, starts_in_reasoning=None, tools=True, "
      "starts_in_tool_calls=False, json_output=False): tokenizer_model and format resolve as in "
      "Conversation.render_for_engine. starts_in_reasoning: the prompt ended inside a reasoning block (thinking "
      "mode); None means only for deepseek-r1, whose prompt always opens it. Output that itself begins with "
      "<think> opens reasoning either way. tools: recognise tool-call markup (else it is content). "
      "starts_in_tool_calls: the prompt prefilled the tool-call block's opener (tool_choice required or named on "
      "the DSML formats), so the output starts inside the block; needs tools (else ValueError). json_output: the "
      "request asked for JSON (response_format): content keeps only the JSON text. RenderedInput.stream_parser() "
      "sets all of these from the prompt.")
      .def(py::init([](py::handle tokenizer_model, py::handle format, std::optional<bool> starts_in_reasoning,
                       bool tools, bool starts_in_tool_calls, bool json_output) {
             recipe::StreamParserOptions options =
                 parser_options(starts_in_reasoning.value_or(false), tools, starts_in_tool_calls, json_output);
             ModelChoice choice = resolve_model(tokenizer_model, format);
             return std::make_unique<PyStreamParser>(std::move(choice.tokenizer), choice.format, options);
           }),
           py::arg("tokenizer_model") = py::none(), py::kw_only(), py::arg("format") = py::none(),
           py::arg("starts_in_reasoning") = py::none(), py::arg("tools") = true,
           py::arg("starts_in_tool_calls") = false, py::arg("json_output") = false)
      .def(
          "step",
          [](PyStreamParser& self, TokenId token_id) {
            check_token_id(self, token_id);
            PyStepEvent event;
            self.parser.push(token_id, event.events);
            return complete(self, std::move(event));
          },
          py::arg("token_id"),
          "Feeds one generated token id. The end-of-sequence token ends the message (it is not content) and "
          "flushes what was held back; tokens after it are ignored.")
      .def(
          "feed",
          [](PyStreamParser& self, const std::vector<TokenId>& token_ids) {
            PyStepEvent event;
            std::vector<recipe::StreamEvent> scratch;
            for (TokenId id : token_ids) check_token_id(self, id);
            for (TokenId id : token_ids) {
              scratch.clear();
              self.parser.push(id, scratch);
              for (recipe::StreamEvent& e : scratch) append_merged(event.events, std::move(e));
            }
            return complete(self, std::move(event));
          },
          py::arg("token_ids"),
          "Feeds several ids (a list or an int array) and returns all they completed, adjacent text and "
          "argument deltas merged.")
      .def(
          "finish",
          [](PyStreamParser& self, bool cut_off) {
            PyStepEvent event;
            self.parser.finish(event.events, cut_off);
            self.finish_called = true;
            return complete(self, std::move(event));
          },
          py::arg("cut_off") = false,
          "End of generation without the end-of-sequence token (length limit, stop string): flushes what was "
          "held back. cut_off=True when the length limit ended it: tool-call markup cut short is dropped (a call "
          "whose name was read keeps the arguments so far) instead of coming back as content, as the server "
          "does at finish_reason \"length\".")
      .def(
          "result",
          [](const PyStreamParser& self) {
            return PyParsedMessage{self.parser.result(), self.parser.malformed_tool_calls()};
          },
          "The message so far (complete once finished).")
      .def_property_readonly("format", [](const PyStreamParser& self) { return recipe::format_name(self.format); })
      .def_property_readonly(
          "finished",
          [](const PyStreamParser& self) { return self.finish_called || self.parser.result().ended_with_eos; })
      .def("__repr__", [](const PyStreamParser& self) {
        return "StreamOutputParser(format='" + std::string(recipe::format_name(self.format)) + "')";
      });
}

}  // namespace deepinfer::python
