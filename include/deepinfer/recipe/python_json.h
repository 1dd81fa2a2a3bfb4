// JSON text exactly as Python's `json.dumps(value, ensure_ascii=False)` writes it: ", " and ": "
// separators, keys in insertion order, non-ASCII characters raw, floats in Python's shortest `repr`.
// DeepSeek's reference encoders and templates serialize tool schemas and arguments this way, so a prompt
// is byte-identical to theirs only if we do the same.
#pragma once

#include <string>

#include <boost/json/value.hpp>

namespace deepinfer::recipe {

// Appends the Python-style JSON text of `value` to `out`. Never fails.
void append_python_json(const boost::json::value& value, std::string& out);
std::string python_json(const boost::json::value& value);

}  // namespace deepinfer::recipe
