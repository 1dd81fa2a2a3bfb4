// Tensor and expert parallel against one process, with real processes over Gloo on loopback: for each fixture and
// each (tensor-parallel, expert-parallel) size, the test (this binary) serves the rendezvous store and starts
// tp x ep copies of itself as the ranks (DEEPINFER_TP_RANK set: main() runs the rank instead of the tests). Rank
// ep_rank * tp + tp_rank joins its tensor-parallel group and its expert-parallel group and loads its shard. Each
// expert-parallel rank (an attention data-parallel replica) runs its share of the work: the fixture's prompts
// i % ep == ep_rank prefilled in one batch (every position's logits), then group 0 greedy-decodes 16 tokens of prompt
// 0 by forward_greedy while the other groups pass empty batches (idle ranks that still serve the MoE layers'
// exchanges). Each group's tensor-parallel rank 0 writes what it got; the test compares every prompt with the
// single-process model's: logits within float32 noise (relative error <= 1e-5), argmax and greedy tokens identical,
// and against the transformers reference as the single-process test does (<= 1e-4).
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "deepinfer/backend/communicator.h"
#include "logits_compare.h"
#include "reference_prompts.h"
#include "temp_dir.h"
#include "test_data.h"

extern char** environ;

namespace deepinfer::testing {
namespace {

using namespace std::chrono_literals;
using model::ForwardBatch;
using model::TensorParallel;

struct Outcome {
  std::vector<float> logits;   // every prompt's every position, prompts one after another, [positions, vocab]
  std::vector<int32_t> greedy;  // 16 greedy tokens after prompt 0 (forward_greedy)
  std::vector<double> before, after;  // EPLB: per MoE layer max/mean rank load under the old / new placement
  int64_t capacity_dropped = 0;       // pairs the capacity factor dropped (group 0's tensor-parallel rank 0)
};

constexpr int kRebalanceAt = 8;  // with EPLB: the greedy pass before which every rank rebalances

// The work of expert-parallel group `group` of `groups` (one process: group 0 of 1): prompts i % groups == group in
// one batch, then (group 0 only; the others pass empty batches) 16 greedy tokens of prompt 0.
// With `rebalance`, every rank calls rebalance_experts() before greedy pass kRebalanceAt (requests continuing).
Status run_work(DeepSeekModel& model, const std::vector<ReferencePrompt>& all_prompts, Outcome& out, int group = 0,
                int groups = 1, bool rebalance = false) {
  auto maybe_rebalance = [&](int pass) {
    if (!rebalance || pass != kRebalanceAt) return Status();
    return model.rebalance_experts(model::EplbPolicy::kGlobal, 1, 1, &out.before, &out.after);
  };
  std::vector<ReferencePrompt> prompts;
  for (size_t i = 0; i < all_prompts.size(); ++i) {
    if (static_cast<int>(i % static_cast<size_t>(groups)) == group) prompts.push_back(all_prompts[i]);
  }
  int64_t total = static_cast<int64_t>(all_prompts[0].input_ids.size());
  for (const ReferencePrompt& p : prompts) total += static_cast<int64_t>(p.input_ids.size());
  TestCache cache(model, total / kBlockTokens + static_cast<int64_t>(prompts.size()) + 4);
  ForwardBatch batch;
  std::vector<std::vector<int32_t>> tables;
  for (const ReferencePrompt& p : prompts) {
    const int32_t n = static_cast<int32_t>(p.input_ids.size());
    tables.push_back(cache.allocate(n + 16));
    for (int32_t i = 0; i < n; ++i) batch.logits_rows.push_back(static_cast<int32_t>(batch.token_ids.size()) + i);
    batch.token_ids.insert(batch.token_ids.end(), p.input_ids.begin(), p.input_ids.end());
    batch.sequences.push_back({n, 0, tables.back()});
  }
  if (Status s = model.forward(batch, cache.pointers, out.logits); !s.ok()) return s;
  if (group != 0) {  // idle while group 0 prefills in two chunks and decodes: 17 empty passes
    std::vector<int32_t> ids;
    for (int pass = 0; pass < 17; ++pass) {
      if (pass >= 2) {
        if (Status s = maybe_rebalance(pass - 1); !s.ok()) return s;
      }
      if (Status s = model.forward_greedy(ForwardBatch{}, cache.pointers, ids); !s.ok()) return s;
    }
    return Status();
  }
  // Prompt 0 again in its own blocks, then greedy decoding.
  const std::vector<int32_t>& prompt = all_prompts[0].input_ids;
  const int32_t n = static_cast<int32_t>(prompt.size());
  std::vector<int32_t> table = cache.allocate(n + 16);
  // A first chunk that wants no logits (as a long prompt's middle chunks; regression: with tensor parallel the
  // gather of no logits crashed), then the last token.
  ForwardBatch chunk;
  chunk.token_ids.assign(prompt.begin(), prompt.end() - 1);
  chunk.sequences.push_back({n - 1, 0, table});
  std::vector<int32_t> ids;
  if (Status s = model.forward_greedy(chunk, cache.pointers, ids); !s.ok()) return s;
  if (!ids.empty()) return Status::internal("a pass without logits rows returned ids");
  ForwardBatch prefill;
  prefill.token_ids = {prompt.back()};
  prefill.sequences.push_back({1, n - 1, table});
  prefill.logits_rows = {0};
  if (Status s = model.forward_greedy(prefill, cache.pointers, ids); !s.ok()) return s;
  out.greedy = ids;
  for (int32_t i = 1; i < 16; ++i) {
    if (Status s = maybe_rebalance(i); !s.ok()) return s;
    ForwardBatch step;
    step.token_ids = {out.greedy.back()};
    step.sequences.push_back({1, n + i - 1, table});
    step.logits_rows = {0};
    if (Status s = model.forward_greedy(step, cache.pointers, ids); !s.ok()) return s;
    out.greedy.push_back(ids[0]);
  }
  return Status();
}

// A rank: DEEPINFER_TP_{RANK,SIZE,EP,PORT,FIXTURE,OUT}. Exit 0 on success.
int run_rank() {
  const int rank = std::atoi(std::getenv("DEEPINFER_TP_RANK"));
  const int tp = std::atoi(std::getenv("DEEPINFER_TP_SIZE"));
  const int ep = std::atoi(std::getenv("DEEPINFER_TP_EP"));
  const int redundant = std::atoi(std::getenv("DEEPINFER_TP_REDUNDANT"));
  // Experts over the tensor-parallel ranks themselves (ExpertParallel::replicated_tokens): world tp, ep = tp.
  const bool replicated = std::getenv("DEEPINFER_TP_REPLICATED") != nullptr;
  const double capacity = std::atof(std::getenv("DEEPINFER_TP_CAPACITY"));
  const int port = std::atoi(std::getenv("DEEPINFER_TP_PORT"));
  const std::string fixture = std::getenv("DEEPINFER_TP_FIXTURE");
  const std::string out_dir = std::getenv("DEEPINFER_TP_OUT");
  const int tp_rank = rank % tp, ep_rank = replicated ? 0 : rank / tp;
  auto fail = [&](const Status& s) {
    std::fprintf(stderr, "rank %d: %s\n", rank, s.to_string().c_str());
    return 1;
  };
  Result<std::unique_ptr<backend::TcpStore>> store = backend::connect_tcp_store("127.0.0.1", port, 10s);
  if (!store.ok()) return fail(store.status());
  std::unique_ptr<backend::Communicator> tp_comm, ep_comm;
  if (tp > 1) {
    auto comm = backend::make_gloo_communicator(**store, "tp/" + std::to_string(ep_rank), tp_rank, tp, "127.0.0.1", 30s);
    if (!comm.ok()) return fail(comm.status());
    tp_comm = std::move(comm).value();
  }
  if (ep > 1 && !replicated) {
    auto comm = backend::make_gloo_communicator(**store, "ep/" + std::to_string(tp_rank), ep_rank, ep, "127.0.0.1", 30s);
    if (!comm.ok()) return fail(comm.status());
    ep_comm = std::move(comm).value();
  }
  std::unique_ptr<backend::Backend> cpu = backend::make_cpu_backend();
  Result<std::unique_ptr<DeepSeekModel>> model =
      DeepSeekModel::load(fixture, *cpu, backend::Precision::kF32, false, TensorParallel{tp_rank, tp, tp_comm.get()},
                          replicated ? model::ExpertParallel{tp_rank, tp, tp_comm.get(), redundant, true, capacity}
                                     : model::ExpertParallel{ep_rank, ep, ep_comm.get(), redundant, false, capacity});
  if (!model.ok()) return fail(model.status());
  Outcome out;
  if (Status s = run_work(**model, load_reference(fixture), out, ep_rank, replicated ? 1 : ep, redundant > 0); !s.ok()) {
    return fail(s);
  }
  if (tp_rank == 0) {
    std::ofstream file(out_dir + "/group" + std::to_string(ep_rank) + ".bin", std::ios::binary);
    const uint64_t n = out.logits.size();
    file.write(reinterpret_cast<const char*>(&n), sizeof(n));
    file.write(reinterpret_cast<const char*>(out.logits.data()), static_cast<std::streamsize>(n * sizeof(float)));
    const uint64_t g = out.greedy.size();
    file.write(reinterpret_cast<const char*>(&g), sizeof(g));
    file.write(reinterpret_cast<const char*>(out.greedy.data()), static_cast<std::streamsize>(g * sizeof(int32_t)));
    const uint64_t layers = out.before.size();
    file.write(reinterpret_cast<const char*>(&layers), sizeof(layers));
    file.write(reinterpret_cast<const char*>(out.before.data()), static_cast<std::streamsize>(layers * sizeof(double)));
    file.write(reinterpret_cast<const char*>(out.after.data()), static_cast<std::streamsize>(layers * sizeof(double)));
    const int64_t dropped = (*model)->eplb_stats().capacity_dropped;
    file.write(reinterpret_cast<const char*>(&dropped), sizeof(dropped));
  }
  return 0;
}

// Starts tp x ep ranks of this binary on `fixture` and returns each expert-parallel group's outcome (empty on failure).
std::vector<Outcome> run_ranks(const std::string& fixture, int tp, int ep, int redundant, bool replicated,
                               double capacity) {
  const int world = replicated ? tp : tp * ep, groups = replicated ? 1 : ep;
  Result<std::unique_ptr<backend::TcpStore>> store = backend::serve_tcp_store("127.0.0.1", 0);
  EXPECT_TRUE(store.ok()) << store.status().to_string();
  if (!store.ok()) return {};
  TempDir dir;
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
    env_strings.push_back("DEEPINFER_TP_RANK=" + std::to_string(rank));
    env_strings.push_back("DEEPINFER_TP_SIZE=" + std::to_string(tp));
    env_strings.push_back("DEEPINFER_TP_EP=" + std::to_string(ep));
    env_strings.push_back("DEEPINFER_TP_REDUNDANT=" + std::to_string(redundant));
    if (replicated) env_strings.push_back("DEEPINFER_TP_REPLICATED=1");
    env_strings.push_back("DEEPINFER_TP_CAPACITY=" + std::to_string(capacity));
    env_strings.push_back("DEEPINFER_TP_PORT=" + std::to_string((*store)->port()));
    env_strings.push_back("DEEPINFER_TP_FIXTURE=" + fixture);
    env_strings.push_back("DEEPINFER_TP_OUT=" + dir.path().string());
    env_strings.push_back("OMP_NUM_THREADS=1");  // the ranks share the machine's cores
    std::vector<char*> envp;
    for (std::string& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    char self[] = "/proc/self/exe";
    char* argv[] = {self, nullptr};
    pid_t pid = 0;
    EXPECT_EQ(posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data()), 0);
    pids.push_back(pid);
  }
  bool ok = true;
  for (size_t r = 0; r < pids.size(); ++r) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank " << r << " status " << status;
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  if (!ok) return {};
  std::vector<Outcome> outcomes(static_cast<size_t>(groups));
  for (int g = 0; g < groups; ++g) {
    Outcome& out = outcomes[static_cast<size_t>(g)];
    std::ifstream file(dir.path() / ("group" + std::to_string(g) + ".bin"), std::ios::binary);
    uint64_t n = 0, greedy = 0;
    file.read(reinterpret_cast<char*>(&n), sizeof(n));
    out.logits.resize(n);
    file.read(reinterpret_cast<char*>(out.logits.data()), static_cast<std::streamsize>(n * sizeof(float)));
    file.read(reinterpret_cast<char*>(&greedy), sizeof(greedy));
    out.greedy.resize(greedy);
    file.read(reinterpret_cast<char*>(out.greedy.data()), static_cast<std::streamsize>(greedy * sizeof(int32_t)));
    uint64_t layers = 0;
    file.read(reinterpret_cast<char*>(&layers), sizeof(layers));
    out.before.resize(layers);
    out.after.resize(layers);
    file.read(reinterpret_cast<char*>(out.before.data()), static_cast<std::streamsize>(layers * sizeof(double)));
    file.read(reinterpret_cast<char*>(out.after.data()), static_cast<std::streamsize>(layers * sizeof(double)));
    file.read(reinterpret_cast<char*>(&out.capacity_dropped), sizeof(out.capacity_dropped));
    EXPECT_TRUE(file.good()) << "group " << g;
  }
  return outcomes;
}

struct Case {
  std::string fixture;
  int tp, ep;
  int redundant = 0;  // > 0: EPLB with that many redundant experts, rebalanced mid-decode
  bool replicated = false;  // experts over the tensor-parallel ranks (ep == tp, one group)
  double capacity = 0.0;    // --moe-capacity-factor (0: none)
};

class ModelParallelTest : public ::testing::TestWithParam<Case> {};

TEST_P(ModelParallelTest, LogitsWithinFloat32NoiseAndGreedyTokensIdentical) {
  const std::string fixture = source_path("tests/data/models/" + GetParam().fixture);
  const int tp = GetParam().tp, ep = GetParam().ep;
  const std::vector<ReferencePrompt> prompts = load_reference(fixture);
  ASSERT_FALSE(prompts.empty());
  std::unique_ptr<backend::Backend> cpu = backend::make_cpu_backend();
  Result<std::unique_ptr<DeepSeekModel>> single = DeepSeekModel::load(fixture, *cpu, backend::Precision::kF32);
  ASSERT_TRUE(single.ok()) << single.status().to_string();
  Outcome expected;
  ASSERT_TRUE(run_work(**single, prompts, expected).ok());
  const int64_t vocab = (*single)->config().vocab_size;

  const bool replicated = GetParam().replicated;
  std::vector<Outcome> groups = run_ranks(fixture, tp, ep, GetParam().redundant, replicated, GetParam().capacity);
  const int group_count = replicated ? 1 : ep;
  ASSERT_EQ(groups.size(), static_cast<size_t>(group_count));
  double worst = 0.0, worst_reference = 0.0;
  int64_t row = 0, argmax_differ = 0;
  std::vector<int64_t> group_row(static_cast<size_t>(group_count), 0);  // each group's rows so far
  for (size_t i = 0; i < prompts.size(); ++i) {
    const ReferencePrompt& p = prompts[i];
    const int64_t n = static_cast<int64_t>(p.input_ids.size());
    Outcome& group = groups[i % static_cast<size_t>(group_count)];
    int64_t& at = group_row[i % static_cast<size_t>(group_count)];
    ASSERT_LE((at + n) * vocab, static_cast<int64_t>(group.logits.size()));
    const float* ours = group.logits.data() + at * vocab;
    const double error = relative_error(ours, expected.logits.data() + row * vocab, n * vocab);
    worst = std::max(worst, error);
    for (int64_t j = 0; j < n; ++j) {
      argmax_differ += argmax(ours + j * vocab, vocab) != argmax(expected.logits.data() + (row + j) * vocab, vocab);
    }
    std::vector<float> prompt_logits(ours, ours + n * vocab);
    int agree = 0;
    worst_reference = std::max(worst_reference,
                               stored_positions_error(p.positions, p.logits, prompt_logits, vocab, &agree));
    row += n;
    at += n;
  }
  std::printf("{\"test\":\"model_parallel\",\"fixture\":\"%s\",\"tp\":%d,\"ep\":%d,\"experts_over\":\"%s\","
              "\"redundant\":%d,\"max_rel_err_vs_single\":%.3g,"
              "\"max_rel_err_vs_reference\":%.3g,\"argmax_differ\":%lld,\"greedy_identical\":%s}\n",
              GetParam().fixture.c_str(), tp, ep, replicated ? "tp_ranks" : ep > 1 ? "dp_attention_groups" : "none",
              GetParam().redundant, worst, worst_reference, static_cast<long long>(argmax_differ),
              groups[0].greedy == expected.greedy ? "true" : "false");
  if (GetParam().capacity > 0.0 && GetParam().capacity < 10.0) {
    // A tight cap drops pairs and so changes the logits (why it is off by default); they stay finite.
    std::printf("{\"test\":\"moe_capacity\",\"fixture\":\"%s\",\"factor\":%.2f,\"dropped_pairs\":%lld,"
                "\"rel_err_vs_uncapped\":%.3g}\n",
                GetParam().fixture.c_str(), GetParam().capacity, static_cast<long long>(groups[0].capacity_dropped),
                worst);
    EXPECT_GT(groups[0].capacity_dropped, 0);
    EXPECT_GT(worst, 1e-5);
    for (float x : groups[0].logits) ASSERT_TRUE(std::isfinite(x));
    return;
  }
  if (GetParam().capacity > 0.0) {
    EXPECT_EQ(groups[0].capacity_dropped, 0);  // a loose cap drops nothing
  }
  if (GetParam().redundant > 0) {
    // The rebalance happened on every rank (group 0 reports it), and it balanced what it was given.
    ASSERT_FALSE(groups[0].before.empty());
    for (size_t m = 0; m < groups[0].before.size(); ++m) {
      std::printf("{\"test\":\"eplb_rebalance\",\"fixture\":\"%s\",\"ep\":%d,\"redundant\":%d,\"moe_layer\":%zu,"
                  "\"max_over_mean_before\":%.3f,\"max_over_mean_after\":%.3f}\n",
                  GetParam().fixture.c_str(), ep, GetParam().redundant, m, groups[0].before[m], groups[0].after[m]);
      // A greedy packing of a nearly even load may come out a hair less even; never worse than that.
      EXPECT_LE(groups[0].after[m], std::max(groups[0].before[m], 1.05));
    }
  }
  EXPECT_LE(worst, 1e-5);
  EXPECT_LE(worst_reference, 1e-4);
  EXPECT_EQ(argmax_differ, 0);
  EXPECT_EQ(groups[0].greedy, expected.greedy);
  EXPECT_EQ(expected.greedy, prompts[0].greedy);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, ModelParallelTest,
    ::testing::Values(Case{"tiny-deepseek-v2-lite", 2, 1}, Case{"tiny-deepseek-v3", 2, 1}, Case{"tiny-deepseek-v3", 4, 1},
                      Case{"tiny-deepseek-v3-fp8", 2, 1}, Case{"tiny-deepseek-v2-lite", 1, 2},
                      Case{"tiny-deepseek-v3", 1, 2}, Case{"tiny-deepseek-v3", 1, 4}, Case{"tiny-deepseek-v3-fp8", 1, 2},
                      Case{"tiny-deepseek-v2-lite", 2, 2}, Case{"tiny-deepseek-v3", 2, 2},
                      Case{"tiny-deepseek-v3", 1, 2, 2}, Case{"tiny-deepseek-v2-lite", 2, 2, 4},
                      Case{"tiny-deepseek-v3", 2, 2, 0, true}, Case{"tiny-deepseek-v2-lite", 2, 2, 2, true},
                      Case{"tiny-deepseek-v3", 1, 2, 0, false, 100.0}, Case{"tiny-deepseek-v3", 1, 2, 0, false, 0.5},
                      Case{"tiny-deepseek-v3", 2, 2, 0, true, 0.5}),
    [](const ::testing::TestParamInfo<Case>& info) {
      std::string name = info.param.fixture + "_tp" + std::to_string(info.param.tp) + "_ep" + std::to_string(info.param.ep) +
                         (info.param.redundant > 0 ? "_eplb" + std::to_string(info.param.redundant) : "") +
                         (info.param.replicated ? "_over_tp" : "") +
                         (info.param.capacity > 0.0 ? "_capacity" + std::to_string(static_cast<int>(info.param.capacity * 10)) : "");
      for (char& ch : name) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
      return name;
    });

// A shape that does not split is refused at load, naming the dimension.
TEST(TensorParallel, RefusesASizeThatDoesNotDivideTheHeads) {
  std::unique_ptr<backend::Backend> cpu = backend::make_cpu_backend();
  std::unique_ptr<backend::Communicator> single = backend::make_single_communicator(*cpu);
  // A communicator of size 3 is not needed to see the refusal: the shape check comes first.
  Result<std::unique_ptr<DeepSeekModel>> model =
      DeepSeekModel::load(source_path("tests/data/models/tiny-deepseek-v3"), *cpu, backend::Precision::kF32, false,
                          TensorParallel{0, 3, single.get()});
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("tensor"), std::string::npos) << model.status().message();
}

}  // namespace
}  // namespace deepinfer::testing

int main(int argc, char** argv) {
  if (std::getenv("DEEPINFER_TP_RANK") != nullptr) return deepinfer::testing::run_rank();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
