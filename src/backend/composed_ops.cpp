// The base versions of backend ops that a backend may fuse (backend.h): the composition of the primitive ops, which is
// also their definition.
#include "deepinfer/backend/backend.h"

#include <cmath>

namespace deepinfer::backend {

float softmax_probability_of(std::span<const float> row, int32_t id) {
  const float best = row[static_cast<size_t>(id)];
  double sum = 0.0;
  for (float value : row) sum += std::exp(value - best);
  return static_cast<float>(1.0 / sum);
}

void Backend::mla_prepare(Tensor kv, int64_t latent, const Buffer& norm_weight, float eps, Tensor q_rope, int64_t heads,
                          const Buffer& inv_freq, float attention_factor, const Buffer& cache_layer, Tensor q_rope_copy) {
  rms_norm(kv.cols_slice(0, latent), norm_weight, eps, kv.cols_slice(0, latent));
  rope(kv.cols_slice(latent, kv.cols - latent), 1, inv_freq, attention_factor);
  store_kv(kv, cache_layer);
  rope(q_rope, heads, inv_freq, attention_factor);
  if (q_rope_copy.rows > 0) copy(q_rope, q_rope_copy);
}

}  // namespace deepinfer::backend
