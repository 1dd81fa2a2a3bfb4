// Conversation (builder, from_openai, from_anthropic) and RenderedInput. Every message and tool goes through
// the recipe's OpenAI validators (message_from_openai, tool_from_openai), so the builder accepts and rejects
// exactly what an OpenAI payload would, with the same messages.
#include <pybind11/stl.h>

#include <boost/json.hpp>
#include <mutex>
#include <optional>

#include "bindings.h"
#include "deepinfer/recipe/anthropic_request.h"
#include "deepinfer/recipe/openai_request.h"
#include "deepinfer/recipe/responses_request.h"

namespace deepinfer::python {
namespace {

namespace json = boost::json;
using recipe::TokenId;

// Rendering runs with the GIL released; `mu` keeps other Python threads from changing the conversation
// meanwhile. Every method takes it (uncontended, it costs nanoseconds).
struct PyConversation {
  recipe::Conversation conversation;
  std::mutex mu;
};

struct PyRenderedInput {
  std::string text;
  std::shared_ptr<const std::vector<TokenId>> ids;
  recipe::PromptFormat format = recipe::PromptFormat::kDeepSeekV3;
  std::shared_ptr<TokenizerHandle> tokenizer;
  // How to parse the answer to this prompt, as the server decides it (recipe::stream_parser_options): reasoning
  // first, inside a prefilled tool-call block, tools recognised, JSON output.
  recipe::StreamParserOptions parser_options;
  py::object token_list_cache;  // `token_ids`, built on first access
  py::object text_cache;
};

void append_message(PyConversation& self, const json::value& message) {
  std::lock_guard lock(self.mu);
  const std::string path = "messages[" + std::to_string(self.conversation.messages.size()) + "]";
  self.conversation.messages.push_back(unwrap(recipe::message_from_openai(message, path)));
}

// A message of `role` whose content is a str or a list of OpenAI content parts.
void add_simple_message(PyConversation& self, std::string_view role, py::handle content) {
  json::object message{{"role", role}};
  message["content"] = to_json(content, "content");
  append_message(self, message);
}

json::value tool_calls_json(py::handle tool_calls) {
  if (!PyList_Check(tool_calls.ptr()) && !PyTuple_Check(tool_calls.ptr())) {
    throw py::type_error("tool_calls must be a list of OpenAI tool calls or ToolCall objects");
  }
  json::array calls;
  py::sequence list = py::reinterpret_borrow<py::sequence>(tool_calls);
  for (size_t i = 0; i < list.size(); ++i) {
    py::object item = list[i];
    if (std::optional<json::object> parsed = tool_call_json(item)) {
      calls.push_back(std::move(*parsed));
    } else {
      calls.push_back(to_json(item, "tool_calls[" + std::to_string(i) + "]"));
    }
  }
  return calls;
}

std::unique_ptr<PyConversation> from_conversation(recipe::Conversation conversation) {
  auto out = std::make_unique<PyConversation>();
  out->conversation = std::move(conversation);
  return out;
}

// The OpenAI Chat Completions message a recipe message reads back as (content null, a string for one text part,
// else parts), so that message_from_openai(message_json(m)) == m.
json::object message_json(const recipe::Message& message) {
  json::object out{{"role", recipe::role_name(message.role)}};
  if (message.content_is_null) {
    out["content"] = nullptr;
  } else if (message.content.size() == 1 && message.content[0].kind == recipe::ContentPart::Kind::kText) {
    out["content"] = message.content[0].text;
  } else {
    json::array parts;
    for (const recipe::ContentPart& part : message.content) {
      if (part.kind == recipe::ContentPart::Kind::kText) {
        parts.push_back({{"type", "text"}, {"text", part.text}});
      } else {
        parts.push_back({{"type", "image_url"}, {"image_url", {{"url", part.image_url}}}});
      }
    }
    out["content"] = std::move(parts);
  }
  if (message.reasoning_content) out["reasoning_content"] = *message.reasoning_content;
  if (!message.tool_calls.empty()) {
    json::array calls;
    for (const recipe::ToolCall& call : message.tool_calls) {
      calls.push_back({{"id", call.id},
                       {"type", "function"},
                       {"function", {{"name", call.name}, {"arguments", json::serialize(call.arguments)}}}});
    }
    out["tool_calls"] = std::move(calls);
  }
  if (!message.tool_call_id.empty()) out["tool_call_id"] = message.tool_call_id;
  if (!message.name.empty()) out["name"] = message.name;
  if (message.prefix) out["prefix"] = true;
  return out;
}

// A message or tool given to the Conversation constructor: an object with to_openai() (deepseek-recipe's
// message and tool classes) or an OpenAI dict.
json::value openai_item(py::handle item, const std::string& path) {
  if (py::hasattr(item, "to_openai")) return to_json(item.attr("to_openai")(), path);
  return to_json(item, path);
}

py::object compat_module() { return py::module_::import("deepseek_recipe._compat"); }

template <class Parse>
std::unique_ptr<PyConversation> parse_payload(py::handle payload, Parse parse) {
  json::value request = payload_to_json(payload);
  std::optional<Result<recipe::Conversation>> conversation;
  {
    py::gil_scoped_release release;
    conversation.emplace(parse(request));
  }
  return from_conversation(unwrap(std::move(*conversation)));
}

std::unique_ptr<PyRenderedInput> render_for_engine(PyConversation& self, py::handle tokenizer_model,
                                                   std::optional<bool> add_generation_prompt, py::handle format) {
  ModelChoice choice = resolve_model(tokenizer_model, format);
  auto rendered = std::make_unique<PyRenderedInput>();
  std::optional<Result<recipe::RenderedPrompt>> prompt;
  {
    py::gil_scoped_release release;
    std::lock_guard lock(self.mu);
    recipe::ConversationOptions& options = self.conversation.options;
    const bool saved = options.add_generation_prompt;
    if (add_generation_prompt) options.add_generation_prompt = *add_generation_prompt;
    // render_and_tokenize renders with render_options_for(tokenizer), as the server does: marker text in request
    // text is ordinary text when the tokenizer has the ｜DSML｜ token, an error naming the field when it has not.
    prompt.emplace(recipe::render_and_tokenize(self.conversation, choice.format, *choice.tokenizer->tokenizer));
    options.add_generation_prompt = saved;
    if (prompt->ok()) rendered->parser_options = recipe::stream_parser_options(self.conversation, **prompt);
  }
  recipe::RenderedPrompt result = unwrap(std::move(*prompt));
  rendered->text = std::move(result.text);
  rendered->ids = std::make_shared<const std::vector<TokenId>>(std::move(result.token_ids));
  rendered->format = choice.format;
  rendered->tokenizer = std::move(choice.tokenizer);
  return rendered;
}

}  // namespace

void bind_conversation(py::module_& module) {
  py::class_<PyRenderedInput>(module, "RenderedInput",
                              "A rendered prompt: its text and token ids (control markers as their ids, request "
                              "text tokenized untrusted). Immutable.")
      .def_property_readonly(
          "token_ids",
          [](PyRenderedInput& self) -> py::object {
            if (!self.token_list_cache) self.token_list_cache = token_list(*self.ids);
            return self.token_list_cache;
          },
          "The ids as a list of int (built once, on first access): what JSON bodies, vLLM's TokensPrompt and "
          "SGLang's input_ids take. For no per-token objects use token_array.")
      .def_property_readonly(
          "token_array", [](const PyRenderedInput& self) { return token_array(self.ids); },
          "The ids without copying: a read-only NumPy int32 array when NumPy is installed, else a memoryview "
          "(format 'i'). Both support the buffer protocol (np.asarray, torch.frombuffer, bytes(...)).")
      .def_property_readonly("num_tokens", [](const PyRenderedInput& self) { return self.ids->size(); })
      .def("__len__", [](const PyRenderedInput& self) { return self.ids->size(); })
      .def_property_readonly(
          "text",
          [](PyRenderedInput& self) -> py::object {
            if (!self.text_cache) self.text_cache = py::str(self.text.data(), self.text.size());
            return self.text_cache;
          },
          "The prompt text, byte for byte what DeepSeek's template or reference encoder produces.")
      .def_property_readonly(
          "format", [](const PyRenderedInput& self) { return recipe::format_name(self.format); },
          "The prompt format it was rendered in (\"deepseek-v4.1\", ...).")
      .def_property_readonly(
          "starts_in_reasoning", [](const PyRenderedInput& self) { return self.parser_options.starts_in_reasoning; },
          "The prompt ends inside a reasoning block (it opened <think>): the output starts as "
          "reasoning.")
      .def_property_readonly(
          "tools_enabled", [](const PyRenderedInput& self) { return self.parser_options.tools_enabled; },
          "The conversation offered tools (so tool-call markup in the output is parsed).")
      .def_property_readonly(
          "starts_in_tool_calls", [](const PyRenderedInput& self) { return self.parser_options.starts_in_tool_calls; },
          "The prompt ends with a prefilled tool-call block opener (tool_choice required or named on the DSML "
          "formats): the output starts inside the block, before its first call.")
      .def_property_readonly(
          "json_output", [](const PyRenderedInput& self) { return self.parser_options.json_output; },
          "The conversation asked for JSON (response_format): the answer's content is only its JSON text.")
      .def_property_readonly(
          "parser_options",
          [](const PyRenderedInput& self) {
            const recipe::StreamParserOptions& options = self.parser_options;
            py::dict out;
            out["starts_in_reasoning"] = options.starts_in_reasoning;
            out["tools"] = options.tools_enabled;
            out["starts_in_tool_calls"] = options.starts_in_tool_calls;
            out["json_output"] = options.json_output;
            return out;
          },
          "The parser options for this prompt's output as keyword arguments of StreamOutputParser and "
          "ResponseStream: ResponseStream(dialect, ..., format=r.format, **r.parser_options).")
      .def(
          "stream_parser",
          [](const PyRenderedInput& self) {
            return new_stream_parser(self.tokenizer, self.format, self.parser_options);
          },
          "A StreamOutputParser for this prompt's output with every option the server takes from the prompt "
          "(recipe::stream_parser_options): same tokenizer and format, starting in reasoning when the prompt "
          "opened it or inside the tool-call block when it prefilled one, recognising tool calls only when tools "
          "were offered, keeping only the JSON text when JSON was asked for.")
      .def("__repr__", [](const PyRenderedInput& self) {
        return "RenderedInput(format='" + std::string(recipe::format_name(self.format)) +
               "', num_tokens=" + std::to_string(self.ids->size()) + ")";
      });

  py::class_<PyConversation>(module, "Conversation",
                             "The canonical conversation every prompt format renders from. Build it message by "
                             "message, or convert an API request with from_openai / from_anthropic. Rendering "
                             "releases the GIL, so several threads may render (the same or different "
                             "conversations) at once.")
      .def(py::init([](py::handle messages, py::handle tools, std::optional<bool> thinking_mode,
                       py::handle reasoning_effort) {
             auto self = std::make_unique<PyConversation>();
             if (!messages.is_none()) {
               py::sequence list = py::reinterpret_borrow<py::sequence>(messages);
               for (size_t i = 0; i < list.size(); ++i) {
                 const std::string path = "messages[" + std::to_string(i) + "]";
                 self->conversation.messages.push_back(
                     unwrap(recipe::message_from_openai(openai_item(list[i], path), path)));
               }
             }
             if (!tools.is_none()) {
               py::sequence list = py::reinterpret_borrow<py::sequence>(tools);
               for (size_t i = 0; i < list.size(); ++i) {
                 const std::string path = "tools[" + std::to_string(i) + "]";
                 self->conversation.tools.push_back(unwrap(recipe::tool_from_openai(openai_item(list[i], path), path)));
               }
             }
             if (thinking_mode) self->conversation.options.thinking = *thinking_mode;
             if (!reasoning_effort.is_none()) {
               self->conversation.options.reasoning_effort = py::str(reasoning_effort).cast<std::string>();
             }
             return self;
           }),
           py::kw_only(), py::arg("messages") = py::none(), py::arg("tools") = py::none(),
           py::arg("thinking_mode") = py::none(), py::arg("reasoning_effort") = py::none(),
           "An empty conversation to build with the add_* methods, or (deepseek-recipe's constructor) one made of "
           "`messages` (UserMessage, AssistantMessage, ... objects or OpenAI message dicts) and `tools` "
           "(ToolDefinition objects or OpenAI tool dicts), validated as an OpenAI payload would be.")
      .def_static(
          "from_openai",
          [](py::handle payload) {
            return parse_payload(
                payload, [](const json::value& request) { return recipe::conversation_from_openai_chat(request); });
          },
          py::arg("payload"),
          "An OpenAI Chat Completions request (dict, or JSON text as str/bytes): messages, tools, tool_choice, "
          "reasoning_effort, response_format, add_generation_prompt and the thinking switches "
          "(chat_template_kwargs.thinking / enable_thinking, thinking). Sampling fields are ignored. Raises "
          "ValueError naming the field (\"messages[2].tool_calls[0].function.arguments ...\").")
      .def_static(
          "from_anthropic",
          [](py::handle payload) {
            return parse_payload(payload, [](const json::value& request) {
              return recipe::conversation_from_anthropic_messages(request);
            });
          },
          py::arg("payload"),
          "An Anthropic Messages request (dict or JSON text): system, messages (text, image, tool_use, "
          "tool_result, thinking blocks), tools, tool_choice, thinking. Sampling fields are ignored.")
      .def_static(
          "from_responses",
          [](py::handle payload) {
            return parse_payload(
                payload, [](const json::value& request) { return recipe::conversation_from_responses(request); });
          },
          py::arg("payload"),
          "An OpenAI Responses request (dict or JSON text): instructions, input (messages, function_call, "
          "function_call_output, reasoning items), tools, tool_choice, reasoning, text.format.")
      .def_property_readonly(
          "messages",
          [](PyConversation& self) {
            std::vector<json::object> messages;
            {
              std::lock_guard lock(self.mu);
              for (const recipe::Message& message : self.conversation.messages)
                messages.push_back(message_json(message));
            }
            py::object make = compat_module().attr("message_from_openai");
            py::list out;
            for (const json::object& message : messages) out.append(make(from_json(message)));
            return out;
          },
          "The messages as deepseek-recipe's message objects (SystemMessage, UserMessage, AssistantMessage, "
          "ToolMessage, ...; .to_openai() gives the OpenAI dict). A copy: changing it changes nothing here.")
      .def_property_readonly(
          "tools",
          [](PyConversation& self) {
            std::vector<json::object> functions;
            {
              std::lock_guard lock(self.mu);
              for (const recipe::ToolDefinition& tool : self.conversation.tools) functions.push_back(tool.function);
            }
            py::object make = compat_module().attr("tool_from_function");
            py::list out;
            for (const json::object& function : functions) out.append(make(from_json(function)));
            return out;
          },
          "The offered functions as ToolDefinition objects (a copy).")
      .def_property_readonly(
          "thinking_mode",
          [](PyConversation& self) {
            std::lock_guard lock(self.mu);
            return self.conversation.options.thinking;
          },
          "Thinking mode (deepseek-recipe's name for reasoning_mode).")
      .def_property_readonly(
          "tool_choice",
          [](PyConversation& self) -> py::object {
            std::lock_guard lock(self.mu);
            const recipe::ToolChoice& choice = self.conversation.tool_choice;
            switch (choice.mode) {
              case recipe::ToolChoice::Mode::kAuto:
                return py::str("auto");
              case recipe::ToolChoice::Mode::kRequired:
                return py::str("required");
              case recipe::ToolChoice::Mode::kNamed:
                return from_json(json::object{{"type", "function"}, {"function", {{"name", choice.name}}}});
            }
            return py::none();
          },
          "\"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\"}} (\"none\" dropped the tools).")
      .def_property_readonly(
          "response_format",
          [](PyConversation& self) -> py::object {
            std::lock_guard lock(self.mu);
            const auto& format = self.conversation.options.response_format;
            return format ? from_json(*format) : py::none();
          },
          "The requested JSON output format (response_format / text.format), or None.")
      .def(
          "render_text",
          [](PyConversation& self, const std::string& format, py::handle tokenizer) {
            recipe::PromptFormat parsed = unwrap(recipe::parse_format(format));
            // The tokenizer the prompt is for decides the marker-text rule (renderer.h), as in render_for_engine.
            recipe::RenderOptions render_options;
            if (!tokenizer.is_none()) {
              render_options =
                  recipe::render_options_for(*resolve_model(tokenizer, py::str(format)).tokenizer->tokenizer);
            }
            std::optional<Result<recipe::RenderedPrompt>> prompt;
            std::vector<std::string> images;
            {
              py::gil_scoped_release release;
              std::lock_guard lock(self.mu);
              prompt.emplace(recipe::render_prompt(self.conversation, parsed, render_options));
              for (const recipe::Message& message : self.conversation.messages) {
                for (const recipe::ContentPart& part : message.content) {
                  if (part.kind == recipe::ContentPart::Kind::kImage) images.push_back(part.image_url);
                }
              }
            }
            recipe::RenderedPrompt result = unwrap(std::move(*prompt));
            const bool opens = recipe::prompt_opens_reasoning(result);
            return py::make_tuple(py::str(result.text.data(), result.text.size()), images, opens);
          },
          py::arg("format"), py::arg("tokenizer") = py::none(),
          "(prompt text, image URLs in order, starts_in_reasoning) in `format`: what deepseek-recipe's "
          "render_conversation returns. tokenizer (a Tokenizer, or a tokenizer_model as in render_for_engine): the "
          "one the prompt is for; with one that has the ｜DSML｜ token (DeepSeek-V4's, V4.1's), marker text in "
          "request text (｜DSML｜, <tool_result>, <｜deepseek_image｜>) is ordinary text; without it (None, or "
          "DeepSeek-V3's, the one this package ships) the DSML formats refuse such text with a ValueError naming "
          "the field. Raises ValueError as render_for_engine does.")
      .def(
          "set_reasoning_mode",
          [](PyConversation& self, bool enabled) {
            std::lock_guard lock(self.mu);
            self.conversation.options.thinking = enabled;
          },
          py::arg("enabled"), "Thinking mode (the prompt opens <think>) or chat mode (the default).")
      .def(
          "set_reasoning_effort",
          [](PyConversation& self, py::handle effort) {
            std::optional<std::string> value;
            if (PyBool_Check(effort.ptr())) {
              throw py::type_error("reasoning effort must be a str, an int or None, got bool");
            } else if (PyLong_Check(effort.ptr())) {
              value = py::str(effort).cast<std::string>();
            } else if (PyUnicode_Check(effort.ptr())) {
              value = effort.cast<std::string>();
            } else if (!effort.is_none()) {
              throw py::type_error("reasoning effort must be a str, an int or None, got " +
                                   std::string(Py_TYPE(effort.ptr())->tp_name));
            }
            std::lock_guard lock(self.mu);
            self.conversation.options.reasoning_effort = std::move(value);
          },
          py::arg("effort"),
          "\"low\" | \"medium\" | \"high\" | \"xhigh\" | \"max\", or 1..100 (V4.1); None for the format's "
          "default. Checked against the format when rendering.")
      .def(
          "set_v4_revision",
          [](PyConversation& self, const std::string& revision) {
            recipe::V4Revision parsed = unwrap(recipe::parse_v4_revision(revision));
            std::lock_guard lock(self.mu);
            self.conversation.options.v4_revision = parsed;
          },
          py::arg("revision"),
          "Which deepseek-v4 revision renders the reasoning-effort preambles: \"0731\" (the default, the released "
          "V4-Flash/V4-Pro: low adds nothing, high the preview's max text, max/xhigh \"Beyond maximum\") or "
          "\"preview\" (only max adds a preamble). Raises ValueError for another name. Other formats ignore it.")
      .def(
          "register_tool",
          [](PyConversation& self, const std::string& name, py::handle description, py::handle parameters) {
            json::object function{{"name", name}};
            if (!description.is_none()) function["description"] = to_json(description, "description");
            if (!parameters.is_none()) function["parameters"] = to_json(parameters, "parameters");
            json::value tool = json::object{{"type", "function"}, {"function", std::move(function)}};
            std::lock_guard lock(self.mu);
            const std::string path = "tools[" + std::to_string(self.conversation.tools.size()) + "]";
            self.conversation.tools.push_back(unwrap(recipe::tool_from_openai(tool, path)));
          },
          py::arg("name"), py::arg("description") = py::none(), py::arg("parameters") = py::none(),
          "Offers a function to the model, as OpenAI's {\"type\": \"function\", \"function\": {name, description, "
          "parameters}} (a None description or parameters is left out).")
      .def(
          "add_system_message",
          [](PyConversation& self, py::handle content) { add_simple_message(self, "system", content); },
          py::arg("content"), "content: a str or a list of OpenAI content parts.")
      .def(
          "add_developer_message",
          [](PyConversation& self, py::handle content) { add_simple_message(self, "developer", content); },
          py::arg("content"))
      .def(
          "add_user_message",
          [](PyConversation& self, py::handle content) { add_simple_message(self, "user", content); },
          py::arg("content"), "content: a str or a list of OpenAI content parts (text, image_url).")
      .def(
          "add_assistant_message",
          [](PyConversation& self, py::handle content, py::handle reasoning_content, py::handle tool_calls,
             bool prefix) {
            json::object message{{"role", "assistant"}};
            message["content"] = to_json(content, "content");
            if (!reasoning_content.is_none())
              message["reasoning_content"] = to_json(reasoning_content, "reasoning_content");
            if (!tool_calls.is_none()) message["tool_calls"] = tool_calls_json(tool_calls);
            if (prefix) message["prefix"] = true;
            append_message(self, message);
          },
          py::arg("content") = py::none(), py::arg("reasoning_content") = py::none(),
          py::arg("tool_calls") = py::none(), py::arg("prefix") = false,
          "An earlier assistant turn. tool_calls: OpenAI tool calls ({\"id\", \"type\": \"function\", \"function\": "
          "{\"name\", \"arguments\"}}, arguments a JSON string or a dict) or ToolCall objects from "
          "StreamOutputParser. prefix=True: a prefix the model must continue (V3.1).")
      .def(
          "add_tool_result",
          [](PyConversation& self, const std::string& tool_call_id, py::handle result) {
            json::object message{{"role", "tool"}, {"tool_call_id", tool_call_id}};
            message["content"] = to_json(result, "result");
            append_message(self, message);
          },
          py::arg("tool_call_id"), py::arg("result"), "The result (str or content parts) of the call `tool_call_id`.")
      .def(
          "add_message",
          [](PyConversation& self, py::handle message) { append_message(self, to_json(message, "message")); },
          py::arg("message"), "Any OpenAI Chat Completions message dict (role, content, tool_calls, ...).")
      .def("render_for_engine", &render_for_engine, py::arg("tokenizer_model") = py::none(),
           py::arg("add_generation_prompt") = py::none(), py::kw_only(), py::arg("format") = py::none(),
           "Renders and tokenizes the conversation (C++, the GIL released). tokenizer_model: a directory "
           "holding tokenizer.json, or a known model name (deepseek_recipe.MODELS) whose tokenizer ships in the "
           "package. The prompt format comes from `format` if given, else from the model name, else from the "
           "directory's tokenizer_config.json. add_generation_prompt: end with the assistant turn opener "
           "(None: the conversation's own setting, True unless the payload said otherwise). Raises ValueError "
           "with the renderer's message for conversations the format cannot express.")
      .def_property_readonly("reasoning_mode",
                             [](PyConversation& self) {
                               std::lock_guard lock(self.mu);
                               return self.conversation.options.thinking;
                             })
      .def_property_readonly("reasoning_effort",
                             [](PyConversation& self) {
                               std::lock_guard lock(self.mu);
                               return self.conversation.options.reasoning_effort;
                             })
      .def_property_readonly("tool_names",
                             [](PyConversation& self) {
                               std::lock_guard lock(self.mu);
                               std::vector<std::string> names;
                               for (const recipe::ToolDefinition& tool : self.conversation.tools)
                                 names.push_back(tool.name);
                               return names;
                             })
      .def("__len__",
           [](PyConversation& self) {
             std::lock_guard lock(self.mu);
             return self.conversation.messages.size();
           })
      .def("__repr__", [](PyConversation& self) {
        std::lock_guard lock(self.mu);
        return "Conversation(messages=" + std::to_string(self.conversation.messages.size()) +
               ", tools=" + std::to_string(self.conversation.tools.size()) +
               ", reasoning_mode=" + (self.conversation.options.thinking ? "True" : "False") + ")";
      });
}

}  // namespace deepinfer::python
