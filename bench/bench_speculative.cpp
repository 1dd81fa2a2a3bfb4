// Speculative decoding on the CPU: output tokens/s and mean accepted length of greedy chat requests on the demo
// model with no speculation and with MTP drafting (K = 1, 2, 3), at batch 1, 8 and 32. Fixed prompts (questions
// in the demo's training domains, rendered as DeepSeek-V3 chat turns), EOS stops; each (K, batch) runs --reps times
// on a fresh engine after a warm-up request and reports the median (min, max). Every MTP run's tokens are compared
// with the plain run's (greedy speculation must not change them). One JSON line per (K, batch).
//
// Usage: bench_speculative [--model DIR] [--draft-tokens 0,1,2,3] [--batches 1,8,32] [--max-tokens 64] [--reps 3]
//                          [--bf16]
// Command of the recorded results (bench/results/*-cpu-speculative-mtp.jsonl):
//   build/bench/bench_speculative --model models/demo --draft-tokens 0,1,2,3 --batches 1,8,32 --max-tokens 64 --reps 3
#include <omp.h>

#include <algorithm>
#include <boost/json.hpp>
#include <chrono>
#include <ctime>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "deepinfer/engine/engine.h"
#include "deepinfer/recipe/tokenizer.h"

namespace {

using namespace deepinfer;
using Clock = std::chrono::steady_clock;

// Questions of the kinds the demo model was trained on (Python docs, PostgreSQL docs, man pages).
const char* const kQuestions[] = {
    "What does the os.path.join function do?",
    "How do I create an index in PostgreSQL?",
    "What is the ls command used for?",
    "Explain Python list comprehensions.",
    "What does VACUUM do in PostgreSQL?",
    "How does the grep command search files?",
    "What is a Python generator?",
    "How do I use the COPY command?",
    "What does the chmod command change?",
    "How are exceptions handled in Python?",
    "What is a PostgreSQL tablespace?",
    "What does the fork system call return?",
    "How do I read a file line by line in Python?",
    "What is the difference between DELETE and TRUNCATE?",
    "What does the tar command do?",
    "What is the purpose of the with statement?",
};

std::vector<int64_t> parse_list(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) out.push_back(std::stoll(item));
  return out;
}

struct Run {
  double seconds = 0.0;
  int64_t generated = 0;
  std::vector<std::vector<TokenId>> outputs;
  engine::SpeculativeStats stats;
};

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir = std::string(DEEPINFER_SOURCE_DIR) + "/models/demo";
  std::vector<int64_t> draft_tokens = {0, 1, 2, 3}, batches = {1, 8, 32};
  int64_t max_tokens = 64;
  int reps = 3;
  bool bf16 = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << arg << " needs a value\n";
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--model") {
      model_dir = next();
    } else if (arg == "--draft-tokens") {
      draft_tokens = parse_list(next());
    } else if (arg == "--batches") {
      batches = parse_list(next());
    } else if (arg == "--max-tokens") {
      max_tokens = std::stoll(next());
    } else if (arg == "--reps") {
      reps = std::stoi(next());
    } else if (arg == "--bf16") {
      bf16 = true;
    } else {
      std::cerr << "usage: bench_speculative [--model DIR] [--draft-tokens 0,1,2,3] [--batches 1,8,32] "
                   "[--max-tokens N] [--reps N] [--bf16]\n";
      return 2;
    }
  }
  {
    // The header: the command as run, when, on what.
    std::string command = "build/bench/bench_speculative";
    for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
    const std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    boost::json::object header{{"bench", "speculative_run"},
                               {"command", command},
                               {"date", date},
                               {"cpus", static_cast<int64_t>(std::thread::hardware_concurrency())},
                               {"omp_threads", omp_get_max_threads()},
                               {"cpu_features", backend::cpu_features()}};
    std::cout << boost::json::serialize(header) << std::endl;
  }
  auto tokenizer = recipe::Tokenizer::load(model_dir);
  if (!tokenizer.ok()) {
    std::cerr << tokenizer.status().to_string() << "\n";
    return 1;
  }
  std::vector<std::vector<TokenId>> prompts;
  for (const char* question : kQuestions) {
    // DeepSeek-V3's chat format, the generation prompt open (control tokens as the trusted text's added tokens).
    const std::string text = std::string("<｜begin▁of▁sentence｜><｜User｜>") + question + "<｜Assistant｜>";
    prompts.push_back((*tokenizer)->encode(text, recipe::TextTrust::kTrusted));
  }
  const backend::Precision precision = bf16 ? backend::Precision::kBF16 : backend::Precision::kF32;

  std::map<int64_t, Run> plain;  // per batch: the K = 0 run's outputs and tokens/s
  for (int64_t batch : batches) {
    for (int64_t k : draft_tokens) {
      std::vector<Run> runs;
      for (int rep = 0; rep < reps; ++rep) {
        auto backend = backend::make_cpu_backend();
        auto model = model::DeepSeekModel::load(model_dir, *backend, precision);
        if (!model.ok()) {
          std::cerr << model.status().to_string() << "\n";
          return 1;
        }
        engine::EngineConfig config;
        config.max_num_seqs = static_cast<int32_t>(std::max<int64_t>(batch, 1));
        config.kv_cache_bytes = 256ll << 20;
        if (k > 0) {
          config.speculative.algorithm = engine::SpeculativeAlgorithm::kMtp;
          config.speculative.num_draft_tokens = static_cast<int32_t>(k);
        }
        auto created = engine::Engine::create(std::move(backend), std::move(model).value(), config);
        if (!created.ok()) {
          std::cerr << created.status().to_string() << "\n";
          return 1;
        }
        engine::Engine& engine = **created;
        engine::SamplingParams params;
        params.temperature = 0.0f;
        params.max_tokens = max_tokens;
        (void)engine.submit(prompts[0], params);  // warm-up (scratch buffers, pages)
        while (engine.has_pending_work()) (void)engine.step();
        const engine::SpeculativeStats before = engine.speculative_stats();
        std::vector<engine::SequenceId> ids;
        const Clock::time_point start = Clock::now();
        for (int64_t r = 0; r < batch; ++r) {
          ids.push_back(*engine.submit(prompts[static_cast<size_t>(r) % prompts.size()], params));
        }
        std::map<engine::SequenceId, std::vector<TokenId>> tokens;
        while (engine.has_pending_work()) {
          auto events = engine.step();
          if (!events.ok()) {
            std::cerr << events.status().to_string() << "\n";
            return 1;
          }
          for (const engine::TokenEvent& event : *events) {
            if (event.token) tokens[event.id].push_back(*event.token);
          }
        }
        Run run;
        run.seconds = std::chrono::duration<double>(Clock::now() - start).count();
        for (engine::SequenceId id : ids) {
          run.generated += static_cast<int64_t>(tokens[id].size());
          run.outputs.push_back(tokens[id]);
        }
        run.stats = engine.speculative_stats();
        run.stats.verifies -= before.verifies;
        run.stats.emitted_tokens -= before.emitted_tokens;
        run.stats.draft_tokens -= before.draft_tokens;
        run.stats.accepted_tokens -= before.accepted_tokens;
        for (size_t p = 0; p < before.accepted_by_position.size(); ++p) {
          run.stats.accepted_by_position[p] -= before.accepted_by_position[p];
          run.stats.drafted_by_position[p] -= before.drafted_by_position[p];
        }
        runs.push_back(std::move(run));
      }
      std::vector<double> rates;
      for (const Run& run : runs) rates.push_back(static_cast<double>(run.generated) / run.seconds);
      std::sort(rates.begin(), rates.end());
      const Run& first = runs.front();
      boost::json::object line{{"bench", "speculative"},
                               {"model", model_dir},
                               {"weights", bf16 ? "bf16" : "f32"},
                               {"algorithm", k > 0 ? "mtp" : "off"},
                               {"draft_tokens", k},
                               {"batch", batch},
                               {"max_tokens", max_tokens},
                               {"reps", reps},
                               {"generated_tokens", first.generated},
                               {"tokens_per_s", rates[rates.size() / 2]},
                               {"tokens_per_s_min", rates.front()},
                               {"tokens_per_s_max", rates.back()}};
      if (k == 0) {
        plain[batch] = runs[static_cast<size_t>(runs.size() / 2)];
        plain[batch].seconds = static_cast<double>(first.generated) / rates[rates.size() / 2];
        line["mean_accepted_length"] = 1.0;
      } else {
        const engine::SpeculativeStats& s = first.stats;
        line["mean_accepted_length"] =
            s.verifies > 0 ? static_cast<double>(s.emitted_tokens) / static_cast<double>(s.verifies) : 0.0;
        boost::json::array by_position;
        for (size_t p = 0; p < s.drafted_by_position.size(); ++p) {
          by_position.push_back(s.drafted_by_position[p] > 0 ? static_cast<double>(s.accepted_by_position[p]) /
                                                                   static_cast<double>(s.drafted_by_position[p])
                                                             : 0.0);
        }
        line["acceptance_by_position"] = by_position;
        if (plain.contains(batch)) {
          line["identical_to_off"] = first.outputs == plain[batch].outputs;
          line["speedup_vs_off"] =
              rates[rates.size() / 2] * plain[batch].seconds / static_cast<double>(plain[batch].generated);
        }
      }
      std::cout << boost::json::serialize(line) << std::endl;
    }
  }
  return 0;
}
