// The forward pass against the fixtures' reference (transformers 5.17, float64): logits at the stored
// positions within relative error 1e-4 on the float32 path and the 16 greedy tokens identical, whether the
// prompt is prefilled whole or in chunks of 1, 7 and 64 tokens, with decode following the prefill, and with
// 8 different prompts in one batch. The bf16-weight path reports its error and argmax agreement. The CUDA backend
// (bf16 activations and KV cache, FP8 weights kept FP8) runs the same prompts on a machine with a GPU (skipped
// without one; scripts/gpu-check.sh runs it on the H200): within a bf16 bound, argmax and greedy agreement reported.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/model/deepseek_model.h"
#include "deepinfer/model/safetensors.h"
#include "logits_compare.h"
#include "reference_prompts.h"
#include "test_data.h"

namespace deepinfer::model {
namespace {

using deepinfer::testing::ReferencePrompt;
using deepinfer::testing::TestCache;
using deepinfer::testing::kBlockTokens;
using deepinfer::testing::load_reference;

// Runs one sequence: prefill in chunks of `chunk` tokens (0 = whole prompt), collecting logits at every
// prompt position, then greedy-decodes `decode_tokens` tokens.
struct RunResult {
  std::vector<float> logits;  // [prompt length, vocab]
  std::vector<int32_t> greedy;
};

using deepinfer::testing::argmax;

RunResult run_sequence(DeepSeekModel& model, const std::vector<int32_t>& prompt, int chunk, int decode_tokens) {
  const ModelConfig& c = model.config();
  TestCache cache(model, (static_cast<int64_t>(prompt.size()) + decode_tokens) / kBlockTokens + 2);
  std::vector<int32_t> table = cache.allocate(static_cast<int64_t>(prompt.size()) + decode_tokens);
  RunResult result;
  int32_t done = 0;
  const int32_t n = static_cast<int32_t>(prompt.size());
  std::vector<float> logits;
  while (done < n) {
    int32_t len = chunk == 0 ? n : std::min(chunk, n - done);
    ForwardBatch batch;
    batch.token_ids.assign(prompt.begin() + done, prompt.begin() + done + len);
    batch.sequences.push_back({len, done, table});
    for (int32_t r = 0; r < len; ++r) batch.logits_rows.push_back(r);
    Status s = model.forward(batch, cache.pointers, logits);
    EXPECT_TRUE(s.ok()) << s.to_string();
    result.logits.insert(result.logits.end(), logits.begin(), logits.end());
    done += len;
  }
  int32_t next = argmax(result.logits.data() + (n - 1) * c.vocab_size, c.vocab_size);
  for (int i = 0; i < decode_tokens; ++i) {
    result.greedy.push_back(next);
    if (i + 1 == decode_tokens) break;
    ForwardBatch batch;
    batch.token_ids = {next};
    batch.sequences.push_back({1, n + i, table});
    batch.logits_rows = {0};
    Status s = model.forward(batch, cache.pointers, logits);
    EXPECT_TRUE(s.ok()) << s.to_string();
    next = argmax(logits.data(), c.vocab_size);
  }
  return result;
}

// ‖ours − reference‖ / ‖reference‖ over the stored positions; counts argmax agreement.
double relative_error(const ReferencePrompt& ref, const std::vector<float>& ours, int64_t vocab, int* argmax_agree) {
  return deepinfer::testing::stored_positions_error(ref.positions, ref.logits, ours, vocab, argmax_agree);
}

class ExactnessTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = deepinfer::testing::source_path("tests/data/models/" + GetParam());
    backend_ = backend::make_cpu_backend();
    auto model = DeepSeekModel::load(dir_, *backend_, backend::Precision::kF32);
    ASSERT_TRUE(model.ok()) << model.status().to_string();
    model_ = std::move(model).value();
    reference_ = load_reference(dir_);
    ASSERT_EQ(reference_.size(), 7u);
  }
  std::string dir_;
  std::unique_ptr<backend::Backend> backend_;
  std::unique_ptr<DeepSeekModel> model_;
  std::vector<ReferencePrompt> reference_;
};

TEST_P(ExactnessTest, Float32LogitsAndGreedyTokensMatchInEveryChunking) {
  const int64_t vocab = model_->config().vocab_size;
  for (int chunk : {0, 1, 7, 64}) {
    for (const ReferencePrompt& ref : reference_) {
      if (chunk == 1 && ref.input_ids.size() > 129) continue;  // token-by-token on the longest prompts is slow
      RunResult run = run_sequence(*model_, ref.input_ids, chunk, 16);
      int agree = 0;
      double error = relative_error(ref, run.logits, vocab, &agree);
      EXPECT_LE(error, 1e-4) << GetParam() << " " << ref.name << " (" << ref.input_ids.size() << " tokens) chunk "
                             << chunk;
      EXPECT_EQ(agree, static_cast<int>(ref.positions.size())) << ref.name << " chunk " << chunk;
      EXPECT_EQ(run.greedy, ref.greedy) << GetParam() << " " << ref.name << " chunk " << chunk;
      if (chunk == 0)
        std::printf("[ %s %s ] %zu tokens: relative error %.3g\n", GetParam().c_str(), ref.name.c_str(),
                    ref.input_ids.size(), error);
    }
  }
}

// Prompts 0..6 plus a second copy of prompt 2, prefilled together in one forward: each within `bound`, and the
// number of positions whose argmax agrees with the reference, over all prompts.
int run_eight_prompts(DeepSeekModel& model, const std::vector<ReferencePrompt>& reference, double bound,
                      int* positions) {
  const ModelConfig& c = model.config();
  std::vector<const ReferencePrompt*> prompts;
  for (const auto& ref : reference) prompts.push_back(&ref);
  prompts.push_back(&reference[2]);
  int64_t total = 0;
  for (auto* p : prompts) total += static_cast<int64_t>(p->input_ids.size());
  TestCache cache(model, total / kBlockTokens + static_cast<int64_t>(prompts.size()) + 1);
  ForwardBatch batch;
  for (auto* p : prompts) {
    int32_t n = static_cast<int32_t>(p->input_ids.size());
    int32_t first_row = static_cast<int32_t>(batch.token_ids.size());
    batch.token_ids.insert(batch.token_ids.end(), p->input_ids.begin(), p->input_ids.end());
    batch.sequences.push_back({n, 0, cache.allocate(n)});
    for (int32_t r = 0; r < n; ++r) batch.logits_rows.push_back(first_row + r);
  }
  std::vector<float> logits;
  Status s = model.forward(batch, cache.pointers, logits);
  EXPECT_TRUE(s.ok()) << s.to_string();
  if (!s.ok()) return 0;
  int64_t offset = 0;
  int agree_total = 0;
  *positions = 0;
  for (auto* p : prompts) {
    std::vector<float> mine(logits.begin() + offset * c.vocab_size,
                            logits.begin() + (offset + static_cast<int64_t>(p->input_ids.size())) * c.vocab_size);
    int agree = 0;
    EXPECT_LE(relative_error(*p, mine, c.vocab_size, &agree), bound) << p->name << " in a batch of 8";
    agree_total += agree;
    *positions += static_cast<int>(p->positions.size());
    offset += static_cast<int64_t>(p->input_ids.size());
  }
  return agree_total;
}

// forward_greedy returns each logits row's argmax (lowest id on ties) without the logits: every prompt position
// of the 7 prompts prefilled in one batch, against the argmax of forward()'s logits for the same batch.
void expect_greedy_ids_equal_logits_argmax(DeepSeekModel& model, const std::vector<ReferencePrompt>& reference) {
  const int64_t vocab = model.config().vocab_size;
  int64_t total = 0;
  for (const auto& ref : reference) total += static_cast<int64_t>(ref.input_ids.size());
  TestCache cache(model, total / kBlockTokens + static_cast<int64_t>(reference.size()) + 1);
  ForwardBatch batch;
  for (const auto& ref : reference) {
    const int32_t n = static_cast<int32_t>(ref.input_ids.size()), first = static_cast<int32_t>(batch.token_ids.size());
    batch.token_ids.insert(batch.token_ids.end(), ref.input_ids.begin(), ref.input_ids.end());
    batch.sequences.push_back({n, 0, cache.allocate(n)});
    for (int32_t r = 0; r < n; ++r) batch.logits_rows.push_back(first + r);
  }
  std::vector<float> logits;
  std::vector<int32_t> ids;
  ASSERT_TRUE(model.forward(batch, cache.pointers, logits).ok());
  ASSERT_TRUE(model.forward_greedy(batch, cache.pointers, ids).ok());
  ASSERT_EQ(ids.size(), batch.logits_rows.size());
  for (size_t r = 0; r < ids.size(); ++r) {
    ASSERT_EQ(ids[r], argmax(logits.data() + static_cast<int64_t>(r) * vocab, vocab)) << "row " << r;
  }
}

TEST_P(ExactnessTest, GreedyIdsEqualTheLogitsArgmax) { expect_greedy_ids_equal_logits_argmax(*model_, reference_); }

TEST_P(ExactnessTest, EightPromptsInOneBatch) {
  int positions = 0;
  EXPECT_EQ(run_eight_prompts(*model_, reference_, 1e-4, &positions), positions);
}

TEST_P(ExactnessTest, Bf16WeightsReportErrorAndArgmaxAgreement) {
  auto model = DeepSeekModel::load(dir_, *backend_, backend::Precision::kBF16);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  const int64_t vocab = (*model)->config().vocab_size;
  for (const ReferencePrompt& ref : reference_) {
    RunResult run = run_sequence(**model, ref.input_ids, 0, 16);
    int agree = 0;
    double error = relative_error(ref, run.logits, vocab, &agree);
    std::printf("[ %s bf16 %s ] relative error %.3g, argmax %d/%zu, greedy %s\n", GetParam().c_str(), ref.name.c_str(),
                error, agree, ref.positions.size(), run.greedy == ref.greedy ? "identical" : "differs");
    // bf16 checkpoints stay exact; FP8 x block scale rounded to bf16 moves logits by up to ~7% on these random
    // tiny weights (reported above). A sanity bound, not a tolerance.
    EXPECT_LE(error, 0.1) << ref.name;
  }
}

// The same prompts on the CUDA backend: bf16 activations and KV cache, prefilled whole and in chunks of 7, then 16
// greedy tokens; and the batch of 8. Weights as served: bf16, and for the FP8 fixture once in FP8 (the FP8 GEMMs
// quantize activations to e4m3 per 1x128, as DeepSeek's inference does: ~2% per GEMM) and once dequantized to bf16.
// Bounds: every prompt's relative error under 0.35 (a sanity bound: bf16 hidden states can flip a near-tie in the
// router, and a token routed to another expert moves its logits by 10-30%), and the argmax of at least 95% (bf16) or
// 80% (FP8 activations) of the positions equal to the reference's. Greedy agreement is reported.
void run_cuda_fixture(const std::string& fixture, const std::string& dir, const std::vector<ReferencePrompt>& reference,
                      backend::Precision precision, const char* label, int min_agree_percent) {
  Result<std::unique_ptr<backend::Backend>> cuda = backend::make_cuda_backend(0);
  if (!cuda.ok()) GTEST_SKIP() << cuda.status().to_string();
  auto model = DeepSeekModel::load(dir, **cuda, precision);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  const int64_t vocab = (*model)->config().vocab_size;
  for (int chunk : {0, 7}) {
    int agree_total = 0, positions = 0, greedy_same = 0;
    double worst = 0.0;
    for (const ReferencePrompt& ref : reference) {
      RunResult run = run_sequence(**model, ref.input_ids, chunk, 16);
      int agree = 0;
      double error = relative_error(ref, run.logits, vocab, &agree);
      worst = std::max(worst, error);
      agree_total += agree;
      positions += static_cast<int>(ref.positions.size());
      greedy_same += run.greedy == ref.greedy ? 1 : 0;
      EXPECT_LE(error, 0.35) << ref.name << " chunk " << chunk;
    }
    std::printf("[ %s cuda %s chunk %d ] worst relative error %.3g, argmax agreement %d/%d, greedy identical %d/%zu\n",
                fixture.c_str(), label, chunk, worst, agree_total, positions, greedy_same, reference.size());
    EXPECT_GE(agree_total * 100, positions * min_agree_percent) << "chunk " << chunk;
  }
  expect_greedy_ids_equal_logits_argmax(**model, reference);
  int positions = 0;
  int agree = run_eight_prompts(**model, reference, 0.35, &positions);
  std::printf("[ %s cuda %s batch of 8 ] argmax agreement %d/%d\n", fixture.c_str(), label, agree, positions);
  EXPECT_GE(agree * 100, positions * min_agree_percent);
}

TEST_P(ExactnessTest, CudaBackendWithBf16Weights) {
  run_cuda_fixture(GetParam(), dir_, reference_, backend::Precision::kBF16, "bf16", 95);
}

TEST_P(ExactnessTest, CudaBackendWithFp8Weights) {
  if (GetParam().find("fp8") == std::string::npos) GTEST_SKIP() << "a bf16 checkpoint";
  run_cuda_fixture(GetParam(), dir_, reference_, backend::Precision::kFP8, "fp8", 80);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ExactnessTest,
                         ::testing::Values("tiny-deepseek-v3", "tiny-deepseek-v2-lite", "tiny-deepseek-v3-fp8"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
}  // namespace deepinfer::model
