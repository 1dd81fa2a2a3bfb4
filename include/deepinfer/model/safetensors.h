// Safetensors checkpoints, memory-mapped: one file or sharded (model.safetensors.index.json). Headers are
// validated before any tensor is touched; nothing reads out of bounds. Format reference:
// huggingface/safetensors README ("8-byte little-endian header size, JSON header, byte buffer").
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "deepinfer/core/status.h"

namespace deepinfer::model {

enum class DType { kF64, kF32, kF16, kBF16, kF8E4M3, kF8E8M0, kI64, kI32, kI16, kI8, kU8, kBool };
std::string_view dtype_name(DType dtype);  // as safetensors spells it: "F32", "BF16", "F8_E4M3", ...
size_t dtype_size(DType dtype);            // bytes per element

// A tensor inside a mapped file. `data` stays valid while the owning SafetensorsFile / Checkpoint lives.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;  // little-endian, row-major, any alignment (the format aligns nothing)
  size_t size_bytes = 0;
  int64_t numel() const;
};

// One mapped .safetensors file. Immutable after open; thread-safe for readers.
class SafetensorsFile {
 public:
  // Validates: header size bound (<= 100 MiB and within the file), JSON well-formed, each tensor's dtype
  // known, shape non-negative, data_offsets in range, ordered, non-overlapping and equal to
  // numel * dtype_size. Errors (Corruption / IoError / NotFound) name the file and the tensor; a dtype that
  // safetensors defines but this build does not load (F8_E5M2, U16, ...) is Unsupported. `__metadata__`
  // (string values only) is allowed; gaps between tensors' bytes are allowed, overlaps are not. The file must
  // not shrink while mapped (reading a page past its new end raises SIGBUS, as for any mmap).
  static Result<std::unique_ptr<SafetensorsFile>> open(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const TensorView* find(std::string_view name) const;  // nullptr when absent
  const std::vector<TensorView>& tensors() const { return tensors_; }
  const std::filesystem::path& path() const { return path_; }
  // The header's `__metadata__` (string -> string), sorted by key; empty when absent.
  const std::vector<std::pair<std::string, std::string>>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  Status parse_header();  // fills tensors_ and metadata_ from the mapping; the first error wins
  std::filesystem::path path_;
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
  std::vector<TensorView> tensors_;  // sorted by name
  std::vector<std::pair<std::string, std::string>> metadata_;
};

// Progress callback for loading: (bytes done, bytes total). Called from the loading thread.
using LoadProgress = std::function<void(size_t done_bytes, size_t total_bytes)>;

// One line of a progress bar, e.g. "loading tiny [##########----------]  50%  3.0/6.0 MiB" (no newline).
// `width` is the number of cells between the brackets; done is clamped to total.
std::string format_progress_bar(std::string_view label, size_t done_bytes, size_t total_bytes, int width = 30);

// A LoadProgress that redraws format_progress_bar in place on stderr ("\r"), at most once per 0.1%, and ends
// the line when done == total. When stderr is not a terminal it prints nothing.
LoadProgress terminal_progress_bar(std::string label);

// A checkpoint directory: model.safetensors, or the shards named by model.safetensors.index.json
// (every shard it names must exist; a tensor named in the index must be in that shard; shard names are plain
// file names inside the directory; no tensor may be in two files). `dir` may also name one .safetensors file
// (e.g. a fixture's reference.safetensors). Immutable after open; thread-safe for readers.
class Checkpoint {
 public:
  static Result<std::unique_ptr<Checkpoint>> open(const std::filesystem::path& dir);

  const TensorView* find(std::string_view name) const;  // nullptr when absent

  // Converts the tensor `name` to float32, checking its shape equals `expected_shape`. BF16, F16 and F32
  // convert exactly. F8_E4M3 is dequantized with `name + "_scale_inv"` (float32, one scale per
  // block_rows x block_cols block, partial edge blocks included): w = q * scale_inv, exactly as DeepSeek's
  // reference does (weight-only dequantization). Errors name the file, tensor, dtype and shapes.
  // F8_E4M3 weights must be 2-D; the scale may be F32, BF16 or F16 (real checkpoints: F32) and must have shape
  // [ceil(rows / block_rows), ceil(cols / block_cols)]. Other dtypes (integers, F64) are Unsupported here.
  // REQUIRES: block_rows > 0 and block_cols > 0 (else InvalidArgument).
  Result<std::vector<float>> load_f32(std::string_view name, std::span<const int64_t> expected_shape,
                                      int64_t block_rows = 128, int64_t block_cols = 128) const;

  // Converts an integer or BOOL tensor (I8, I16, I32, I64, U8, BOOL) to int64, exactly, checking its shape
  // like load_f32 (e.g. a reference file's token ids). Float dtypes are Unsupported here.
  Result<std::vector<int64_t>> load_i64(std::string_view name, std::span<const int64_t> expected_shape) const;

  // The file holding tensor `name`; nullptr when absent.
  const SafetensorsFile* file_of(std::string_view name) const;

  // All tensor names, sorted.
  std::vector<std::string> names() const;
  // Sum of the tensors' size_bytes over all files (the unit of LoadProgress).
  size_t total_bytes() const;

 private:
  struct Entry {
    const TensorView* tensor;
    const SafetensorsFile* file;
  };
  Checkpoint() = default;
  const Entry* find_entry(std::string_view name) const;
  // "<file>: tensor '<name>': ", the prefix of every per-tensor error.
  static std::string where(const Entry& entry);
  std::filesystem::path source_;  // what open() was given
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<Entry> entries_;  // every tensor of every file, sorted by name
};

// Exact scalar conversions behind load_f32, exposed for backends and tests. Inputs are raw little-endian bits.
float bf16_to_f32(uint16_t bits);  // the upper 16 bits of a float32
float f16_to_f32(uint16_t bits);   // IEEE binary16: subnormals, +-inf and NaN (payload kept) included
// float8_e4m3fn (OCP FP8 E4M3, as PyTorch's float8_e4m3fn): bias 7, 3 mantissa bits, subnormals m * 2^-9,
// no infinities, 0x7f / 0xff are NaN, largest finite 448.
float f8_e4m3_to_f32(uint8_t bits);
// float8_e8m0fnu (OCP MX scale, DeepSeek-V4's "ue8m0" block scales): 2^(bits - 127); 0xff is NaN.
float f8_e8m0_to_f32(uint8_t bits);

}  // namespace deepinfer::model
