// Python objects <-> Boost.JSON values, and Status -> Python exceptions. Request bodies cross this boundary
// once per call, so the conversion walks the objects directly instead of going through JSON text.
#include <algorithm>
#include <boost/json.hpp>
#include <vector>

#include "bindings.h"

namespace deepinfer::python {
namespace json = boost::json;

void throw_status(const Status& status) {
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kUnsupported:
      throw py::value_error(status.message());
    default:
      throw std::runtime_error(status.message());  // pybind11 raises RuntimeError
  }
}

namespace {

// Deeper nesting than any request needs; a deeper (or self-referencing) object is refused before it can exhaust
// the C++ stack, as deepseek-recipe refuses it.
constexpr size_t kMaxDepth = 128;

// The containers being converted, outermost first: a container met again inside itself is a cycle (one seen
// twice side by side is a shared subtree, which is fine).
struct Walk {
  std::vector<PyObject*> open;
};

json::value convert(py::handle object, const std::string& path, Walk& walk);

// Converts a dict, list or tuple `o` with `walk` tracking it.
template <class Body>
json::value container(PyObject* o, const std::string& path, Walk& walk, Body body) {
  const std::string where = path.empty() ? std::string("the payload") : path;
  if (std::find(walk.open.begin(), walk.open.end(), o) != walk.open.end()) {
    throw py::value_error(where + " is a circular reference (it contains itself)");
  }
  if (walk.open.size() >= kMaxDepth) {
    PyErr_SetString(PyExc_RecursionError,
                    (where + " nests deeper than " + std::to_string(kMaxDepth) + " levels").c_str());
    throw py::error_already_set();
  }
  walk.open.push_back(o);
  json::value out = body();
  walk.open.pop_back();
  return out;
}

json::value convert(py::handle object, const std::string& path, Walk& walk) {
  PyObject* o = object.ptr();
  if (o == Py_None) return nullptr;
  if (PyBool_Check(o)) return o == Py_True;  // before int: bool is an int subclass
  if (PyLong_Check(o)) {
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow == 0) {
      if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
      return static_cast<int64_t>(value);
    }
    if (overflow > 0) {
      unsigned long long unsigned_value = PyLong_AsUnsignedLongLong(o);
      if (!PyErr_Occurred()) return static_cast<uint64_t>(unsigned_value);
      PyErr_Clear();
    }
    throw py::value_error(path + " is an integer outside the 64-bit range JSON numbers are read with");
  }
  if (PyFloat_Check(o)) return PyFloat_AS_DOUBLE(o);
  if (PyUnicode_Check(o)) {
    Py_ssize_t size = 0;
    const char* data = PyUnicode_AsUTF8AndSize(o, &size);
    if (data == nullptr) throw py::error_already_set();  // lone surrogates
    return json::string(data, static_cast<size_t>(size));
  }
  if (PyDict_Check(o))
    return container(o, path, walk, [&]() -> json::value {
      json::object out;
      out.reserve(static_cast<size_t>(PyDict_Size(o)));
      PyObject* key = nullptr;
      PyObject* value = nullptr;
      Py_ssize_t position = 0;
      while (PyDict_Next(o, &position, &key, &value)) {
        if (!PyUnicode_Check(key)) {
          throw py::type_error(path + " has a key of type " + std::string(Py_TYPE(key)->tp_name) +
                               "; JSON object keys must be str");
        }
        Py_ssize_t size = 0;
        const char* data = PyUnicode_AsUTF8AndSize(key, &size);
        if (data == nullptr) throw py::error_already_set();
        std::string_view name(data, static_cast<size_t>(size));
        out[name] = convert(value, path.empty() ? std::string(name) : path + "." + std::string(name), walk);
      }
      return out;
    });
  if (PyList_Check(o) || PyTuple_Check(o))
    return container(o, path, walk, [&]() -> json::value {
      py::sequence sequence = py::reinterpret_borrow<py::sequence>(object);
      json::array out;
      out.reserve(sequence.size());
      for (size_t i = 0; i < sequence.size(); ++i) {
        out.push_back(convert(sequence[i], path + "[" + std::to_string(i) + "]", walk));
      }
      return out;
    });
  // NumPy scalars and other numbers (not arrays): an integer when they have __index__, else a float when they
  // convert.
  const bool sequence = PySequence_Check(o) != 0;
  if (PyIndex_Check(o) && !sequence) {
    py::object integer = py::reinterpret_steal<py::object>(PyNumber_Index(o));
    if (!integer) throw py::error_already_set();
    return convert(integer, path, walk);
  }
  if (!sequence && Py_TYPE(o)->tp_as_number != nullptr && Py_TYPE(o)->tp_as_number->nb_float != nullptr) {
    double value = PyFloat_AsDouble(o);
    if (value == -1.0 && PyErr_Occurred()) throw py::error_already_set();
    return value;
  }
  throw py::type_error((path.empty() ? std::string("the payload") : path) + " is a " +
                       std::string(Py_TYPE(o)->tp_name) +
                       "; expected dict, list, tuple, str, int, float, bool or None");
}

}  // namespace

json::value to_json(py::handle object, const std::string& path) {
  Walk walk;
  return convert(object, path, walk);
}

py::object from_json(const json::value& value) {
  switch (value.kind()) {
    case json::kind::null:
      return py::none();
    case json::kind::bool_:
      return py::bool_(value.get_bool());
    case json::kind::int64:
      return py::int_(value.get_int64());
    case json::kind::uint64:
      return py::int_(value.get_uint64());
    case json::kind::double_:
      return py::float_(value.get_double());
    case json::kind::string: {
      const json::string& s = value.get_string();
      return py::str(s.data(), s.size());
    }
    case json::kind::array: {
      const json::array& array = value.get_array();
      py::list out(array.size());
      for (size_t i = 0; i < array.size(); ++i) out[i] = from_json(array[i]);
      return out;
    }
    case json::kind::object: {
      py::dict out;
      for (const json::key_value_pair& item : value.get_object()) {
        out[py::str(item.key().data(), item.key().size())] = from_json(item.value());
      }
      return out;
    }
  }
  return py::none();
}

json::value payload_to_json(py::handle payload) {
  std::string_view text;
  if (PyUnicode_Check(payload.ptr())) {
    Py_ssize_t size = 0;
    const char* data = PyUnicode_AsUTF8AndSize(payload.ptr(), &size);
    if (data == nullptr) throw py::error_already_set();
    text = std::string_view(data, static_cast<size_t>(size));
  } else if (PyBytes_Check(payload.ptr())) {
    text = std::string_view(PyBytes_AS_STRING(payload.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(payload.ptr())));
  } else {
    if (!PyDict_Check(payload.ptr())) {
      throw py::type_error("the payload must be a dict or JSON text (str or bytes), got " +
                           std::string(Py_TYPE(payload.ptr())->tp_name));
    }
    return to_json(payload, "");
  }
  boost::system::error_code ec;
  json::value parsed = json::parse(text, ec);
  if (ec) throw py::value_error("the request body is not valid JSON: " + ec.message());
  return parsed;
}

}  // namespace deepinfer::python
