// Safetensors and checkpoint tests: exact dtype conversions (FP8 E4M3 against hand-computed values), every
// tensor of the three fixture checkpoints against the names and shapes their config implies, FP8 block
// dequantization with partial edge blocks, the fixtures' reference.safetensors, a sharded checkpoint built from
// a fixture, and a table of broken files that must fail with the file and tensor named, never crash.
#include "deepinfer/model/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <boost/json.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <thread>

#include "deepinfer/model/config.h"
#include "deepinfer/model/tensor_names.h"

namespace deepinfer::model {
namespace {

namespace json = boost::json;
namespace fs = std::filesystem;

constexpr const char* kModelsDir = DEEPINFER_SOURCE_DIR "/tests/data/models";
const char* const kFixtures[] = {"tiny-deepseek-v3", "tiny-deepseek-v2-lite", "tiny-deepseek-v3-fp8"};

// ---------------------------------------------------------------------------------------------------------
// Helpers

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("deepinfer_safetensors_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string le64(uint64_t value) {
  std::string out(8, '\0');
  std::memcpy(out.data(), &value, 8);
  return out;
}

// A safetensors file from its parts: header size as written (may lie), header text, data.
std::string raw_file(uint64_t header_size, const std::string& header, const std::string& data) {
  return le64(header_size) + header + data;
}
std::string raw_file(const std::string& header, const std::string& data) {
  return raw_file(header.size(), header, data);
}

struct RawTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

// A well-formed safetensors file, tensors laid out in the given order, header padded with spaces to 8 bytes
// as the reference writer does.
std::string build_safetensors(const std::vector<RawTensor>& tensors, const json::object& metadata = {}) {
  json::object header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string data;
  for (const RawTensor& tensor : tensors) {
    json::array shape;
    for (int64_t dim : tensor.shape) shape.push_back(dim);
    header[tensor.name] = json::object{{"dtype", tensor.dtype},
                                       {"shape", shape},
                                       {"data_offsets", json::array{data.size(), data.size() + tensor.bytes.size()}}};
    data += tensor.bytes;
  }
  std::string text = json::serialize(header);
  text.append((8 - text.size() % 8) % 8, ' ');
  return raw_file(text, data);
}

std::string f32_bytes(std::initializer_list<float> values) {
  std::string out(values.size() * 4, '\0');
  size_t i = 0;
  for (float v : values) std::memcpy(out.data() + 4 * (i++), &v, 4);
  return out;
}

RawTensor raw_of(const TensorView& tensor) {
  return {tensor.name, std::string(dtype_name(tensor.dtype)), tensor.shape,
          std::string(reinterpret_cast<const char*>(tensor.data), tensor.size_bytes)};
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// E4M3FN by its definition, written independently of the library's bit manipulation.
double f8_e4m3_reference(uint8_t bits) {
  const double sign = (bits & 0x80) ? -1.0 : 1.0;
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  if (exponent == 15 && mantissa == 7) return std::nan("");
  if (exponent == 0) return sign * std::ldexp(mantissa / 8.0, 1 - 7);
  return sign * std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
}

std::unique_ptr<Checkpoint> open_checkpoint(const fs::path& path) {
  Result<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::open(path);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status().to_string();
  return checkpoint.ok() ? std::move(checkpoint).value() : nullptr;
}

ModelConfig fixture_config(const std::string& fixture) {
  Result<ModelConfig> config = load_model_config(fs::path(kModelsDir) / fixture);
  EXPECT_TRUE(config.ok()) << config.status().to_string();
  return config.ok() ? *config : ModelConfig{};
}

double rms(const std::vector<float>& values) {
  double sum = 0.0;
  for (float v : values) sum += static_cast<double>(v) * v;
  return std::sqrt(sum / static_cast<double>(values.size()));
}

// ---------------------------------------------------------------------------------------------------------
// dtype conversions

TEST(DTypeTest, NamesAndSizes) {
  EXPECT_EQ(dtype_name(DType::kF8E4M3), "F8_E4M3");
  EXPECT_EQ(dtype_name(DType::kBF16), "BF16");
  EXPECT_EQ(dtype_name(DType::kBool), "BOOL");
  EXPECT_EQ(dtype_size(DType::kF64), 8u);
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kI32), 4u);
  EXPECT_EQ(dtype_size(DType::kBool), 1u);
}

TEST(DTypeTest, F8E4M3HandComputedValues) {
  const std::vector<std::pair<uint8_t, float>> table = {
      {0x00, 0.0f},          {0x38, 1.0f},   {0x30, 0.5f},    {0x40, 2.0f},   {0x3C, 1.5f},         {0x3F, 1.875f},
      {0x7E, 448.0f},        {0x7D, 416.0f}, {0x78, 256.0f},  {0x77, 240.0f}, {0x01, 0.001953125f},  // 2^-9, smallest
                                                                                                     // subnormal
      {0x07, 0.013671875f},  // 7 * 2^-9, largest subnormal
      {0x08, 0.015625f},     // 2^-6, smallest normal
      {0x81, -0.001953125f}, {0xB8, -1.0f},  {0xFE, -448.0f}, {0xC0, -2.0f},
  };
  for (const auto& [bits, value] : table) {
    EXPECT_EQ(f8_e4m3_to_f32(bits), value) << "bits 0x" << std::hex << int(bits);
  }
  EXPECT_EQ(std::bit_cast<uint32_t>(f8_e4m3_to_f32(0x80)), 0x80000000u);  // -0.0
  EXPECT_EQ(std::bit_cast<uint32_t>(f8_e4m3_to_f32(0x00)), 0x00000000u);
  EXPECT_TRUE(std::isnan(f8_e4m3_to_f32(0x7F)));
  EXPECT_TRUE(std::isnan(f8_e4m3_to_f32(0xFF)));
}

TEST(DTypeTest, F8E4M3FullTableMatchesDefinition) {
  int nan_count = 0;
  float previous = -1.0f;
  for (int bits = 0; bits < 256; ++bits) {
    const float value = f8_e4m3_to_f32(static_cast<uint8_t>(bits));
    const double reference = f8_e4m3_reference(static_cast<uint8_t>(bits));
    if (std::isnan(reference)) {
      EXPECT_TRUE(std::isnan(value)) << bits;
      ++nan_count;
      continue;
    }
    EXPECT_EQ(static_cast<double>(value), reference) << "bits " << bits;
    EXPECT_FALSE(std::isinf(value)) << "e4m3fn has no infinities: bits " << bits;
    EXPECT_LE(std::fabs(value), 448.0f);
    if (bits < 0x7F) {  // positive codes increase strictly
      EXPECT_GT(value, previous) << bits;
      previous = value;
    }
  }
  EXPECT_EQ(nan_count, 2);
}

TEST(DTypeTest, F16ExactIncludingSubnormalsInfAndNan) {
  EXPECT_EQ(f16_to_f32(0x3C00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xC000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x3555), 0.333251953125f);
  EXPECT_EQ(f16_to_f32(0x7BFF), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x0400), std::ldexp(1.0f, -14));     // smallest normal
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));     // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x03FF), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(f16_to_f32(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x7C00), INFINITY);
  EXPECT_EQ(f16_to_f32(0xFC00), -INFINITY);
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7E00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7C01)));
  EXPECT_EQ(std::bit_cast<uint32_t>(f16_to_f32(0x8000)), 0x80000000u);
  // Every finite half against its definition.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const int exponent = (bits >> 10) & 0x1F;
    if (exponent == 0x1F) continue;
    const int mantissa = bits & 0x3FF;
    double reference = exponent == 0 ? std::ldexp(mantissa, -24) : std::ldexp(1024 + mantissa, exponent - 25);
    if (bits & 0x8000) reference = -reference;
    ASSERT_EQ(static_cast<double>(f16_to_f32(static_cast<uint16_t>(bits))), reference) << bits;
  }
}

TEST(DTypeTest, Bf16IsTheUpperHalfOfFloat32) {
  EXPECT_EQ(bf16_to_f32(0x3F80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0xC040), -3.0f);
  EXPECT_EQ(bf16_to_f32(0x7F80), INFINITY);
  EXPECT_TRUE(std::isnan(bf16_to_f32(0x7FC0)));
  EXPECT_EQ(bf16_to_f32(0x0001), std::bit_cast<float>(0x00010000u));  // a float32 subnormal
  for (uint32_t bits = 0; bits < 0x10000; bits += 7) {
    EXPECT_EQ(std::bit_cast<uint32_t>(bf16_to_f32(static_cast<uint16_t>(bits))), bits << 16);
  }
}

// ---------------------------------------------------------------------------------------------------------
// The fixtures

// Every tensor a fixture holds is one the config implies (plus FP8 scales), with the implied shape and dtype,
// and every tensor the config requires is there.
TEST(FixtureCheckpointTest, TensorNamesAndShapesMatchConfig) {
  for (const char* fixture : kFixtures) {
    SCOPED_TRACE(fixture);
    const ModelConfig config = fixture_config(fixture);
    std::unique_ptr<Checkpoint> checkpoint = open_checkpoint(fs::path(kModelsDir) / fixture);
    ASSERT_NE(checkpoint, nullptr);
    const bool fp8 = config.quant_method == "fp8";
    std::set<std::string> expected_names;
    for (const ExpectedTensor& spec : expected_tensors(config)) {
      const TensorView* tensor = checkpoint->find(spec.name);
      if (tensor == nullptr) {
        EXPECT_FALSE(spec.required) << "missing " << spec.name;
        continue;
      }
      expected_names.insert(spec.name);
      EXPECT_EQ(tensor->shape, spec.shape) << spec.name;
      const DType want = fp8 && spec.fp8_quantizable ? DType::kF8E4M3 : DType::kBF16;
      EXPECT_EQ(tensor->dtype, want) << spec.name;
      if (fp8 && spec.fp8_quantizable) {
        const std::string scale_name = scale_inv_name(spec.name);
        expected_names.insert(scale_name);
        const TensorView* scale = checkpoint->find(scale_name);
        ASSERT_NE(scale, nullptr) << scale_name;
        EXPECT_EQ(scale->dtype, DType::kF32);
        EXPECT_EQ(scale->shape, std::vector<int64_t>({(spec.shape[0] + 127) / 128, (spec.shape[1] + 127) / 128}));
      }
    }
    const std::vector<std::string> names = checkpoint->names();
    EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), expected_names);
    EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  }
}

TEST(FixtureCheckpointTest, ExpectedTensorCounts) {
  // tiny-deepseek-v3: embed, norm, lm_head; 3 layers + 1 MTP layer. Per layer 2 norms + 7 attention tensors
  // with q-LoRA; dense layer 0: 3 MLP weights; MoE layers: gate + bias + 16 * 3 experts + 3 shared = 53;
  // the MTP layer adds enorm, hnorm, eh_proj, embed_tokens and shared_head.{norm,head}.
  const ModelConfig v3 = fixture_config("tiny-deepseek-v3");
  EXPECT_EQ(expected_tensors(v3).size(), 3u + (9 + 3) + 2 * (9 + 53) + (6 + 9 + 53));
  // tiny-deepseek-v2-lite: q_proj (5 attention tensors), no bias, no MTP.
  const ModelConfig v2 = fixture_config("tiny-deepseek-v2-lite");
  EXPECT_EQ(expected_tensors(v2).size(), 3u + (7 + 3) + 2 * (7 + 52));
  // DeepSeek-V3's layer structure: 3 dense layers, 58 MoE layers of 256 experts, MTP layer 61.
  ModelConfig real = v3;
  real.num_hidden_layers = 61;
  real.first_k_dense_replace = 3;
  real.n_routed_experts = 256;
  const std::vector<ExpectedTensor> real_tensors = expected_tensors(real);
  const size_t moe_layer = 9 + 2 + 256 * 3 + 3;
  EXPECT_EQ(real_tensors.size(), 3u + 3 * (9 + 3) + 58 * moe_layer + 6 + moe_layer);
  EXPECT_EQ(real_tensors.back().name, "model.layers.61.mlp.shared_experts.down_proj.weight");
  size_t quantizable = 0;
  for (const ExpectedTensor& spec : real_tensors) quantizable += spec.fp8_quantizable ? 1 : 0;
  EXPECT_EQ(quantizable, 62u * 5 + 3u * 3 + 59u * (256 * 3 + 3));  // attention 5 per layer; MLP weights
}

TEST(FixtureCheckpointTest, EveryTensorLoadsAsFloat32WithProgress) {
  for (const char* fixture : kFixtures) {
    SCOPED_TRACE(fixture);
    const ModelConfig config = fixture_config(fixture);
    std::unique_ptr<Checkpoint> checkpoint = open_checkpoint(fs::path(kModelsDir) / fixture);
    ASSERT_NE(checkpoint, nullptr);
    const std::vector<ExpectedTensor> expected = expected_tensors(config);
    std::vector<std::pair<size_t, size_t>> calls;
    Result<std::vector<std::vector<float>>> loaded = load_all_f32(
        *checkpoint, config, expected, [&](size_t done, size_t total) { calls.emplace_back(done, total); });
    ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
    ASSERT_EQ(loaded->size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      int64_t numel = 1;
      for (int64_t dim : expected[i].shape) numel *= dim;
      ASSERT_EQ(static_cast<int64_t>((*loaded)[i].size()), numel) << expected[i].name;
      for (float v : (*loaded)[i]) ASSERT_TRUE(std::isfinite(v)) << expected[i].name;
    }
    // Progress: starts at 0, never goes back, ends at the total, which covers every byte of the checkpoint here.
    ASSERT_GE(calls.size(), 2u);
    EXPECT_EQ(calls.front().first, 0u);
    EXPECT_EQ(calls.back().first, calls.back().second);
    EXPECT_EQ(calls.back().second, checkpoint->total_bytes());
    for (size_t i = 1; i < calls.size(); ++i) EXPECT_GE(calls[i].first, calls[i - 1].first);
  }
}

TEST(FixtureCheckpointTest, Bf16LoadsBitExact) {
  std::unique_ptr<Checkpoint> checkpoint = open_checkpoint(fs::path(kModelsDir) / "tiny-deepseek-v3");
  ASSERT_NE(checkpoint, nullptr);
  const std::string name = "model.layers.1.self_attn.kv_b_proj.weight";
  const TensorView* tensor = checkpoint->find(name);
  ASSERT_NE(tensor, nullptr);
  Result<std::vector<float>> values = checkpoint->load_f32(name, std::vector<int64_t>{256, 64});
  ASSERT_TRUE(values.ok()) << values.status().to_string();
  for (size_t i = 0; i < values->size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, tensor->data + 2 * i, 2);
    ASSERT_EQ(std::bit_cast<uint32_t>((*values)[i]), static_cast<uint32_t>(bits) << 16) << i;
  }
}

// w = e4m3(q) * scale_inv[r / 128][c / 128] on every element, edge blocks included: kv_a_proj_with_mqa is
// [160, 256] (rows 128..159 form a partial block), q_a_proj [128, 256], q_b_proj [384, 128].
TEST(FixtureCheckpointTest, Fp8DequantizationPerBlockWithPartialEdgeBlocks) {
  std::unique_ptr<Checkpoint> checkpoint = open_checkpoint(fs::path(kModelsDir) / "tiny-deepseek-v3-fp8");
  ASSERT_NE(checkpoint, nullptr);
  for (const std::string role : {"self_attn.kv_a_proj_with_mqa", "self_attn.q_b_proj", "mlp.experts.7.down_proj"}) {
    const std::string name =
        "model.layers." + std::string(role.starts_with("mlp") ? "2" : "0") + "." + role + ".weight";
    SCOPED_TRACE(name);
    const TensorView* weight = checkpoint->find(name);
    const TensorView* scale = checkpoint->find(name + "_scale_inv");
    ASSERT_NE(weight, nullptr);
    ASSERT_NE(scale, nullptr);
    const int64_t rows = weight->shape[0], cols = weight->shape[1];
    const int64_t scale_cols = scale->shape[1];
    Result<std::vector<float>> values = checkpoint->load_f32(name, weight->shape);
    ASSERT_TRUE(values.ok()) << values.status().to_string();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        float s;
        std::memcpy(&s, scale->data + 4 * ((r / 128) * scale_cols + c / 128), 4);
        const uint8_t q = static_cast<uint8_t>(weight->data[r * cols + c]);
        const float want = static_cast<float>(f8_e4m3_reference(q)) * s;
        ASSERT_EQ((*values)[r * cols + c], want) << "row " << r << " col " << c;
      }
    }
  }
  // A different block size than the scales were made for is caught.
  Result<std::vector<float>> wrong_block = checkpoint->load_f32("model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                                                                std::vector<int64_t>{160, 256}, 64, 128);
  ASSERT_FALSE(wrong_block.ok());
  EXPECT_EQ(wrong_block.status().code(), StatusCode::kCorruption);
  EXPECT_NE(wrong_block.status().message().find("kv_a_proj_with_mqa.weight_scale_inv"), std::string::npos);
}

// The FP8 fixture's dequantized weights look like the bf16 fixture's for the same roles (both are random
// weights of the same initialisation scale per fan-in).
TEST(FixtureCheckpointTest, Fp8MagnitudesResembleBf16Fixture) {
  std::unique_ptr<Checkpoint> fp8 = open_checkpoint(fs::path(kModelsDir) / "tiny-deepseek-v3-fp8");
  std::unique_ptr<Checkpoint> bf16 = open_checkpoint(fs::path(kModelsDir) / "tiny-deepseek-v3");
  ASSERT_NE(fp8, nullptr);
  ASSERT_NE(bf16, nullptr);
  const std::vector<std::string> names = {
      "model.layers.0.self_attn.q_a_proj.weight",
      "model.layers.0.self_attn.q_b_proj.weight",
      "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
      "model.layers.0.self_attn.kv_b_proj.weight",
      "model.layers.0.self_attn.o_proj.weight",
      "model.layers.0.mlp.gate_proj.weight",
      "model.layers.0.mlp.down_proj.weight",
      "model.layers.1.mlp.experts.3.gate_proj.weight",
      "model.layers.1.mlp.experts.3.down_proj.weight",
      "model.layers.2.mlp.shared_experts.up_proj.weight",
  };
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    Result<std::vector<float>> a = fp8->load_f32(name, fp8->find(name)->shape);
    Result<std::vector<float>> b = bf16->load_f32(name, bf16->find(name)->shape);
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    const double rms_fp8 = rms(*a), rms_bf16 = rms(*b);
    EXPECT_GT(rms_fp8, 0.01);
    EXPECT_LT(rms_fp8, 0.5);
    EXPECT_GT(rms_fp8 / rms_bf16, 0.4) << rms_fp8 << " vs " << rms_bf16;
    EXPECT_LT(rms_fp8 / rms_bf16, 2.5) << rms_fp8 << " vs " << rms_bf16;
    float max_abs = 0.0f;
    for (float v : *a) max_abs = std::max(max_abs, std::fabs(v));
    EXPECT_LT(max_abs, 1.0f);  // 448 * scale_inv (about 6e-4 here)
  }
}

TEST(FixtureCheckpointTest, ReferenceOutputsLoad) {
  const std::vector<int64_t> lengths = {1, 5, 17, 64, 129, 300, 600};
  for (const char* fixture : kFixtures) {
    SCOPED_TRACE(fixture);
    const fs::path path = fs::path(kModelsDir) / fixture / "reference.safetensors";
    Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::open(path);
    ASSERT_TRUE(file.ok()) << file.status().to_string();
    const auto& metadata = (*file)->metadata();
    auto lengths_entry =
        std::find_if(metadata.begin(), metadata.end(), [](const auto& kv) { return kv.first == "lengths"; });
    ASSERT_NE(lengths_entry, metadata.end());
    EXPECT_EQ(lengths_entry->second, "[1, 5, 17, 64, 129, 300, 600]");
    EXPECT_EQ((*file)->tensors().size(), 4 * lengths.size());

    std::unique_ptr<Checkpoint> reference = open_checkpoint(path);  // a single file opens as a checkpoint too
    ASSERT_NE(reference, nullptr);
    for (size_t i = 0; i < lengths.size(); ++i) {
      const std::string prefix = "prompt_" + std::to_string(i) + ".";
      const int64_t n = lengths[i];
      Result<std::vector<int64_t>> ids = reference->load_i64(prefix + "input_ids", std::vector<int64_t>{n});
      ASSERT_TRUE(ids.ok()) << ids.status().to_string();
      for (int64_t id : *ids) EXPECT_TRUE(id >= 3 && id < 1024) << id;

      const TensorView* positions_view = reference->find(prefix + "positions");
      ASSERT_NE(positions_view, nullptr);
      EXPECT_EQ(positions_view->dtype, DType::kI32);
      ASSERT_EQ(positions_view->shape.size(), 1u);
      const int64_t k = positions_view->shape[0];
      // All positions up to 64 tokens; else the first 16, the last 16 and the listed ones in between.
      static constexpr int64_t kListed[] = {63, 64, 127, 128, 129, 255, 256};
      const int64_t listed_between =
          std::count_if(std::begin(kListed), std::end(kListed), [&](int64_t p) { return p >= 16 && p < n - 16; });
      EXPECT_EQ(k, n <= 64 ? n : 32 + listed_between);
      Result<std::vector<int64_t>> positions = reference->load_i64(prefix + "positions", std::vector<int64_t>{k});
      ASSERT_TRUE(positions.ok());
      EXPECT_TRUE(std::is_sorted(positions->begin(), positions->end()));
      EXPECT_EQ(positions->front(), 0);
      EXPECT_EQ(positions->back(), n - 1);

      Result<std::vector<float>> logits = reference->load_f32(prefix + "logits", std::vector<int64_t>{k, 1024});
      ASSERT_TRUE(logits.ok()) << logits.status().to_string();
      for (float v : *logits) ASSERT_TRUE(std::isfinite(v));
      EXPECT_GT(rms(*logits), 0.0);

      Result<std::vector<int64_t>> greedy = reference->load_i64(prefix + "greedy", std::vector<int64_t>{16});
      ASSERT_TRUE(greedy.ok());
      for (int64_t id : *greedy) EXPECT_TRUE(id >= 0 && id < 1024) << id;

      // Integers are not floats and vice versa: each loader says so.
      Result<std::vector<float>> ids_as_float = reference->load_f32(prefix + "input_ids", std::vector<int64_t>{n});
      ASSERT_FALSE(ids_as_float.ok());
      EXPECT_EQ(ids_as_float.status().code(), StatusCode::kUnsupported);
      EXPECT_NE(ids_as_float.status().message().find("I32"), std::string::npos);
      EXPECT_FALSE(reference->load_i64(prefix + "logits", std::vector<int64_t>{k, 1024}).ok());
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Sharded checkpoints

// Splits a fixture's tensors alternately into two shards plus an index, like `save_pretrained` does.
void write_sharded_copy(const Checkpoint& source, const fs::path& dir, json::object* weight_map_out = nullptr) {
  std::vector<RawTensor> shards[2];
  json::object weight_map;
  const char* shard_names[2] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
  size_t index = 0;
  for (const std::string& name : source.names()) {
    shards[index % 2].push_back(raw_of(*source.find(name)));
    weight_map[name] = shard_names[index % 2];
    ++index;
  }
  for (int s = 0; s < 2; ++s) write_bytes(dir / shard_names[s], build_safetensors(shards[s], {{"format", "pt"}}));
  json::object index_json{{"metadata", json::object{{"total_size", source.total_bytes()}}}, {"weight_map", weight_map}};
  write_bytes(dir / "model.safetensors.index.json", json::serialize(index_json));
  if (weight_map_out != nullptr) *weight_map_out = weight_map;
}

TEST(ShardedCheckpointTest, LoadsTheSameValuesAsTheSingleFile) {
  for (const char* fixture : {"tiny-deepseek-v3", "tiny-deepseek-v3-fp8"}) {
    SCOPED_TRACE(fixture);
    std::unique_ptr<Checkpoint> single = open_checkpoint(fs::path(kModelsDir) / fixture);
    ASSERT_NE(single, nullptr);
    TempDir dir;
    write_sharded_copy(*single, dir.path());
    std::unique_ptr<Checkpoint> sharded = open_checkpoint(dir.path());
    ASSERT_NE(sharded, nullptr);
    ASSERT_EQ(sharded->names(), single->names());
    EXPECT_EQ(sharded->total_bytes(), single->total_bytes());
    const ModelConfig config = fixture_config(fixture);
    std::set<std::string> shard_files;
    for (const ExpectedTensor& spec : expected_tensors(config)) {
      if (single->find(spec.name) == nullptr) continue;
      Result<std::vector<float>> a = single->load_f32(spec.name, spec.shape);
      Result<std::vector<float>> b = sharded->load_f32(spec.name, spec.shape);
      ASSERT_TRUE(a.ok() && b.ok()) << a.status().to_string() << " / " << b.status().to_string();
      ASSERT_EQ(a->size(), b->size());
      ASSERT_EQ(std::memcmp(a->data(), b->data(), a->size() * sizeof(float)), 0) << spec.name;
      shard_files.insert(sharded->file_of(spec.name)->path().filename().string());
    }
    EXPECT_EQ(shard_files.size(), 2u);
  }
}

struct BrokenIndexCase {
  std::string label;
  std::function<void(const fs::path& dir, json::object& weight_map)> mutate;  // the index is rewritten after
  StatusCode code;
  std::vector<std::string> message_parts;
};

TEST(ShardedCheckpointTest, BrokenIndexesNameIndexShardAndTensor) {
  std::unique_ptr<Checkpoint> source = open_checkpoint(fs::path(kModelsDir) / "tiny-deepseek-v3");
  ASSERT_NE(source, nullptr);
  const std::string tensor = "model.norm.weight";
  const std::vector<BrokenIndexCase> cases = {
      {"shard missing",
       [&](const fs::path&, json::object& map) { map[tensor] = "model-00003-of-00003.safetensors"; },
       StatusCode::kNotFound,
       {"model-00003-of-00003.safetensors", "model.safetensors.index.json"}},
      {"tensor in the other shard",
       [&](const fs::path&, json::object& map) {
         map[tensor] = map[tensor].as_string() == "model-00001-of-00002.safetensors"
                           ? "model-00002-of-00002.safetensors"
                           : "model-00001-of-00002.safetensors";
       },
       StatusCode::kCorruption,
       {tensor, "does not hold it"}},
      {"tensor in no shard",
       [&](const fs::path&, json::object& map) { map["model.extra.weight"] = "model-00001-of-00002.safetensors"; },
       StatusCode::kCorruption,
       {"model.extra.weight"}},
      {"shard outside the directory",
       [&](const fs::path&, json::object& map) { map[tensor] = "../model.safetensors"; },
       StatusCode::kCorruption,
       {tensor, "../model.safetensors", "plain file name"}},
      {"shard not a string",
       [&](const fs::path&, json::object& map) { map[tensor] = 3; },
       StatusCode::kCorruption,
       {tensor}},
      {"tensor in both shards",
       [&](const fs::path& dir, json::object&) {
         std::vector<RawTensor> duplicate = {raw_of(*source->find(tensor))};
         // Replace shard 2 with one that also holds model.norm.weight next to its own tensors.
         Result<std::unique_ptr<SafetensorsFile>> shard2 =
             SafetensorsFile::open(dir / "model-00002-of-00002.safetensors");
         ASSERT_TRUE(shard2.ok());
         std::vector<RawTensor> tensors;
         for (const TensorView& t : (*shard2)->tensors()) tensors.push_back(raw_of(t));
         bool already =
             std::any_of(tensors.begin(), tensors.end(), [&](const RawTensor& t) { return t.name == tensor; });
         if (!already) tensors.push_back(duplicate[0]);
         std::vector<RawTensor> tensors1;
         Result<std::unique_ptr<SafetensorsFile>> shard1 =
             SafetensorsFile::open(dir / "model-00001-of-00002.safetensors");
         ASSERT_TRUE(shard1.ok());
         for (const TensorView& t : (*shard1)->tensors()) tensors1.push_back(raw_of(t));
         if (already) tensors1.push_back(duplicate[0]);
         shard1 = Status::internal("closed");  // unmap before rewriting
         shard2 = Status::internal("closed");
         write_bytes(dir / "model-00002-of-00002.safetensors", build_safetensors(tensors));
         write_bytes(dir / "model-00001-of-00002.safetensors", build_safetensors(tensors1));
       },
       StatusCode::kCorruption,
       {tensor, "in both", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}},
      {"broken shard",
       [&](const fs::path& dir, json::object&) {
         const fs::path shard = dir / "model-00001-of-00002.safetensors";
         std::string bytes = read_bytes(shard);
         write_bytes(shard, bytes.substr(0, bytes.size() / 2));
       },
       StatusCode::kCorruption,
       {"model-00001-of-00002.safetensors", "truncated", "model.safetensors.index.json", "tensor '"}},
  };
  for (const BrokenIndexCase& test_case : cases) {
    SCOPED_TRACE(test_case.label);
    TempDir dir;
    json::object weight_map;
    write_sharded_copy(*source, dir.path(), &weight_map);
    test_case.mutate(dir.path(), weight_map);
    write_bytes(dir.path() / "model.safetensors.index.json", json::serialize(json::object{{"weight_map", weight_map}}));
    Result<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::open(dir.path());
    ASSERT_FALSE(checkpoint.ok());
    EXPECT_EQ(checkpoint.status().code(), test_case.code) << checkpoint.status().to_string();
    for (const std::string& part : test_case.message_parts) {
      EXPECT_NE(checkpoint.status().message().find(part), std::string::npos)
          << "'" << part << "' not in: " << checkpoint.status().message();
    }
  }
}

TEST(ShardedCheckpointTest, BrokenIndexFiles) {
  for (const std::string text : {"{\"weight_map\": ", "[]", "{}", "{\"weight_map\": {}}", "{\"weight_map\": []}"}) {
    SCOPED_TRACE(text);
    TempDir dir;
    write_bytes(dir.path() / "model.safetensors.index.json", text);
    Result<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::open(dir.path());
    ASSERT_FALSE(checkpoint.ok());
    EXPECT_EQ(checkpoint.status().code(), StatusCode::kCorruption) << checkpoint.status().to_string();
    EXPECT_NE(checkpoint.status().message().find("model.safetensors.index.json"), std::string::npos);
  }
}

TEST(CheckpointTest, MissingDirectoriesAndFiles) {
  TempDir dir;
  Result<std::unique_ptr<Checkpoint>> empty = Checkpoint::open(dir.path());
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), StatusCode::kNotFound);
  EXPECT_NE(empty.status().message().find(dir.path().string()), std::string::npos);

  Result<std::unique_ptr<Checkpoint>> missing = Checkpoint::open(dir.path() / "nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);

  Result<std::unique_ptr<SafetensorsFile>> missing_file = SafetensorsFile::open(dir.path() / "x.safetensors");
  ASSERT_FALSE(missing_file.ok());
  EXPECT_EQ(missing_file.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing_file.status().message().find("x.safetensors"), std::string::npos);

  Result<std::unique_ptr<SafetensorsFile>> directory = SafetensorsFile::open(dir.path());
  ASSERT_FALSE(directory.ok());
}

// ---------------------------------------------------------------------------------------------------------
// Broken files: each must fail to open with the file (and tensor, where there is one) named.

struct BrokenFileCase {
  std::string label;
  std::function<std::string()> bytes;
  StatusCode code;
  std::vector<std::string> message_parts;
};

std::string tensor_header(const std::string& entries) { return "{" + entries + "}"; }

TEST(SafetensorsFileTest, BrokenFilesFailWithFileAndTensorNamed) {
  const std::string fixture = read_bytes(fs::path(kModelsDir) / "tiny-deepseek-v3" / "model.safetensors");
  const std::string sixteen_bytes = f32_bytes({1, 2, 3, 4});
  auto one_tensor = [&](const std::string& entry) { return raw_file(tensor_header("\"w\": " + entry), sixteen_bytes); };
  const std::vector<BrokenFileCase> cases = {
      {"empty file", [] { return std::string(); }, StatusCode::kCorruption, {"0 bytes", "8-byte header size"}},
      {"shorter than the size field",
       [] { return std::string("\x10\x00\x00", 3); },
       StatusCode::kCorruption,
       {"3 bytes"}},
      {"header size past end of file",
       [&] { return raw_file(1000, "{}", ""); },
       StatusCode::kCorruption,
       {"header size 1000", "past the end of the file"}},
      {"huge header size",
       [&] { return raw_file(uint64_t{1} << 62, "{}", ""); },
       StatusCode::kCorruption,
       {"exceeds the limit"}},
      {"header size 2^64-1",
       [&] { return raw_file(~uint64_t{0}, "{}", ""); },
       StatusCode::kCorruption,
       {"exceeds the limit"}},
      {"header size just past the end",
       [&] { return raw_file(3, "{}", ""); },
       StatusCode::kCorruption,
       {"past the end"}},
      {"truncated fixture: header cut",
       [&] { return fixture.substr(0, 200); },
       StatusCode::kCorruption,
       {"header size", "past the end"}},
      {"truncated fixture: data cut",
       [&] { return fixture.substr(0, fixture.size() / 2); },
       StatusCode::kCorruption,
       {"tensor 'model.", "run past the end of the data", "truncated"}},
      {"truncated fixture: last byte missing",
       [&] { return fixture.substr(0, fixture.size() - 1); },
       StatusCode::kCorruption,
       {"tensor 'model.norm.weight'"}},
      {"bad JSON",
       [&] { return raw_file("{\"w\": {\"dtype\": \"F32\"", sixteen_bytes); },
       StatusCode::kCorruption,
       {"not valid JSON"}},
      {"JSON with trailing bytes", [&] { return raw_file("{} {}", ""); }, StatusCode::kCorruption, {"not valid JSON"}},
      {"invalid UTF-8", [&] { return raw_file("{\"w\xff\": 1}", ""); }, StatusCode::kCorruption, {"not valid JSON"}},
      {"header is a list", [&] { return raw_file("[1, 2]", ""); }, StatusCode::kCorruption, {"not a JSON object"}},
      {"entry not an object", [&] { return one_tensor("5"); }, StatusCode::kCorruption, {"tensor 'w'"}},
      {"unknown dtype",
       [&] { return one_tensor(R"({"dtype": "F7", "shape": [4], "data_offsets": [0, 16]})"); },
       StatusCode::kCorruption,
       {"tensor 'w'", "unknown dtype 'F7'"}},
      {"dtype this build does not load",
       [&] { return one_tensor(R"({"dtype": "F8_E5M2", "shape": [16], "data_offsets": [0, 16]})"); },
       StatusCode::kUnsupported,
       {"tensor 'w'", "F8_E5M2"}},
      {"dtype missing",
       [&] { return one_tensor(R"({"shape": [4], "data_offsets": [0, 16]})"); },
       StatusCode::kCorruption,
       {"tensor 'w'", "dtype"}},
      {"dtype not a string",
       [&] { return one_tensor(R"({"dtype": 4, "shape": [4], "data_offsets": [0, 16]})"); },
       StatusCode::kCorruption,
       {"tensor 'w'", "dtype"}},
      {"negative dimension",
       [&] { return one_tensor(R"({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]})"); },
       StatusCode::kCorruption,
       {"tensor 'w'", "[-4]"}},
      {"fractional dimension",
       [&] { return one_tensor(R"({"dtype": "F32", "shape": [2.5], "data_offsets": [0, 16]})"); },
       StatusCode::kCorruption,
       {"tensor 'w'", "shape"}},
      {"shape not a list",
       [&] { return one_tensor(R"({"dtype": "F32", "shape": 4, "data_offsets": [0, 16]})"); },
       StatusCode::kCorruption,
       {"tensor 'w'", "shape"}},
      {"shape overflows",
       [&] { return one_tensor(R"({"dtype": "F32", "shape": [4294967296, 4294967296, 4], "data_offsets": [0, 16]})"); },
       StatusCode::kCorruption,
       {"tensor 'w'", "overflows"}},
      {"numel * dtype size overflows",
       [&] { return one_tensor(R"({"dtype": "F64", "shape": [4611686018427387904], "data_offsets": [0, 16]})"); },
       StatusCode::kCorruption,
       {"tensor 'w'", "overflows"}},
      {"data_offsets missing",
       [&] { return one_tensor(R"({"dtype": "F32", "shape": [4]})"); },
       StatusCode::kCorruption,
       {"tensor 'w'", "data_offsets"}},
      {"data_offsets one number",
       [&] { return one_tensor(R"({"dtype": "F32", "shape": [4], "data_offsets": [16]})"); },
       StatusCode::kCorruption,
       {"tensor 'w'", "data_offsets"}},
      {"negative offset",
       [&] { return one_tensor(R"({"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]})"); },
       StatusCode::kCorruption,
       {"tensor 'w'", "data_offsets"}},
      {"end before begin",
       [&] { return one_tensor(R"({"dtype": "F32", "shape": [0], "data_offsets": [16, 0]})"); },
       StatusCode::kCorruption,
       {"tensor 'w'", "[16, 0]"}},
      {"offsets past end",
       [&] { return one_tensor(R"({"dtype": "F32", "shape": [8], "data_offsets": [0, 32]})"); },
       StatusCode::kCorruption,
       {"tensor 'w'", "[0, 32]", "past the end", "16 bytes"}},
      {"offsets far past end",
       [&] {
         return one_tensor(
             R"({"dtype": "U8", "shape": [16], "data_offsets": [18446744073709551600, 18446744073709551615]})");
       },
       StatusCode::kCorruption,
       {"tensor 'w'"}},
      {"size mismatch with shape",
       [&] { return one_tensor(R"({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]})"); },
       StatusCode::kCorruption,
       {"tensor 'w'", "16 bytes", "F32 [2, 3] needs 24"}},
      {"overlapping offsets",
       [&] {
         return raw_file(tensor_header(R"("a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},)"
                                       R"("b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]})"),
                         sixteen_bytes);
       },
       StatusCode::kCorruption,
       {"tensor 'b'", "overlap tensor 'a'", "[0, 12]", "[8, 16]"}},
      {"one tensor inside another",
       [&] {
         return raw_file(tensor_header(R"("outer": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
                                       R"("inner": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]})"),
                         sixteen_bytes);
       },
       StatusCode::kCorruption,
       {"tensor 'inner'", "overlap tensor 'outer'"}},
      {"metadata not an object",
       [&] { return raw_file(R"({"__metadata__": [1]})", ""); },
       StatusCode::kCorruption,
       {"__metadata__"}},
      {"metadata value not a string",
       [&] { return raw_file(R"({"__metadata__": {"format": 1}})", ""); },
       StatusCode::kCorruption,
       {"__metadata__", "'format'"}},
  };
  for (const BrokenFileCase& test_case : cases) {
    SCOPED_TRACE(test_case.label);
    TempDir dir;
    const fs::path file = dir.path() / "broken.safetensors";
    write_bytes(file, test_case.bytes());
    Result<std::unique_ptr<SafetensorsFile>> opened = SafetensorsFile::open(file);
    ASSERT_FALSE(opened.ok());
    EXPECT_EQ(opened.status().code(), test_case.code) << opened.status().to_string();
    const std::string message = opened.status().message();
    EXPECT_NE(message.find(file.string()), std::string::npos) << message;
    for (const std::string& part : test_case.message_parts) {
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
    }
    // Through Checkpoint too: the same error.
    Result<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::open(file);
    ASSERT_FALSE(checkpoint.ok());
    EXPECT_EQ(checkpoint.status().message(), message);
  }
}

TEST(SafetensorsFileTest, AcceptsMetadataEmptyTensorsUnalignedDataAndPadding) {
  TempDir dir;
  const fs::path file = dir.path() / "edge.safetensors";
  // One byte of U8 first, so the BF16 tensor after it starts at an odd address.
  std::string bf16 = {'\x80', '\x3f', '\x40', '\xc0'};  // 1.0, -3.0
  std::string data = std::string("\x07", 1) + bf16 + f32_bytes({0.5f});
  std::string header = R"({"__metadata__": {"format": "pt", "note": "x"},)"
                       R"("byte": {"dtype": "U8", "shape": [], "data_offsets": [0, 1]},)"
                       R"("odd": {"dtype": "BF16", "shape": [1, 2], "data_offsets": [1, 5]},)"
                       R"("f": {"dtype": "F32", "shape": [1], "data_offsets": [5, 9]},)"
                       R"("empty": {"dtype": "F32", "shape": [0, 4], "data_offsets": [9, 9]},)"
                       R"("empty_at_start": {"dtype": "I64", "shape": [0], "data_offsets": [0, 0]}})"
                       "       ";
  write_bytes(file, raw_file(header, data));
  Result<std::unique_ptr<SafetensorsFile>> opened = SafetensorsFile::open(file);
  ASSERT_TRUE(opened.ok()) << opened.status().to_string();
  EXPECT_EQ((*opened)->tensors().size(), 5u);
  EXPECT_EQ((*opened)->metadata().size(), 2u);
  EXPECT_EQ((*opened)->metadata()[0], std::make_pair(std::string("format"), std::string("pt")));
  ASSERT_NE((*opened)->find("byte"), nullptr);
  EXPECT_EQ((*opened)->find("byte")->numel(), 1);  // a scalar
  EXPECT_EQ((*opened)->find("empty")->numel(), 0);
  EXPECT_EQ((*opened)->find("missing"), nullptr);

  std::unique_ptr<Checkpoint> checkpoint = open_checkpoint(file);
  ASSERT_NE(checkpoint, nullptr);
  Result<std::vector<float>> odd = checkpoint->load_f32("odd", std::vector<int64_t>{1, 2});
  ASSERT_TRUE(odd.ok()) << odd.status().to_string();
  EXPECT_EQ(*odd, std::vector<float>({1.0f, -3.0f}));
  Result<std::vector<float>> empty = checkpoint->load_f32("empty", std::vector<int64_t>{0, 4});
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
  Result<std::vector<int64_t>> byte = checkpoint->load_i64("byte", std::vector<int64_t>{});
  ASSERT_TRUE(byte.ok());
  EXPECT_EQ(*byte, std::vector<int64_t>({7}));

  // An empty header is a valid (empty) file.
  write_bytes(file, raw_file("{}", ""));
  Result<std::unique_ptr<SafetensorsFile>> empty_file = SafetensorsFile::open(file);
  ASSERT_TRUE(empty_file.ok()) << empty_file.status().to_string();
  EXPECT_TRUE((*empty_file)->tensors().empty());
}

// ---------------------------------------------------------------------------------------------------------
// load_f32 errors

TEST(CheckpointTest, LoadErrorsNameFileTensorDtypeAndShapes) {
  TempDir dir;
  const fs::path file = dir.path() / "model.safetensors";
  std::string fp8_bytes(6, '\x38');  // six 1.0s
  write_bytes(file, build_safetensors({
                        {"f", "F32", {2, 2}, f32_bytes({1, 2, 3, 4})},
                        {"no_scale", "F8_E4M3", {2, 3}, fp8_bytes},
                        {"bad_scale", "F8_E4M3", {2, 3}, fp8_bytes},
                        {"bad_scale_scale_inv", "F32", {2, 1}, f32_bytes({1, 1})},
                        {"one_d", "F8_E4M3", {6}, fp8_bytes},
                        {"one_d_scale_inv", "F32", {1}, f32_bytes({1})},
                        {"int_scale", "F8_E4M3", {2, 3}, fp8_bytes},
                        {"int_scale_scale_inv", "I32", {1, 1}, std::string(4, '\0')},
                        {"good", "F8_E4M3", {2, 3}, fp8_bytes},
                        {"good_scale_inv", "BF16", {1, 1}, std::string("\x00\x40", 2)},  // 2.0
                    }));
  std::unique_ptr<Checkpoint> checkpoint = open_checkpoint(dir.path());
  ASSERT_NE(checkpoint, nullptr);

  Result<std::vector<float>> good = checkpoint->load_f32("good", std::vector<int64_t>{2, 3});
  ASSERT_TRUE(good.ok()) << good.status().to_string();
  EXPECT_EQ(*good, std::vector<float>(6, 2.0f));

  struct LoadCase {
    std::string tensor;
    std::vector<int64_t> shape;
    int64_t block;
    StatusCode code;
    std::vector<std::string> parts;
  };
  const std::vector<LoadCase> cases = {
      {"f", {4}, 128, StatusCode::kInvalidArgument, {"tensor 'f'", "F32 shape [2, 2]", "expected [4]"}},
      {"f", {2, 2, 1}, 128, StatusCode::kInvalidArgument, {"tensor 'f'", "[2, 2, 1]"}},
      {"absent", {1}, 128, StatusCode::kNotFound, {"no tensor 'absent'"}},
      {"no_scale", {2, 3}, 128, StatusCode::kNotFound, {"tensor 'no_scale'", "'no_scale_scale_inv'"}},
      {"bad_scale", {2, 3}, 128, StatusCode::kCorruption, {"tensor 'bad_scale_scale_inv'", "[2, 1]", "[1, 1]"}},
      {"bad_scale", {2, 3}, 1, StatusCode::kCorruption, {"tensor 'bad_scale_scale_inv'", "[2, 3]", "1x1"}},
      {"one_d", {6}, 128, StatusCode::kUnsupported, {"tensor 'one_d'", "2-D"}},
      {"int_scale", {2, 3}, 128, StatusCode::kUnsupported, {"tensor 'int_scale_scale_inv'", "I32"}},
      {"good", {2, 3}, 0, StatusCode::kInvalidArgument, {"tensor 'good'", "block size"}},
  };
  for (const LoadCase& test_case : cases) {
    SCOPED_TRACE(test_case.tensor + " " + shape_text(test_case.shape));
    Result<std::vector<float>> result =
        checkpoint->load_f32(test_case.tensor, test_case.shape, test_case.block, test_case.block);
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.status().code(), test_case.code) << result.status().to_string();
    EXPECT_NE(result.status().message().find(dir.path().string()), std::string::npos) << result.status().message();
    for (const std::string& part : test_case.parts) {
      EXPECT_NE(result.status().message().find(part), std::string::npos)
          << "'" << part << "' not in: " << result.status().message();
    }
  }
  // load_all_f32: a required tensor that is absent is named.
  ModelConfig config;
  std::vector<ExpectedTensor> expected = {
      {"f", {2, 2}, false, true}, {"absent", {1}, false, false}, {"missing", {1}, false, true}};
  Result<std::vector<std::vector<float>>> all = load_all_f32(*checkpoint, config, expected);
  ASSERT_FALSE(all.ok());
  EXPECT_NE(all.status().message().find("'missing'"), std::string::npos);
  expected.pop_back();
  all = load_all_f32(*checkpoint, config, expected);
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  EXPECT_EQ((*all)[0], std::vector<float>({1, 2, 3, 4}));
  EXPECT_TRUE((*all)[1].empty());
}

TEST(CheckpointTest, ConcurrentReadersSeeTheSameValues) {
  std::unique_ptr<Checkpoint> checkpoint = open_checkpoint(fs::path(kModelsDir) / "tiny-deepseek-v3-fp8");
  ASSERT_NE(checkpoint, nullptr);
  const std::string name = "model.layers.1.self_attn.q_b_proj.weight";
  const std::vector<int64_t> shape = checkpoint->find(name)->shape;
  Result<std::vector<float>> reference = checkpoint->load_f32(name, shape);
  ASSERT_TRUE(reference.ok());
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20; ++i) {
        Result<std::vector<float>> values = checkpoint->load_f32(name, shape);
        if (!values.ok() || *values != *reference) ++mismatches;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// ---------------------------------------------------------------------------------------------------------
// Progress bar

TEST(ProgressBarTest, Format) {
  EXPECT_EQ(format_progress_bar("loading tiny", 3u << 20, 6u << 20, 20),
            "loading tiny [##########----------]  50%  3.0/6.0 MiB");
  EXPECT_EQ(format_progress_bar("x", 0, 2048, 4), "x [----]   0%  0.0/2.0 KiB");
  EXPECT_EQ(format_progress_bar("x", 5000, 2048, 4), "x [####] 100%  2.0/2.0 KiB");  // clamped
  EXPECT_EQ(format_progress_bar("x", 0, 0, 4), "x [####] 100%  0.0/0.0 KiB");
  EXPECT_EQ(format_progress_bar("big", size_t{671} << 30, size_t{1342} << 30, 10),
            "big [#####-----]  50%  671.0/1342.0 GiB");
  // The terminal callback is safe to call in any order when stderr is not a terminal (as under ctest).
  LoadProgress progress = terminal_progress_bar("test");
  progress(0, 10);
  progress(10, 10);
  progress(5, 10);
}

}  // namespace
}  // namespace deepinfer::model
