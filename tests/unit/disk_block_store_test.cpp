// DiskBlockStore, the durable disk tier: the on-disk format byte by byte, round trips across reopen, kill -9
// of a writer process at random points and in the middle of a temp file (acknowledged blocks are served
// intact, nothing partial is ever served, temp files are cleaned), every kind of damaged file (detected,
// deleted, counted, then written again), foreign fingerprints, LRU capacity across restarts, match_prefix
// over holes, and a writer thread racing a reader.
#include "deepinfer/kvcache/disk_block_store.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "deepinfer/kvcache/transfer/block_mover.h"
#include "temp_dir.h"

namespace deepinfer::kvcache {
namespace {

using TempDir = deepinfer::testing::TempDir;

namespace fs = std::filesystem;

constexpr size_t kBlockBytes = 4096 + 7;  // not a multiple of anything the store could silently assume

const ModelFingerprint kFingerprint = model_fingerprint(R"({"model_type":"deepseek_v3"})", "weights-a");
const ModelFingerprint kOtherFingerprint = model_fingerprint(R"({"model_type":"deepseek_v3"})", "weights-b");

// A distinct hash per id whose first hex digits vary, so blocks spread over the fan-out directories.
BlockHash hash_of(uint64_t id) { return BlockHash{id ^ 0xABCDEF, (id + 1) * 0x9E3779B97F4A7C15ull}; }
BlockHash parent_of(uint64_t id) { return id == 0 ? kRootBlockHash : hash_of(id - 1); }

// Deterministic payload bytes of block `id` (splitmix64).
std::vector<std::byte> payload_of(uint64_t id, size_t bytes = kBlockBytes) {
  std::vector<std::byte> payload(bytes);
  uint64_t state = id * 0x632BE59BD9B4E019ull + 1;
  for (size_t i = 0; i < bytes; ++i) {
    state += 0x9E3779B97F4A7C15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    payload[i] = static_cast<std::byte>(z ^ (z >> 31));
  }
  return payload;
}

DiskBlockStoreOptions options_for(const fs::path& directory, int64_t capacity_blocks = 1000,
                                  const ModelFingerprint& fingerprint = kFingerprint, bool sync = false) {
  DiskBlockStoreOptions options;
  options.directory = directory;
  options.fingerprint = fingerprint;
  options.block_bytes = kBlockBytes;
  options.capacity_blocks = capacity_blocks;
  options.sync = sync;
  return options;
}

std::unique_ptr<DiskBlockStore> open_store(DiskBlockStoreOptions options) {
  Result<std::unique_ptr<DiskBlockStore>> store = DiskBlockStore::open(std::move(options));
  EXPECT_TRUE(store.ok()) << store.status().to_string();
  return store.ok() ? std::move(store).value() : nullptr;
}

void put_block(DiskBlockStore& store, uint64_t id, bool first_block = false) {
  const std::vector<std::byte> payload = payload_of(id);
  Status status = store.put(hash_of(id), first_block ? kRootBlockHash : parent_of(id), payload);
  ASSERT_TRUE(status.ok()) << "put block " << id << ": " << status.to_string();
}

// Ok and byte-identical to payload_of(id), or a failure explaining what differed.
::testing::AssertionResult serves_intact(DiskBlockStore& store, uint64_t id) {
  std::vector<std::byte> out(kBlockBytes, std::byte{0x5A});
  Status status = store.get(hash_of(id), out);
  if (!status.ok()) return ::testing::AssertionFailure() << "get block " << id << ": " << status.to_string();
  if (out != payload_of(id)) return ::testing::AssertionFailure() << "block " << id << " served with wrong bytes";
  return ::testing::AssertionSuccess();
}

std::vector<std::byte> read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> bytes(chars.size());
  std::memcpy(bytes.data(), chars.data(), chars.size());
  return bytes;
}

void write_file(const fs::path& path, std::span<const std::byte> bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

uint64_t le_u64(const std::vector<std::byte>& bytes, size_t offset) {
  uint64_t value = 0;
  for (int i = 0; i < 8; ++i) value |= static_cast<uint64_t>(bytes[offset + i]) << (8 * i);
  return value;
}

uint32_t le_u32(const std::vector<std::byte>& bytes, size_t offset) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= static_cast<uint32_t>(bytes[offset + i]) << (8 * i);
  return value;
}

// Files under `directory` whose name ends with `suffix`.
std::vector<fs::path> files_ending_with(const fs::path& directory, std::string_view suffix) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::recursive_directory_iterator(directory)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && name.size() >= suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      files.push_back(entry.path());
    }
  }
  return files;
}

TEST(DiskBlockStoreTest, OnDiskFormatMatchesTheHeaderComment) {
  TempDir dir;
  auto store = open_store(options_for(dir.path()));
  ASSERT_NE(store, nullptr);
  put_block(*store, 7);
  const BlockHash hash = hash_of(7);
  const fs::path path = store->block_path(hash);
  EXPECT_EQ(path, dir.path() / hash.to_hex().substr(0, 2) / (hash.to_hex() + ".kvb"));
  const std::vector<std::byte> file = read_file(path);
  ASSERT_EQ(file.size(), kDiskBlockHeaderBytes + kBlockBytes);
  EXPECT_EQ(std::memcmp(file.data(), "DIKVBLK\0", 8), 0);
  EXPECT_EQ(le_u32(file, 8), 1u) << "format version";
  EXPECT_EQ(le_u32(file, 12), 128u) << "header size";
  EXPECT_EQ(le_u64(file, 16), kFingerprint.low);
  EXPECT_EQ(le_u64(file, 24), kFingerprint.high);
  EXPECT_EQ(le_u64(file, 32), hash.low);
  EXPECT_EQ(le_u64(file, 40), hash.high);
  EXPECT_EQ(le_u64(file, 48), parent_of(7).low);
  EXPECT_EQ(le_u64(file, 56), parent_of(7).high);
  EXPECT_EQ(le_u64(file, 64), kBlockBytes);
  EXPECT_EQ(le_u64(file, 72), 1u) << "first sequence number of a fresh directory";
  const std::vector<std::byte> payload = payload_of(7);
  EXPECT_EQ(le_u64(file, 80), XXH3_64bits(payload.data(), payload.size()));
  EXPECT_EQ(le_u64(file, 88), 0u) << "expiry: put() without a TTL never expires";
  for (size_t i = 96; i < 120; ++i) EXPECT_EQ(file[i], std::byte{0}) << "reserved byte " << i;
  EXPECT_EQ(le_u64(file, 120), XXH3_64bits(file.data(), 120));
  EXPECT_TRUE(std::equal(payload.begin(), payload.end(), file.begin() + kDiskBlockHeaderBytes));
  EXPECT_TRUE(fs::exists(dir.path() / "LOCK"));
}

TEST(DiskBlockStoreTest, RoundTripAndReopenServesEveryBlockByteIdentical) {
  TempDir dir;
  constexpr uint64_t kBlocks = 40;
  {
    auto store = open_store(options_for(dir.path()));
    ASSERT_NE(store, nullptr);
    for (uint64_t id = 0; id < kBlocks; ++id) put_block(*store, id);
    for (uint64_t id = 0; id < kBlocks; ++id) EXPECT_TRUE(serves_intact(*store, id));
    put_block(*store, 3);  // already there: no second write
    const DiskBlockStoreStats stats = store->stats();
    EXPECT_EQ(stats.blocks, static_cast<int64_t>(kBlocks));
    EXPECT_EQ(stats.writes, static_cast<int64_t>(kBlocks));
    EXPECT_EQ(stats.hits, static_cast<int64_t>(kBlocks));
    EXPECT_EQ(stats.misses, 0);
    EXPECT_EQ(stats.bytes_written, kBlocks * kBlockBytes);
    EXPECT_EQ(stats.bytes_read, kBlocks * kBlockBytes);
  }
  auto reopened = open_store(options_for(dir.path()));
  ASSERT_NE(reopened, nullptr);
  EXPECT_EQ(reopened->stats().blocks, static_cast<int64_t>(kBlocks));
  for (uint64_t id = 0; id < kBlocks; ++id) {
    EXPECT_TRUE(reopened->contains(hash_of(id))) << "block " << id;
    EXPECT_TRUE(serves_intact(*reopened, id));
  }
  EXPECT_FALSE(reopened->contains(hash_of(kBlocks)));
  std::vector<std::byte> out(kBlockBytes);
  EXPECT_EQ(reopened->get(hash_of(kBlocks), out).code(), StatusCode::kNotFound);
  const DiskBlockStoreStats stats = reopened->stats();
  EXPECT_EQ(stats.corrupt_dropped + stats.foreign_dropped + stats.temp_files_removed + stats.evictions, 0);
  EXPECT_EQ(stats.misses, 1);
  // A put after reopen continues the sequence rather than restarting it.
  put_block(*reopened, 100);
  EXPECT_EQ(le_u64(read_file(reopened->block_path(hash_of(100))), 72), kBlocks + 1);
}

TEST(DiskBlockStoreTest, ArgumentsAndTheDirectoryLockAreChecked) {
  TempDir dir;
  DiskBlockStoreOptions no_bytes = options_for(dir.path());
  no_bytes.block_bytes = 0;
  EXPECT_EQ(DiskBlockStore::open(no_bytes).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DiskBlockStore::open(options_for(dir.path(), 0)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DiskBlockStore::open(options_for("")).status().code(), StatusCode::kInvalidArgument);

  auto store = open_store(options_for(dir.path()));
  ASSERT_NE(store, nullptr);
  Result<std::unique_ptr<DiskBlockStore>> second = DiskBlockStore::open(options_for(dir.path()));
  EXPECT_EQ(second.status().code(), StatusCode::kIoError) << "a second store on a locked directory";

  std::vector<std::byte> short_payload(kBlockBytes - 1);
  EXPECT_EQ(store->put(hash_of(1), parent_of(1), short_payload).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(store->contains(hash_of(1)));
  put_block(*store, 1);
  std::vector<std::byte> long_out(kBlockBytes + 1);
  EXPECT_EQ(store->get(hash_of(1), long_out).code(), StatusCode::kInvalidArgument);

  EXPECT_TRUE(store->remove(hash_of(1)).ok());
  EXPECT_FALSE(store->contains(hash_of(1)));
  EXPECT_FALSE(fs::exists(store->block_path(hash_of(1))));
  EXPECT_TRUE(store->remove(hash_of(1)).ok()) << "removing an absent block is not an error";
  store.reset();
  EXPECT_NE(open_store(options_for(dir.path())), nullptr) << "the lock goes with the store";
}

// --- kill -9 ---------------------------------------------------------------------------------------------

// Messages of the child writer on its pipe: 5 bytes, a tag and the block id (u32, native order).
constexpr char kAcked = 'P';     // put() of the block returned Ok
constexpr char kMidWrite = 'T';  // inside put(): the temp file holds the header, not the payload
constexpr char kFailed = 'E';    // open() or put() failed

struct Message {
  char tag;
  uint32_t id;
};

void send(int fd, char tag, uint32_t id) {
  char bytes[5];
  bytes[0] = tag;
  std::memcpy(bytes + 1, &id, 4);
  (void)!::write(fd, bytes, sizeof(bytes));
}

bool receive(int fd, Message* message) {
  char bytes[5];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::read(fd, bytes + got, sizeof(bytes) - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    got += static_cast<size_t>(n);
  }
  message->tag = bytes[0];
  std::memcpy(&message->id, bytes + 1, 4);
  return true;
}

// In a forked child: opens the store (fsync on, as in production) and puts blocks first_id, first_id+1, ...
// forever, acknowledging each on `fd`; when `stall_id` comes up, stops in the middle of its temp file.
[[noreturn]] void run_writer_child(const fs::path& directory, uint32_t first_id, int64_t stall_id, int fd) {
  DiskBlockStoreOptions options = options_for(directory, 1000, kFingerprint, /*sync=*/true);
  options.test_hook_mid_write = [&](const BlockHash& hash) {
    if (stall_id >= 0 && hash == hash_of(static_cast<uint64_t>(stall_id))) {
      send(fd, kMidWrite, static_cast<uint32_t>(stall_id));
      for (;;) ::pause();
    }
  };
  Result<std::unique_ptr<DiskBlockStore>> store = DiskBlockStore::open(std::move(options));
  if (!store.ok()) {
    send(fd, kFailed, 0);
    ::_exit(2);
  }
  for (uint32_t id = first_id;; ++id) {
    const std::vector<std::byte> payload = payload_of(id);
    if (!(*store)->put(hash_of(id), parent_of(id), payload).ok()) {
      send(fd, kFailed, id);
      ::_exit(3);
    }
    send(fd, kAcked, id);
  }
}

struct KillRound {
  uint32_t first_id;
  int kill_after_acks;  // SIGKILL once this many puts were acknowledged (when stall_id < 0)
  int64_t stall_id;     // or: SIGKILL while this block's temp file is half written
};

// Runs one child to its SIGKILL; returns the ids whose put() returned Ok.
std::vector<uint32_t> run_kill_round(const fs::path& directory, const KillRound& round, const std::string& where) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    run_writer_child(directory, round.first_id, round.stall_id, fds[1]);
  }
  ::close(fds[1]);
  std::vector<uint32_t> acked;
  Message message{};
  bool killed = false;
  bool stalled = false;
  while (receive(fds[0], &message)) {
    EXPECT_NE(message.tag, kFailed) << where << ": the child failed at block " << message.id;
    if (message.tag == kAcked) acked.push_back(message.id);
    if (message.tag == kMidWrite) stalled = true;
    const bool kill_now = round.stall_id >= 0 ? stalled : static_cast<int>(acked.size()) >= round.kill_after_acks;
    if (kill_now && !killed) {
      if (stalled) {  // the half-written temp file is there for open() to clean up
        EXPECT_FALSE(files_ending_with(directory, ".tmp").empty()) << where;
      }
      ::kill(pid, SIGKILL);
      killed = true;  // keep reading: acknowledgements already in the pipe count
    }
  }
  ::close(fds[0]);
  int wait_status = 0;
  EXPECT_EQ(::waitpid(pid, &wait_status, 0), pid) << where;
  EXPECT_TRUE(WIFSIGNALED(wait_status) && WTERMSIG(wait_status) == SIGKILL) << where << ": the child was not killed";
  if (round.stall_id >= 0) {
    EXPECT_TRUE(stalled) << where << ": the child never reached the mid-write hook";
  }
  return acked;
}

TEST(DiskBlockStoreTest, KillNineAtAnyPointLosesNoAcknowledgedBlockAndServesNothingPartial) {
  TempDir dir;
  // Kill points chosen by a fixed seed; the last two rounds stop the child inside a temp file.
  std::mt19937 rng(20240601);
  std::vector<KillRound> rounds;
  for (uint32_t r = 0; r < 6; ++r) {
    rounds.push_back({r * 100, std::uniform_int_distribution<int>(1, 12)(rng), -1});
  }
  rounds.push_back({600, 0, 603});
  rounds.push_back({700, 0, 700});  // before any put of the round returned

  std::vector<uint32_t> all_acked;
  std::vector<uint32_t> all_ids;
  for (size_t r = 0; r < rounds.size(); ++r) {
    const std::string where = "round " + std::to_string(r + 1);
    const std::vector<uint32_t> acked = run_kill_round(dir.path(), rounds[r], where);
    all_acked.insert(all_acked.end(), acked.begin(), acked.end());
    for (uint32_t id = rounds[r].first_id; id < rounds[r].first_id + 100; ++id) all_ids.push_back(id);
    if (rounds[r].stall_id >= 0) {
      EXPECT_EQ(acked.size(), static_cast<size_t>(rounds[r].stall_id - rounds[r].first_id)) << where;
    }

    const bool had_temp = !files_ending_with(dir.path(), ".tmp").empty();
    auto store = open_store(options_for(dir.path()));
    ASSERT_NE(store, nullptr) << where;
    const DiskBlockStoreStats stats = store->stats();
    EXPECT_EQ(stats.corrupt_dropped, 0) << where << ": a partial file under a final name";
    EXPECT_EQ(stats.temp_files_removed > 0, had_temp) << where;
    EXPECT_TRUE(files_ending_with(dir.path(), ".tmp").empty()) << where << ": temp files left after open()";
    for (uint32_t id : all_acked) {
      EXPECT_TRUE(store->contains(hash_of(id))) << where << ": acknowledged block " << id << " lost";
    }
    // Every block the index has (acknowledged or not: a put may finish just before the kill) is intact.
    int64_t indexed = 0;
    for (uint32_t id : all_ids) {
      if (!store->contains(hash_of(id))) continue;
      ++indexed;
      EXPECT_TRUE(serves_intact(*store, id)) << where;
    }
    EXPECT_EQ(indexed, store->stats().blocks) << where;
    if (rounds[r].stall_id >= 0) {
      EXPECT_FALSE(store->contains(hash_of(static_cast<uint64_t>(rounds[r].stall_id))))
          << where << ": the half-written block";
    }
  }
  EXPECT_GE(all_acked.size(), 6u);
}

// --- damaged files --------------------------------------------------------------------------------------

struct Damage {
  std::string name;
  // Damages the files of blocks 1 and (for swaps) 2 of a store holding blocks 1, 2, 3.
  std::function<void(const fs::path& block1, const fs::path& block2)> apply;
  std::vector<uint64_t> broken;  // the blocks whose files it damages
  bool detected_at_open;         // by the header scan; false: only get()'s payload checksum sees it
};

std::vector<Damage> damages() {
  auto flip = [](const fs::path& path, size_t offset) {
    std::vector<std::byte> bytes = read_file(path);
    bytes[offset] ^= std::byte{0x01};
    write_file(path, bytes);
  };
  return {
      {"payload bit flip", [=](const fs::path& a, const fs::path&) { flip(a, 128 + kBlockBytes / 2); }, {1}, false},
      {"last payload byte flipped",
       [=](const fs::path& a, const fs::path&) { flip(a, 128 + kBlockBytes - 1); },
       {1},
       false},
      {"truncated payload",
       [](const fs::path& a, const fs::path&) { fs::resize_file(a, kDiskBlockHeaderBytes + kBlockBytes - 1); },
       {1},
       true},
      {"truncated inside the header", [](const fs::path& a, const fs::path&) { fs::resize_file(a, 60); }, {1}, true},
      {"empty file", [](const fs::path& a, const fs::path&) { fs::resize_file(a, 0); }, {1}, true},
      {"trailing garbage",
       [](const fs::path& a, const fs::path&) { fs::resize_file(a, kDiskBlockHeaderBytes + kBlockBytes + 1); },
       {1},
       true},
      {"garbled magic", [=](const fs::path& a, const fs::path&) { flip(a, 0); }, {1}, true},
      {"garbled hash field", [=](const fs::path& a, const fs::path&) { flip(a, 35); }, {1}, true},
      {"garbled payload checksum", [=](const fs::path& a, const fs::path&) { flip(a, 83); }, {1}, true},
      {"garbled reserved byte", [=](const fs::path& a, const fs::path&) { flip(a, 100); }, {1}, true},
      {"two files' contents swapped",
       [](const fs::path& a, const fs::path& b) {
         const std::vector<std::byte> bytes_a = read_file(a);
         write_file(a, read_file(b));
         write_file(b, bytes_a);
       },
       {1, 2},
       true},
  };
}

void check_damage(const Damage& damage, bool reopen) {
  const std::string where = damage.name + (reopen ? ", after reopen" : ", live store");
  TempDir dir;
  auto store = open_store(options_for(dir.path()));
  ASSERT_NE(store, nullptr) << where;
  for (uint64_t id : {1, 2, 3}) put_block(*store, id);
  damage.apply(store->block_path(hash_of(1)), store->block_path(hash_of(2)));
  const int64_t broken = static_cast<int64_t>(damage.broken.size());

  if (reopen) {
    store.reset();
    store = open_store(options_for(dir.path()));
    ASSERT_NE(store, nullptr) << where;
    const int64_t dropped_at_open = damage.detected_at_open ? broken : 0;
    EXPECT_EQ(store->stats().corrupt_dropped, dropped_at_open) << where;
    EXPECT_EQ(store->stats().blocks, 3 - dropped_at_open) << where;
  }
  std::vector<std::byte> out(kBlockBytes);
  for (uint64_t id : damage.broken) {
    const bool seen_at_open = reopen && damage.detected_at_open;
    EXPECT_EQ(store->contains(hash_of(id)), !seen_at_open) << where << ", block " << id;
    const Status status = store->get(hash_of(id), out);
    EXPECT_EQ(status.code(), seen_at_open ? StatusCode::kNotFound : StatusCode::kCorruption)
        << where << ", block " << id << ": " << status.to_string();
    EXPECT_FALSE(store->contains(hash_of(id))) << where << ", block " << id;
    EXPECT_FALSE(fs::exists(store->block_path(hash_of(id)))) << where << ": block " << id << "'s file not deleted";
  }
  DiskBlockStoreStats stats = store->stats();
  EXPECT_EQ(stats.corrupt_dropped, broken) << where;
  EXPECT_EQ(stats.foreign_dropped, 0) << where;
  EXPECT_EQ(stats.hits, 0) << where;
  EXPECT_EQ(stats.misses, broken) << where;
  EXPECT_TRUE(serves_intact(*store, 3)) << where << ": the undamaged neighbour";

  for (uint64_t id : damage.broken) {
    put_block(*store, id);
    EXPECT_TRUE(serves_intact(*store, id)) << where << ": rewritten block " << id;
  }
  stats = store->stats();
  EXPECT_EQ(stats.writes, (reopen ? 0 : 3) + broken) << where;  // counters start at open()
  EXPECT_EQ(stats.blocks, 3) << where;
}

TEST(DiskBlockStoreTest, DamagedFileOnLiveStoreIsAMissDeletedCountedAndRewritable) {
  for (const Damage& damage : damages()) check_damage(damage, /*reopen=*/false);
}

TEST(DiskBlockStoreTest, DamagedFileAfterRestartIsDroppedAtOpenOrGetAndRewritable) {
  for (const Damage& damage : damages()) check_damage(damage, /*reopen=*/true);
}

TEST(DiskBlockStoreTest, LeftoverTempFilesAreRemovedAndUnrelatedFilesKept) {
  TempDir dir;
  {
    auto store = open_store(options_for(dir.path()));
    ASSERT_NE(store, nullptr);
    put_block(*store, 1);
  }
  const fs::path fan_out = dir.path() / hash_of(2).to_hex().substr(0, 2);
  const fs::path temp = fan_out / (hash_of(2).to_hex() + ".9.tmp");
  write_file(temp, payload_of(2, 300));  // a put() killed halfway
  const fs::path notes = dir.path() / "ab" / "notes.txt";
  write_file(notes, payload_of(3, 10));
  const fs::path misnamed = dir.path() / "00" / "not-a-hash.kvb";
  write_file(misnamed, payload_of(4, 10));

  auto store = open_store(options_for(dir.path()));
  ASSERT_NE(store, nullptr);
  EXPECT_FALSE(fs::exists(temp));
  EXPECT_TRUE(fs::exists(notes)) << "not ours: left alone";
  EXPECT_FALSE(fs::exists(misnamed)) << "a .kvb whose name is no block hash";
  const DiskBlockStoreStats stats = store->stats();
  EXPECT_EQ(stats.temp_files_removed, 1);
  EXPECT_EQ(stats.corrupt_dropped, 1);
  EXPECT_EQ(stats.blocks, 1);
  EXPECT_FALSE(store->contains(hash_of(2)));
  EXPECT_TRUE(serves_intact(*store, 1));
}

// --- foreign blocks -------------------------------------------------------------------------------------

// Regression: opening another model's directory silently deleted every block in it (only a metric said so).
TEST(DiskBlockStoreTest, ADirectoryOfAnotherModelIsRefusedNamingBothModelsAndKeptIntact) {
  TempDir dir;
  {
    DiskBlockStoreOptions theirs = options_for(dir.path(), 1000, kOtherFingerprint);
    theirs.model_name = "their-model";
    auto store = open_store(theirs);
    ASSERT_NE(store, nullptr);
    for (uint64_t id = 0; id < 5; ++id) put_block(*store, id);
  }
  DiskBlockStoreOptions ours = options_for(dir.path(), 1000, kFingerprint);
  ours.model_name = "our-model";
  Result<std::unique_ptr<DiskBlockStore>> refused = DiskBlockStore::open(ours);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("'their-model'"), std::string::npos) << refused.status().message();
  EXPECT_NE(refused.status().message().find("'our-model'"), std::string::npos) << refused.status().message();
  EXPECT_NE(refused.status().message().find("--kv-disk-reset"), std::string::npos) << refused.status().message();
  // A directory of before MODEL (no manifest): the foreign block files themselves refuse it.
  fs::remove(dir.path() / "MODEL");
  refused = DiskBlockStore::open(ours);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("5 block(s) of another model"), std::string::npos)
      << refused.status().message();
  // Nothing was deleted: their model still finds every block.
  DiskBlockStoreOptions theirs = options_for(dir.path(), 1000, kOtherFingerprint);
  auto again = open_store(theirs);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again->stats().blocks, 5);
}

// Regression (a break-it pass, 2026-12-07): a MODEL that was a FIFO blocked open() forever, one linked to /dev/zero
// read without end (16 GB in 45 s). Not a regular file: a clear refusal; a huge one: its first 4 KiB.
TEST(DiskBlockStoreTest, AManifestThatIsNotARegularFileIsRefusedAndAHugeOneIsNotReadWhole) {
  TempDir dir;
  { ASSERT_NE(open_store(options_for(dir.path())), nullptr); }
  const fs::path manifest = dir.path() / "MODEL";
  fs::remove(manifest);
  ASSERT_EQ(::mkfifo(manifest.c_str(), 0644), 0);
  Result<std::unique_ptr<DiskBlockStore>> refused = DiskBlockStore::open(options_for(dir.path()));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("is not a regular file"), std::string::npos) << refused.status().message();
  fs::remove(manifest);
  fs::create_symlink("/dev/zero", manifest);
  refused = DiskBlockStore::open(options_for(dir.path()));
  EXPECT_FALSE(refused.ok());
  fs::remove(manifest);
  {
    std::ofstream huge(manifest);
    huge << std::string(1 << 20, 'x');  // one line of 1 MiB: unreadable, rewritten after the scan
  }
  EXPECT_NE(open_store(options_for(dir.path())), nullptr);
}

TEST(DiskBlockStoreTest, WithResetBlocksOfAnotherModelAreDroppedAtOpenAndNeverServed) {
  TempDir dir;
  {
    auto store = open_store(options_for(dir.path(), 1000, kOtherFingerprint));
    ASSERT_NE(store, nullptr);
    for (uint64_t id = 0; id < 5; ++id) put_block(*store, id);
  }
  DiskBlockStoreOptions reset = options_for(dir.path(), 1000, kFingerprint);
  reset.reset_foreign = true;
  auto store = open_store(reset);
  ASSERT_NE(store, nullptr);
  DiskBlockStoreStats stats = store->stats();
  EXPECT_EQ(stats.foreign_dropped, 5);
  EXPECT_EQ(stats.corrupt_dropped, 0);
  EXPECT_EQ(stats.blocks, 0);
  std::vector<std::byte> out(kBlockBytes);
  for (uint64_t id = 0; id < 5; ++id) {
    EXPECT_FALSE(store->contains(hash_of(id))) << "block " << id;
    EXPECT_EQ(store->get(hash_of(id), out).code(), StatusCode::kNotFound) << "block " << id;
    EXPECT_FALSE(fs::exists(store->block_path(hash_of(id)))) << "block " << id;
  }
  // The same block under our fingerprint is a different file, written and served normally.
  put_block(*store, 0);
  EXPECT_TRUE(serves_intact(*store, 0));
}

TEST(DiskBlockStoreTest, ForeignFileSlippedUnderALiveStoreIsDroppedOnGet) {
  TempDir ours;
  TempDir theirs;
  auto store = open_store(options_for(ours.path()));
  ASSERT_NE(store, nullptr);
  put_block(*store, 1);
  {
    auto foreign = open_store(options_for(theirs.path(), 1000, kOtherFingerprint));
    ASSERT_NE(foreign, nullptr);
    put_block(*foreign, 1);
    fs::copy_file(foreign->block_path(hash_of(1)), store->block_path(hash_of(1)), fs::copy_options::overwrite_existing);
  }
  std::vector<std::byte> out(kBlockBytes);
  EXPECT_EQ(store->get(hash_of(1), out).code(), StatusCode::kCorruption);
  EXPECT_FALSE(store->contains(hash_of(1)));
  EXPECT_FALSE(fs::exists(store->block_path(hash_of(1))));
  EXPECT_EQ(store->stats().foreign_dropped, 1);
  EXPECT_EQ(store->stats().corrupt_dropped, 0);
}

// --- capacity and recency -------------------------------------------------------------------------------

TEST(DiskBlockStoreTest, CapacityEvictsLeastRecentlyUsedAndGetRefreshesRecency) {
  TempDir dir;
  auto store = open_store(options_for(dir.path(), 3));
  ASSERT_NE(store, nullptr);
  struct Step {
    char op;  // 'p' put, 'g' get
    uint64_t id;
    std::vector<uint64_t> expected_on_disk;
    int64_t expected_evictions;
  };
  const std::vector<Step> steps = {
      {'p', 1, {1}, 0},       {'p', 2, {1, 2}, 0},    {'p', 3, {1, 2, 3}, 0},
      {'g', 1, {1, 2, 3}, 0}, {'p', 4, {1, 3, 4}, 1},  // 2 is least recently used, not 1
      {'p', 1, {1, 3, 4}, 1},                          // a put of a present block only touches it
      {'p', 5, {1, 4, 5}, 2}, {'g', 4, {1, 4, 5}, 2}, {'p', 6, {4, 5, 6}, 3},
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& step = steps[i];
    const std::string where = "step " + std::to_string(i + 1);
    if (step.op == 'p') {
      put_block(*store, step.id);
    } else {
      EXPECT_TRUE(serves_intact(*store, step.id)) << where;
    }
    for (uint64_t id = 1; id <= 6; ++id) {
      const bool expected =
          std::find(step.expected_on_disk.begin(), step.expected_on_disk.end(), id) != step.expected_on_disk.end();
      EXPECT_EQ(store->contains(hash_of(id)), expected) << where << ", block " << id;
      EXPECT_EQ(fs::exists(store->block_path(hash_of(id))), expected) << where << ", file of block " << id;
    }
    EXPECT_EQ(store->stats().evictions, step.expected_evictions) << where;
    EXPECT_EQ(store->stats().blocks, static_cast<int64_t>(step.expected_on_disk.size())) << where;
  }
}

TEST(DiskBlockStoreTest, RecencyOfGetsSurvivesRestartAndSmallerCapacityEvictsOldestAtOpen) {
  TempDir dir;
  // Independent blocks (each the first of its prompt): the order at open is their recency alone.
  {
    auto store = open_store(options_for(dir.path(), 10));
    ASSERT_NE(store, nullptr);
    for (uint64_t id = 1; id <= 4; ++id) put_block(*store, id, true);
    EXPECT_TRUE(serves_intact(*store, 1));  // write order 1 2 3 4, use order 2 3 4 1
  }
  {
    auto store = open_store(options_for(dir.path(), 4));
    ASSERT_NE(store, nullptr);
    put_block(*store, 5, true);  // evicts 2: by write order alone it would be 1
    EXPECT_TRUE(store->contains(hash_of(1)));
    EXPECT_FALSE(store->contains(hash_of(2)));
    EXPECT_EQ(store->stats().evictions, 1);
  }
  auto store = open_store(options_for(dir.path(), 2));  // 1 3 4 5 on disk, oldest first: 3 4 1 5
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->stats().evictions, 2);
  EXPECT_EQ(store->stats().blocks, 2);
  for (uint64_t id : {1, 5}) EXPECT_TRUE(serves_intact(*store, id)) << "block " << id;
  for (uint64_t id : {2, 3, 4}) {
    EXPECT_FALSE(store->contains(hash_of(id))) << "block " << id;
    EXPECT_FALSE(fs::exists(store->block_path(hash_of(id)))) << "block " << id;
  }
}

// Regression (a break-it pass, 2026-12-07): a restart with a smaller capacity trimmed the oldest files first, which
// are the chains' first blocks, so every block kept lost its chain and the next start dropped them all (the log said
// 21 recovered; 0 were left). A block now goes before the block it follows, and a chain counts as used when any of
// its blocks was.
TEST(DiskBlockStoreTest, ASmallerCapacityAtOpenTrimsChainsFromTheirEnds) {
  TempDir dir;
  {
    auto store = open_store(options_for(dir.path(), 20));
    ASSERT_NE(store, nullptr);
    for (uint64_t id = 1; id <= 4; ++id) put_block(*store, id, id == 1);     // chain 1 2 3 4
    for (uint64_t id = 11; id <= 13; ++id) put_block(*store, id, id == 11);  // chain 11 12 13, written later
    EXPECT_TRUE(serves_intact(*store, 4));                                   // chain 1-4 used last
  }
  auto store = open_store(options_for(dir.path(), 4));
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->stats().evictions, 3);
  // The least recently used chain (11-13) goes from its end, then chain 1-4 would; 4 blocks stay, each chained.
  for (uint64_t id : {1, 2, 3, 4}) EXPECT_TRUE(store->contains(hash_of(id))) << "block " << id;
  for (uint64_t id : {11, 12, 13}) EXPECT_FALSE(store->contains(hash_of(id))) << "block " << id;
}

// Regression (the same pass): the background writers kept writes of one block in order but not a chain's, so a
// block's file could land before its parent's, and a kill -9 between the two left a gap the next start dropped
// everything after. A disk write now starts only once its parent's write is done: every completion comes after its
// parent's. Four chains of 24 blocks on 4 workers (without the rule, children overtook parents in most runs).
TEST(DiskBlockStoreTest, BackgroundWritesLandParentsBeforeChildren) {
  TempDir dir;
  auto store = open_store(options_for(dir.path(), 1000));
  ASSERT_NE(store, nullptr);
  std::vector<std::pair<BlockHash, BlockHash>> links;  // (hash, parent)
  std::vector<transfer::Transfer> transfers;
  uint64_t next_id = 0;
  for (uint64_t chain = 0; chain < 4; ++chain) {
    for (uint64_t b = 0; b < 24; ++b) {
      const uint64_t id = 1000 * (chain + 1) + b;
      transfer::Transfer t;
      t.kind = transfer::Transfer::Kind::kToDisk;
      t.id = next_id++;
      t.hash = hash_of(id);
      t.parent = b == 0 ? kRootBlockHash : hash_of(id - 1);
      t.host = std::make_shared<transfer::HostBlock>();
      t.host->bytes = payload_of(id);
      t.host->state.store(transfer::HostBlock::kReady);
      links.emplace_back(t.hash, t.parent);
      transfers.push_back(std::move(t));
    }
  }
  // Interleaved by position, as several prompts' blocks arrive: chain 0's block 0, chain 1's block 0, ...
  std::vector<transfer::Transfer> interleaved;
  for (size_t b = 0; b < 24; ++b) {
    for (size_t chain = 0; chain < 4; ++chain) interleaved.push_back(transfers[chain * 24 + b]);
  }
  transfer::BlockMover mover(nullptr, store.get(), kBlockBytes, 4);
  mover.submit(std::move(interleaved));
  mover.drain();
  std::vector<transfer::TransferResult> done = mover.poll();
  ASSERT_EQ(done.size(), links.size());
  std::unordered_map<BlockHash, size_t, BlockHashHasher> finished_at;
  for (size_t i = 0; i < done.size(); ++i) {
    EXPECT_TRUE(done[i].status.ok()) << done[i].status.to_string();
    finished_at[done[i].hash] = i;
  }
  for (const auto& [hash, parent] : links) {
    if (parent == kRootBlockHash) continue;
    EXPECT_LT(finished_at.at(parent), finished_at.at(hash)) << "block " << hash.to_hex();
  }
}

// Regression (CI of a3b1732: KvEventsTest saw 13 block files where the index counted 12, and a restart dropped a
// chain): a disk write passed over while its parent's write ran let the same block's removal, queued after it, run
// first; the write then left a file nobody counted. One hash's transfers now run in queue order.
TEST(DiskBlockStoreTest, ABlocksRemovalWaitsForItsOwnWriteHeldBehindItsParent) {
  TempDir dir;
  DiskBlockStoreOptions options = options_for(dir.path());
  std::promise<void> parent_entered, release_parent;
  std::shared_future<void> release = release_parent.get_future().share();
  const BlockHash parent = hash_of(1), child = hash_of(2);
  options.test_hook_mid_write = [&](const BlockHash& hash) {
    if (hash != parent) return;
    parent_entered.set_value();
    release.wait();
  };
  auto store = open_store(std::move(options));
  ASSERT_NE(store, nullptr);
  auto write = [&](const BlockHash& hash, const BlockHash& after, uint64_t id) {
    transfer::Transfer t;
    t.kind = transfer::Transfer::Kind::kToDisk;
    t.id = id;
    t.hash = hash;
    t.parent = after;
    t.host = std::make_shared<transfer::HostBlock>();
    t.host->bytes = payload_of(id);
    t.host->state.store(transfer::HostBlock::kReady);
    t.ttl_ms = 3'600'000;
    return t;
  };
  transfer::BlockMover mover(nullptr, store.get(), kBlockBytes, 4);
  std::vector<transfer::Transfer> first;
  first.push_back(write(parent, kRootBlockHash, 1));
  mover.submit(std::move(first));
  parent_entered.get_future().wait();  // the parent's write is running, held mid-file
  std::vector<transfer::Transfer> then;
  then.push_back(write(child, parent, 2));
  transfer::Transfer remove;
  remove.kind = transfer::Transfer::Kind::kRemoveFromDisk;
  remove.id = 3;
  remove.hash = child;
  then.push_back(std::move(remove));
  mover.submit(std::move(then));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // idle workers look for work meanwhile
  release_parent.set_value();
  mover.drain();
  std::vector<transfer::TransferResult> done = mover.poll();
  ASSERT_EQ(done.size(), 3u);
  std::vector<uint64_t> order;
  for (const transfer::TransferResult& result : done) {
    EXPECT_TRUE(result.status.ok()) << result.status.to_string();
    order.push_back(result.id);
  }
  EXPECT_EQ(order, (std::vector<uint64_t>{1, 2, 3})) << "parent's write, child's write, child's removal";
  EXPECT_TRUE(store->contains(parent));
  EXPECT_FALSE(store->contains(child)) << "the removal came after the write";
  EXPECT_FALSE(fs::exists(store->block_path(child))) << "no file the index does not count";
}

// An owner that keeps the count itself (KvCacheManager) opens the store with evict_on_put off: put() past capacity
// keeps every block (a removal of another block may still be on its way), open() trims to capacity from chains' ends.
TEST(DiskBlockStoreTest, WithoutEvictionOnPutTheOwnerKeepsTheCountAndOpenStillTrims) {
  TempDir dir;
  {
    DiskBlockStoreOptions options = options_for(dir.path(), 3);
    options.evict_on_put = false;
    auto store = open_store(std::move(options));
    ASSERT_NE(store, nullptr);
    for (uint64_t id = 0; id < 5; ++id) put_block(*store, id, id == 0);
    EXPECT_EQ(store->stats().blocks, 5);
    EXPECT_EQ(store->stats().evictions, 0);
    for (uint64_t id = 0; id < 5; ++id) EXPECT_TRUE(store->contains(hash_of(id))) << id;
  }
  auto reopened = open_store(options_for(dir.path(), 3));
  ASSERT_NE(reopened, nullptr);
  EXPECT_EQ(reopened->recovery().evicted, 2);
  for (uint64_t id = 0; id < 3; ++id) EXPECT_TRUE(reopened->contains(hash_of(id))) << "kept: " << id;
  for (uint64_t id = 3; id < 5; ++id) EXPECT_FALSE(reopened->contains(hash_of(id))) << "trimmed: " << id;
}

// --- match_prefix ---------------------------------------------------------------------------------------

TEST(DiskBlockStoreTest, MatchPrefixStopsAtTheFirstHole) {
  TempDir dir;
  std::vector<int32_t> tokens(6 * kBlockTokens);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 7 % 1000);
  const std::vector<BlockHash> chain = block_hash_chain(tokens, kFingerprint);
  ASSERT_EQ(chain.size(), 6u);
  auto put_chain_block = [&](DiskBlockStore& store, size_t i) {
    const std::vector<std::byte> payload = payload_of(i);
    ASSERT_TRUE(store.put(chain[i], i == 0 ? kRootBlockHash : chain[i - 1], payload).ok());
  };
  auto store = open_store(options_for(dir.path()));
  ASSERT_NE(store, nullptr);
  struct Step {
    std::string action;
    std::function<void()> apply;
    size_t expected_match;
  };
  const std::vector<Step> steps = {
      {"empty store", [] {}, 0},
      {"blocks 1, 2 (no block 0)",
       [&] {
         put_chain_block(*store, 1);
         put_chain_block(*store, 2);
       },
       0},
      {"block 0", [&] { put_chain_block(*store, 0); }, 3},
      {"blocks 4, 5 (hole at 3)",
       [&] {
         put_chain_block(*store, 4);
         put_chain_block(*store, 5);
       },
       3},
      {"block 3", [&] { put_chain_block(*store, 3); }, 6},
      {"remove block 1", [&] { ASSERT_TRUE(store->remove(chain[1]).ok()); }, 1},
      {"reopen",
       [&] {
         store.reset();
         store = open_store(options_for(dir.path()));
       },
       1},
      {"block 1 again", [&] { put_chain_block(*store, 1); }, 6},
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    steps[i].apply();
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(store->match_prefix(chain), steps[i].expected_match) << "step " << i + 1 << ": " << steps[i].action;
  }
  EXPECT_EQ(store->match_prefix(std::span<const BlockHash>()), 0u);
  EXPECT_EQ(store->match_prefix(std::span(chain).subspan(2)), 4u) << "a chain need not start at block 0";
  EXPECT_EQ(store->stats().hits + store->stats().misses, 0) << "match_prefix reads no file";
}

// Blocks expire ttl_ms after their put() by the store's clock (a fake one here): an expired block is absent to
// contains() and match_prefix(), a miss for get() (which deletes it and counts it expired), dropped by open(), and
// written afresh by a later put(). The expiry sits in the header at offset 88 (0: never, as files written before the
// field existed hold there), so it outlives a restart.
TEST(DiskBlockStoreTest, ExpiredBlocksAreAbsentMissesDroppedAtOpenAndRewritable) {
  TempDir dir;
  int64_t now = 1'800'000'000'000;  // Unix ms
  DiskBlockStoreOptions options = options_for(dir.path());
  options.now_unix_ms = [&now] { return now; };
  auto store = open_store(options);
  ASSERT_NE(store, nullptr);
  const std::vector<std::byte> p0 = payload_of(0), p1 = payload_of(1), p2 = payload_of(2);
  // Three first blocks (a later block extends the expiry of the blocks before it: the next test).
  ASSERT_TRUE(store->put(hash_of(0), kRootBlockHash, p0, 1000).ok());  // expires at now + 1 s
  ASSERT_TRUE(store->put(hash_of(1), kRootBlockHash, p1, 5000).ok());  // at now + 5 s
  ASSERT_TRUE(store->put(hash_of(2), kRootBlockHash, p2).ok());        // never
  EXPECT_EQ(le_u64(read_file(store->block_path(hash_of(0))), 88), static_cast<uint64_t>(now + 1000));
  const std::vector<BlockHash> chain = {hash_of(0), hash_of(1), hash_of(2)};
  EXPECT_EQ(store->match_prefix(chain), 3u);

  now += 1000;  // block 0's expiry: expired from this millisecond on
  EXPECT_FALSE(store->contains(hash_of(0)));
  EXPECT_TRUE(store->contains(hash_of(1)));
  EXPECT_EQ(store->match_prefix(chain), 0u) << "an expired block ends the match";
  EXPECT_EQ(store->match_prefix(std::span(chain).subspan(1)), 2u);
  std::vector<std::byte> out(kBlockBytes);
  EXPECT_EQ(store->get(hash_of(0), out).code(), StatusCode::kNotFound);
  EXPECT_FALSE(fs::exists(store->block_path(hash_of(0)))) << "get() deletes an expired block";
  EXPECT_EQ(store->stats().expired, 1);
  EXPECT_EQ(store->stats().misses, 1);
  EXPECT_TRUE(serves_intact(*store, 1));

  ASSERT_TRUE(store->put(hash_of(0), kRootBlockHash, p0, 1000).ok());  // written afresh, a new expiry
  EXPECT_TRUE(serves_intact(*store, 0));

  // A restart after block 1's expiry: open() drops it, keeps the others with their expiries.
  store.reset();
  now += 4000;  // block 1 expires (now + 5 s from its put); block 0's new copy expired too (1 s)
  store = open_store(options);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->stats().expired, 2);
  EXPECT_EQ(store->stats().blocks, 1);
  EXPECT_FALSE(fs::exists(store->block_path(hash_of(1))));
  EXPECT_TRUE(serves_intact(*store, 2)) << "a block without a TTL never expires";
  now += int64_t{365} * 24 * 3600 * 1000;
  EXPECT_TRUE(serves_intact(*store, 2));
}

// Regression (stop 54's note, left): a reused prefix's expiry was refreshed in memory only, so after a restart a
// chain's first block could expire before the blocks written after it, and those were then unchained and lost. A
// block's expiry now covers the blocks before it: in memory at put(), and at open() from the files (the latest
// expiry below a block applies to it).
TEST(DiskBlockStoreTest, ALaterBlockKeepsTheBlocksBeforeItFromExpiringAlsoAcrossARestart) {
  TempDir dir;
  const int64_t t0 = 1'800'000'000'000;  // Unix ms
  int64_t now = t0;
  DiskBlockStoreOptions options = options_for(dir.path());
  options.now_unix_ms = [&now] { return now; };
  auto store = open_store(options);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->put(hash_of(0), kRootBlockHash, payload_of(0), 1000).ok());  // A: t0 + 1 s in its file
  now = t0 + 500;
  ASSERT_TRUE(store->put(hash_of(1), hash_of(0), payload_of(1), 1000).ok());  // B after A: t0 + 1.5 s
  EXPECT_EQ(le_u64(read_file(store->block_path(hash_of(0))), 88), static_cast<uint64_t>(t0 + 1000));
  const std::vector<BlockHash> chain = {hash_of(0), hash_of(1)};
  now = t0 + 1200;  // past A's own expiry, before B's
  EXPECT_TRUE(store->contains(hash_of(0)));
  EXPECT_EQ(store->match_prefix(chain), 2u);

  store.reset();  // a restart at the same time: A's file still says t0 + 1 s
  store = open_store(options);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->recovery().expired_dropped, 0);
  EXPECT_EQ(store->stats().blocks, 2);
  EXPECT_TRUE(serves_intact(*store, 0));
  EXPECT_TRUE(serves_intact(*store, 1));

  store.reset();  // past B's expiry too: both go
  now = t0 + 1600;
  store = open_store(options);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->recovery().expired_dropped, 2);
  EXPECT_EQ(store->stats().blocks, 0);
  EXPECT_FALSE(fs::exists(store->block_path(hash_of(0))));
}

// refresh() (a prompt reused the block from any tier): the index's expiry of the block and the blocks before it,
// and the block's file header once the new expiry is past the header's by more than the slack.
TEST(DiskBlockStoreTest, RefreshMovesExpiriesOutAndRewritesTheHeaderPastTheSlack) {
  TempDir dir;
  const int64_t t0 = 1'800'000'000'000;
  int64_t now = t0;
  DiskBlockStoreOptions options = options_for(dir.path());
  options.now_unix_ms = [&now] { return now; };
  auto store = open_store(options);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->put(hash_of(0), kRootBlockHash, payload_of(0), 10'000).ok());
  ASSERT_TRUE(store->put(hash_of(1), hash_of(0), payload_of(1), 10'000).ok());
  ASSERT_EQ(DiskBlockStore::refresh_slack_ms(10'000), 1'000);
  now = t0 + 500;  // within the slack: the index moves, the header stays
  ASSERT_TRUE(store->refresh(hash_of(1), 10'000).ok());
  EXPECT_EQ(le_u64(read_file(store->block_path(hash_of(1))), 88), static_cast<uint64_t>(t0 + 10'000));
  now = t0 + 5'000;  // past it: the header of block 1 (only) is rewritten, still a valid block
  ASSERT_TRUE(store->refresh(hash_of(1), 10'000).ok());
  EXPECT_EQ(le_u64(read_file(store->block_path(hash_of(1))), 88), static_cast<uint64_t>(t0 + 15'000));
  EXPECT_EQ(le_u64(read_file(store->block_path(hash_of(0))), 88), static_cast<uint64_t>(t0 + 10'000));
  now = t0 + 12'000;  // both live in the index; after a restart too (block 0 from block 1's header)
  EXPECT_TRUE(store->contains(hash_of(0)) && store->contains(hash_of(1)));
  store.reset();
  store = open_store(options);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->stats().blocks, 2);
  EXPECT_TRUE(serves_intact(*store, 0));
  EXPECT_TRUE(serves_intact(*store, 1));
  EXPECT_TRUE(store->refresh(hash_of(7), 10'000).ok()) << "absent: nothing to refresh";
}

// --- threads --------------------------------------------------------------------------------------------

TEST(DiskBlockStoreTest, WriterThreadRacingAReaderServesOnlyWholeBlocks) {
  TempDir dir;
  auto store = open_store(options_for(dir.path(), 32));
  ASSERT_NE(store, nullptr);
  constexpr uint64_t kBlocks = 150;
  std::atomic<bool> done{false};
  std::thread writer([&] {
    for (uint64_t id = 0; id < kBlocks; ++id) put_block(*store, id);
    done = true;
  });
  int64_t gets = 0;
  int64_t intact = 0;
  std::vector<std::byte> out(kBlockBytes);
  std::vector<BlockHash> chain;
  for (uint64_t id = 0; id < kBlocks; ++id) chain.push_back(hash_of(id));
  for (uint64_t round = 0; !done || round < 50; ++round) {
    const uint64_t id = (round * 37) % kBlocks;
    const Status status = store->get(hash_of(id), out);
    ++gets;
    if (status.ok()) {
      ++intact;
      EXPECT_TRUE(out == payload_of(id)) << "block " << id << " served with wrong bytes";
    } else {
      EXPECT_EQ(status.code(), StatusCode::kNotFound) << status.to_string();
    }
    EXPECT_LE(store->match_prefix(chain), kBlocks);
  }
  writer.join();
  const DiskBlockStoreStats stats = store->stats();
  EXPECT_EQ(stats.hits, intact);
  EXPECT_EQ(stats.hits + stats.misses, gets);
  EXPECT_EQ(stats.corrupt_dropped, 0);
  EXPECT_EQ(stats.writes, static_cast<int64_t>(kBlocks));
  EXPECT_EQ(stats.blocks, 32);
  EXPECT_EQ(stats.evictions, static_cast<int64_t>(kBlocks) - 32);
  EXPECT_EQ(files_ending_with(dir.path(), ".kvb").size(), 32u);
}

}  // namespace
}  // namespace deepinfer::kvcache
