// The trained demo model (models/demo, unpacked by scripts/setup.sh from assets/demo-model) against the
// PyTorch reference its training script wrote (tests/data/models/demo-reference.safetensors: tools/demo_model.py
// in float64 from the exported bf16 weights): float32 logits within relative error 1e-4 and 16 greedy tokens
// identical; the FP8 copy (models/demo-fp8) loads and its error is reported. Skipped only while the repository
// has no demo model (no assets/demo-model/config.json). DEEPINFER_DEMO_MODEL_DIR and DEEPINFER_DEMO_REFERENCE
// point it elsewhere (the CPU smoke run of tools/train_demo_model.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/model/deepseek_model.h"
#include "deepinfer/model/safetensors.h"
#include "logits_compare.h"
#include "test_data.h"

namespace deepinfer::model {
namespace {

constexpr int kBlockTokens = 64;

std::string setting(const char* env, const std::string& fallback) {
  const char* value = std::getenv(env);
  return value != nullptr && *value != '\0' ? std::string(value) : fallback;
}

struct Reference {
  std::string name;
  std::vector<int32_t> input_ids, positions, greedy;
  std::vector<float> logits;  // [positions, vocab]
};

template <class T>
std::vector<T> values(const SafetensorsFile& file, const std::string& name) {
  const TensorView* view = file.find(name);
  if (view == nullptr) {
    ADD_FAILURE() << "reference has no tensor " << name;
    return {};
  }
  std::vector<T> out(static_cast<size_t>(view->numel()));
  std::memcpy(out.data(), view->data, view->size_bytes);
  return out;
}

using deepinfer::testing::argmax;

// Prefill of the whole prompt, then `decode` greedy tokens one at a time through the KV cache.
void run(DeepSeekModel& model, const std::vector<int32_t>& prompt, int decode, std::vector<float>& prompt_logits,
         std::vector<int32_t>& greedy) {
  const ModelConfig& c = model.config();
  const int64_t total = static_cast<int64_t>(prompt.size()) + decode;
  const int64_t blocks = total / kBlockTokens + 1;
  Result<std::vector<backend::Buffer>> made = model.make_layer_caches(blocks);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  const std::vector<backend::Buffer> caches = std::move(made).value();
  std::vector<int32_t> table(static_cast<size_t>(blocks));
  for (int64_t b = 0; b < blocks; ++b) table[b] = static_cast<int32_t>(b);
  const int32_t n = static_cast<int32_t>(prompt.size());
  ForwardBatch batch;
  batch.token_ids = prompt;
  batch.sequences.push_back({n, 0, table});
  for (int32_t r = 0; r < n; ++r) batch.logits_rows.push_back(r);
  Status s = model.forward(batch, caches, prompt_logits);
  ASSERT_TRUE(s.ok()) << s.to_string();
  int32_t next = argmax(prompt_logits.data() + (n - 1) * c.vocab_size, c.vocab_size);
  std::vector<float> logits;
  for (int i = 0; i < decode; ++i) {
    greedy.push_back(next);
    if (i + 1 == decode) break;
    ForwardBatch step;
    step.token_ids = {next};
    step.sequences.push_back({1, n + i, table});
    step.logits_rows = {0};
    s = model.forward(step, caches, logits);
    ASSERT_TRUE(s.ok()) << s.to_string();
    next = argmax(logits.data(), c.vocab_size);
  }
}

class DemoModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    namespace fs = std::filesystem;
    const bool overridden = std::getenv("DEEPINFER_DEMO_MODEL_DIR") != nullptr;
    dir_ = setting("DEEPINFER_DEMO_MODEL_DIR", deepinfer::testing::source_path("models/demo"));
    reference_path_ = setting("DEEPINFER_DEMO_REFERENCE",
                              deepinfer::testing::source_path("tests/data/models/demo-reference.safetensors"));
    if (!overridden && !fs::exists(deepinfer::testing::source_path("assets/demo-model/config.json"))) {
      GTEST_SKIP() << "no demo model in this repository yet (assets/demo-model/config.json is absent)";
    }
    ASSERT_TRUE(fs::exists(fs::path(dir_) / "model.safetensors"))
        << dir_ << " has no model.safetensors: run scripts/setup.sh (it unpacks assets/demo-model there)";
    auto file = SafetensorsFile::open(reference_path_);
    ASSERT_TRUE(file.ok()) << file.status().to_string();
    for (int i = 0;; ++i) {
      const std::string p = "prompt_" + std::to_string(i);
      if ((*file)->find(p + ".input_ids") == nullptr) break;
      references_.push_back({p, values<int32_t>(**file, p + ".input_ids"), values<int32_t>(**file, p + ".positions"),
                             values<int32_t>(**file, p + ".greedy"), values<float>(**file, p + ".logits")});
    }
    ASSERT_FALSE(references_.empty()) << reference_path_ << " holds no prompt_0";
    backend_ = backend::make_cpu_backend();
  }

  // Relative error over the stored positions; counts argmax agreement.
  double compare(const Reference& ref, const std::vector<float>& ours, int64_t vocab, int* agree) const {
    return deepinfer::testing::stored_positions_error(ref.positions, ref.logits, ours, vocab, agree);
  }

  std::string dir_, reference_path_;
  std::vector<Reference> references_;
  std::unique_ptr<backend::Backend> backend_;
};

TEST_F(DemoModelTest, Float32LogitsAndGreedyTokensMatchPyTorch) {
  auto model = DeepSeekModel::load(dir_, *backend_, backend::Precision::kF32);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  const int64_t vocab = (*model)->config().vocab_size;
  for (const Reference& ref : references_) {
    std::vector<float> logits;
    std::vector<int32_t> greedy;
    run(**model, ref.input_ids, static_cast<int>(ref.greedy.size()), logits, greedy);
    int agree = 0;
    const double error = compare(ref, logits, vocab, &agree);
    std::printf("[ demo %s ] %zu tokens: relative error %.3g\n", ref.name.c_str(), ref.input_ids.size(), error);
    EXPECT_LE(error, 1e-4) << ref.name;
    EXPECT_EQ(agree, static_cast<int>(ref.positions.size())) << ref.name;
    EXPECT_EQ(greedy, ref.greedy) << ref.name << ": greedy tokens differ from PyTorch's";
  }
}

TEST_F(DemoModelTest, Fp8CopyLoadsAndReportsError) {
  const std::string fp8_dir = dir_ + "-fp8";
  if (!std::filesystem::exists(std::filesystem::path(fp8_dir) / "model.safetensors")) {
    GTEST_SKIP() << "no FP8 copy at " << fp8_dir;
  }
  auto model = DeepSeekModel::load(fp8_dir, *backend_, backend::Precision::kF32);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  EXPECT_EQ((*model)->config().quant_method, "fp8");
  for (const Reference& ref : references_) {
    std::vector<float> logits;
    std::vector<int32_t> greedy;
    run(**model, ref.input_ids, 1, logits, greedy);
    int agree = 0;
    const double error = compare(ref, logits, (*model)->config().vocab_size, &agree);
    std::printf("[ demo-fp8 %s ] relative error %.3g vs the bf16 reference, argmax %d/%zu\n", ref.name.c_str(), error,
                agree, ref.positions.size());
    EXPECT_LT(error, 0.2) << ref.name << ": FP8 weights far from the bf16 model";
  }
}

}  // namespace
}  // namespace deepinfer::model
