// The demo model's trained DSpark draft module (models/demo: mtp.{stage}.* tensors and dspark_* keys, unpacked by
// scripts/setup.sh from assets/demo-model) against the PyTorch reference its training script wrote
// (tests/data/models/demo-dspark-reference.safetensors: tools/train_dspark_draft.py in float64 from the exported
// bf16 weights): per prompt, the target's greedy token after it (the anchor), then the module's block pass at the
// next position over the injected prompt — base logits and h rows within relative error 1e-4 — and the greedy chain
// through the host heads (Markov-corrected drafts identical, confidences within 1e-4). Skipped only while the
// repository has no demo model (no assets/demo-model/config.json). DEEPINFER_DEMO_MODEL_DIR and
// DEEPINFER_DSPARK_REFERENCE point it elsewhere (the CPU smoke run of tools/train_dspark_draft.py).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/model/deepseek_model.h"
#include "deepinfer/model/safetensors.h"
#include "logits_compare.h"
#include "test_data.h"

namespace deepinfer::model {
namespace {

using deepinfer::testing::source_path;

std::string setting(const char* env, const std::string& fallback) {
  const char* value = std::getenv(env);
  return value != nullptr && *value != '\0' ? std::string(value) : fallback;
}

// A reference tensor's values (int64 ids or float32 values, as the training script writes them).
template <class T>
std::vector<T> values(const SafetensorsFile& file, const std::string& name, DType dtype) {
  const TensorView* view = file.find(name);
  if (view == nullptr || view->dtype != dtype) {
    ADD_FAILURE() << "reference has no tensor " << name << " of dtype " << dtype_name(dtype);
    return {};
  }
  std::vector<T> out(static_cast<size_t>(view->numel()));
  std::memcpy(out.data(), view->data, view->size_bytes);
  return out;
}
std::vector<int64_t> ints(const SafetensorsFile& file, const std::string& name) {
  return values<int64_t>(file, name, DType::kI64);
}
std::vector<float> floats(const SafetensorsFile& file, const std::string& name) {
  return values<float>(file, name, DType::kF32);
}

TEST(DsparkModuleTest, TheDemoDraftMatchesItsPyTorchReference) {
  namespace fs = std::filesystem;
  const std::string dir = setting("DEEPINFER_DEMO_MODEL_DIR", source_path("models/demo"));
  if (!fs::exists(fs::path(dir) / "model.safetensors")) {
    if (!fs::exists(source_path("assets/demo-model/config.json"))) GTEST_SKIP() << "no demo model";
    FAIL() << dir << " has no model.safetensors: run scripts/setup.sh";
  }
  auto reference = SafetensorsFile::open(
      setting("DEEPINFER_DSPARK_REFERENCE", source_path("tests/data/models/demo-dspark-reference.safetensors")));
  ASSERT_TRUE(reference.ok()) << reference.status().to_string();
  auto backend = backend::make_cpu_backend();
  auto loaded = DeepSeekModel::load(dir, *backend, backend::Precision::kF32);
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  DeepSeekModel& model = **loaded;
  const ModelConfig& c = model.config();
  ASSERT_TRUE(c.dspark.has_value()) << "the demo model ships a DSpark draft module";
  const DeepSeekModel::DsparkHeads* heads = model.dspark_heads();
  ASSERT_NE(heads, nullptr);
  const int64_t vocab = c.vocab_size, hidden = c.hidden_size, gamma = c.dspark->block_size;
  constexpr int64_t kBlocks = 4;  // 256 positions: every prompt plus its block
  auto main_caches = model.make_layer_caches(kBlocks);
  ASSERT_TRUE(main_caches.ok());
  std::vector<backend::Buffer> stage_caches;
  for (int64_t s = 0; s < c.dspark->num_stages(); ++s) stage_caches.push_back(*model.make_layer_cache(kBlocks));
  const std::vector<int32_t> table = {0, 1, 2, 3};
  int prompts = 0;
  for (int i = 0; (*reference)->find("prompt." + std::to_string(i)) != nullptr; ++i, ++prompts) {
    const std::string n = std::to_string(i);
    const std::vector<int64_t> prompt64 = ints(**reference, "prompt." + n);
    const std::vector<int32_t> prompt(prompt64.begin(), prompt64.end());
    const int32_t length = static_cast<int32_t>(prompt.size());
    ASSERT_LE(length + gamma, kBlocks * 64);
    ForwardBatch forward;
    forward.token_ids = prompt;
    forward.sequences = {{length, 0, table}};
    forward.logits_rows = {length - 1};
    forward.keep_dspark_context = true;
    std::vector<int32_t> anchor;
    ASSERT_TRUE(model.forward_greedy(forward, *main_caches, anchor).ok());
    ASSERT_EQ(anchor.at(0), ints(**reference, "anchor." + n).at(0)) << "prompt " << i;
    DsparkInjectBatch inject;
    for (int32_t t = 0; t < length; ++t) inject.context_rows.push_back(t);
    inject.sequences = {{length, 0, table}};
    ASSERT_TRUE(model.forward_dspark_inject(inject, stage_caches).ok());
    DsparkBlockBatch block;
    block.token_ids.assign(static_cast<size_t>(gamma), static_cast<int32_t>(c.dspark->noise_token_id));
    block.token_ids[0] = anchor[0];
    block.sequences = {{static_cast<int32_t>(gamma), length, table}};
    std::vector<float> draft_logits, h;
    ASSERT_TRUE(model.forward_dspark_block(block, stage_caches, draft_logits, h).ok());
    const int64_t draft_vocab = heads->draft_vocab();
    ASSERT_EQ(static_cast<int64_t>(draft_logits.size()), gamma * draft_vocab);
    std::vector<float> logits(static_cast<size_t>(gamma * vocab));  // over the whole vocabulary
    for (int64_t k = 0; k < gamma; ++k) {
      heads->expand(std::span(draft_logits.data() + k * draft_vocab, static_cast<size_t>(draft_vocab)),
                    std::span(logits.data() + k * vocab, static_cast<size_t>(vocab)));
    }
    const std::vector<float> want_logits = floats(**reference, "base_logits." + n);
    const std::vector<float> want_h = floats(**reference, "hidden." + n);
    ASSERT_EQ(logits.size(), want_logits.size());
    ASSERT_EQ(h.size(), want_h.size());
    const double logits_error = deepinfer::testing::relative_error(logits.data(), want_logits.data(),
                                                                   static_cast<int64_t>(logits.size()));
    const double h_error =
        deepinfer::testing::relative_error(h.data(), want_h.data(), static_cast<int64_t>(h.size()));
    EXPECT_LE(logits_error, 1e-4) << "prompt " << i << ": base logits";
    EXPECT_LE(h_error, 1e-4) << "prompt " << i << ": h rows";
    // The greedy chain through the host heads, in the draft's vocabulary, against a full-vocabulary argmax.
    const std::vector<int64_t> want_drafts = ints(**reference, "drafts." + n);
    const std::vector<float> want_confidences = floats(**reference, "confidences." + n);
    ASSERT_EQ(static_cast<int64_t>(want_drafts.size()), gamma);
    std::vector<float> row(static_cast<size_t>(draft_vocab)), full(static_cast<size_t>(vocab));
    int32_t previous = anchor[0];
    for (int64_t k = 0; k < gamma; ++k) {
      heads->markov(std::span(draft_logits.data() + k * draft_vocab, static_cast<size_t>(draft_vocab)), previous, row);
      const int32_t draft = heads->argmax(row);
      const std::span<const float> base(draft_logits.data() + k * draft_vocab, static_cast<size_t>(draft_vocab));
      EXPECT_EQ(heads->greedy_draft(base, previous), draft) << "greedy_draft's pruned argmax, prompt " << i;
      // The pruning against the whole row after 300 other previous tokens, and on rows of ties (all equal: the
      // lowest id must win, as argmax's).
      for (int32_t p = 0; p < 300; ++p) {
        const int32_t other = static_cast<int32_t>((p * 7919 + i * 104729 + k * 31) % vocab);
        heads->markov(base, other, row);
        ASSERT_EQ(heads->greedy_draft(base, other), heads->argmax(row)) << "previous " << other;
      }
      for (const float tie : {0.0f, -3.0f, 2.5f}) {
        const std::vector<float> flat(static_cast<size_t>(draft_vocab), tie);
        for (const int32_t other : {0, 1, 2, 12345}) {
          heads->markov(flat, other, row);
          ASSERT_EQ(heads->greedy_draft(flat, other), heads->argmax(row)) << "a flat row of " << tie;
        }
      }
      heads->markov(base, previous, row);
      heads->expand(row, full);
      EXPECT_EQ(draft, deepinfer::testing::argmax(full.data(), vocab)) << "the draft vocabulary's argmax rule";
      const double confidence =
          heads->confidence_of(std::span(h.data() + k * hidden, static_cast<size_t>(hidden)), previous);
      EXPECT_EQ(draft, want_drafts[static_cast<size_t>(k)]) << "prompt " << i << " draft " << k;
      EXPECT_NEAR(confidence, want_confidences[static_cast<size_t>(k)], 1e-4) << "prompt " << i << " draft " << k;
      previous = draft;
    }
    std::cout << "[ dspark ] prompt " << i << " (" << length << " tokens): base logits error " << logits_error
              << ", h error " << h_error << "\n";
  }
  EXPECT_GE(prompts, 3);
}

}  // namespace
}  // namespace deepinfer::model
