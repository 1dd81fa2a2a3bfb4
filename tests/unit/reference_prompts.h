// The fixtures' reference prompts (reference.safetensors: input ids, stored positions' logits, 16 greedy tokens) and
// a KV cache for driving DeepSeekModel::forward directly, shared by the model tests.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/model/deepseek_model.h"
#include "deepinfer/model/safetensors.h"

namespace deepinfer::testing {

using model::SafetensorsFile;
using model::TensorView;
using model::DeepSeekModel;

constexpr int kBlockTokens = 64;

struct ReferencePrompt {
  std::string name;
  std::vector<int32_t> input_ids;
  std::vector<int32_t> positions;  // positions whose logits are stored
  std::vector<float> logits;       // [positions, vocab]
  std::vector<int32_t> greedy;     // 16 tokens
};

template <class T>
inline std::vector<T> tensor_values(const SafetensorsFile& file, const std::string& name) {
  const TensorView* view = file.find(name);
  EXPECT_NE(view, nullptr) << name;
  if (view == nullptr) return {};
  std::vector<T> values(static_cast<size_t>(view->numel()));
  std::memcpy(values.data(), view->data, view->size_bytes);
  return values;
}

inline std::vector<ReferencePrompt> load_reference(const std::string& dir) {
  auto file = SafetensorsFile::open(dir + "/reference.safetensors");
  EXPECT_TRUE(file.ok()) << file.status().to_string();
  std::vector<ReferencePrompt> prompts;
  if (!file.ok()) return prompts;
  for (int i = 0;; ++i) {
    std::string p = "prompt_" + std::to_string(i);
    if ((*file)->find(p + ".input_ids") == nullptr) break;
    prompts.push_back({p, tensor_values<int32_t>(**file, p + ".input_ids"),
                       tensor_values<int32_t>(**file, p + ".positions"), tensor_values<float>(**file, p + ".logits"),
                       tensor_values<int32_t>(**file, p + ".greedy")});
  }
  return prompts;
}

// A KV cache for tests: each sequence gets its own run of blocks.
struct TestCache {
  TestCache(const DeepSeekModel& model, int64_t num_blocks) {
    Result<std::vector<backend::Buffer>> caches = model.make_layer_caches(num_blocks);
    EXPECT_TRUE(caches.ok()) << caches.status().to_string();
    if (caches.ok()) pointers = std::move(caches).value();
  }
  std::vector<int32_t> allocate(int64_t tokens) {
    std::vector<int32_t> table;
    for (int64_t t = 0; t < tokens; t += kBlockTokens) table.push_back(next_block++);
    return table;
  }
  std::vector<backend::Buffer> pointers;
  int32_t next_block = 0;
};

}  // namespace deepinfer::testing
