// checkpoint_fingerprint: config.json + per-shard name, size, header hash and sampled data hash.
#include "deepinfer/engine/checkpoint_fingerprint.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace deepinfer::engine {

namespace {
constexpr int kSamples = 16;
constexpr size_t kSampleBytes = 64 * 1024;

Result<std::string> read_all(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::io_error("cannot read " + path.string());
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::string hex64(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}

// "name size header-hash samples-hash".
Result<std::string> shard_identity(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::io_error("cannot read " + path.string());
  std::error_code error;
  const uint64_t size = std::filesystem::file_size(path, error);
  if (error) return Status::io_error("cannot stat " + path.string() + ": " + error.message());
  uint64_t header_bytes = 0;
  unsigned char length[8] = {};
  if (size < 8 || !in.read(reinterpret_cast<char*>(length), 8)) {
    return Status::io_error(path.string() + " is too short for a safetensors file");
  }
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | length[i];
  header_bytes = std::min<uint64_t>(header_bytes, size - 8);
  std::string header(header_bytes, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(header_bytes))) {
    return Status::io_error("cannot read the header of " + path.string());
  }
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  const uint64_t data_begin = 8 + header_bytes;
  const uint64_t data_size = size - data_begin;
  std::vector<char> sample(kSampleBytes);
  for (int i = 0; i < kSamples && data_size > 0; ++i) {
    const uint64_t offset = data_begin + data_size / kSamples * static_cast<uint64_t>(i);
    const auto count = static_cast<std::streamsize>(std::min<uint64_t>(kSampleBytes, size - offset));
    in.seekg(static_cast<std::streamoff>(offset));
    if (!in.read(sample.data(), count)) {
      XXH3_freeState(state);
      return Status::io_error("cannot read " + path.string() + " at byte " + std::to_string(offset));
    }
    XXH3_64bits_update(state, sample.data(), static_cast<size_t>(count));
  }
  const uint64_t samples_hash = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return path.filename().string() + " " + std::to_string(size) + " " +
         hex64(XXH3_64bits(header.data(), header.size())) + " " + hex64(samples_hash);
}
}  // namespace

Result<kvcache::ModelFingerprint> checkpoint_fingerprint(const std::filesystem::path& dir, std::string_view compute_mode) {
  Result<std::string> config = read_all(dir / "config.json");
  if (!config.ok()) return config.status();
  std::vector<std::filesystem::path> shards;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    if (entry.is_regular_file() && entry.path().extension() == ".safetensors") shards.push_back(entry.path());
  }
  if (error) return Status::io_error("cannot list " + dir.string() + ": " + error.message());
  if (shards.empty()) return Status::not_found("no *.safetensors file in " + dir.string());
  std::sort(shards.begin(), shards.end());
  std::string identity;
  for (const auto& shard : shards) {
    Result<std::string> line = shard_identity(shard);
    if (!line.ok()) return line.status();
    identity += *line + "\n";
  }
  identity += "compute " + std::string(compute_mode) + "\n";
  return kvcache::model_fingerprint(*config, identity);
}

}  // namespace deepinfer::engine
