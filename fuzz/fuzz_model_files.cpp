// Fuzz target, built once per checkpoint file (FUZZ_FILE 0 a .safetensors file's header, 1
// model.safetensors.index.json beside a valid shard, 2 config.json, 3 tokenizer.json): arbitrary bytes
// written as that file into a scratch directory and loaded by the product's loader. Any input gives a Status
// or a loaded object, never a crash; what loads is used a little (a tensor read, a config field, an encode).
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "deepinfer/model/config.h"
#include "deepinfer/model/safetensors.h"
#include "deepinfer/recipe/tokenizer.h"
#include "fuzz_common.h"

using namespace deepinfer;

namespace {
// A valid one-tensor shard ("w": F32 [2, 2]) for the index target to point at.
[[maybe_unused]] std::string tiny_shard() {
  const std::string header = R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + std::string(16, '\0');
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  fuzz::reset_scratch();
  const auto& dir = fuzz::scratch_dir();
  if constexpr (FUZZ_FILE == 0) {
    fuzz::write_file(dir / "model.safetensors", bytes);
    auto file = model::SafetensorsFile::open(dir / "model.safetensors");
    if (file.ok()) {
      auto checkpoint = model::Checkpoint::open(dir);
      (void)checkpoint;
    }
  } else if constexpr (FUZZ_FILE == 1) {
    fuzz::write_file(dir / "model-00001-of-00001.safetensors", tiny_shard());
    fuzz::write_file(dir / "model.safetensors.index.json", bytes);
    auto checkpoint = model::Checkpoint::open(dir);
    if (checkpoint.ok() && (*checkpoint)->find("w") != nullptr) {
      const int64_t shape[] = {2, 2};
      auto w = (*checkpoint)->load_f32("w", shape);
      (void)w;
    }
  } else if constexpr (FUZZ_FILE == 2) {
    fuzz::write_file(dir / "config.json", bytes);
    auto config = model::load_model_config(dir);
    (void)config;
  } else {
    fuzz::write_file(dir / "tokenizer.json", bytes);
    auto tokenizer = recipe::Tokenizer::load(dir / "tokenizer.json");
    if (tokenizer.ok()) {
      const auto ids = (*tokenizer)->encode("Hello <｜User｜> world 123", recipe::TextTrust::kTrusted);
      (void)(*tokenizer)->decode(ids);
    }
  }
  return 0;
}
