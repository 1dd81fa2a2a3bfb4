#include "deepinfer/backend/kv_block_copy.h"

#include <vector>

namespace deepinfer::backend {

Status download_kv_blocks(Backend& backend, std::span<const Buffer> layer_caches,
                          size_t layer_bytes, std::span<const int32_t> blocks,
                          std::span<std::byte* const> out) {
  if (out.size() != blocks.size()) return Status::invalid_argument("download_kv_blocks: one payload per block");
  std::vector<Backend::DownloadRegion> regions;
  regions.reserve(blocks.size() * layer_caches.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    for (size_t layer = 0; layer < layer_caches.size(); ++layer) {
      regions.push_back({&layer_caches[layer], static_cast<size_t>(blocks[i]) * layer_bytes, layer_bytes,
                         out[i] + layer * layer_bytes});
    }
  }
  return backend.download_batch(regions);
}

Status upload_kv_blocks(Backend& backend, std::span<const Buffer> layer_caches, size_t layer_bytes,
                        std::span<const int32_t> blocks, std::span<const std::byte* const> in) {
  if (in.size() != blocks.size()) return Status::invalid_argument("upload_kv_blocks: one payload per block");
  std::vector<Backend::UploadRegion> regions;
  regions.reserve(blocks.size() * layer_caches.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    for (size_t layer = 0; layer < layer_caches.size(); ++layer) {
      regions.push_back({in[i] + layer * layer_bytes, layer_bytes, &layer_caches[layer],
                         static_cast<size_t>(blocks[i]) * layer_bytes});
    }
  }
  return backend.upload_batch(regions);
}

}  // namespace deepinfer::backend
