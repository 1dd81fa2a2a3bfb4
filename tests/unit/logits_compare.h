// Comparisons of logits against a reference, shared by the model tests: argmax with the lowest index among equal
// maxima (the engine sampler's rule), and the relative error ‖ours − reference‖ / ‖reference‖ in double.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace deepinfer::testing {

inline int32_t argmax(const float* row, int64_t n) {
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

// ‖a − b‖ / ‖b‖ over n values.
inline double relative_error(const float* a, const float* b, int64_t n) {
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

// The relative error of `ours` ([rows, vocab]) at the reference's stored `positions` against `reference_logits`
// ([positions, vocab]), over all of them together; counts the positions whose argmax agrees.
inline double stored_positions_error(std::span<const int32_t> positions, std::span<const float> reference_logits,
                                     const std::vector<float>& ours, int64_t vocab, int* argmax_agree) {
  double diff = 0.0, norm = 0.0;
  *argmax_agree = 0;
  for (size_t k = 0; k < positions.size(); ++k) {
    const float* a = ours.data() + positions[k] * vocab;
    const float* b = reference_logits.data() + k * vocab;
    for (int64_t v = 0; v < vocab; ++v) {
      diff += (static_cast<double>(a[v]) - b[v]) * (static_cast<double>(a[v]) - b[v]);
      norm += static_cast<double>(b[v]) * b[v];
    }
    *argmax_agree += argmax(a, vocab) == argmax(b, vocab) ? 1 : 0;
  }
  return std::sqrt(diff / norm);
}

}  // namespace deepinfer::testing
