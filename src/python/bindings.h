// What the binding files of the deepseek_recipe module share: Status -> Python exception, Python objects <->
// JSON, the tokenizer handle and model resolution, and token ids handed to Python.
#pragma once

#include <pybind11/pybind11.h>

#include <boost/json/object.hpp>
#include <boost/json/value.hpp>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/recipe/renderer.h"
#include "deepinfer/recipe/stream_parser.h"
#include "deepinfer/recipe/tokenizer.h"

namespace deepinfer::python {

namespace py = pybind11;

// Raises the Python exception for a failed Status, with the C++ message unchanged: ValueError for
// InvalidArgument and Unsupported (the caller's input), RuntimeError for everything else.
[[noreturn]] void throw_status(const Status& status);

template <class T>
T unwrap(Result<T> result) {
  if (!result.ok()) throw_status(result.status());
  return std::move(result).value();
}

// Python -> JSON: dict (str keys, insertion order kept), list, tuple, str, bool, int, float, None. Anything else
// is a TypeError naming `path` ("messages[2].content") and the type. Requires the GIL.
boost::json::value to_json(py::handle object, const std::string& path);
// JSON -> Python: dict, list, str, int, float, bool, None. Requires the GIL.
py::object from_json(const boost::json::value& value);
// A request body: a dict (converted as above) or JSON text (str, bytes), parsed in C++.
boost::json::value payload_to_json(py::handle payload);

// A loaded tokenizer as Python holds it. Immutable; shared by every object built from it.
struct TokenizerHandle {
  std::shared_ptr<const recipe::Tokenizer> tokenizer;
  std::string path;  // the tokenizer.json it was loaded from
};

// What a `tokenizer_model` (directory, tokenizer.json file or known model name) and an optional `format`
// resolve to, as deepseek_recipe/_models.py decides (cached there). Raises ValueError when neither
// names a prompt format, FileNotFoundError for a missing directory.
struct ModelChoice {
  std::shared_ptr<TokenizerHandle> tokenizer;
  recipe::PromptFormat format = recipe::PromptFormat::kDeepSeekV3;
};
ModelChoice resolve_model(py::handle tokenizer_model, py::handle format);

// Token ids without a Python object per token: a read-only NumPy int32 array viewing `ids` when NumPy imports,
// else a memoryview (format "i"). Either keeps `ids` alive.
py::object token_array(std::shared_ptr<const std::vector<recipe::TokenId>> ids);
// Token ids as a Python list of ints (one pass, no intermediate objects).
py::list token_list(std::span<const recipe::TokenId> ids);

// A StreamOutputParser over `tokenizer` for `format` with `options` (parser_bindings.cpp).
py::object new_stream_parser(std::shared_ptr<TokenizerHandle> tokenizer, recipe::PromptFormat format,
                             recipe::StreamParserOptions options);
// The parser options a Python caller spelled out (StreamOutputParser, ResponseStream). Raises ValueError for
// starts_in_tool_calls without tools: the parser would read the prefilled block as text (stream_parser.h), so
// the option would be accepted and then ignored.
recipe::StreamParserOptions parser_options(bool starts_in_reasoning, bool tools_enabled, bool starts_in_tool_calls,
                                           bool json_output);
// The OpenAI tool-call JSON ({"id", "type", "function": {"name", "arguments"}}) of a ToolCall object the
// parser returned, or nullopt when `object` is not one (parser_bindings.cpp).
std::optional<boost::json::object> tool_call_json(py::handle object);

void bind_tokenizer(py::module_& module);
void bind_conversation(py::module_& module);
void bind_parser(py::module_& module);
void bind_response(py::module_& module);

}  // namespace deepinfer::python
