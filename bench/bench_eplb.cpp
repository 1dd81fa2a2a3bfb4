// Expert load balancing on a real routing trace: the built-in demo model (DeepSeek-V3 routing: 16 experts in 4
// groups, top-4, 3 MoE layers) prefills the messages of tests/data/conversations/agent-session.json (a real agent
// session) and counts the tokens routed to each expert per layer (the model's own counter, ExpertParallel with one
// rank); then, for several expert-parallel shapes, the ranks' max/mean load with the load-time placement (slot p holds
// expert p mod E) and with EPLB's global and hierarchical placements (expert_placement.h). One JSON line per (layer,
// ranks, redundant experts). Reports, does not judge.
//
// Usage: bench_eplb [--model DIR] [--max-tokens N (per message, default 512)]
// Command of the recorded results (bench/results/2026-12-03-dev-cpu-eplb.jsonl):
//   build/bench/bench_eplb --model models/demo
#include <boost/json.hpp>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "deepinfer/backend/communicator.h"
#include "deepinfer/model/deepseek_model.h"
#include "deepinfer/model/expert_placement.h"
#include "deepinfer/recipe/tokenizer.h"

using namespace deepinfer;

int main(int argc, char** argv) {
  std::string model_dir = std::string(DEEPINFER_SOURCE_DIR) + "/models/demo";
  int64_t max_tokens = 512;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--model") model_dir = argv[i + 1];
    if (flag == "--max-tokens") max_tokens = std::stoll(argv[i + 1]);
  }
  std::unique_ptr<backend::Backend> cpu = backend::make_cpu_backend();
  std::unique_ptr<backend::Communicator> one = backend::make_single_communicator(*cpu);
  auto model = model::DeepSeekModel::load(model_dir, *cpu, backend::Precision::kF32, false, {},
                                          model::ExpertParallel{0, 1, one.get(), 0});
  if (!model.ok()) {
    std::fprintf(stderr, "bench_eplb: %s\n", model.status().to_string().c_str());
    return 1;
  }
  auto tokenizer = recipe::Tokenizer::load(model_dir);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "bench_eplb: %s\n", tokenizer.status().to_string().c_str());
    return 1;
  }
  std::ifstream file(std::string(DEEPINFER_SOURCE_DIR) + "/tests/data/conversations/agent-session.json");
  std::stringstream text;
  text << file.rdbuf();
  const boost::json::value session = boost::json::parse(text.str());
  const int64_t blocks = (max_tokens + 63) / 64 + 1;
  auto caches = (*model)->make_layer_caches(blocks);
  if (!caches.ok()) return 1;
  int64_t tokens = 0, messages = 0;
  for (const boost::json::value& message : session.at("messages").as_array()) {
    const boost::json::value* content = message.as_object().if_contains("content");
    if (content == nullptr || !content->is_string() || content->as_string().empty()) continue;
    std::vector<int32_t> ids = (*tokenizer)->encode(std::string(content->as_string()), recipe::TextTrust::kUntrusted);
    if (static_cast<int64_t>(ids.size()) > max_tokens) ids.resize(static_cast<size_t>(max_tokens));
    if (ids.empty()) continue;
    model::ForwardBatch batch;
    batch.token_ids = ids;
    std::vector<int32_t> table;
    for (int64_t b = 0; b < blocks; ++b) table.push_back(static_cast<int32_t>(b));
    batch.sequences.push_back({static_cast<int32_t>(ids.size()), 0, table});
    batch.logits_rows = {static_cast<int32_t>(ids.size()) - 1};
    std::vector<int32_t> next;
    if (Status s = (*model)->forward_greedy(batch, *caches, next); !s.ok()) {
      std::fprintf(stderr, "bench_eplb: %s\n", s.to_string().c_str());
      return 1;
    }
    tokens += static_cast<int64_t>(ids.size());
    ++messages;
  }
  const std::vector<std::vector<double>> load = (*model)->expert_load();
  const model::ModelConfig& c = (*model)->config();
  const int64_t E = c.n_routed_experts;
  struct Shape {
    int64_t ranks, redundant, nodes;
  };
  const Shape shapes[] = {{2, 0, 1}, {4, 0, 1}, {4, 4, 2}, {8, 0, 2}, {8, 8, 2}};
  for (size_t m = 0; m < load.size(); ++m) {
    double hottest = 0.0, total = 0.0;
    for (double x : load[m]) {
      hottest = std::max(hottest, x);
      total += x;
    }
    for (const Shape& shape : shapes) {
      const int64_t P = E + shape.redundant;
      if (P % shape.ranks != 0) continue;
      const auto start = model::ExpertPlacement::contiguous(1, E, shape.redundant, shape.ranks);
      const auto global = model::rebalance_experts({load[m]}, P, shape.ranks, model::EplbPolicy::kGlobal);
      const auto hierarchical = model::rebalance_experts({load[m]}, P, shape.ranks, model::EplbPolicy::kHierarchical,
                                                         c.n_group, shape.nodes);
      std::printf("{\"bench\":\"eplb\",\"model\":\"demo\",\"trace\":\"agent-session.json\",\"messages\":%lld,"
                  "\"tokens\":%lld,\"moe_layer\":%zu,\"experts\":%lld,\"top_k\":%lld,\"hottest_expert_share\":%.3f,"
                  "\"ranks\":%lld,\"redundant\":%lld,\"nodes\":%lld,\"max_over_mean_load_time\":%.3f,"
                  "\"max_over_mean_global\":%.3f,\"max_over_mean_hierarchical\":%.3f}\n",
                  static_cast<long long>(messages), static_cast<long long>(tokens), m, static_cast<long long>(E),
                  static_cast<long long>(c.num_experts_per_tok), total > 0 ? hottest / total : 0.0,
                  static_cast<long long>(shape.ranks), static_cast<long long>(shape.redundant),
                  static_cast<long long>(shape.nodes), model::rank_imbalance(load[m], start.phy2log[0], shape.ranks),
                  model::rank_imbalance(load[m], global.phy2log[0], shape.ranks),
                  model::rank_imbalance(load[m], hierarchical.phy2log[0], shape.ranks));
    }
  }
  return 0;
}
