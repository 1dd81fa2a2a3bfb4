// The base versions of the DeepSeek-V4 ops (backend.h): a backend without them reports has_v4_ops() false and the
// V4 model refuses to load on it, so reaching one of these is a programming error.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "deepinfer/backend/backend.h"

namespace deepinfer::backend {
namespace {

[[noreturn]] void no_v4_op(const Backend& backend, const char* op) {
  std::fprintf(stderr, "%s backend: %s is not implemented (has_v4_ops() is false)\n", std::string(backend.name()).c_str(),
               op);
  std::abort();
}

}  // namespace

void Backend::v4_hc_pre(const Tensor&, const V4HyperMix&, Tensor, Tensor, Tensor) { no_v4_op(*this, "v4_hc_pre"); }
void Backend::v4_hc_post(Tensor, const Tensor&, const Tensor&, const Tensor&) { no_v4_op(*this, "v4_hc_post"); }
void Backend::v4_norm_rope(Tensor, const V4NormRope&) { no_v4_op(*this, "v4_norm_rope"); }
void Backend::v4_compress(const Tensor&, const Tensor&, const V4Compressor&, std::span<const V4CompressWork>) {
  no_v4_op(*this, "v4_compress");
}
void Backend::v4_indexer_topk(const Tensor&, const Tensor&, double, std::span<const V4IndexRow>, int64_t, const Buffer&) {
  no_v4_op(*this, "v4_indexer_topk");
}
void Backend::v4_attention(const V4Attention&, const Tensor&, const Tensor&, std::span<const V4AttentionRow>, Tensor) {
  no_v4_op(*this, "v4_attention");
}
void Backend::copy_spans(std::span<const CopySpan>) { no_v4_op(*this, "copy_spans"); }
void Backend::silu_mul_clamped(const Tensor&, float, Tensor) { no_v4_op(*this, "silu_mul_clamped"); }

}  // namespace deepinfer::backend
