// `deepinfer router`: the KV-aware gateway in front of `deepinfer serve` workers (router/router.h).
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "deepinfer/router/router.h"

namespace deepinfer::apps {

std::function<int()> add_router_command(CLI::App& app) {
  struct Options {
    std::vector<std::string> workers, prefill, decode;
    std::string policy = "kv-aware";
    std::string model_path, tokenizer;
    router::RouterConfig config;
  };
  auto options = std::make_shared<Options>();
  router::RouterConfig& c = options->config;
  CLI::App* cmd = app.add_subcommand(
      "router", "Route OpenAI/Anthropic requests to `deepinfer serve` workers by where their prefix is cached");
  cmd->add_option("--worker", options->workers,
                  "Worker base URL, http://HOST:PORT (repeat, several after one flag, or comma-separated)");
  cmd->add_option("--prefill", options->prefill,
                  "Prefill worker URL (`deepinfer serve --role prefill`; repeat or comma-separate; with --decode)");
  cmd->add_option("--decode", options->decode,
                  "Decode worker URL (`deepinfer serve --role decode`; repeat or comma-separate; with --prefill)");
  cmd->add_option("--max-local-prefill-tokens", options->config.max_local_prefill_tokens,
                  "Disaggregated, kv-aware: a prompt whose uncached part on the chosen decode worker is at most this "
                  "is prefilled there, with no KV transfer")
      ->capture_default_str();
  cmd->add_option("--policy", options->policy,
                  "kv-aware (by uncached prefill tokens and load, from the workers' KV events), round-robin, "
                  "consistent-hash (the first 2,048 characters of system + user text), least-load")
      ->capture_default_str();
  cmd->add_option("--model-path,--model", options->model_path,
                  "The checkpoint the workers serve (its tokenizer.json): kv-aware tokenizes prompts as they do "
                  "(this or --tokenizer is required with --policy kv-aware, the default)");
  cmd->add_option("--tokenizer", options->tokenizer, "tokenizer.json or its directory (instead of --model-path)");
  cmd->add_option("--affinity-chars", c.affinity_chars,
                  "consistent-hash: characters of system + user text in the key (the seed's gateway: 2048)")
      ->capture_default_str();
  cmd->add_option("--host", c.host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", c.port, "Port to listen on (0: any free port)")->capture_default_str();
  cmd->add_option("--health-check-interval-ms", c.health_check_interval_ms, "How often each worker's /health is asked")
      ->capture_default_str();
  cmd->add_option("--health-check-timeout-ms", c.health_check_timeout_ms, "A health check not answered within fails")
      ->capture_default_str();
  cmd->add_option("--connect-timeout-ms", c.connect_timeout_ms, "Connecting to a worker; then the request is retried")
      ->capture_default_str();
  cmd->add_option("--first-byte-timeout-ms", c.first_byte_timeout_ms,
                  "A worker must send its response header within this (a long prefill counts)")
      ->capture_default_str();
  cmd->add_option("--stream-idle-timeout-ms", c.stream_idle_timeout_ms,
                  "Longest pause between bytes of a worker's response before the router ends it with an error")
      ->capture_default_str();
  cmd->add_option("--max-retries", c.max_retries,
                  "Other workers tried when one cannot be reached or answers 429/5xx before sending anything")
      ->capture_default_str();
  cmd->add_option("--prefill-weight", c.weights.prefill_weight, "kv-aware: weight of prefill blocks against decode load")
      ->capture_default_str();
  cmd->add_option("--queue-weight", c.weights.queue_weight,
                  "kv-aware: weight of a block of prefill queued on a worker against a block of this request's prefill")
      ->capture_default_str();
  cmd->add_option("--decode-weight", c.weights.decode_weight,
                  "kv-aware: weight of a block of running requests' KV (decode load) against a block of prefill")
      ->capture_default_str();
  cmd->add_option("--host-block-cost", c.weights.host_block_cost,
                  "kv-aware: cost of a prompt block cached only in a worker's host RAM, as a fraction of computing it")
      ->capture_default_str();
  cmd->add_option("--disk-block-cost", c.weights.disk_block_cost, "kv-aware: the same for a block only on disk")
      ->capture_default_str();
  cmd->add_option("--max-body-bytes", c.max_body_bytes, "Largest request body in bytes (larger: 413)")
      ->capture_default_str();
  cmd->add_option("--http-threads", c.http_threads, "Threads serving HTTP")->capture_default_str();
  cmd->add_option("--shutdown-timeout-s", c.shutdown_timeout_seconds,
                  "SIGTERM: how long in-flight requests may take to finish")
      ->capture_default_str();
  return [options]() -> int {
    auto fail = [](const std::string& message) {
      std::cerr << "deepinfer router: " << message << "\n";
      return 1;
    };
    if (!options->prefill.empty() != !options->decode.empty()) {
      return fail("--prefill and --decode go together (prefill/decode disaggregation: at least one of each)");
    }
    if (!options->prefill.empty() && !options->workers.empty()) {
      return fail("--worker (--role both workers) and --prefill/--decode (a disaggregated pool) cannot be mixed in "
                  "one router");
    }
    router::RouterConfig config = options->config;
    // --worker A,B as well as --worker A --worker B
    const auto split = [](const std::vector<std::string>& items, std::vector<std::string>& out) {
      for (const std::string& item : items) {
        size_t start = 0;
        while (start <= item.size()) {
          const size_t comma = std::min(item.find(',', start), item.size());
          if (comma > start) out.push_back(item.substr(start, comma - start));
          start = comma + 1;
        }
      }
    };
    split(options->workers, config.workers);
    split(options->decode, config.workers);
    split(options->prefill, config.prefill_workers);
    Result<router::Policy> policy = router::parse_policy(options->policy);
    if (!policy.ok()) return fail(policy.status().message());
    config.policy = *policy;
    if (!options->model_path.empty() && !options->tokenizer.empty()) {
      return fail("give --model-path or --tokenizer, not both");
    }
    config.tokenizer_path = !options->tokenizer.empty() ? options->tokenizer : options->model_path;
    for (double w : {config.weights.prefill_weight, config.weights.queue_weight, config.weights.decode_weight, config.weights.host_block_cost,
                     config.weights.disk_block_cost}) {
      if (!(w >= 0)) return fail("--prefill-weight, --queue-weight, --decode-weight, --host-block-cost and --disk-block-cost must be >= 0");
    }
    config.handle_signals = true;
    auto router = router::Router::start(config);
    if (!router.ok()) return fail(router.status().message());
    std::cout << "deepinfer router: " << router::policy_name(config.policy) << " over " << config.workers.size()
              << (config.prefill_workers.empty() ? " worker" : " decode worker") << (config.workers.size() == 1 ? "" : "s");
    if (!config.prefill_workers.empty()) {
      std::cout << " and " << config.prefill_workers.size() << " prefill worker"
                << (config.prefill_workers.size() == 1 ? "" : "s");
    }
    std::cout << " on http://" << config.host << ":" << (*router)->port() << "\n";
    const bool disaggregated = !config.prefill_workers.empty();
    for (const std::string& w : config.workers) std::cout << (disaggregated ? "  decode " : "  worker ") << w << "\n";
    for (const std::string& w : config.prefill_workers) std::cout << "  prefill " << w << "\n";
    std::cout << std::flush;
    (*router)->wait();
    std::cout << "deepinfer router: stopped\n";
    return 0;
  };
}

}  // namespace deepinfer::apps
