// The built-in default model is written deterministically (the same bytes on every machine) and loads
// through the release path with the real DeepSeek-V3 vocabulary.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <vector>

#include <gtest/gtest.h>

#include "deepinfer/backend/backend.h"
#include "deepinfer/model/deepseek_model.h"
#include "deepinfer/model/random_checkpoint.h"

namespace deepinfer::model {
namespace {

uint64_t fnv1a_of_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> buffer(1 << 20);
  uint64_t hash = 0xcbf29ce484222325ull;
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    for (std::streamsize i = 0; i < in.gcount(); ++i) {
      hash = (hash ^ static_cast<unsigned char>(buffer[static_cast<size_t>(i)])) * 0x100000001b3ull;
    }
  }
  return hash;
}

TEST(RandomCheckpointTest, DefaultModelIsDeterministicAndLoads) {
  const auto dir = std::filesystem::temp_directory_path() / ("deepinfer-default-" + std::to_string(::getpid()));
  ASSERT_TRUE(write_random_checkpoint(dir, random_model_config(), 20261130).ok());
  EXPECT_EQ(std::filesystem::file_size(dir / "model.safetensors"), 145874288u);
  // Regression value: a change here changes the default model every user gets.
  EXPECT_EQ(fnv1a_of_file(dir / "model.safetensors"), 0xcfdf8fc4060a9aefull);
  auto backend = backend::make_cpu_backend();
  auto model = DeepSeekModel::load(dir, *backend, backend::Precision::kBF16);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  EXPECT_EQ((*model)->config().vocab_size, 129280);
  EXPECT_EQ((*model)->config().num_nextn_predict_layers, 1);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace deepinfer::model
