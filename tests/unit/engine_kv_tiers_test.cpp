// The engine's tiers below the device on the tiny DeepSeek-V3 fixture. A two-turn conversation (prompt_5 and
// its 16 greedy tokens, then that plus 5 more tokens) must give turn 2 the same greedy tokens as a cache-off
// engine when turn 1's blocks come back from host RAM (after the device evicted them), from disk after a
// restart, from disk after the first process was killed with SIGKILL, and when a disk block is corrupted
// (then it is dropped and recomputed, never used).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "deepinfer/engine/engine.h"
#include "deepinfer/engine/engine_client.h"
#include "deepinfer/kvcache/block_hash.h"
#include "deepinfer/model/safetensors.h"
#include "fixture_engine.h"
#include "temp_dir.h"
#include "test_data.h"

extern char** environ;

namespace deepinfer::engine {
namespace {

using TempDir = deepinfer::testing::TempDir;

const std::string kFixture = "tests/data/models/tiny-deepseek-v3";
// Tiny V3: 3 layers x 80 latent values x 64 tokens x 4 bytes.
constexpr int64_t kBlockBytes = 3 * 80 * kvcache::kBlockTokens * 4;
const kvcache::ModelFingerprint kFingerprint = kvcache::model_fingerprint("tiny-deepseek-v3 test", "f32");
constexpr const char* kChildDirVariable = "DEEPINFER_KV_TIERS_CHILD_DIR";

std::unique_ptr<Engine> make_engine(const EngineConfig& config) { return deepinfer::testing::make_fixture_engine(config); }

std::vector<int32_t> reference_ids(const std::string& name) {
  auto file = model::SafetensorsFile::open(deepinfer::testing::source_path(kFixture + "/reference.safetensors"));
  EXPECT_TRUE(file.ok());
  const model::TensorView* view = (*file)->find(name);
  std::vector<int32_t> values(static_cast<size_t>(view->numel()));
  std::memcpy(values.data(), view->data, view->size_bytes);
  return values;
}

SamplingParams greedy_params() {
  SamplingParams params;
  params.temperature = 0.0f;
  params.max_tokens = 16;
  params.ignore_eos = true;
  return params;
}

struct Turn {
  std::vector<TokenId> tokens;
  int64_t cached_tokens = 0;
};

// Steps `engine` until it is idle; the tokens and cached count of sequence `id`.
Turn finish(Engine& engine, SequenceId id) {
  Turn run;
  for (int steps = 0; engine.has_pending_work() && steps < 10000; ++steps) {
    auto events = engine.step();
    EXPECT_TRUE(events.ok()) << events.status().to_string();
    if (!events.ok()) break;
    for (const TokenEvent& event : *events) {
      if (event.id != id) continue;
      if (event.token) run.tokens.push_back(*event.token);
      if (event.finished) run.cached_tokens = event.num_cached_tokens;
    }
  }
  return run;
}

Turn generate(Engine& engine, const std::vector<TokenId>& prompt) {
  Result<SequenceId> submitted = engine.submit(prompt, greedy_params());
  EXPECT_TRUE(submitted.ok()) << submitted.status().to_string();
  if (!submitted.ok()) return {};
  return finish(engine, *submitted);
}

std::vector<TokenId> turn1_prompt() { return reference_ids("prompt_5.input_ids"); }  // 300 tokens

std::vector<TokenId> turn2_prompt(const std::vector<TokenId>& turn1_output) {
  std::vector<TokenId> prompt = turn1_prompt();
  prompt.insert(prompt.end(), turn1_output.begin(), turn1_output.end());
  std::vector<int32_t> more = reference_ids("prompt_2.input_ids");
  prompt.insert(prompt.end(), more.begin(), more.begin() + 5);
  return prompt;  // 321 tokens: 5 full blocks, of which the 4 turn 1 completed are cacheable
}

EngineConfig base_config() {
  EngineConfig config;
  config.max_num_batched_tokens = 256;
  config.kv_cache_bytes = 8 * kBlockBytes;  // 8 device blocks: turn 2 alone needs 6
  config.fingerprint = kFingerprint;
  return config;
}

EngineConfig tiered_config(const std::filesystem::path& disk_dir) {
  EngineConfig config = base_config();
  config.host_cache_bytes = 64 * kBlockBytes;
  config.disk_cache_path = disk_dir.string();
  config.disk_cache_bytes = 64 * kBlockBytes;
  return config;
}

// Turn 2 on a fresh cache-off engine: the tokens every cached run must reproduce.
std::vector<TokenId> uncached_turn2(const std::vector<TokenId>& prompt) {
  EngineConfig config = base_config();
  config.enable_prefix_caching = false;
  auto engine = make_engine(config);
  Turn run = generate(*engine, prompt);
  EXPECT_EQ(run.tokens.size(), 16u);
  return run.tokens;
}

TEST(EngineKvTiersTest, HostTierServesBlocksTheDeviceEvicted) {
  EngineConfig config = base_config();
  config.host_cache_bytes = 64 * kBlockBytes;
  auto engine = make_engine(config);
  Turn turn1 = generate(*engine, turn1_prompt());
  ASSERT_EQ(turn1.tokens, reference_ids("prompt_5.greedy"));
  // A prompt of other tokens needs all 8 device blocks: plain free blocks go first, then turn 1's cached blocks
  // are evicted (written through to host already). Short prompts alone no longer evict them: they fit the 4
  // blocks turn 1 left plainly free.
  // (prompt_6, 600 tokens, does not fit the 8 blocks: refused at submit since max_model_len is capped to them.)
  for (int i : {0, 1, 3, 4}) generate(*engine, reference_ids("prompt_" + std::to_string(i) + ".input_ids"));
  std::vector<TokenId> other = turn1_prompt();
  std::reverse(other.begin(), other.end());
  other.insert(other.end(), other.begin(), other.begin() + 140);  // 440 tokens + 16 generated: 8 blocks
  generate(*engine, other);
  KvTierStats before = engine->kv_tier_stats();
  ASSERT_GE(before.device_evicted_blocks, 4);
  ASSERT_TRUE(before.lower.has_value());
  EXPECT_GE(before.lower->host.stored_blocks, 4);

  std::vector<TokenId> prompt2 = turn2_prompt(turn1.tokens);
  Turn turn2 = generate(*engine, prompt2);
  KvTierStats after = engine->kv_tier_stats();
  EXPECT_EQ(turn2.cached_tokens, 256);
  EXPECT_EQ(after.loaded_blocks - before.loaded_blocks, 4);
  EXPECT_EQ(after.lower->host.bytes_read - before.lower->host.bytes_read, 4 * kBlockBytes);
  // Regression: hits were counted at every match, also for steps where the request could not be admitted yet.
  EXPECT_EQ(after.lower->host.hit_blocks - before.lower->host.hit_blocks, 4);
  EXPECT_EQ(turn2.tokens, uncached_turn2(prompt2));
}

// Prefill/decode disaggregation at the engine: a "prefill" engine exports the prompt's blocks as it computes
// them (KvHandoff::export_block), a second engine imports them (KvHandoff::import_blocks) and decodes: the same
// greedy tokens as one engine, the imported blocks reused as cached tokens. Then the refusals.
TEST(EngineKvTiersTest, BlocksHandedToAnotherEngineDecodeTheSame) {
  const std::vector<TokenId> prompt = turn1_prompt();  // 300 tokens: 4 whole blocks
  const size_t whole = (prompt.size() - 1) / kvcache::kBlockTokens * kvcache::kBlockTokens;
  EngineConfig config = base_config();
  config.max_num_batched_tokens = 128;  // chunked: blocks leave after the step that completes them
  auto prefill = make_engine(config);
  ASSERT_EQ(prefill->block_bytes(), static_cast<size_t>(kBlockBytes));
  std::vector<std::pair<int64_t, std::vector<std::byte>>> sent;
  std::vector<size_t> sent_by_step;
  KvHandoff out;
  out.export_block = [&](int64_t index, std::vector<std::byte> payload) { sent.emplace_back(index, std::move(payload)); };
  SamplingParams one = greedy_params();
  one.max_tokens = 1;
  const std::vector<TokenId> asked(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(whole));
  ASSERT_TRUE(prefill->submit(asked, one, std::move(out)).ok());
  while (prefill->has_pending_work()) {
    ASSERT_TRUE(prefill->step().ok());
    sent_by_step.push_back(sent.size());
  }
  ASSERT_EQ(sent.size(), whole / kvcache::kBlockTokens);
  for (size_t i = 0; i < sent.size(); ++i) EXPECT_EQ(sent[i].first, static_cast<int64_t>(i));
  // Streamed per chunk: 2 blocks after the first 128-token step, 4 after the second.
  ASSERT_GE(sent_by_step.size(), 2u);
  EXPECT_EQ(sent_by_step[0], 2u);
  EXPECT_EQ(sent_by_step[1], 4u);

  // The decode side, two-phase: a reservation first (every block missing here: 4 reserved from block 0), then the
  // blocks into it.
  auto decode = make_engine(base_config());
  Result<KvReservation> reserved = decode->reserve_kv_blocks(asked);
  ASSERT_TRUE(reserved.ok()) << reserved.status().to_string();
  EXPECT_EQ(reserved->first_block, 0);
  EXPECT_EQ(reserved->blocks.size(), 4u);
  EXPECT_EQ(decode->scheduler().block_pool().num_used(), 4);
  KvHandoff in;
  in.reservation = reserved->id;
  for (auto& [index, payload] : sent) in.import_blocks.push_back(payload);
  SequenceId id = *decode->submit(prompt, greedy_params(), std::move(in));
  EXPECT_EQ(decode->num_kv_reservations(), 0u);
  const Turn run = finish(*decode, id);
  EXPECT_EQ(run.tokens, reference_ids("prompt_5.greedy"));
  EXPECT_EQ(run.cached_tokens, static_cast<int64_t>(whole));

  // Only the blocks the receiver lacks: an engine that computed the prompt's first 2 blocks (a 129-token prompt)
  // holds them and reserves blocks 2 and 3; it takes those two and reuses all 4.
  auto warm = make_engine(base_config());
  (void)generate(*warm, std::vector<TokenId>(prompt.begin(), prompt.begin() + 129));
  Result<KvReservation> tail_reserved = warm->reserve_kv_blocks(asked);
  ASSERT_TRUE(tail_reserved.ok());
  EXPECT_EQ(tail_reserved->first_block, 2);
  EXPECT_EQ(tail_reserved->blocks.size(), 2u);
  KvHandoff tail;
  tail.reservation = tail_reserved->id;
  tail.import_first_block = 2;
  tail.import_blocks = {sent[2].second, sent[3].second};
  const Turn partial = finish(*warm, *warm->submit(prompt, greedy_params(), std::move(tail)));
  EXPECT_EQ(partial.tokens, reference_ids("prompt_5.greedy"));
  EXPECT_EQ(partial.cached_tokens, static_cast<int64_t>(whole));

  // Every way a reservation ends gives its blocks back: released unused; a submit whose payload has another size
  // (another model or cache dtype: InvalidArgument) or whose blocks do not match the reservation; a submit that
  // fails validation. Blocks without a reservation are refused.
  auto fresh = make_engine(base_config());
  auto used = [&] { return fresh->scheduler().block_pool().num_used(); };
  Result<KvReservation> r1 = fresh->reserve_kv_blocks(asked);
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(used(), 4);
  fresh->release_kv_blocks(r1->id);
  fresh->release_kv_blocks(r1->id);  // a second release is ignored
  EXPECT_EQ(used(), 0);
  Result<KvReservation> r2 = fresh->reserve_kv_blocks(asked);
  KvHandoff wrong;
  wrong.reservation = r2->id;
  wrong.import_blocks.assign(4, std::vector<std::byte>(100));
  EXPECT_EQ(fresh->submit(prompt, greedy_params(), std::move(wrong)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(used(), 0);
  Result<KvReservation> r3 = fresh->reserve_kv_blocks(asked);
  KvHandoff short_of_blocks;
  short_of_blocks.reservation = r3->id;
  short_of_blocks.import_blocks = {sent[0].second};
  EXPECT_EQ(fresh->submit(prompt, greedy_params(), std::move(short_of_blocks)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(used(), 0);
  Result<KvReservation> r4 = fresh->reserve_kv_blocks(asked);
  KvHandoff invalid;
  invalid.reservation = r4->id;
  SamplingParams bad = greedy_params();
  bad.top_p = 2.0f;
  EXPECT_FALSE(fresh->submit(prompt, bad, std::move(invalid)).ok());
  EXPECT_EQ(used(), 0);
  EXPECT_EQ(fresh->num_kv_reservations(), 0u);
  KvHandoff unreserved;
  unreserved.import_blocks.push_back(sent[0].second);
  EXPECT_EQ(fresh->submit(prompt, greedy_params(), std::move(unreserved)).status().code(),
            StatusCode::kInvalidArgument);

  // A pool too small for the transfer: ResourceExhausted, nothing held. An engine without a prefix cache reserves
  // nothing.
  EngineConfig small = base_config();
  small.kv_cache_bytes = 3 * kBlockBytes;
  auto tiny = make_engine(small);
  Result<KvReservation> too_big = tiny->reserve_kv_blocks(asked);
  EXPECT_EQ(too_big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(tiny->scheduler().block_pool().num_used(), 0);
  EngineConfig no_cache = base_config();
  no_cache.enable_prefix_caching = false;
  auto plain = make_engine(no_cache);
  EXPECT_EQ(plain->reserve_kv_blocks(asked).status().code(), StatusCode::kFailedPrecondition);

  // Beside a running request, a reservation leaves one free block per running request (never a preemption for
  // it): all the free blocks are refused, one fewer is granted.
  auto busy = make_engine(base_config());
  SequenceId running = *busy->submit(prompt, greedy_params());
  ASSERT_TRUE(busy->step().ok());
  ASSERT_EQ(busy->scheduler().num_running(), 1);
  const int32_t free_blocks = busy->scheduler().block_pool().num_free();
  ASSERT_GE(free_blocks, 2);
  std::vector<TokenId> other(static_cast<size_t>(free_blocks) * kvcache::kBlockTokens);
  for (size_t i = 0; i < other.size(); ++i) other[i] = static_cast<TokenId>(7 + i % 50);
  EXPECT_EQ(busy->reserve_kv_blocks(other).status().code(), StatusCode::kResourceExhausted);
  other.resize(other.size() - kvcache::kBlockTokens);
  Result<KvReservation> fits = busy->reserve_kv_blocks(other);
  ASSERT_TRUE(fits.ok()) << fits.status().to_string();
  EXPECT_EQ(fits->blocks.size(), static_cast<size_t>(free_blocks - 1));
  busy->release_kv_blocks(fits->id);
  ASSERT_TRUE(busy->cancel(running).ok());
}

TEST(EngineKvTiersTest, DiskTierServesBlocksAfterARestart) {
  TempDir dir;
  std::vector<TokenId> turn1_output;
  {
    auto engine = make_engine(tiered_config(dir.path()));
    Turn turn1 = generate(*engine, turn1_prompt());
    ASSERT_EQ(turn1.tokens, reference_ids("prompt_5.greedy"));
    turn1_output = turn1.tokens;
  }  // the engine's destructor drains the disk queue
  std::vector<TokenId> prompt2 = turn2_prompt(turn1_output);
  auto engine = make_engine(tiered_config(dir.path()));
  Turn turn2 = generate(*engine, prompt2);
  EXPECT_EQ(turn2.cached_tokens, 256);
  KvTierStats stats = engine->kv_tier_stats();
  EXPECT_EQ(stats.loaded_blocks, 4);
  EXPECT_GE(stats.lower->disk.hit_blocks, 4);
  EXPECT_EQ(turn2.tokens, uncached_turn2(prompt2));
}

// Submits turn 1 through the server's engine thread (InProcessEngineClient) and waits for its end.
void serve_turn1(InProcessEngineClient& client) {
  struct Done final : EventSink {
    std::promise<void> finished;
    void deliver(std::vector<GenerationEvent> events) override {
      for (const GenerationEvent& e : events)
        if (e.event.finished || !e.error.ok()) finished.set_value();
    }
  };
  auto sink = std::make_shared<Done>();
  std::future<void> finished = sink->finished.get_future();
  client.submit(turn1_prompt(), greedy_params(), sink);
  ASSERT_EQ(finished.wait_for(std::chrono::seconds(60)), std::future_status::ready);
}

int64_t block_files(const std::filesystem::path& dir) {
  int64_t files = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir))
    files += entry.path().extension() == ".kvb" ? 1 : 0;
  return files;
}

// The client's load once `settled(load)` holds (with the lower tiers present), or at `timeout`; polled every 20 ms.
template <typename Settled>
EngineLoad load_once(const InProcessEngineClient& client, std::chrono::seconds timeout, Settled settled) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  EngineLoad load = client.load();
  while (std::chrono::steady_clock::now() < deadline && (!load.kv_tiers.lower || !settled(load))) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    load = client.load();
  }
  return load;
}

// Regression (stop 54's note, left): the engine thread handed the KV cache's transfers to the disk writer and took
// their completions in only inside a step, so on a server gone idle the last blocks' writes sat in the manager (a
// failed try-lock) or their completions went uncounted, and deepinfer_kv_disk_queue_blocks stayed above zero. The
// idle engine thread now polls the cache while it has transfers in flight.
TEST(EngineKvTiersTest, AnIdleServerFinishesItsDiskWritesWithoutAnotherStep) {
  TempDir dir;
  InProcessEngineClient client(wrap_engine(make_engine(tiered_config(dir.path()))));
  serve_turn1(client);
  // No more requests: what is on its way to disk lands, and the engine counts it, within a few seconds.
  const EngineLoad load = load_once(client, std::chrono::seconds(10), [&](const EngineLoad& l) {
    return l.kv_tiers.lower->disk_queue_blocks == 0 && l.kv_tiers.lower->disk.usage_blocks == block_files(dir.path()) &&
           block_files(dir.path()) >= 4;
  });
  ASSERT_TRUE(load.kv_tiers.lower.has_value());
  EXPECT_EQ(load.kv_tiers.lower->disk_queue_blocks, 0);
  EXPECT_GE(block_files(dir.path()), 4) << "the prompt's 4 full blocks";
  EXPECT_EQ(load.kv_tiers.lower->disk.usage_blocks, block_files(dir.path()));
  client.stop();
}

// Regression (a break-it pass, 2026-12-07): retention ran only inside a step, so on an idle server expired blocks
// stayed in every tier and their disk files stayed on disk. The idle engine thread now ticks the cache every second.
TEST(EngineKvTiersTest, AnIdleServerDropsExpiredBlocksFromDisk) {
  TempDir dir;
  EngineConfig config = tiered_config(dir.path());
  config.kv_cache_ttl_hours = 1.0 / 3600;  // 1 s
  InProcessEngineClient client(wrap_engine(make_engine(config)));
  serve_turn1(client);
  // No more requests: within a few seconds the blocks expire and leave, files included.
  const EngineLoad load = load_once(client, std::chrono::seconds(15), [&](const EngineLoad& l) {
    return l.kv_tiers.lower->disk.expired_blocks >= 4 && block_files(dir.path()) == 0;
  });
  ASSERT_TRUE(load.kv_tiers.lower.has_value());
  EXPECT_GE(load.kv_tiers.lower->disk.stored_blocks, 4);
  EXPECT_GE(load.kv_tiers.lower->disk.expired_blocks, 4);
  EXPECT_EQ(load.kv_tiers.lower->disk.usage_blocks, 0);
  EXPECT_EQ(block_files(dir.path()), 0);
  client.stop();
}

TEST(EngineKvTiersTest, ACorruptDiskBlockIsDroppedAndRecomputed) {
  TempDir dir;
  std::vector<TokenId> turn1_output;
  {
    auto engine = make_engine(tiered_config(dir.path()));
    turn1_output = generate(*engine, turn1_prompt()).tokens;
  }
  // Flip one payload byte of block 2 (the third of the chain).
  std::vector<kvcache::BlockHash> chain = kvcache::block_hash_chain(turn1_prompt(), kFingerprint);
  const std::string hex = chain[2].to_hex();
  const std::filesystem::path file = dir.path() / hex.substr(0, 2) / (hex + ".kvb");
  ASSERT_TRUE(std::filesystem::exists(file)) << file;
  {
    std::fstream stream(file, std::ios::in | std::ios::out | std::ios::binary);
    stream.seekg(128 + 1000);
    char byte = 0;
    stream.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x40);
    stream.seekp(128 + 1000);
    stream.write(&byte, 1);
  }
  std::vector<TokenId> prompt2 = turn2_prompt(turn1_output);
  auto engine = make_engine(tiered_config(dir.path()));
  Turn turn2 = generate(*engine, prompt2);
  EXPECT_EQ(turn2.cached_tokens, 128);  // blocks 0 and 1 loaded; 2 was corrupt, so 2 and 3 were computed
  KvTierStats stats = engine->kv_tier_stats();
  EXPECT_EQ(stats.loaded_blocks, 2);
  EXPECT_EQ(stats.lower->disk.corrupt_blocks, 1);
  EXPECT_EQ(turn2.tokens, uncached_turn2(prompt2));
}

// Turn only as the child of DiskTierServesBlocksAfterKill9: computes turn 1 with a disk tier, waits until its
// blocks are on disk, says so on stdout, then sleeps until it is killed.
TEST(EngineKvTiersChild, ComputeTurn1ThenWaitForSigkill) {
  const char* dir = std::getenv(kChildDirVariable);
  if (dir == nullptr) GTEST_SKIP() << "only run by DiskTierServesBlocksAfterKill9";
  auto engine = make_engine(tiered_config(dir));
  Turn turn1 = generate(*engine, turn1_prompt());
  engine->flush_kv_tiers();
  std::string line = "TURN1";
  for (TokenId token : turn1.tokens) line += " " + std::to_string(token);
  line += "\n";
  ASSERT_EQ(::write(STDOUT_FILENO, line.data(), line.size()), static_cast<ssize_t>(line.size()));
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

TEST(EngineKvTiersTest, DiskTierServesBlocksAfterKill9) {
  TempDir dir;
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, pipe_fds[0]);
  std::string filter = "--gtest_filter=EngineKvTiersChild.*";
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  char* argv[] = {self.data(), filter.data(), nullptr};
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  env_strings.push_back(std::string(kChildDirVariable) + "=" + dir.path().string());
  std::vector<char*> envp;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  pid_t child = 0;
  ASSERT_EQ(posix_spawn(&child, self.c_str(), &actions, nullptr, argv, envp.data()), 0);
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipe_fds[1]);

  // Read the child's "TURN1 <tokens>" line (gtest prints its own lines around it).
  std::string output;
  char buffer[4096];
  while (output.find("TURN1") == std::string::npos || output.find('\n', output.find("TURN1")) == std::string::npos) {
    ssize_t n = ::read(pipe_fds[0], buffer, sizeof buffer);
    if (n <= 0) break;
    output.append(buffer, static_cast<size_t>(n));
  }
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  ::close(pipe_fds[0]);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << output;
  const size_t start = output.find("TURN1");
  ASSERT_NE(start, std::string::npos) << output;
  std::vector<TokenId> turn1_output;
  {
    std::istringstream line(output.substr(start + 5, output.find('\n', start) - start - 5));
    for (TokenId token; line >> token;) turn1_output.push_back(token);
  }
  ASSERT_EQ(turn1_output, reference_ids("prompt_5.greedy"));

  std::vector<TokenId> prompt2 = turn2_prompt(turn1_output);
  auto engine = make_engine(tiered_config(dir.path()));
  Turn turn2 = generate(*engine, prompt2);
  EXPECT_EQ(turn2.cached_tokens, 256);
  EXPECT_EQ(engine->kv_tier_stats().loaded_blocks, 4);
  EXPECT_EQ(turn2.tokens, uncached_turn2(prompt2));
}

TEST(EngineKvTiersTest, ConfigurationErrorsAreExplicit) {
  auto backend = backend::make_cpu_backend();
  auto load = [&] {
    return std::move(model::DeepSeekModel::load(deepinfer::testing::source_path(kFixture), *backend,
                                                backend::Precision::kF32))
        .value();
  };
  EngineConfig no_host = base_config();
  no_host.disk_cache_path = "/tmp/unused";
  auto engine = Engine::create(backend::make_cpu_backend(), load(), no_host);
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("host tier"), std::string::npos) << engine.status().to_string();

  EngineConfig no_fingerprint = tiered_config("/tmp/unused");
  no_fingerprint.fingerprint = {};
  engine = Engine::create(backend::make_cpu_backend(), load(), no_fingerprint);
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("fingerprint"), std::string::npos) << engine.status().to_string();

  EngineConfig bad_class = base_config();
  auto ok_engine = make_engine(bad_class);
  SamplingParams params = greedy_params();
  params.kv_ttl_class = 7;
  auto submitted = ok_engine->submit({1, 2, 3}, params);
  ASSERT_FALSE(submitted.ok());
  EXPECT_NE(submitted.status().message().find("retention class"), std::string::npos);
}

}  // namespace
}  // namespace deepinfer::engine
