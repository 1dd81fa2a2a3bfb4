// Fuzz target: the disk tier's block file and its directory scan. The input (after byte 0) is written as one
// .kvb file named after the block hash its header claims (offsets 32..47), so the fuzzer reaches every header
// and payload check; byte 0's bits add a MODEL manifest (from the input's tail), a stray temp file, a file in
// the wrong fan-out directory, and a second copy under another name. Then DiskBlockStore::open (the scan),
// match_prefix, get and remove run as the engine would. Nothing may crash; a block get() returns is exactly
// block_bytes long and was served only after its checksums passed.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/kvcache/disk_block_store.h"
#include "fuzz_common.h"

using namespace deepinfer;
using namespace deepinfer::kvcache;

namespace {
constexpr size_t kBlockBytes = 64;
uint64_t u64_at(std::string_view bytes, size_t offset) {
  uint64_t v = 0;
  if (bytes.size() >= offset + 8) std::memcpy(&v, bytes.data() + offset, 8);
  return v;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  const std::string_view file(reinterpret_cast<const char*>(data + 1), size - 1);
  fuzz::reset_scratch();
  const auto dir = fuzz::scratch_dir() / "disk";
  const BlockHash claimed{u64_at(file, 32), u64_at(file, 40)};
  const std::string hex = claimed.to_hex();
  fuzz::write_file(dir / hex.substr(0, 2) / (hex + ".kvb"), file);
  if (flags & 1) fuzz::write_file(dir / "MODEL", file.substr(file.size() / 2));
  if (flags & 2) fuzz::write_file(dir / hex.substr(0, 2) / (hex + ".7.tmp"), file.substr(0, file.size() / 3));
  if (flags & 4) fuzz::write_file(dir / "ff" / (hex + ".kvb"), file);
  if (flags & 8) fuzz::write_file(dir / "00" / "00000000000000000000000000000000.kvb", file);
  DiskBlockStoreOptions options;
  options.directory = dir;
  options.fingerprint = model_fingerprint(R"({"model_type":"deepseek_v3"})", "fuzz");
  options.model_name = "fuzz";
  options.block_bytes = kBlockBytes;
  options.capacity_blocks = 4;
  options.sync = false;
  options.reset_foreign = (flags & 16) != 0;
  auto store = DiskBlockStore::open(options);
  if (!store.ok()) return 0;
  const BlockHash chain[] = {claimed, BlockHash{}};
  (void)(*store)->match_prefix(chain);
  std::vector<std::byte> out(kBlockBytes);
  Status got = (*store)->get(claimed, out);
  if (got.ok() && !(*store)->contains(claimed)) abort();
  (void)(*store)->remove(claimed);
  return 0;
}
