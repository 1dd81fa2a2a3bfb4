// Exact conversions of the checkpoint dtypes to float32: BF16 and F16 by bit placement, float8_e4m3fn by a
// 256-entry table built at compile time. No floating-point arithmetic is involved, so NaN payloads and
// signed zeros come through unchanged.
#include "convert.h"

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "deepinfer/model/safetensors.h"

namespace deepinfer::model {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; add byte swaps");

// A float32 from its sign, unbiased exponent and 23-bit mantissa field (normal numbers only).
constexpr float make_normal(uint32_t sign, int exponent, uint32_t mantissa23) {
  return std::bit_cast<float>((sign << 31) | (static_cast<uint32_t>(exponent + 127) << 23) | mantissa23);
}

// A subnormal of a narrow format, value `mantissa * 2^exponent_of_lsb`, as a normal float32: shift the leading
// one into the implicit position. REQUIRES: mantissa != 0 and the result is a float32 normal.
constexpr float make_from_subnormal(uint32_t sign, uint32_t mantissa, int exponent_of_lsb) {
  int msb = 31 - std::countl_zero(mantissa);
  uint32_t fraction = (mantissa ^ (1u << msb)) << (23 - msb);
  return make_normal(sign, exponent_of_lsb + msb, fraction);
}

constexpr float decode_f8_e4m3(uint8_t bits) {
  uint32_t sign = bits >> 7;
  uint32_t exponent = (bits >> 3) & 0xF;
  uint32_t mantissa = bits & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::bit_cast<float>((sign << 31) | 0x7FC00000u);  // NaN
  if (exponent == 0) {
    if (mantissa == 0) return std::bit_cast<float>(sign << 31);  // +-0
    return make_from_subnormal(sign, mantissa, -9);              // m * 2^(1 - 7 - 3)
  }
  return make_normal(sign, static_cast<int>(exponent) - 7, mantissa << 20);
}

constexpr std::array<float, 256> make_f8_table() {
  std::array<float, 256> table{};
  for (int i = 0; i < 256; ++i) table[i] = decode_f8_e4m3(static_cast<uint8_t>(i));
  return table;
}

constexpr std::array<float, 256> kF8E4M3Table = make_f8_table();

static_assert(kF8E4M3Table[0x38] == 1.0f);
static_assert(kF8E4M3Table[0x7E] == 448.0f);
static_assert(kF8E4M3Table[0x01] == 1.0f / 512.0f);

}  // namespace

float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

float f16_to_f32(uint16_t bits) {
  uint32_t sign = bits >> 15;
  uint32_t exponent = (bits >> 10) & 0x1F;
  uint32_t mantissa = bits & 0x3FF;
  if (exponent == 0x1F) return std::bit_cast<float>((sign << 31) | 0x7F800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {
    if (mantissa == 0) return std::bit_cast<float>(sign << 31);
    return make_from_subnormal(sign, mantissa, -24);  // m * 2^(1 - 15 - 10)
  }
  return make_normal(sign, static_cast<int>(exponent) - 15, mantissa << 13);
}

float f8_e4m3_to_f32(uint8_t bits) { return kF8E4M3Table[bits]; }

float f8_e8m0_to_f32(uint8_t bits) {
  if (bits == 0xff) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(bits) - 127);
}

namespace detail {

void convert_to_f32(DType dtype, const std::byte* src, size_t count, float* dst) {
  if (count == 0) return;  // dst may be the null data() of an empty vector
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, count * sizeof(float));
      return;
    case DType::kBF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, src + 2 * i, 2);  // tensors are not necessarily 2-byte aligned in the file
        dst[i] = bf16_to_f32(bits);
      }
      return;
    case DType::kF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, src + 2 * i, 2);
        dst[i] = f16_to_f32(bits);
      }
      return;
    case DType::kF8E4M3:
      for (size_t i = 0; i < count; ++i) dst[i] = kF8E4M3Table[static_cast<uint8_t>(src[i])];
      return;
    case DType::kF8E8M0:
      for (size_t i = 0; i < count; ++i) dst[i] = f8_e8m0_to_f32(static_cast<uint8_t>(src[i]));
      return;
    default:
      return;  // callers check is_float_convertible first
  }
}

bool is_float_convertible(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF8E4M3 ||
         dtype == DType::kF8E8M0;
}

void dequantize_f8_block_scaled(const std::byte* weight, int64_t rows, int64_t cols, const float* scale_inv,
                                int64_t block_rows, int64_t block_cols, float* out) {
  const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
  for (int64_t r = 0; r < rows; ++r) {
    const float* scale_row = scale_inv + (r / block_rows) * scale_cols;
    const std::byte* in = weight + r * cols;
    float* dst = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      dst[c] = kF8E4M3Table[static_cast<uint8_t>(in[c])] * scale_row[c / block_cols];
    }
  }
}

}  // namespace detail
}  // namespace deepinfer::model
