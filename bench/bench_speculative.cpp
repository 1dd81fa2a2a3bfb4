// Speculative decoding on the CPU: output tokens/s and mean accepted length of greedy chat requests on the demo
// model with no speculation, with MTP drafting (K = 1, 2, 3) and with DSpark's planner over the same drafts (up to
// --dspark-max-draft-tokens, its step-time table measured when each engine starts, outside the timed part), at
// batch 1, 8 and 32. Fixed prompts (questions
// in the demo's training domains, rendered as DeepSeek-V3 chat turns), EOS stops; each (K, batch) runs --reps times
// on a fresh engine after a warm-up run of the same batch (the reps of a batch interleave the configurations) and reports the median (min, max). Every MTP run's tokens are compared
// with the plain run's (greedy speculation must not change them). One JSON line per (K, batch).
//
// Usage: bench_speculative [--model DIR] [--draft-tokens 0,1,2,3] [--batches 1,8,32] [--max-tokens 64] [--reps 3]
//                          [--bf16] [--dspark-max-draft-tokens 4 (0: no DSpark run)] [--dspark-confidence-threshold X]
//                          [--dspark-step-time-table const|FILE (const: the planner verifies every draft, so that the
//                          draft phases are timed; default: measured at each engine's start)]
// Command of the recorded results (bench/results/*-cpu-speculative-mtp.jsonl):
//   build/bench/bench_speculative --model models/demo --draft-tokens 0,1,2,3 --batches 1,8,32 --max-tokens 64 --reps 3
#include <omp.h>
#include <spdlog/cfg/env.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <boost/json.hpp>
#include <chrono>
#include <cmath>
#include <ctime>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/engine/dspark.h"
#include "deepinfer/engine/engine.h"
#include "deepinfer/recipe/tokenizer.h"

namespace {

using namespace deepinfer;
using Clock = std::chrono::steady_clock;

// Questions of the kinds the demo model was trained on (Debian's documentation and man pages, chat).
const char* const kQuestions[] = {
    "What does the ls command do?",
    "How do I search files for a pattern with grep?",
    "What is the tar command used for?",
    "Explain what the chmod command changes.",
    "What does the fork system call return?",
    "How do I copy a directory with cp?",
    "What does the find command do?",
    "How do I see which processes are running?",
    "What is a symbolic link?",
    "How do I compress a file with gzip?",
    "What does the mount command do?",
    "How do I change my password?",
    "What is the difference between a hard link and a soft link?",
    "What does the kill command do?",
    "How do I read a man page?",
    "What does apt-get install do?",
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
  // Off only (one more pass after the timed ones, with logprobs): per sequence, per token, the gap between the
  // chosen token's logprob and the runner-up's - where a run that is not identical to off first differs, this
  // says whether it was a near-tie (rounding of another step shape) or a real difference.
  std::vector<std::vector<float>> margins;
  bool margins_match_outputs = true;  // the logprob pass gave the same tokens as the timed ones
};

Result<std::unique_ptr<backend::Backend>> make_backend(const std::string& device) {
  if (device == "cpu") return backend::make_cpu_backend();
  if (device == "cuda") return backend::make_cuda_backend(0);
  return Status::invalid_argument("--device must be cpu or cuda, got " + device);
}

// --step-times: the step times the DSpark planner measures (engine::step_times, the product's code) for models of
// real shapes with random weights and one MTP layer (config.json directories, e.g. bench/gpu/configs/v2-lite; its
// num_nextn_predict_layers is set to 1), and from them the tokens/s each speculation setting would reach at the
// given acceptance (--acceptance A1,A2,...: the rate at which drafts 1..k were all accepted, as measured on a
// trained model): B * (1 + A_1 + ... + A_K) / (verify_ms(B * (K + 1)) + K * draft_ms(B)) for K drafts at batch B.
// Projections, not runs: random weights accept nothing.
int project(const std::vector<std::string>& configs, const std::vector<double>& acceptance,
            const std::vector<int64_t>& batches, const std::vector<int64_t>& draft_tokens, const std::string& device) {
  const int32_t max_k = static_cast<int32_t>(
      std::max<int64_t>(1, *std::max_element(draft_tokens.begin(), draft_tokens.end())));
  const int32_t max_batch = static_cast<int32_t>(*std::max_element(batches.begin(), batches.end()));
  for (const std::string& dir : configs) {
    Result<model::ModelConfig> config = model::load_model_config(dir + "/config.json");
    if (!config.ok()) {
      std::cerr << config.status().to_string() << "\n";
      return 1;
    }
    config->num_nextn_predict_layers = 1;
    Result<std::unique_ptr<backend::Backend>> backend = make_backend(device);
    if (!backend.ok()) {
      std::cerr << backend.status().to_string() << "\n";
      return 1;
    }
    const bool fp8 = config->quant_method == "fp8";
    const backend::Precision precision =
        device == "cpu" ? backend::Precision::kF32 : fp8 ? backend::Precision::kFP8 : backend::Precision::kBF16;
    auto model = model::DeepSeekModel::create_random(*config, **backend, precision, 1234);
    if (!model.ok()) {
      std::cerr << model.status().to_string() << "\n";
      return 1;
    }
    // Blocks for max_batch sequences of 64 + max_k + 1 positions (2 blocks each), and the MTP layer's cache.
    const int32_t num_blocks = 2 * max_batch + 2;
    auto caches = (*model)->make_layer_caches(num_blocks);
    if (!caches.ok()) {
      std::cerr << caches.status().to_string() << "\n";
      return 1;
    }
    auto mtp_cache = (*model)->make_layer_cache(num_blocks + max_batch);
    if (!mtp_cache.ok()) {
      std::cerr << mtp_cache.status().to_string() << "\n";
      return 1;
    }
    caches->push_back(std::move(mtp_cache).value());
    engine::DsparkConfig dspark;  // "": measured now, not written
    Result<engine::StepTimes> times =
        engine::step_times(dspark, **model, *caches, num_blocks, max_batch, max_batch * (max_k + 1));
    if (!times.ok()) {
      std::cerr << times.status().to_string() << "\n";
      return 1;
    }
    auto table_json = [](const engine::StepTimeTable& table) {
      boost::json::array points;
      for (const auto& [rows, ms] : table.points()) points.push_back(boost::json::array{rows, ms});
      return points;
    };
    std::cout << boost::json::serialize(boost::json::object{{"bench", "speculative_step_times"},
                                                            {"config", dir},
                                                            {"device", device},
                                                            {"precision", precision == backend::Precision::kFP8    ? "fp8"
                                                                          : precision == backend::Precision::kBF16 ? "bf16"
                                                                                                                   : "f32"},
                                                            {"verify_ms", table_json(times->verify)},
                                                            {"draft_pass_ms", table_json(times->draft)}})
              << std::endl;
    for (int64_t batch : batches) {
      const double off = static_cast<double>(batch) / times->verify.milliseconds(batch) * 1000.0;
      auto rate = [&](int32_t k) {
        double expected = 1.0;
        for (int32_t i = 0; i < k && i < static_cast<int32_t>(acceptance.size()); ++i) expected += acceptance[i];
        const double ms =
            times->verify.milliseconds(batch * (k + 1)) + (k > 0 ? k * times->draft.milliseconds(batch) : 0.0);
        return static_cast<double>(batch) * expected / ms * 1000.0;
      };
      for (int64_t k : draft_tokens) {
        if (k > static_cast<int64_t>(acceptance.size())) continue;
        std::cout << boost::json::serialize(boost::json::object{{"bench", "speculative_projection"},
                                                                {"config", dir},
                                                                {"device", device},
                                                                {"algorithm", k > 0 ? "mtp" : "off"},
                                                                {"draft_tokens", k},
                                                                {"batch", batch},
                                                                {"tokens_per_s", rate(static_cast<int32_t>(k))},
                                                                {"speedup_vs_off", rate(static_cast<int32_t>(k)) / off}})
                  << std::endl;
      }
      const int32_t length = engine::plan_draft_length(batch, batch, batch, static_cast<int32_t>(acceptance.size()),
                                                       acceptance, *times);
      std::cout << boost::json::serialize(boost::json::object{{"bench", "speculative_projection"},
                                                              {"config", dir},
                                                              {"device", device},
                                                              {"algorithm", "dspark"},
                                                              {"draft_tokens", length},
                                                              {"batch", batch},
                                                              {"tokens_per_s", rate(length)},
                                                              {"speedup_vs_off", rate(length) / off}})
                << std::endl;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // The engine's log lines (the planner's measured step times) to stderr: stdout is JSON lines.
  spdlog::set_default_logger(spdlog::stderr_color_mt("bench_speculative"));
  spdlog::cfg::load_env_levels();  // SPDLOG_LEVEL=debug: the DSpark planner's trace of every step
  std::string model_dir = std::string(DEEPINFER_SOURCE_DIR) + "/models/demo";
  std::vector<int64_t> draft_tokens = {0, 1, 2, 3}, batches = {1, 8, 32};
  int64_t max_tokens = 64;
  int reps = 3;
  bool bf16 = false;
  int64_t dspark_max_drafts = 4;
  double dspark_threshold = 0.85;
  std::string dspark_step_times;  // --dspark-step-time-table: "const" makes and verifies every draft; empty measures
  std::string device = "cpu";
  std::vector<std::string> step_time_configs;
  std::vector<double> acceptance;
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
    } else if (arg == "--dspark-max-draft-tokens") {
      dspark_max_drafts = std::stoll(next());
    } else if (arg == "--dspark-confidence-threshold") {
      dspark_threshold = std::stod(next());
    } else if (arg == "--dspark-step-time-table") {
      dspark_step_times = next();
    } else if (arg == "--device") {
      device = next();
    } else if (arg == "--step-times") {
      std::stringstream list(next());
      std::string item;
      while (std::getline(list, item, ',')) step_time_configs.push_back(item);
    } else if (arg == "--acceptance") {
      std::stringstream list(next());
      std::string item;
      while (std::getline(list, item, ',')) acceptance.push_back(std::stod(item));
    } else {
      std::cerr << "usage: bench_speculative [--model DIR] [--draft-tokens 0,1,2,3] [--batches 1,8,32] "
                   "[--max-tokens N] [--reps N] [--bf16] [--dspark-max-draft-tokens N] "
                   "[--dspark-confidence-threshold X] [--dspark-step-time-table const|FILE] [--device cpu|cuda] "
                   "[--step-times CONFIG_DIR,... --acceptance A1,A2,...]\n";
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
  if (!step_time_configs.empty()) return project(step_time_configs, acceptance, batches, draft_tokens, device);
  auto tokenizer = recipe::Tokenizer::load(model_dir);
  if (!tokenizer.ok()) {
    std::cerr << tokenizer.status().to_string() << "\n";
    return 1;
  }
  std::vector<std::vector<TokenId>> prompts;
  for (const char* question : kQuestions) {
    // The demo's chat format (deepseek-v4.1, non-thinking), the generation prompt open (control tokens as the trusted
    // text's added tokens): what `deepinfer render --format deepseek-v4.1` writes for one user turn.
    const std::string text =
        std::string("<｜begin▁of▁sentence｜><｜User｜>") + question + "<｜Assistant｜></think>";
    prompts.push_back((*tokenizer)->encode(text, recipe::TextTrust::kTrusted));
  }
  const backend::Precision precision =
      bf16 || device == "cuda" ? backend::Precision::kBF16 : backend::Precision::kF32;

  std::map<int64_t, Run> plain;  // per batch: the K = 0 run's outputs and tokens/s
  // The runs of each batch: K drafts of plain MTP (0: off), then DSpark (k = -1).
  std::vector<int64_t> runs_of_batch = draft_tokens;
  if (dspark_max_drafts > 0) runs_of_batch.push_back(-1);
  for (int64_t batch : batches) {
    // The reps interleave the configurations (off, K = 1.., DSpark, then again), so that a drift of the machine during
    // the run (other tenants, clocks) spreads over all of them instead of landing on one.
    std::map<int64_t, std::vector<Run>> runs_by_k;
    for (int rep = 0; rep < reps; ++rep) {
      for (int64_t k : runs_of_batch) {
        const bool dspark = k < 0;
        std::vector<Run>& runs = runs_by_k[k];
        Result<std::unique_ptr<backend::Backend>> made = make_backend(device);
        if (!made.ok()) {
          std::cerr << made.status().to_string() << "\n";
          return 1;
        }
        std::unique_ptr<backend::Backend> backend = std::move(made).value();
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
        } else if (dspark) {
          config.speculative.algorithm = engine::SpeculativeAlgorithm::kDspark;
          config.speculative.num_draft_tokens = static_cast<int32_t>(dspark_max_drafts);
          config.speculative.dspark.confidence_threshold = dspark_threshold;
          config.speculative.dspark.step_time_table = dspark_step_times;
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
        // Warm-up: the same batch once (scratch buffers, pages, and on CUDA the graphs of the step shapes this batch
        // meets: each runs eagerly the first time and is captured the second), so that the timed run is the steady
        // state a serving engine reaches.
        for (int64_t r = 0; r < batch; ++r) (void)engine.submit(prompts[static_cast<size_t>(r) % prompts.size()], params);
        while (engine.has_pending_work()) {
          if (auto warm = engine.step(); !warm.ok()) {  // (an engine whose step fails would otherwise spin here)
            std::cerr << "warm-up step (batch " << batch << ", " << (dspark ? "dspark" : "K=" + std::to_string(k))
                      << "): " << warm.status().to_string() << "\n";
            return 1;
          }
        }
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
        for (size_t n = 0; n < before.verify_length_counts.size(); ++n) {
          run.stats.verify_length_counts[n] -= before.verify_length_counts[n];
        }
        if (k == 0) {
          // The logprob pass (not timed): the margins of the same batch's greedy tokens.
          engine::SamplingParams with_logprobs = params;
          with_logprobs.logprobs = 2;  // the chosen token and the runner-up among the top alternatives
          std::vector<engine::SequenceId> again;
          for (int64_t r = 0; r < batch; ++r) {
            again.push_back(*engine.submit(prompts[static_cast<size_t>(r) % prompts.size()], with_logprobs));
          }
          std::map<engine::SequenceId, std::vector<TokenId>> again_tokens;
          std::map<engine::SequenceId, std::vector<float>> margins;
          while (engine.has_pending_work()) {
            auto events = engine.step();
            if (!events.ok()) break;
            for (const engine::TokenEvent& event : *events) {
              if (!event.token) continue;
              again_tokens[event.id].push_back(*event.token);
              float runner_up = -INFINITY;
              for (const engine::TokenLogprob& alternative : event.top_logprobs) {
                if (alternative.token_id != *event.token) runner_up = std::max(runner_up, alternative.logprob);
              }
              margins[event.id].push_back(event.logprob.value_or(0.0f) - runner_up);
            }
          }
          for (size_t r = 0; r < again.size(); ++r) {
            run.margins.push_back(margins[again[r]]);
            run.margins_match_outputs = run.margins_match_outputs && again_tokens[again[r]] == run.outputs[r];
          }
        }
        run.stats.unverified_steps -= before.unverified_steps;
        run.stats.fallbacks -= before.fallbacks;
        for (size_t p = 0; p < run.stats.phase_seconds.size(); ++p) run.stats.phase_seconds[p] -= before.phase_seconds[p];
        runs.push_back(std::move(run));
      }
    }
    for (int64_t k : runs_of_batch) {
      const bool dspark = k < 0;
      const std::vector<Run>& runs = runs_by_k[k];
      std::vector<double> rates;
      for (const Run& run : runs) rates.push_back(static_cast<double>(run.generated) / run.seconds);
      std::sort(rates.begin(), rates.end());
      const Run& first = runs.front();
      boost::json::object line{{"bench", "speculative"},
                               {"model", model_dir},
                               {"device", device},
                               {"weights", precision == backend::Precision::kBF16 ? "bf16" : "f32"},
                               {"algorithm", dspark ? "dspark" : k > 0 ? "mtp" : "off"},
                               {"draft_tokens", dspark ? dspark_max_drafts : k},
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
        // Where the first rep's time went, per generated token (the rest of ms_per_token: scheduling, streaming).
        boost::json::object phases;
        for (int p = 0; p < engine::SpeculativeStats::kNumPhases; ++p) {
          phases[engine::SpeculativeStats::kPhaseNames[p]] =
              1e3 * s.phase_seconds[static_cast<size_t>(p)] / static_cast<double>(std::max<int64_t>(first.generated, 1));
        }
        line["ms_per_token"] = 1e3 * first.seconds / static_cast<double>(std::max<int64_t>(first.generated, 1));
        line["phase_ms_per_token"] = phases;
        if (dspark) {
          // What drafts under DSpark's planner: the checkpoint's DSpark module when it ships one, else its MTP layer.
          const auto model_config = model::load_model_config(model_dir);
          line["draft"] = model_config.ok() && model_config->dspark
                              ? "dspark module, block size " + std::to_string(model_config->dspark->block_size)
                              : std::string("mtp layer");
          line["confidence_threshold"] = dspark_threshold;
          line["unverified_steps"] = s.unverified_steps;
          line["fallbacks"] = s.fallbacks;
          boost::json::array lengths;
          for (int64_t n : s.verify_length_counts) lengths.push_back(n);
          line["verify_length_counts"] = lengths;
        }
        if (plain.contains(batch)) {
          line["identical_to_off"] = first.outputs == plain[batch].outputs;
          if (first.outputs != plain[batch].outputs) {
            // Where each differing sequence first differs, and off's margin there (top-1 minus runner-up logprob).
            boost::json::array divergences;
            const Run& off = plain[batch];
            for (size_t r = 0; r < first.outputs.size() && r < off.outputs.size(); ++r) {
              const std::vector<TokenId>& a = first.outputs[r];
              const std::vector<TokenId>& b = off.outputs[r];
              size_t i = 0;
              while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
              if (i == a.size() && i == b.size()) continue;
              boost::json::object d{{"sequence", static_cast<int64_t>(r)}, {"position", static_cast<int64_t>(i)}};
              if (r < off.margins.size() && i < off.margins[r].size() && std::isfinite(off.margins[r][i])) {
                d["off_margin"] = off.margins[r][i];
              }
              divergences.push_back(d);
            }
            line["divergences"] = divergences;
            line["off_logprob_pass_identical"] = off.margins_match_outputs;
          }
          line["speedup_vs_off"] =
              rates[rates.size() / 2] * plain[batch].seconds / static_cast<double>(plain[batch].generated);
        }
      }
      std::cout << boost::json::serialize(line) << std::endl;
    }
  }
  return 0;
}
