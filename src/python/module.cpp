// deepseek_recipe._core: the recipe layer (conversation, renderers, tokenizer, stream parser, response builders)
// for Python.
// The public module is python/deepseek_recipe/__init__.py, which re-exports these classes and adds the model
// name table (_models.py).
#include <pybind11/stl.h>

#include "bindings.h"
#include "deepinfer/recipe/model_formats.h"
#include "deepinfer/recipe/response_builder.h"
#include "deepinfer/recipe/responses_request.h"

namespace deepinfer::python {
namespace {

std::vector<std::string> format_names() {
  std::vector<std::string> names;
  for (recipe::PromptFormat format : recipe::all_formats()) names.emplace_back(recipe::format_name(format));
  return names;
}

}  // namespace
}  // namespace deepinfer::python

PYBIND11_MODULE(_core, module) {
  namespace py = pybind11;
  using namespace deepinfer::python;
  module.doc() = "DeepSeek prompt rendering, tokenization and output parsing (C++ core of deepseek_recipe).";
  bind_tokenizer(module);
  bind_conversation(module);
  bind_parser(module);
  bind_response(module);
  module.def("formats", &format_names, "The prompt formats, by name.");
  module.def(
      "models",
      [] {
        std::vector<std::pair<std::string, std::string>> models;
        for (const deepinfer::recipe::KnownModel& model : deepinfer::recipe::known_models()) {
          models.emplace_back(model.name, deepinfer::recipe::format_name(model.format));
        }
        return models;
      },
      "DeepSeek's chat models: (Hugging Face name, prompt format name) pairs (recipe known_models).");
  module.def(
      "format_for_model",
      [](std::string_view name) -> std::optional<std::string> {
        std::optional<deepinfer::recipe::PromptFormat> format = deepinfer::recipe::format_for_model(name);
        if (!format) return std::nullopt;
        return std::string(deepinfer::recipe::format_name(*format));
      },
      py::arg("name"), "The prompt format of a known model name, or None (recipe format_for_model).");
  module.def(
      "detect_format",
      [](const std::string& directory) -> std::optional<std::string> {
        std::optional<deepinfer::recipe::PromptFormat> format = unwrap(deepinfer::recipe::detect_format(directory));
        if (!format) return std::nullopt;
        return std::string(deepinfer::recipe::format_name(*format));
      },
      py::arg("directory"),
      "The prompt format a checkpoint or tokenizer directory names, or None; ValueError for a config.json "
      "chat_format that is not a format name (recipe detect_format).");
  module.def(
      "json_value",
      [](py::handle value) {
        if (PyUnicode_Check(value.ptr()) || PyBytes_Check(value.ptr())) return from_json(payload_to_json(value));
        return from_json(to_json(value, ""));
      },
      py::arg("value"),
      "A value (dict, list, ..., or JSON text as str/bytes) as plain JSON values: a checked copy. Raises "
      "ValueError for a circular reference, RecursionError past 128 levels, TypeError for a value JSON cannot "
      "hold.");
  module.def(
      "json_text", [](py::handle value) { return deepinfer::recipe::to_json_text(to_json(value, "")); },
      py::arg("value"), "JSON text with numbers as the server writes them (-0.5, 1e-07, 12.0).");
  module.def(
      "responses_echo",
      [](py::handle request, std::optional<int64_t> max_output_tokens, bool parallel_tool_calls, double temperature,
         double top_p) {
        boost::json::value body = to_json(request, "request");
        if (!body.is_object()) throw py::type_error("request must be a dict");
        return from_json(deepinfer::recipe::responses_echo(body.get_object(), max_output_tokens, parallel_tool_calls,
                                                           temperature, top_p));
      },
      py::arg("request"), py::arg("max_output_tokens") = py::none(), py::arg("parallel_tool_calls") = true,
      py::arg("temperature") = 1.0, py::arg("top_p") = 1.0,
      "The request fields a Responses response object repeats (recipe responses_echo).");
}
