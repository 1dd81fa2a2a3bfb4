// python_json() writes what Python's json.dumps(value, ensure_ascii=False) writes (expected strings
// produced with CPython 3.11).
#include <gtest/gtest.h>

#include <boost/json.hpp>

#include "deepinfer/recipe/python_json.h"

namespace deepinfer::recipe {
namespace {

TEST(PythonJsonTest, MatchesCPythonOutput) {
  struct Case {
    const char* json_in;
    const char* python_out;
  };
  const Case cases[] = {
      {R"({"city":"Paris","unit":"celsius"})", R"({"city": "Paris", "unit": "celsius"})"},
      {R"([1,2,[3,{}],[]])", R"([1, 2, [3, {}], []])"},
      {R"({"b":1,"a":2})", R"({"b": 1, "a": 2})"},  // insertion order kept, not sorted
      {R"([true,false,null])", R"([true, false, null])"},
      {R"("é中🌍/\u2028")", "\"é中🌍/\u2028\""},  // ensure_ascii=False: raw UTF-8, '/' unescaped
      {R"("a\"b\\c\n\r\t\b\f\u0001\u001f\u007f")", "\"a\\\"b\\\\c\\n\\r\\t\\b\\f\\u0001\\u001f\x7f\""},
      {"1.0", "1.0"},
      {"-0.0", "-0.0"},
      {"3.14", "3.14"},
      {"0.0001", "0.0001"},
      {"0.00001", "1e-05"},
      {"1e15", "1000000000000000.0"},
      {"1e16", "1e+16"},
      {"123456789.123", "123456789.123"},
      {"1.5e300", "1.5e+300"},
      {"12345678901234567890.0", "1.2345678901234567e+19"},
      {"-2.5e-7", "-2.5e-07"},
      {"9007199254740993", "9007199254740993"},
      {"-42", "-42"},
      {"18446744073709551615", "18446744073709551615"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(python_json(boost::json::parse(c.json_in)), c.python_out) << "input: " << c.json_in;
  }
}

}  // namespace
}  // namespace deepinfer::recipe
