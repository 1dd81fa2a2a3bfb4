// Bulk dtype conversions behind Checkpoint::load_f32 (the scalar ones are public in safetensors.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "deepinfer/model/safetensors.h"

namespace deepinfer::model::detail {

// True for the dtypes convert_to_f32 handles: F32, BF16, F16 and F8_E4M3 (the last without its scale).
bool is_float_convertible(DType dtype);

// Converts `count` elements at `src` (any alignment) to float32. REQUIRES: is_float_convertible(dtype).
void convert_to_f32(DType dtype, const std::byte* src, size_t count, float* dst);

// out[r][c] = e4m3(weight[r][c]) * scale_inv[r / block_rows][c / block_cols], rounded once to float32, as
// DeepSeek's weight_dequant (inference/kernel.py) computes it. `weight` is [rows, cols] row-major bytes,
// `scale_inv` is [ceil(rows / block_rows), ceil(cols / block_cols)] row-major. REQUIRES: block sizes > 0.
void dequantize_f8_block_scaled(const std::byte* weight, int64_t rows, int64_t cols, const float* scale_inv,
                                int64_t block_rows, int64_t block_cols, float* out);

}  // namespace deepinfer::model::detail
