// The disk tier's block files (format in disk_block_store.h): atomic writes by temp file + rename, headers
// validated at open(), payload checksums at get(), and an in-memory index with LRU order rebuilt by scanning.
// POSIX calls rather than iostreams: fsync, O_EXCL, flock and futimens have no portable equivalents.
#include "deepinfer/kvcache/disk_block_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <fstream>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

namespace deepinfer::kvcache {
namespace {

namespace fs = std::filesystem;

constexpr std::array<unsigned char, 8> kMagic = {'D', 'I', 'K', 'V', 'B', 'L', 'K', '\0'};
constexpr size_t kHeaderChecksumOffset = 120;
constexpr std::string_view kBlockSuffix = ".kvb";
constexpr std::string_view kTempSuffix = ".tmp";

using Header = std::array<std::byte, kDiskBlockHeaderBytes>;

void put_u64(std::byte* out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::byte>(value >> (8 * i));
}
void put_u32(std::byte* out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<std::byte>(value >> (8 * i));
}
uint64_t get_u64(const std::byte* in) {
  uint64_t value = 0;
  for (int i = 0; i < 8; ++i) value |= static_cast<uint64_t>(in[i]) << (8 * i);
  return value;
}
uint32_t get_u32(const std::byte* in) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= static_cast<uint32_t>(in[i]) << (8 * i);
  return value;
}

struct HeaderFields {
  ModelFingerprint fingerprint;
  BlockHash hash;
  BlockHash parent;
  uint64_t payload_bytes = 0;
  uint64_t sequence = 0;
  uint64_t payload_checksum = 0;
  uint64_t expires_at_unix_ms = 0;
};

Header encode_header(const HeaderFields& fields) {
  Header header{};
  std::memcpy(header.data(), kMagic.data(), kMagic.size());
  put_u32(header.data() + 8, kDiskBlockFormatVersion);
  put_u32(header.data() + 12, static_cast<uint32_t>(kDiskBlockHeaderBytes));
  put_u64(header.data() + 16, fields.fingerprint.low);
  put_u64(header.data() + 24, fields.fingerprint.high);
  put_u64(header.data() + 32, fields.hash.low);
  put_u64(header.data() + 40, fields.hash.high);
  put_u64(header.data() + 48, fields.parent.low);
  put_u64(header.data() + 56, fields.parent.high);
  put_u64(header.data() + 64, fields.payload_bytes);
  put_u64(header.data() + 72, fields.sequence);
  put_u64(header.data() + 80, fields.payload_checksum);
  put_u64(header.data() + 88, fields.expires_at_unix_ms);
  put_u64(header.data() + kHeaderChecksumOffset, XXH3_64bits(header.data(), kHeaderChecksumOffset));
  return header;
}

// The fields of a structurally sound header (magic, version, size, header checksum); nullopt otherwise.
std::optional<HeaderFields> decode_header(const Header& header) {
  if (std::memcmp(header.data(), kMagic.data(), kMagic.size()) != 0) return std::nullopt;
  if (get_u32(header.data() + 8) != kDiskBlockFormatVersion) return std::nullopt;
  if (get_u32(header.data() + 12) != kDiskBlockHeaderBytes) return std::nullopt;
  if (get_u64(header.data() + kHeaderChecksumOffset) != XXH3_64bits(header.data(), kHeaderChecksumOffset)) {
    return std::nullopt;
  }
  for (size_t i = 96; i < kHeaderChecksumOffset; ++i) {
    if (header[i] != std::byte{0}) return std::nullopt;
  }
  HeaderFields fields;
  fields.fingerprint = {get_u64(header.data() + 16), get_u64(header.data() + 24)};
  fields.hash = {get_u64(header.data() + 32), get_u64(header.data() + 40)};
  fields.parent = {get_u64(header.data() + 48), get_u64(header.data() + 56)};
  fields.payload_bytes = get_u64(header.data() + 64);
  fields.sequence = get_u64(header.data() + 72);
  fields.payload_checksum = get_u64(header.data() + 80);
  fields.expires_at_unix_ms = get_u64(header.data() + 88);
  return fields;
}

enum class Verdict { kValid, kCorrupt, kForeign };

struct Checked {
  Verdict verdict = Verdict::kCorrupt;
  std::string reason;  // when not valid
  HeaderFields fields;
};

// Everything open() validates: the header against the options, the name and the file's size.
Checked check_header(const Header& header, const BlockHash& name_hash, uint64_t file_size,
                     const DiskBlockStoreOptions& options) {
  Checked checked;
  std::optional<HeaderFields> fields = decode_header(header);
  if (!fields) {
    checked.reason = "bad header (magic, version, size or header checksum)";
    return checked;
  }
  checked.fields = *fields;
  if (fields->fingerprint != options.fingerprint) {
    checked.verdict = Verdict::kForeign;
    checked.reason =
        "written under model fingerprint " + fields->fingerprint.to_hex() + ", not " + options.fingerprint.to_hex();
    return checked;
  }
  if (fields->hash != name_hash) {
    checked.reason = "header holds block " + fields->hash.to_hex();
  } else if (fields->payload_bytes != options.block_bytes) {
    checked.reason = "payload size " + std::to_string(fields->payload_bytes) + " != block_bytes " +
                     std::to_string(options.block_bytes);
  } else if (file_size != kDiskBlockHeaderBytes + fields->payload_bytes) {
    checked.reason = "file size " + std::to_string(file_size) +
                     " != " + std::to_string(kDiskBlockHeaderBytes + fields->payload_bytes) + " (truncated or padded)";
  } else {
    checked.verdict = Verdict::kValid;
  }
  return checked;
}

std::string errno_text(int error) { return std::generic_category().message(error); }

Status io_error(std::string_view operation, const fs::path& path, int error) {
  return Status::io_error("disk KV tier: " + std::string(operation) + " " + path.string() + ": " + errno_text(error));
}

// Writes all of `bytes`, retrying on EINTR and short writes. 0 or an errno.
int write_all(int fd, std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    const ssize_t written = ::write(fd, bytes.data(), bytes.size());
    if (written < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    bytes = bytes.subspan(static_cast<size_t>(written));
  }
  return 0;
}

// Reads exactly out.size() bytes at `offset`. 0, an errno, or -1 when the file ends first.
int pread_all(int fd, std::span<std::byte> out, uint64_t offset) {
  while (!out.empty()) {
    const ssize_t got = ::pread(fd, out.data(), out.size(), static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (got == 0) return -1;
    out = out.subspan(static_cast<size_t>(got));
    offset += static_cast<uint64_t>(got);
  }
  return 0;
}

// Writes all of `bytes` at `offset`, retrying on EINTR and short writes. 0 or an errno.
int pwrite_all(int fd, std::span<const std::byte> bytes, uint64_t offset) {
  while (!bytes.empty()) {
    const ssize_t written = ::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(offset));
    if (written < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    bytes = bytes.subspan(static_cast<size_t>(written));
    offset += static_cast<uint64_t>(written);
  }
  return 0;
}

int fsync_directory(const fs::path& directory) {
  const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno;
  const int result = ::fsync(fd) == 0 ? 0 : errno;
  ::close(fd);
  return result;
}

// Sets the file's mtime to the wall clock (recency that survives a restart). Best effort.
void touch_mtime(int fd) {
  timespec times[2];
  times[0].tv_sec = 0;
  times[0].tv_nsec = UTIME_OMIT;
  clock_gettime(CLOCK_REALTIME, &times[1]);
  (void)::futimens(fd, times);
}

int64_t mtime_ns(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
}

bool is_hex_digit(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

// "<32 lowercase hex>" -> BlockHash (the inverse of BlockHash::to_hex); nullopt for anything else.
std::optional<BlockHash> parse_hex(std::string_view hex) {
  if (hex.size() != 32) return std::nullopt;
  uint64_t halves[2] = {0, 0};
  for (size_t i = 0; i < 32; ++i) {
    const char c = hex[i];
    uint64_t digit = 0;
    if (c >= '0' && c <= '9') {
      digit = static_cast<uint64_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      digit = static_cast<uint64_t>(c - 'a' + 10);
    } else {
      return std::nullopt;
    }
    halves[i / 16] = (halves[i / 16] << 4) | digit;
  }
  return BlockHash{halves[1], halves[0]};
}

bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

// Closes a file descriptor on scope exit.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;

 private:
  int fd_;
};

}  // namespace

Result<std::unique_ptr<DiskBlockStore>> DiskBlockStore::open(DiskBlockStoreOptions options) {
  if (options.directory.empty()) return Status::invalid_argument("disk KV tier: directory is empty");
  if (options.block_bytes == 0) return Status::invalid_argument("disk KV tier: block_bytes is 0; it must be > 0");
  if (options.capacity_blocks < 1) {
    return Status::invalid_argument("disk KV tier: capacity_blocks is " + std::to_string(options.capacity_blocks) +
                                    "; it must be >= 1");
  }
  std::error_code error;
  fs::create_directories(options.directory, error);
  if (error) {
    return Status::io_error("disk KV tier: cannot create directory " + options.directory.string() + ": " +
                            error.message());
  }
  const fs::path lock_path = options.directory / "LOCK";
  const int lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd < 0) return io_error("open", lock_path, errno);
  if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    const int lock_error = errno;
    ::close(lock_fd);
    if (lock_error == EWOULDBLOCK) {
      return Status::io_error("disk KV tier: " + options.directory.string() +
                              " is in use by another store (its LOCK is held); give each process its own directory");
    }
    return io_error("flock", lock_path, lock_error);
  }
  std::unique_ptr<DiskBlockStore> store(new DiskBlockStore(std::move(options), lock_fd));
  if (Status status = store->check_manifest(); !status.ok()) return status;
  if (Status status = store->scan(); !status.ok()) return status;
  if (Status status = store->write_manifest(); !status.ok()) return status;
  return store;
}

DiskBlockStore::DiskBlockStore(DiskBlockStoreOptions options, int lock_fd)
    : options_(std::move(options)), lock_fd_(lock_fd) {}

DiskBlockStore::~DiskBlockStore() { ::close(lock_fd_); }

namespace {
constexpr std::string_view kManifestName = "MODEL";

std::string refusal(const fs::path& directory, const std::string& theirs, const DiskBlockStoreOptions& ours) {
  return "disk KV tier: " + directory.string() + " holds KV blocks of " + theirs + ", not of this server's model " +
         (ours.model_name.empty() ? std::string() : "'" + ours.model_name + "' ") + "(fingerprint " +
         ours.fingerprint.to_hex() + "); give this model its own --tiered-kv-storage-path, or pass --kv-disk-reset " +
         "to delete those blocks";
}
}  // namespace

Status DiskBlockStore::check_manifest() {
  const fs::path path = options_.directory / std::string(kManifestName);
  std::error_code error;
  const fs::file_status status = fs::status(path, error);
  if (error || !fs::exists(status)) return Status::ok_status();  // a new directory, or one of before MODEL
  // A FIFO would block the open forever, /dev/zero feed getline without end (a break-it pass): regular files only,
  // and only their first 4 KiB (the manifest is two short lines).
  if (!fs::is_regular_file(status)) {
    return Status::failed_precondition("disk KV tier: " + path.string() +
                                       " is not a regular file; remove it (DeepInfer writes it again)");
  }
  std::ifstream file(path);
  if (!file) return Status::ok_status();
  std::string head(4096, '\0');
  file.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(file.gcount()));
  std::istringstream in(head);
  std::string line, fingerprint_hex, name;
  while (std::getline(in, line)) {
    if (line.starts_with("fingerprint ")) fingerprint_hex = line.substr(12);
    if (line.starts_with("model ")) name = line.substr(6);
  }
  const std::optional<BlockHash> recorded = parse_hex(fingerprint_hex);
  if (!recorded) return Status::ok_status();  // unreadable: rewritten after the scan, which checks every block
  const ModelFingerprint theirs{recorded->low, recorded->high};
  if (theirs == options_.fingerprint) return Status::ok_status();
  if (!options_.reset_foreign) {
    return Status::failed_precondition(
        refusal(options_.directory, "model '" + name + "' (fingerprint " + theirs.to_hex() + ")", options_));
  }
  return Status::ok_status();
}

Status DiskBlockStore::write_manifest() {
  const fs::path path = options_.directory / std::string(kManifestName);
  const fs::path temp = options_.directory / (std::string(kManifestName) + std::string(kTempSuffix));
  {
    std::ofstream out(temp, std::ios::trunc);
    out << "fingerprint " << options_.fingerprint.to_hex() << "\nmodel " << options_.model_name << "\n";
    if (!out.flush()) return io_error("write", temp, errno);
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) return io_error("rename", temp, errno);
  return Status::ok_status();
}

fs::path DiskBlockStore::block_path(const BlockHash& hash) const {
  const std::string hex = hash.to_hex();
  return options_.directory / hex.substr(0, 2) / (hex + std::string(kBlockSuffix));
}

Status DiskBlockStore::scan() {
  struct Found {
    int64_t mtime_ns;
    uint64_t sequence;
    BlockHash hash;
    BlockHash parent;
    int64_t expires_at_unix_ms;  // 0: never
    int64_t depth = 0;           // blocks before it among the files found
    fs::path path;
    int64_t file_expires_at_unix_ms = 0;  // the header's own (expires_at_unix_ms may be a later block's)
  };
  std::vector<Found> found;
  uint64_t max_sequence = 0;
  int64_t expired_files = 0;
  const int64_t now = now_unix_ms();
  int64_t corrupt = 0;
  int64_t foreign = 0;
  int64_t temps = 0;
  std::vector<fs::path> foreign_paths;  // deleted only once the whole scan allows it (reset_foreign)
  std::optional<ModelFingerprint> foreign_fingerprint;
  // Fan-out directories are created by put() on demand; scan the ones that exist.
  std::vector<std::string> prefixes;
  {
    std::error_code error;
    for (fs::directory_iterator it(options_.directory, error), end; !error && it != end; it.increment(error)) {
      const std::string name = it->path().filename().string();
      std::error_code type_error;
      if (name.size() == 2 && is_hex_digit(name[0]) && is_hex_digit(name[1]) && it->is_directory(type_error)) {
        prefixes.push_back(name);
      }
    }
    if (error) {
      return Status::io_error("disk KV tier: cannot list " + options_.directory.string() + ": " + error.message());
    }
  }
  for (const std::string& prefix : prefixes) {
    const fs::path directory = options_.directory / prefix;
    std::error_code error;
    // Names first, then work: unlinking while iterating a directory is unspecified.
    std::vector<std::string> names;
    for (fs::directory_iterator it(directory, error), end; !error && it != end; it.increment(error)) {
      std::error_code type_error;
      if (it->is_regular_file(type_error)) names.push_back(it->path().filename().string());
    }
    if (error) return Status::io_error("disk KV tier: cannot list " + directory.string() + ": " + error.message());

    for (const std::string& name : names) {
      const fs::path path = directory / name;
      if (ends_with(name, kTempSuffix)) {
        if (::unlink(path.c_str()) == 0) ++temps;
        continue;
      }
      if (!ends_with(name, kBlockSuffix)) continue;  // not ours
      const std::optional<BlockHash> name_hash = parse_hex(std::string_view(name).substr(0, name.size() - 4));
      Verdict verdict = Verdict::kCorrupt;
      HeaderFields fields;
      struct stat st {};
      if (name_hash && name.compare(0, 2, prefix) == 0) {
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) return io_error("open", path, errno);
        FdCloser closer(fd);
        if (::fstat(fd, &st) != 0) return io_error("fstat", path, errno);
        Header header;
        const int read_error = pread_all(fd, header, 0);
        if (read_error > 0) return io_error("read", path, read_error);
        if (read_error == 0) {  // -1: shorter than a header, corrupt
          Checked checked = check_header(header, *name_hash, static_cast<uint64_t>(st.st_size), options_);
          verdict = checked.verdict;
          fields = checked.fields;
        }
      }
      if (verdict == Verdict::kValid) {  // expired ones too: a later block may extend their expiry (below)
        found.push_back({mtime_ns(st), fields.sequence, fields.hash, fields.parent,
                         static_cast<int64_t>(fields.expires_at_unix_ms), 0, path,
                         static_cast<int64_t>(fields.expires_at_unix_ms)});
        max_sequence = std::max(max_sequence, fields.sequence);
        continue;
      }
      if (verdict == Verdict::kForeign) {
        foreign_paths.push_back(path);
        if (!foreign_fingerprint) foreign_fingerprint = fields.fingerprint;
        continue;
      }
      if (::unlink(path.c_str()) != 0 && errno != ENOENT) return io_error("unlink", path, errno);
      ++corrupt;
    }
  }
  if (!foreign_paths.empty() && !options_.reset_foreign) {
    return Status::failed_precondition(refusal(
        options_.directory,
        std::to_string(foreign_paths.size()) + " block(s) of another model (fingerprint " +
            foreign_fingerprint->to_hex() + "; the directory does not record which model)",
        options_));
  }
  for (const fs::path& path : foreign_paths) {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) return io_error("unlink", path, errno);
    ++foreign;
  }
  // The recency order (least recent first: what the capacity trim below and later evictions drop first) must put
  // every block before the block it follows, or a trim drops a chain's head and strands the rest (the next start
  // then loses them all). A block's time is the latest of its own and of every block after it (a use of a later
  // block is a use of its prefix), ties deepest first. Its expiry likewise: the latest of its own and of every block
  // after it (a prefix reused by a later request is refreshed in memory, not in its file; without this, a chain's
  // first block expired at the next start before the blocks written after it, and took them with it).
  {
    std::unordered_map<BlockHash, size_t, BlockHashHasher> at;
    for (size_t i = 0; i < found.size(); ++i) at.emplace(found[i].hash, i);
    std::vector<int64_t> depth(found.size(), -1);
    for (size_t i = 0; i < found.size(); ++i) {  // depth within the files found (a missing parent ends a chain)
      std::vector<size_t> path;
      size_t k = i;
      while (depth[k] < 0) {
        path.push_back(k);
        auto parent = at.find(found[k].parent);
        if (parent == at.end() || path.size() > found.size()) break;
        k = parent->second;
      }
      int64_t d = depth[k] >= 0 ? depth[k] + 1 : 0;
      for (auto it = path.rbegin(); it != path.rend(); ++it) {
        if (depth[*it] < 0) depth[*it] = d++;
      }
    }
    std::vector<size_t> deepest_first(found.size());
    std::iota(deepest_first.begin(), deepest_first.end(), size_t{0});
    std::sort(deepest_first.begin(), deepest_first.end(), [&](size_t a, size_t b) { return depth[a] > depth[b]; });
    for (size_t i : deepest_first) {  // children before parents: each parent takes the latest time below it
      auto parent = at.find(found[i].parent);
      if (parent != at.end() && depth[parent->second] < depth[i]) {
        Found& up = found[parent->second];
        up.mtime_ns = std::max(up.mtime_ns, found[i].mtime_ns);
        if (up.expires_at_unix_ms != 0)
          up.expires_at_unix_ms =
              found[i].expires_at_unix_ms == 0 ? 0 : std::max(up.expires_at_unix_ms, found[i].expires_at_unix_ms);
      }
    }
    for (size_t i = 0; i < found.size(); ++i) found[i].depth = depth[i];
  }
  {  // the expired: their files go
    std::vector<Found> live;
    live.reserve(found.size());
    for (Found& block : found) {
      if (block.expires_at_unix_ms != 0 && block.expires_at_unix_ms <= now) {
        if (::unlink(block.path.c_str()) != 0 && errno != ENOENT) return io_error("unlink", block.path, errno);
        ++expired_files;
      } else {
        live.push_back(std::move(block));
      }
    }
    found = std::move(live);
  }
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    if (a.mtime_ns != b.mtime_ns) return a.mtime_ns < b.mtime_ns;
    if (a.depth != b.depth) return a.depth > b.depth;
    return a.sequence < b.sequence;
  });
  std::lock_guard<std::mutex> lock(mu_);
  for (const Found& block : found) {
    recency_.push_back(block.hash);
    index_.emplace(block.hash, Entry{block.parent, block.expires_at_unix_ms, std::prev(recency_.end()),
                                     block.file_expires_at_unix_ms});
  }
  next_sequence_ = max_sequence + 1;
  const int64_t evictions_before = stats_.evictions;
  stats_.expired += expired_files;
  stats_.corrupt_dropped += corrupt;
  stats_.foreign_dropped += foreign;
  stats_.temp_files_removed += temps;
  evict_over_capacity_locked();
  recovery_ = DiskRecoveryStats{static_cast<int64_t>(index_.size()), corrupt, foreign, expired_files, temps,
                                stats_.evictions - evictions_before};
  return Status::ok_status();
}

void DiskBlockStore::finish_recovery(int64_t unchained) {
  std::lock_guard<std::mutex> lock(mu_);
  recovery_.unchained_dropped = unchained;
  recovery_.recovered_blocks = static_cast<int64_t>(index_.size());
}

Status DiskBlockStore::put(const BlockHash& hash, const BlockHash& parent, std::span<const std::byte> payload,
                           int64_t ttl_ms, std::span<const TokenId> token_ids) {
  if (payload.size() != options_.block_bytes) {
    return Status::invalid_argument("disk KV tier: put of block " + hash.to_hex() + " with " +
                                    std::to_string(payload.size()) + " payload bytes; block_bytes is " +
                                    std::to_string(options_.block_bytes));
  }
  const int64_t expires_at_unix_ms = ttl_ms > 0 ? now_unix_ms() + ttl_ms : 0;
  uint64_t sequence = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = index_.find(hash); it != index_.end() && !expired(it->second, now_unix_ms())) {
      touch_locked(hash);
      extend_expiry_locked(hash, expires_at_unix_ms);
      return Status::ok_status();
    }
    sequence = next_sequence_++;
  }

  const fs::path final_path = block_path(hash);
  const fs::path directory = final_path.parent_path();
  const fs::path temp_path = directory / (hash.to_hex() + "." + std::to_string(sequence) + std::string(kTempSuffix));
  const Header header = encode_header(
      {options_.fingerprint, hash, parent, payload.size(), sequence, XXH3_64bits(payload.data(), payload.size()),
       static_cast<uint64_t>(std::max<int64_t>(expires_at_unix_ms, 0))});

  int fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0 && errno == ENOENT) {  // the first block of this fan-out directory
    if (::mkdir(directory.c_str(), 0755) != 0 && errno != EEXIST) return io_error("mkdir", directory, errno);
    if (options_.sync) {
      if (int error = fsync_directory(options_.directory); error != 0) {
        return io_error("fsync", options_.directory, error);
      }
    }
    fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  }
  if (fd < 0) return io_error("create", temp_path, errno);
  auto fail = [&](std::string_view operation, int error) {
    if (fd >= 0) ::close(fd);
    ::unlink(temp_path.c_str());
    return io_error(operation, temp_path, error);
  };
  if (int error = write_all(fd, header); error != 0) return fail("write", error);
  if (options_.test_hook_mid_write) options_.test_hook_mid_write(hash);
  if (int error = write_all(fd, payload); error != 0) return fail("write", error);
  touch_mtime(fd);
  if (options_.sync && ::fsync(fd) != 0) return fail("fsync", errno);
  const int close_result = ::close(fd);
  fd = -1;
  if (close_result != 0) return fail("close", errno);

  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = index_.find(hash); it != index_.end() && !expired(it->second, now_unix_ms())) {
      // A concurrent put() of the same block won; its bytes are the same.
      ::unlink(temp_path.c_str());
      touch_locked(hash);
      return Status::ok_status();
    }
    // Under the lock, so that the file under the final name and the index always agree. An expired entry of the
    // same hash is replaced: the rename puts the new file (new expiry) under its name.
    if (::rename(temp_path.c_str(), final_path.c_str()) != 0) return fail("rename", errno);
    if (auto it = index_.find(hash); it != index_.end()) {
      recency_.erase(it->second.recency);
      index_.erase(it);
    }
    recency_.push_back(hash);
    index_.emplace(hash, Entry{parent, expires_at_unix_ms, std::prev(recency_.end()), expires_at_unix_ms});
    extend_expiry_locked(parent, expires_at_unix_ms);
    if (sink_ != nullptr) sink_->publish(KvEvent::stored(kMediumDisk, hash, parent, token_ids));
    ++stats_.writes;
    stats_.bytes_written += payload.size();
    if (options_.evict_on_put) evict_over_capacity_locked();
  }
  if (options_.sync) {
    if (int error = fsync_directory(directory); error != 0) return io_error("fsync", directory, error);
  }
  return Status::ok_status();
}

Status DiskBlockStore::get(const BlockHash& hash, std::span<std::byte> out) {
  if (out.size() != options_.block_bytes) {
    return Status::invalid_argument("disk KV tier: get of block " + hash.to_hex() + " into " +
                                    std::to_string(out.size()) + " bytes; block_bytes is " +
                                    std::to_string(options_.block_bytes));
  }
  const fs::path path = block_path(hash);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(hash);
    if (it == index_.end()) {
      ++stats_.misses;
      return Status::not_found("disk KV tier: block " + hash.to_hex() + " is not on disk");
    }
    if (expired(it->second, now_unix_ms())) {
      ++stats_.misses;
      ++stats_.expired;
      if (Status status = erase_locked(hash); !status.ok()) return status;
      return Status::not_found("disk KV tier: block " + hash.to_hex() + " expired");
    }
  }

  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int open_error = errno;
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.misses;
    if (open_error != ENOENT) return io_error("open", path, open_error);
    // Deleted behind our back: forget it, unless a put() has just written it again.
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0 && index_.contains(hash)) {
      recency_.erase(index_.at(hash).recency);
      index_.erase(hash);
      if (sink_ != nullptr) sink_->publish(KvEvent::removed(kMediumDisk, hash));
    }
    return Status::not_found("disk KV tier: block " + hash.to_hex() + " vanished from " + path.string());
  }
  FdCloser closer(fd);

  // Verdict on the bytes: anything but kValid deletes the file (when it is still the one we read).
  Verdict verdict = Verdict::kCorrupt;
  std::string reason;
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.misses;
    return io_error("fstat", path, error);
  }
  Header header;
  int read_error = pread_all(fd, header, 0);
  if (read_error == 0) {
    Checked checked = check_header(header, hash, static_cast<uint64_t>(st.st_size), options_);
    verdict = checked.verdict;
    reason = std::move(checked.reason);
    if (verdict == Verdict::kValid) {
      read_error = pread_all(fd, out, kDiskBlockHeaderBytes);
      if (read_error == 0 && XXH3_64bits(out.data(), out.size()) != checked.fields.payload_checksum) {
        verdict = Verdict::kCorrupt;
        reason = "payload checksum mismatch";
      }
    }
  }
  if (read_error > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.misses;
    return io_error("read", path, read_error);
  }
  if (read_error < 0) {
    verdict = Verdict::kCorrupt;
    reason = "file ends early (truncated)";
  }

  if (verdict == Verdict::kValid) {
    touch_mtime(fd);
    std::lock_guard<std::mutex> lock(mu_);
    if (index_.contains(hash)) touch_locked(hash);
    ++stats_.hits;
    stats_.bytes_read += out.size();
    return Status::ok_status();
  }

  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.misses;
  struct stat now {};
  const bool same_file = ::stat(path.c_str(), &now) == 0 && now.st_ino == st.st_ino && now.st_dev == st.st_dev;
  if (same_file) {
    if (Status status = erase_locked(hash); !status.ok()) return status;
    ++(verdict == Verdict::kForeign ? stats_.foreign_dropped : stats_.corrupt_dropped);
  }
  return Status::corruption("disk KV tier: block file " + path.string() + " dropped: " + reason);
}

bool DiskBlockStore::contains(const BlockHash& hash) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(hash);
  return it != index_.end() && !expired(it->second, now_unix_ms());
}

Status DiskBlockStore::remove(const BlockHash& hash) {
  std::lock_guard<std::mutex> lock(mu_);
  return erase_locked(hash);
}

size_t DiskBlockStore::match_prefix(std::span<const BlockHash> chain) const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t matched = 0;
  const int64_t now = now_unix_ms();
  for (; matched < chain.size(); ++matched) {
    auto it = index_.find(chain[matched]);
    if (it == index_.end() || expired(it->second, now)) break;
  }
  return matched;
}

DiskBlockStoreStats DiskBlockStore::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  DiskBlockStoreStats snapshot = stats_;
  snapshot.blocks = static_cast<int64_t>(index_.size());
  return snapshot;
}

std::vector<std::pair<BlockHash, BlockHash>> DiskBlockStore::list_blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<BlockHash, BlockHash>> out;
  out.reserve(index_.size());
  for (const BlockHash& hash : recency_) out.emplace_back(hash, index_.at(hash).parent);
  return out;
}

std::vector<DiskBlockStore::ListedBlock> DiskBlockStore::list_entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ListedBlock> out;
  out.reserve(index_.size());
  for (const BlockHash& hash : recency_) {
    const Entry& entry = index_.at(hash);
    out.push_back({hash, entry.parent, entry.expires_at_unix_ms});
  }
  return out;
}

void DiskBlockStore::evict_over_capacity_locked() {
  while (static_cast<int64_t>(index_.size()) > options_.capacity_blocks) {
    // An unlink failure leaves a file the next open() indexes again; the index still shrinks.
    (void)erase_locked(recency_.front());
    ++stats_.evictions;
  }
}

Status DiskBlockStore::erase_locked(const BlockHash& hash_ref) {
  const BlockHash hash = hash_ref;  // hash_ref may live in recency_ (evict passes recency_.front())
  auto it = index_.find(hash);
  if (it == index_.end()) return Status::ok_status();
  recency_.erase(it->second.recency);
  index_.erase(it);
  if (sink_ != nullptr) sink_->publish(KvEvent::removed(kMediumDisk, hash));
  const fs::path path = block_path(hash);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return io_error("unlink", path, errno);
  return Status::ok_status();
}

int64_t DiskBlockStore::now_unix_ms() const {
  if (options_.now_unix_ms) return options_.now_unix_ms();
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Status DiskBlockStore::refresh(const BlockHash& hash, int64_t ttl_ms) {
  int64_t rewrite_to = -1;  // the header's new expiry, when it is to be rewritten
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t now = now_unix_ms();
    auto it = index_.find(hash);
    if (it == index_.end() || expired(it->second, now)) return Status::ok_status();
    const int64_t expiry = ttl_ms > 0 ? now + ttl_ms : 0;
    extend_expiry_locked(hash, expiry);
    int64_t& file = it->second.file_expires_at_unix_ms;
    if (file != 0 && (expiry == 0 || expiry > file + refresh_slack_ms(ttl_ms))) {
      rewrite_to = expiry;
      file = expiry;  // one rewrite per slack, even if this one fails (the next restart then trims sooner)
    }
  }
  if (rewrite_to < 0) return Status::ok_status();
  const fs::path path = block_path(hash);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? Status::ok_status() : io_error("open", path, errno);  // evicted meanwhile
  FdCloser closer(fd);
  Header header;
  if (const int error = pread_all(fd, header, 0); error != 0) {
    return error > 0 ? io_error("read", path, error) : Status::ok_status();  // replaced meanwhile
  }
  std::optional<HeaderFields> fields = decode_header(header);
  if (!fields || fields->hash != hash) return Status::ok_status();  // get() and open() deal with it
  fields->expires_at_unix_ms = static_cast<uint64_t>(rewrite_to);
  if (const int error = pwrite_all(fd, encode_header(*fields), 0); error != 0) return io_error("write", path, error);
  return Status::ok_status();
}

void DiskBlockStore::extend_expiry_locked(const BlockHash& hash, int64_t expires_at_unix_ms) {
  auto it = index_.find(hash);
  for (size_t steps = 0; it != index_.end() && steps <= index_.size(); ++steps) {
    int64_t& expiry = it->second.expires_at_unix_ms;
    if (expiry == 0 || (expires_at_unix_ms != 0 && expires_at_unix_ms <= expiry)) return;
    expiry = expires_at_unix_ms;
    it = index_.find(it->second.parent);
  }
}

void DiskBlockStore::touch_locked(const BlockHash& hash) {
  auto it = index_.find(hash);
  if (it == index_.end()) return;
  recency_.splice(recency_.end(), recency_, it->second.recency);
}

}  // namespace deepinfer::kvcache
