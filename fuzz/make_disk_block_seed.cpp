// Writes fuzz/seeds/disk_block/valid_block: byte 0 (flags: none), then a valid .kvb file as
// DiskBlockStore::put writes it for the fuzz target's options (block_bytes 64). Run by hand when the block
// format changes: build-fuzz/fuzz/make_disk_block_seed fuzz/seeds/disk_block
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

#include "deepinfer/kvcache/disk_block_store.h"

using namespace deepinfer::kvcache;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: make_disk_block_seed OUT_DIR\n";
    return 2;
  }
  const std::filesystem::path tmp = std::filesystem::temp_directory_path() / "deepinfer-disk-seed";
  std::filesystem::remove_all(tmp);
  DiskBlockStoreOptions options;
  options.directory = tmp;
  options.fingerprint = model_fingerprint(R"({"model_type":"deepseek_v3"})", "fuzz");
  options.model_name = "fuzz";
  options.block_bytes = 64;
  options.capacity_blocks = 4;
  options.sync = false;
  auto store = DiskBlockStore::open(options);
  if (!store.ok()) return 1;
  const BlockHash hash{0x0123456789abcdefull, 0xfedcba9876543210ull};
  std::vector<std::byte> payload(64);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>(i);
  if (!(*store)->put(hash, BlockHash{}, payload).ok()) return 1;
  std::ifstream in((*store)->block_path(hash), std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::create_directories(argv[1]);
  std::ofstream out(std::filesystem::path(argv[1]) / "valid_block", std::ios::binary);
  out.put('\0');
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  store->reset();
  std::filesystem::remove_all(tmp);
  return 0;
}
