// Helpers for tests that read committed reference data under tests/data/ and the tokenizer that
// scripts/setup.sh fetches into models/.
#pragma once

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include <boost/json.hpp>
#include <gtest/gtest.h>

namespace deepinfer::testing {

// The checkout the tests read data from: $DEEPINFER_SOURCE_DIR when set (a test binary carried to another machine,
// scripts/gpu-check.sh), else the one it was built from.
inline std::string source_path(const std::string& relative) {
  const char* root = std::getenv("DEEPINFER_SOURCE_DIR");
  return std::string(root != nullptr ? root : DEEPINFER_SOURCE_DIR) + "/" + relative;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    ADD_FAILURE() << "cannot read " << path;
    return {};
  }
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

inline boost::json::value read_json(const std::string& relative) { return boost::json::parse(read_file(source_path(relative))); }

// The DeepSeek-V3 tokenizer fetched by scripts/setup.sh.
inline std::string tokenizer_path() { return source_path("models/deepseek-v3/tokenizer.json"); }

// DeepSeek-V3's tokenizer with DeepSeek-V4's added tokens (<think> 128821, </think> 128822, ｜DSML｜ 128825,
// <｜latest_reminder｜> 128828), written into the build directory by tools/make_v4_tokenizer.py (CMake target
// v4_tokenizer, a dependency of recipe_tests).
inline std::string v4_tokenizer_path() { return DEEPINFER_V4_TOKENIZER_DIR "/tokenizer.json"; }

}  // namespace deepinfer::testing
