// ResponseStream: the recipe's OutputBuilder (parser or detokenizer, then stop strings) feeding one dialect's
// response builder, so that a Python server gets the exact chunks and bodies `deepinfer serve` sends. The
// deepseek-recipe compatible StreamProcessor (deepseek_recipe/_compat.py) is a thin layer over it.
#include <pybind11/stl.h>

#include <boost/json.hpp>

#include "bindings.h"
#include "deepinfer/recipe/output_builder.h"
#include "deepinfer/recipe/response_builder.h"

namespace deepinfer::python {
namespace {

namespace json = boost::json;
using recipe::TokenId;

enum class Dialect { kChatCompletions, kCompletions, kMessages, kResponses };

Dialect parse_dialect(std::string_view name) {
  if (name == "chat_completions") return Dialect::kChatCompletions;
  if (name == "completions") return Dialect::kCompletions;
  if (name == "messages") return Dialect::kMessages;
  if (name == "responses") return Dialect::kResponses;
  throw py::value_error("dialect must be \"chat_completions\", \"completions\", \"messages\" or \"responses\", got \"" +
                        std::string(name) + "\"");
}

struct PyStreamChunk {
  recipe::StreamChunk chunk;
};

py::str to_py(std::string_view text) { return py::str(text.data(), text.size()); }

struct PyResponseStream {
  Dialect dialect = Dialect::kChatCompletions;
  std::shared_ptr<TokenizerHandle> tokenizer;
  recipe::ResponseIdentity identity;
  bool include_usage = false;
  json::object echo;
  std::unique_ptr<recipe::ResponseBuilder> builder;
  std::optional<recipe::OutputBuilder> output;
  recipe::FinishInfo info;
  bool started = false;
  bool finished = false;
  std::vector<recipe::StreamEvent> events;
  std::vector<recipe::StreamChunk> chunks;
  std::vector<recipe::TokenLogprobs> logprobs;  // none: the Python side reports no logprobs

  std::unique_ptr<recipe::ResponseBuilder> make_builder(recipe::ResponseIdentity id) const {
    switch (dialect) {
      case Dialect::kChatCompletions:
        return recipe::chat_completion_builder(std::move(id), include_usage, false, nullptr);
      case Dialect::kCompletions:
        return recipe::completion_builder(std::move(id), include_usage, false, nullptr);
      case Dialect::kMessages:
        return recipe::messages_builder(std::move(id));
      case Dialect::kResponses:
        return recipe::responses_builder(std::move(id), echo);
    }
    return nullptr;
  }

  std::vector<PyStreamChunk> take() {
    std::vector<PyStreamChunk> out;
    out.reserve(chunks.size());
    for (recipe::StreamChunk& chunk : chunks) out.push_back({std::move(chunk)});
    chunks.clear();
    return out;
  }

  void start_once() {
    if (started) return;
    started = true;
    builder->start(info, chunks);
  }

  // Sends the deltas of one push; a stop string ends the stream there.
  void deliver(bool stopped) {
    builder->deltas(events, logprobs, chunks);
    events.clear();
    if (stopped) end(recipe::FinishInfo::Kind::kStopString);
  }

  void end(recipe::FinishInfo::Kind kind) {
    if (finished) return;
    start_once();
    if (kind != recipe::FinishInfo::Kind::kStopString) output->finish(events);
    builder->deltas(events, logprobs, chunks);
    events.clear();
    info.kind = kind;
    info.stop_string = output->stop_string();
    builder->finish(output->message(), info, logprobs, chunks);
    finished = true;
  }
};

recipe::FinishInfo::Kind finish_kind(std::string_view reason) {
  if (reason == "stop") return recipe::FinishInfo::Kind::kStop;
  if (reason == "length") return recipe::FinishInfo::Kind::kLength;
  throw py::value_error("finish reason must be \"stop\" or \"length\", got \"" + std::string(reason) + "\"");
}

json::object message_json(const recipe::OutputMessage& message) {
  json::array calls;
  for (const recipe::OutputToolCall& call : message.tool_calls) {
    calls.push_back({{"id", call.id}, {"name", call.name}, {"arguments", call.arguments_text}});
  }
  return {{"reasoning", message.reasoning}, {"content", message.content}, {"tool_calls", std::move(calls)}};
}

}  // namespace

void bind_response(py::module_& module) {
  py::class_<PyStreamChunk>(module, "StreamChunk",
                            "One chunk of a streamed response: `event` is the SSE event name (None for OpenAI's "
                            "data-only lines), `data` the JSON object, `done` OpenAI's terminal [DONE].")
      .def_property_readonly("event",
                             [](const PyStreamChunk& self) -> py::object {
                               if (self.chunk.event.empty()) return py::none();
                               return to_py(self.chunk.event);
                             })
      .def_property_readonly("data", [](const PyStreamChunk& self) { return from_json(self.chunk.data); })
      .def_property_readonly("done", [](const PyStreamChunk& self) { return self.chunk.done; })
      .def(
          "to_json",
          [](const PyStreamChunk& self) {
            return to_py(self.chunk.done ? std::string("[DONE]") : recipe::to_json_text(self.chunk.data));
          },
          "The JSON text of `data` (\"[DONE]\" for the terminal marker), numbers as the server writes them.")
      .def(
          "to_sse", [](const PyStreamChunk& self) { return to_py(recipe::sse_frame(self.chunk)); },
          "The SSE bytes the server sends for it: \"event: E\\ndata: JSON\\n\\n\" or \"data: JSON\\n\\n\".")
      .def("__repr__", [](const PyStreamChunk& self) {
        return "StreamChunk(" + (self.chunk.event.empty() ? std::string() : "event='" + self.chunk.event + "', ") +
               (self.chunk.done ? std::string("[DONE]") : recipe::to_json_text(self.chunk.data).substr(0, 60)) + ")";
      });

  py::class_<PyResponseStream>(
      module, "ResponseStream",
      "Generated output -> one API response, exactly as `deepinfer serve` builds it: the output parser (or, for "
      "\"completions\", the detokenizer), the stop strings, then the dialect's chunks and body (the recipe's "
      "response builders). One per response; not thread-safe.\n\n"
      "ResponseStream(dialect, *, id, model, created=0, tokenizer_model=None, format=None, "
      "starts_in_reasoning=False, tools=True, starts_in_tool_calls=False, json_output=False, stop=None, "
      "include_usage=False, echo=None). dialect: "
      "\"chat_completions\", \"completions\", \"messages\" or \"responses\". tokenizer_model and format resolve as "
      "in Conversation.render_for_engine (a Tokenizer object is accepted too); the parser options as in "
      "StreamOutputParser (RenderedInput.parser_options() gives them for a rendered prompt; \"completions\" has no "
      "parser and refuses them). include_usage: Chat Completions' stream_options.include_usage. echo: the request "
      "fields a Responses response repeats (instructions, tools, ...).")
      .def(py::init([](const std::string& dialect, const std::string& id, const std::string& model, int64_t created,
                       py::handle tokenizer_model, py::handle format, bool starts_in_reasoning, bool tools,
                       bool starts_in_tool_calls, bool json_output, std::optional<std::vector<std::string>> stop,
                       bool include_usage, py::handle echo) {
             auto self = std::make_unique<PyResponseStream>();
             self->dialect = parse_dialect(dialect);
             const recipe::StreamParserOptions options =
                 parser_options(starts_in_reasoning, tools, starts_in_tool_calls, json_output);
             if (self->dialect == Dialect::kCompletions && (starts_in_tool_calls || json_output)) {
               throw py::value_error(
                   "\"completions\" returns the text as generated (no output parser): "
                   "starts_in_tool_calls and json_output need a chat dialect");
             }
             ModelChoice choice = resolve_model(tokenizer_model, format);
             self->tokenizer = choice.tokenizer;
             self->identity = {id, model, created};
             self->include_usage = include_usage;
             if (!echo.is_none()) {
               json::value value = to_json(echo, "echo");
               if (!value.is_object()) throw py::type_error("echo must be a dict");
               self->echo = std::move(value.get_object());
             }
             self->builder = self->make_builder(self->identity);
             std::vector<std::string> stops = stop.value_or(std::vector<std::string>{});
             if (self->dialect == Dialect::kCompletions) {
               self->output.emplace(self->tokenizer->tokenizer, std::move(stops));
             } else {
               self->output.emplace(recipe::StreamParser(choice.format, self->tokenizer->tokenizer, options),
                                    self->tokenizer->tokenizer, std::move(stops));
             }
             return self;
           }),
           py::arg("dialect"), py::kw_only(), py::arg("id"), py::arg("model"), py::arg("created") = 0,
           py::arg("tokenizer_model") = py::none(), py::arg("format") = py::none(),
           py::arg("starts_in_reasoning") = false, py::arg("tools") = true, py::arg("starts_in_tool_calls") = false,
           py::arg("json_output") = false, py::arg("stop") = py::none(), py::arg("include_usage") = false,
           py::arg("echo") = py::none())
      .def(
          "start",
          [](PyResponseStream& self, int64_t prompt_tokens, int64_t cached_tokens) {
            if (!self.started) {
              self.info.prompt_tokens = prompt_tokens;
              self.info.cached_tokens = cached_tokens;
            }
            self.start_once();
            return self.take();
          },
          py::arg("prompt_tokens") = 0, py::arg("cached_tokens") = 0,
          "The opening chunks (role chunk, message_start, response.created ...), with the prompt's token counts. "
          "Once: later calls return []; a push before it starts the stream with zero prompt tokens.")
      .def(
          "push_text",
          [](PyResponseStream& self, std::string_view text, int64_t completion_tokens) {
            if (self.finished) return self.take();
            self.start_once();
            self.info.completion_tokens += completion_tokens;
            self.deliver(self.output->push_text(text, self.events));
            return self.take();
          },
          py::arg("text"), py::arg("completion_tokens") = 0,
          "Generated text (what a backend reports instead of ids) and the tokens it accounts for. The text is "
          "encoded with added tokens matched, so marker text (</think>, the end-of-sequence text) acts as the "
          "model's marker tokens would. Returns the chunks it completed; a stop string ends the stream.")
      .def(
          "push_token",
          [](PyResponseStream& self, TokenId token_id) {
            if (self.finished) return self.take();
            self.start_once();
            if (token_id < 0 || static_cast<size_t>(token_id) >= self.tokenizer->tokenizer->vocab_size()) {
              return self.take();  // not a token of this vocabulary: no text, not counted
            }
            ++self.info.completion_tokens;
            self.deliver(self.output->push(token_id, self.events));
            return self.take();
          },
          py::arg("token_id"),
          "One generated token id (counted as a completion token; an id outside the vocabulary is ignored).")
      .def(
          "finish",
          [](PyResponseStream& self, std::string_view reason) {
            self.end(finish_kind(reason));
            return self.take();
          },
          py::arg("reason") = "stop",
          "Generation ended (\"stop\": end of sequence or a stop token; \"length\": the token limit): flushes "
          "what was held back and returns the closing chunks (finish reason, usage, [DONE] / message_stop / "
          "response.completed). After a stop string, or a second time, returns [].")
      .def(
          "error",
          [](PyResponseStream& self, int status, const std::string& message, const std::string& param,
             const std::string& code) {
            self.builder->stream_error({status, message, param, code}, self.chunks);
            self.finished = true;
            return self.take();
          },
          py::arg("status"), py::arg("message"), py::arg("param") = "", py::arg("code") = "",
          "The chunks that report an error after the stream started.")
      .def(
          "response",
          [](const PyResponseStream& self, std::optional<std::string> id, std::optional<std::string> model,
             std::optional<int64_t> created) {
            recipe::ResponseIdentity identity = self.identity;
            if (id) identity.id = *id;
            if (model) identity.model = *model;
            if (created) identity.created = *created;
            std::vector<recipe::TokenLogprobs> none;
            return from_json(self.make_builder(std::move(identity))->response(self.output->message(), self.info, none));
          },
          py::arg("id") = py::none(), py::arg("model") = py::none(), py::arg("created") = py::none(),
          "The whole (non-streamed) response body of what was pushed, as a dict; id, model and created default "
          "to the stream's. Call it after finish().")
      .def_property_readonly("finished", [](const PyResponseStream& self) { return self.finished; })
      .def_property_readonly("prompt_tokens", [](const PyResponseStream& self) { return self.info.prompt_tokens; })
      .def_property_readonly("completion_tokens",
                             [](const PyResponseStream& self) { return self.info.completion_tokens; })
      .def_property_readonly("stop_string", [](const PyResponseStream& self) { return self.output->stop_string(); })
      .def_property_readonly(
          "message", [](const PyResponseStream& self) { return from_json(message_json(self.output->message())); },
          "What was shown so far: {\"reasoning\", \"content\", \"tool_calls\": [{\"id\", \"name\", \"arguments\"}]}.")
      .def("__repr__", [](const PyResponseStream& self) {
        return "ResponseStream(id='" + self.identity.id + "'" + (self.finished ? ", finished" : "") + ")";
      });

  module.def(
      "error_body",
      [](int status, const std::string& message, const std::string& param, const std::string& code,
         const std::string& dialect) {
        return to_py(recipe::to_json_text(recipe::error_object(
            {status, message, param, code},
            dialect == "messages" ? recipe::ErrorDialect::kAnthropic : recipe::ErrorDialect::kOpenAI)));
      },
      py::arg("status"), py::arg("message"), py::arg("param") = "", py::arg("code") = "",
      py::arg("dialect") = "chat_completions",
      "The JSON error body the server sends: Anthropic's shape for dialect \"messages\", else OpenAI's.");
}

}  // namespace deepinfer::python
