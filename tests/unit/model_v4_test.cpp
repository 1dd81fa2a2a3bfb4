// DeepSeek-V4 on the CPU against tests/data/models/tiny-deepseek-v4-official: reference logits from DeepSeek's own
// V4-Flash-0731 inference/model.py in float64 (see that folder's README). At every stored position the relative
// error max|ours - ref| / max|ref| is <= 1e-4, the argmax equals the reference's at EVERY prompt position, and the
// 16 greedy tokens are identical - for the whole prompt in one forward, in chunks of 1, 7 and 64 tokens, and with
// the seven prompts in one batch (mixed chunk sizes). Also the config errors and the forward's argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/model/deepseek_v4.h"
#include "deepinfer/model/safetensors.h"
#include "logits_compare.h"
#include "temp_dir.h"
#include "test_data.h"

namespace deepinfer::model {
namespace {

using deepinfer::testing::argmax;

const std::string kFixture = "tests/data/models/tiny-deepseek-v4-official";
constexpr int kPrompts = 7;
constexpr int kGreedy = 16;

struct V4Reference {
  std::vector<int32_t> ids, positions, argmax, greedy;
  std::vector<float> logits;  // [positions][vocab]
};

std::vector<int32_t> as_i32(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

V4Reference load_prompt(const Checkpoint& ref, int i) {
  const std::string p = "prompt_" + std::to_string(i) + ".";
  V4Reference r;
  const TensorView* ids = ref.find(p + "input_ids");
  const TensorView* positions = ref.find(p + "positions");
  EXPECT_NE(ids, nullptr);
  EXPECT_NE(positions, nullptr);
  r.ids = as_i32(*ref.load_i64(p + "input_ids", ids->shape));
  r.positions = as_i32(*ref.load_i64(p + "positions", positions->shape));
  r.argmax = as_i32(*ref.load_i64(p + "argmax", ids->shape));
  r.greedy = as_i32(*ref.load_i64(p + "greedy", std::vector<int64_t>{kGreedy}));
  r.logits = *ref.load_f32(p + "logits", ref.find(p + "logits")->shape);
  return r;
}

class V4Test : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    backend_ = backend::make_cpu_backend().release();
    auto model = DeepSeekV4Model::load(deepinfer::testing::source_path(kFixture), *backend_);
    ASSERT_TRUE(model.ok()) << model.status().to_string();
    model_ = model->release();
    auto ref = Checkpoint::open(deepinfer::testing::source_path(kFixture + "/reference.safetensors"));
    ASSERT_TRUE(ref.ok()) << ref.status().to_string();
    for (int i = 0; i < kPrompts; ++i) prompts_.push_back(load_prompt(**ref, i));
  }
  static void TearDownTestSuite() {
    delete model_;
    delete backend_;
  }

  // Max over the stored positions of max|a - b| / max|b|; counts argmax disagreements at every prompt position.
  static double check(const V4Reference& r, const std::vector<float>& logits, int* argmax_wrong) {
    const int64_t vocab = model_->config().vocab_size;
    double worst = 0.0;
    for (size_t k = 0; k < r.positions.size(); ++k) {
      const float* a = logits.data() + r.positions[k] * vocab;
      const float* b = r.logits.data() + k * vocab;
      double diff = 0.0, norm = 0.0;
      for (int64_t v = 0; v < vocab; ++v) {
        diff = std::max(diff, std::fabs(static_cast<double>(a[v]) - b[v]));
        norm = std::max(norm, std::fabs(static_cast<double>(b[v])));
      }
      worst = std::max(worst, diff / norm);
    }
    *argmax_wrong = 0;
    for (size_t t = 0; t < r.ids.size(); ++t) *argmax_wrong += argmax(logits.data() + t * vocab, vocab) != r.argmax[t];
    return worst;
  }

  // Feeds the prompt in chunks of `chunk` (0: whole), logits at every position; then kGreedy greedy tokens.
  static void run(const V4Reference& r, int chunk, std::vector<float>& logits, std::vector<int32_t>& greedy) {
    const int64_t vocab = model_->config().vocab_size;
    auto sequence = model_->new_sequence();
    logits.clear();
    const int n = static_cast<int>(r.ids.size());
    std::vector<float> out;
    for (int done = 0; done < n;) {
      int len = chunk == 0 ? n : std::min(chunk, n - done);
      DeepSeekV4Model::Chunk c{sequence.get(), std::span<const int32_t>(r.ids.data() + done, len),
                                 DeepSeekV4Model::Logits::kAll};
      Status s = model_->forward(std::span<const DeepSeekV4Model::Chunk>(&c, 1), out);
      ASSERT_TRUE(s.ok()) << s.to_string();
      ASSERT_EQ(out.size(), static_cast<size_t>(len * vocab));
      logits.insert(logits.end(), out.begin(), out.end());
      done += len;
    }
    greedy.clear();
    int32_t next = argmax(logits.data() + (n - 1) * vocab, vocab);
    for (int i = 0; i < kGreedy; ++i) {
      greedy.push_back(next);
      if (i + 1 == kGreedy) break;
      DeepSeekV4Model::Chunk c{sequence.get(), std::span<const int32_t>(&greedy.back(), 1)};
      Status s = model_->forward(std::span<const DeepSeekV4Model::Chunk>(&c, 1), out);
      ASSERT_TRUE(s.ok()) << s.to_string();
      next = argmax(out.data(), vocab);
    }
    EXPECT_EQ(sequence->length(), n + kGreedy - 1);
  }

  static backend::Backend* backend_;
  static DeepSeekV4Model* model_;
  static std::vector<V4Reference> prompts_;
};

backend::Backend* V4Test::backend_ = nullptr;
DeepSeekV4Model* V4Test::model_ = nullptr;
std::vector<V4Reference> V4Test::prompts_;

class V4Chunking : public V4Test, public ::testing::WithParamInterface<int> {};

TEST_P(V4Chunking, MatchesDeepSeekReference) {
  const int chunk = GetParam();
  for (int i = 0; i < kPrompts; ++i) {
    const V4Reference& r = prompts_[i];
    std::vector<float> logits;
    std::vector<int32_t> greedy;
    run(r, chunk, logits, greedy);
    int wrong = 0;
    double error = check(r, logits, &wrong);
    std::printf("{\"test\":\"v4_exactness\",\"chunk\":%d,\"prompt\":%d,\"tokens\":%zu,\"max_rel_error\":%.3g,"
                "\"argmax_wrong\":%d,\"greedy_equal\":%s}\n",
                chunk, i, r.ids.size(), error, wrong, greedy == r.greedy ? "true" : "false");
    EXPECT_LE(error, 1e-4) << "prompt " << i << " chunk " << chunk;
    EXPECT_EQ(wrong, 0) << "prompt " << i << " chunk " << chunk;
    EXPECT_EQ(greedy, r.greedy) << "prompt " << i << " chunk " << chunk;
  }
}

INSTANTIATE_TEST_SUITE_P(Chunks, V4Chunking, ::testing::Values(0, 1, 7, 64));

// All seven prompts in one batch per step, each fed in its own chunk size, so that one forward mixes prefill
// chunks of different lengths and positions.
TEST_F(V4Test, BatchedPromptsMatchReference) {
  const int64_t vocab = model_->config().vocab_size;
  const int sizes[kPrompts] = {1, 3, 7, 64, 50, 128, 129};
  std::vector<std::unique_ptr<V4Sequence>> sequences;
  std::vector<std::vector<float>> logits(kPrompts);
  for (int i = 0; i < kPrompts; ++i) sequences.push_back(model_->new_sequence());
  std::vector<size_t> done(kPrompts, 0);
  std::vector<float> out;
  for (;;) {
    std::vector<DeepSeekV4Model::Chunk> chunks;
    std::vector<int> owner;
    for (int i = 0; i < kPrompts; ++i) {
      const size_t n = prompts_[i].ids.size();
      if (done[i] == n) continue;
      const size_t len = std::min<size_t>(sizes[i], n - done[i]);
      chunks.push_back({sequences[i].get(), std::span<const int32_t>(prompts_[i].ids.data() + done[i], len),
                        DeepSeekV4Model::Logits::kAll});
      owner.push_back(i);
    }
    if (chunks.empty()) break;
    Status s = model_->forward(chunks, out);
    ASSERT_TRUE(s.ok()) << s.to_string();
    size_t row = 0;
    for (size_t k = 0; k < chunks.size(); ++k) {
      const size_t len = chunks[k].token_ids.size();
      logits[owner[k]].insert(logits[owner[k]].end(), out.begin() + row * vocab, out.begin() + (row + len) * vocab);
      row += len;
      done[owner[k]] += len;
    }
    ASSERT_EQ(row * vocab, out.size());
  }
  for (int i = 0; i < kPrompts; ++i) {
    int wrong = 0;
    double error = check(prompts_[i], logits[i], &wrong);
    EXPECT_LE(error, 1e-4) << "prompt " << i;
    EXPECT_EQ(wrong, 0) << "prompt " << i;
  }
}

TEST_F(V4Test, ForwardRejectsBadArguments) {
  auto a = model_->new_sequence();
  std::vector<float> out;
  std::vector<int32_t> bad = {5, 1024};
  DeepSeekV4Model::Chunk c{a.get(), bad};
  Status s = model_->forward(std::span<const DeepSeekV4Model::Chunk>(&c, 1), out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("token id 1024"), std::string::npos) << s.to_string();
  EXPECT_EQ(a->length(), 0);  // unchanged
  std::vector<int32_t> good = {5, 6};
  DeepSeekV4Model::Chunk twice[2] = {{a.get(), good}, {a.get(), good}};
  s = model_->forward(twice, out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  DeepSeekV4Model::Chunk empty{a.get(), {}};
  EXPECT_EQ(model_->forward(std::span<const DeepSeekV4Model::Chunk>(&empty, 1), out).code(),
            StatusCode::kInvalidArgument);
}

// Config errors name the field; the V2/V3 loader points V4 checkpoints elsewhere.
TEST(V4Config, ErrorsNameTheField) {
  deepinfer::testing::TempDir dir;
  std::string base = deepinfer::testing::read_file(deepinfer::testing::source_path(kFixture + "/config.json"));
  auto with = [&](const std::string& from, const std::string& to) {
    std::string text = base;
    size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    std::ofstream(dir.path() / "config.json") << text;
    return load_v4_config(dir.path());
  };
  auto c = with("\"o_groups\": 2", "\"o_groups\": 3");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("'o_groups'"), std::string::npos) << c.status().to_string();
  c = with("128,\n    4\n  ]", "128\n  ]");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("'compress_ratios'"), std::string::npos) << c.status().to_string();
  c = with("\"num_key_value_heads\": 1", "\"num_key_value_heads\": 2");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("one shared KV head"), std::string::npos) << c.status().to_string();
  c = with("\"index_topk\": 16,", "\"index_topk\": 16, \"quantization_config\": {\"quant_method\": \"fp8\"},");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnsupported);
  c = with("\"head_dim\": 64,", "");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("missing required field 'head_dim'"), std::string::npos) << c.status().to_string();

  auto ok = load_v4_config(deepinfer::testing::source_path(kFixture));
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(ok->compress_ratios, (std::vector<int64_t>{0, 4, 128, 4}));
  EXPECT_EQ(ok->rope_scaling.original_max_position_embeddings, 256);
  auto type = read_model_type(deepinfer::testing::source_path(kFixture));
  ASSERT_TRUE(type.ok());
  EXPECT_EQ(*type, "deepseek_v4");
  auto v3 = load_model_config(deepinfer::testing::source_path(kFixture));
  ASSERT_FALSE(v3.ok());
  EXPECT_NE(v3.status().message().find("DeepSeek-V4"), std::string::npos) << v3.status().to_string();
}

}  // namespace
}  // namespace deepinfer::model
