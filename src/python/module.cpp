// deepseek_recipe._core: the recipe layer (conversation, renderers, tokenizer, stream parser) for Python.
// The public module is python/deepseek_recipe/__init__.py, which re-exports these classes and adds the model
// name table (_models.py).
#include <pybind11/stl.h>

#include "bindings.h"

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
  module.def("formats", &format_names, "The prompt formats, by name.");
}
