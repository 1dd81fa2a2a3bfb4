// Tokenizer (load, encode, decode), the zero-copy token buffer, and model resolution (a call into
// deepseek_recipe/_models.py, which owns the name -> format table and the tokenizer cache).
#include <pybind11/stl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>

#include "bindings.h"

namespace deepinfer::python {
namespace {

using recipe::TokenId;

// Exposes a vector of ids through the buffer protocol, read-only, without copying. The NumPy array or
// memoryview built on it keeps this object, and so the vector, alive.
struct TokenBuffer {
  std::shared_ptr<const std::vector<TokenId>> ids;
};

}  // namespace

ModelChoice resolve_model(py::handle tokenizer_model, py::handle format) {
  py::tuple resolved = py::module_::import("deepseek_recipe._models").attr("resolve")(tokenizer_model, format);
  ModelChoice choice;
  choice.tokenizer = resolved[0].cast<std::shared_ptr<TokenizerHandle>>();
  choice.format = unwrap(recipe::parse_format(resolved[1].cast<std::string>()));
  return choice;
}

py::object token_array(std::shared_ptr<const std::vector<TokenId>> ids) {
  py::object owner = py::cast(TokenBuffer{std::move(ids)});
  try {
    py::module_ numpy = py::module_::import("numpy");
    return numpy.attr("frombuffer")(owner, py::arg("dtype") = numpy.attr("int32"));
  } catch (py::error_already_set& error) {
    if (!error.matches(PyExc_ImportError)) throw;
  }
  PyObject* view = PyMemoryView_FromObject(owner.ptr());
  if (view == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(view);
}

py::list token_list(std::span<const TokenId> ids) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(ids.size()));
  if (list == nullptr) throw py::error_already_set();
  py::list out = py::reinterpret_steal<py::list>(list);
  for (size_t i = 0; i < ids.size(); ++i) {
    PyObject* item = PyLong_FromLong(ids[i]);
    if (item == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);  // steals the reference
  }
  return out;
}

void bind_tokenizer(py::module_& module) {
  py::class_<TokenBuffer>(module, "TokenBuffer", py::buffer_protocol(),
                          "Read-only int32 buffer over token ids owned by C++ (what token arrays view).")
      .def_buffer([](TokenBuffer& buffer) {
        static const TokenId kEmpty = 0;  // a valid pointer for an empty buffer
        const TokenId* data = buffer.ids->empty() ? &kEmpty : buffer.ids->data();
        return py::buffer_info(const_cast<TokenId*>(data), sizeof(TokenId), py::format_descriptor<TokenId>::format(), 1,
                               {static_cast<py::ssize_t>(buffer.ids->size())}, {sizeof(TokenId)},
                               /*readonly=*/true);
      })
      .def("__len__", [](const TokenBuffer& buffer) { return buffer.ids->size(); });

  py::class_<TokenizerHandle, std::shared_ptr<TokenizerHandle>>(
      module, "Tokenizer",
      "DeepSeek's byte-level BPE tokenizer (C++; ids equal Hugging Face tokenizers' encode(text, "
      "add_special_tokens=False)).\n\n"
      "Tokenizer(tokenizer_model): a directory holding tokenizer.json, the file itself, or a known model name "
      "(deepseek_recipe.MODELS; the tokenizer shipped in the package). Loaded once per path and shared. "
      "Thread-safe.")
      .def(py::init([](py::handle tokenizer_model) {
             return py::module_::import("deepseek_recipe._models")
                 .attr("load_tokenizer")(tokenizer_model)
                 .cast<std::shared_ptr<TokenizerHandle>>();
           }),
           py::arg("tokenizer_model"))
      .def_static(
          "_load",
          [](const std::string& path) {
            std::optional<Result<std::shared_ptr<const recipe::Tokenizer>>> loaded;
            {
              py::gil_scoped_release release;
              loaded.emplace(recipe::Tokenizer::load(path));
            }
            return std::make_shared<TokenizerHandle>(TokenizerHandle{unwrap(std::move(*loaded)), path});
          },
          py::arg("path"), "Loads a tokenizer.json (or a directory holding one) with no name lookup and no cache.")
      .def_static(
          "from_file",
          [](py::handle path) {
            return py::module_::import("deepseek_recipe._models")
                .attr("load_tokenizer")(path)
                .cast<std::shared_ptr<TokenizerHandle>>();
          },
          py::arg("path"), "deepseek-recipe's spelling of Tokenizer(path): a tokenizer.json file or its directory.")
      .def_static(
          "from_str",
          [](const std::string& json_text) {
            // The loader reads files: the text goes through a private temporary file, removed at once.
            std::error_code ec;
            std::filesystem::path directory = std::filesystem::temp_directory_path(ec);
            if (ec) throw std::runtime_error("no temporary directory for the tokenizer text: " + ec.message());
            std::filesystem::path file =
                directory / ("deepseek_recipe_tokenizer_" + std::to_string(::getpid()) + "_" +
                             std::to_string(reinterpret_cast<uintptr_t>(&json_text)) + ".json");
            {
              std::ofstream out(file, std::ios::binary);
              out.write(json_text.data(), static_cast<std::streamsize>(json_text.size()));
              if (!out) throw std::runtime_error("cannot write the tokenizer text to " + file.string());
            }
            std::optional<Result<std::shared_ptr<const recipe::Tokenizer>>> loaded;
            {
              py::gil_scoped_release release;
              loaded.emplace(recipe::Tokenizer::load(file));
            }
            std::filesystem::remove(file, ec);
            if (!loaded->ok()) throw std::runtime_error(loaded->status().message());  // RuntimeError, as theirs
            return std::make_shared<TokenizerHandle>(TokenizerHandle{std::move(*loaded).value(), "<str>"});
          },
          py::arg("json_text"), "A tokenizer from the text of a tokenizer.json (RuntimeError when it is not one).")
      .def(
          "encode",
          [](const TokenizerHandle& self, std::string_view text, bool untrusted) {
            std::vector<TokenId> ids;
            {
              py::gil_scoped_release release;
              self.tokenizer->encode(text, untrusted ? recipe::TextTrust::kUntrusted : recipe::TextTrust::kTrusted,
                                     ids);
            }
            return token_list(ids);
          },
          py::arg("text"), py::kw_only(), py::arg("untrusted") = false,
          "Token ids of `text` (a list of int). By default added-token text (\"<｜User｜>\") becomes its id, as "
          "Hugging Face tokenizers does; untrusted=True matches no added token, as the renderer does for "
          "request text (the CLI's `deepinfer tokenize --untrusted`).")
      .def(
          "decode",
          [](const TokenizerHandle& self, const std::vector<TokenId>& ids) {
            std::string text;
            {
              py::gil_scoped_release release;
              text = self.tokenizer->decode(ids);
            }
            return py::str(text.data(), text.size());
          },
          py::arg("ids"),
          "Text of `ids` (any sequence of ints, or an int32 array), special tokens included; invalid UTF-8 "
          "becomes U+FFFD.")
      .def(
          "token_to_id",
          [](const TokenizerHandle& self, std::string_view piece) { return self.tokenizer->piece_to_id(piece); },
          py::arg("piece"), "The id of a vocabulary piece or added token (\"<｜end▁of▁sentence｜>\"), or None.")
      .def(
          "id_to_token",
          [](const TokenizerHandle& self, TokenId id) -> std::optional<std::string> {
            std::optional<std::string_view> piece = self.tokenizer->id_to_piece(id);
            if (!piece) return std::nullopt;
            return std::string(*piece);
          },
          py::arg("id"), "The vocabulary piece of `id` (byte-level alphabet), or None.")
      .def_property_readonly(
          "vocab_size", [](const TokenizerHandle& self) { return self.tokenizer->vocab_size(); },
          "One past the largest id defined.")
      .def_property_readonly(
          "path", [](const TokenizerHandle& self) { return self.path; }, "The tokenizer.json it was loaded from.")
      .def("__repr__", [](const TokenizerHandle& self) { return "Tokenizer('" + self.path + "')"; });
}

}  // namespace deepinfer::python
