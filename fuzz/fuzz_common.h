// Shared by the fuzz targets: the real DeepSeek-V3 tokenizer (fetched by scripts/setup.sh) and a private
// scratch directory in /dev/shm for targets whose parser reads files (safetensors, config.json,
// tokenizer.json, the disk tier).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>

#include "deepinfer/recipe/tokenizer.h"

namespace deepinfer::fuzz {

inline std::shared_ptr<const recipe::Tokenizer> tokenizer() {
  static std::shared_ptr<const recipe::Tokenizer> t = [] {
    auto loaded = recipe::Tokenizer::load(std::string(DEEPINFER_SOURCE_DIR) + "/models/deepseek-v3/tokenizer.json");
    if (!loaded.ok()) abort();
    return *loaded;
  }();
  return t;
}

// Loads the tokenizer before the first input (LLVMFuzzerInitialize), so its load (seconds under ASan) does not
// count against the per-input timeout. Use once, in a target that calls tokenizer().
#define DEEPINFER_FUZZ_PRELOAD_TOKENIZER()                   \
  extern "C" int LLVMFuzzerInitialize(int*, char***) {      \
    (void)::deepinfer::fuzz::tokenizer();                   \
    return 0;                                               \
  }

// A directory of this process's own, emptied for each input.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    const std::filesystem::path base = std::filesystem::exists("/dev/shm") ? "/dev/shm" : "/tmp";
    std::filesystem::path d = base / ("deepinfer-fuzz-" + std::to_string(getpid()));
    std::filesystem::create_directories(d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(scratch_dir(), ec);
    });
    return d;
  }();
  return dir;
}

inline void reset_scratch() {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(scratch_dir(), ec)) {
    std::filesystem::remove_all(entry.path(), ec);
  }
}

inline void write_file(const std::filesystem::path& path, std::string_view bytes) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace deepinfer::fuzz
