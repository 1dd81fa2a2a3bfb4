// The live replay's client side: prompts from the trace, a pool of blocking HTTP clients (http_client.h, shared
// with bench_serving), streaming /v1/completions, and /metrics deltas for the server's hit rates.
#include "live_replay.h"

#include <algorithm>
#include <atomic>
#include <boost/beast/http/verb.hpp>
#include <boost/json.hpp>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "deepinfer/kvcache/block_pool.h"
#include "http_client.h"

namespace deepinfer::bench {
namespace {

namespace json = boost::json;
using boost::beast::http::verb;

struct RequestOutcome {
  bool ok = false;
  std::string error;
  double ttft_ms = 0;
  double e2e_ms = 0;
  double send_lag_ms = 0;  // open loop: how late it was sent
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;
  int64_t completion_tokens = 0;
};

std::string request_body(const LivePrompt& prompt, const LiveReplayOptions& options) {
  json::array ids;
  ids.reserve(prompt.token_ids.size());
  for (int32_t id : prompt.token_ids) ids.push_back(id);
  json::object body{{"prompt", std::move(ids)}, {"max_tokens", prompt.max_tokens},
                    {"temperature", 0},         {"ignore_eos", true},
                    {"stream", true},           {"stream_options", {{"include_usage", true}}}};
  if (!options.model.empty()) body["model"] = options.model;
  return json::serialize(body);
}

int64_t int_at(const json::object& object, std::string_view key) {
  const json::value* v = object.if_contains(key);
  return v != nullptr && v->is_number() ? v->to_number<int64_t>() : 0;
}

// TTFT is the arrival of the first chunk whose text is not empty (a first token that decodes to nothing, such as
// half of a UTF-8 character, moves it to the next); `start` is when the request was sent, or due.
RequestOutcome send_one(HttpClient& client, const std::string& body, BenchClock::time_point start) {
  RequestOutcome outcome;
  std::optional<BenchClock::time_point> first;
  size_t consumed = 0;
  bool done = false;
  std::string error_text;
  Result<int> status =
      client.stream("/v1/completions", body, [&](const std::string& so_far, BenchClock::time_point now) {
        scan_sse(so_far, consumed, [&](const std::string& data) {
          if (data == "[DONE]") {
            done = true;
            return;
          }
          boost::system::error_code ec;
          const json::value v = json::parse(data, ec);
          if (ec || !v.is_object()) {
            error_text = "unparsable chunk: " + data.substr(0, 200);
            return;
          }
          const json::object& chunk = v.get_object();
          if (const json::value* err = chunk.if_contains("error")) {
            error_text = json::serialize(*err);
            return;
          }
          if (const json::value* choices = chunk.if_contains("choices"); choices != nullptr && choices->is_array()) {
            for (const json::value& choice : choices->get_array()) {
              const json::value* text = choice.is_object() ? choice.get_object().if_contains("text") : nullptr;
              if (text != nullptr && text->is_string() && !text->get_string().empty() && !first) first = now;
            }
          }
          if (const json::value* usage = chunk.if_contains("usage"); usage != nullptr && usage->is_object()) {
            const json::object& u = usage->get_object();
            outcome.prompt_tokens = int_at(u, "prompt_tokens");
            outcome.completion_tokens = int_at(u, "completion_tokens");
            if (const json::value* details = u.if_contains("prompt_tokens_details"); details && details->is_object()) {
              outcome.cached_tokens = int_at(details->get_object(), "cached_tokens");
            }
          }
        });
      });
  const BenchClock::time_point end = BenchClock::now();
  if (!status.ok()) {
    outcome.error = status.status().message();
  } else if (*status != 200) {
    outcome.error = "HTTP " + std::to_string(*status) + ": " + error_text;
  } else if (!error_text.empty()) {
    outcome.error = error_text;
  } else if (!done) {
    outcome.error = "stream ended without [DONE]";
  }
  if (!outcome.error.empty()) return outcome;
  outcome.e2e_ms = ms_between(start, end);
  outcome.ttft_ms = first ? ms_between(start, *first) : outcome.e2e_ms;
  outcome.ok = true;
  return outcome;
}

// Prometheus text -> {"name{labels}": value}; comments and unparsable lines are skipped.
std::map<std::string, double> parse_metrics(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) continue;
    try {
      out[line.substr(0, space)] = std::stod(line.substr(space + 1));
    } catch (const std::exception&) {
    }
  }
  return out;
}

Result<std::map<std::string, double>> scrape_metrics(HttpClient& client) {
  Result<HttpClient::Response> response = client.request(verb::get, "/metrics", "");
  if (!response.ok()) return response.status();
  if (response->status != 200) {
    return Status::io_error("GET /metrics: HTTP " + std::to_string(response->status) + ": " +
                            response->body.substr(0, 200));
  }
  return parse_metrics(response->body);
}

// Boost.JSON prints doubles as 1.348208E3; this prints them as people write them (up to 10 significant
// digits), everything else as Boost.JSON does.
void write_json(const json::value& v, std::string& out) {
  if (v.is_double()) {
    char buffer[64];
    std::snprintf(buffer, sizeof(buffer), "%.10g", v.get_double());
    out += buffer;
  } else if (v.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [key, value] : v.get_object()) {
      if (!first) out += ',';
      first = false;
      out += json::serialize(json::string(key));
      out += ':';
      write_json(value, out);
    }
    out += '}';
  } else if (v.is_array()) {
    out += '[';
    for (size_t i = 0; i < v.get_array().size(); ++i) {
      if (i > 0) out += ',';
      write_json(v.get_array()[i], out);
    }
    out += ']';
  } else {
    out += json::serialize(v);
  }
}

double r3(double v) { return std::round(v * 1000.0) / 1000.0; }
double r4(double v) { return std::round(v * 10000.0) / 10000.0; }

// The server's side of the run: counter deltas over it, and the tiers' capacities at its end.
json::object server_json(const std::map<std::string, double>& before, const std::map<std::string, double>& after) {
  auto delta = [&](const std::string& key) {
    const auto a = after.find(key);
    if (a == after.end()) return 0.0;
    const auto b = before.find(key);
    return a->second - (b == before.end() ? 0.0 : b->second);
  };
  auto gauge = [&](const std::string& key) {
    const auto a = after.find(key);
    return a == after.end() ? int64_t{0} : std::llround(a->second);
  };
  auto count = [&](const std::string& key) { return std::llround(delta(key)); };
  const double prompt_tokens = delta("deepinfer_prompt_tokens_total");
  const double cached = delta("deepinfer_prompt_tokens_cached_total");
  const double ttft_count = delta("deepinfer_time_to_first_token_seconds_count");
  json::object server{
      {"prompt_tokens", std::llround(prompt_tokens)},
      {"cached_prompt_tokens", std::llround(cached)},
      {"token_hit_rate", prompt_tokens > 0 ? r4(cached / prompt_tokens) : 0.0},
      {"ttft_mean_ms",
       ttft_count > 0 ? r3(1000.0 * delta("deepinfer_time_to_first_token_seconds_sum") / ttft_count) : 0.0},
      {"loaded_blocks", count("deepinfer_kv_tier_loaded_blocks_total")}};
  for (const char* tier : {"device", "host", "disk"}) {
    const std::string label = std::string("{tier=\"") + tier + "\"}";
    if (!after.contains("deepinfer_kv_tier_capacity_blocks" + label)) continue;
    const double hits = delta("deepinfer_kv_tier_hits_total" + label);
    const double misses = delta("deepinfer_kv_tier_misses_total" + label);
    server[std::string(tier)] = json::object{{"capacity_blocks", gauge("deepinfer_kv_tier_capacity_blocks" + label)},
                                             {"hit_blocks", std::llround(hits)},
                                             {"miss_blocks", std::llround(misses)},
                                             {"block_hit_rate", hits + misses > 0 ? r4(hits / (hits + misses)) : 0.0},
                                             {"evicted_blocks", count("deepinfer_kv_tier_evictions_total" + label)}};
  }
  return server;
}

// A `deepinfer router`'s share of the run, from its /metrics deltas: requests per worker (the load balance) and by
// the policy's reason, retries, and the hit rate its index predicted (the workers' own is in usage).
json::object router_json(const std::map<std::string, double>& before, const std::map<std::string, double>& after) {
  auto delta = [&](const std::string& key) {
    const auto b = before.find(key);
    return after.at(key) - (b == before.end() ? 0.0 : b->second);
  };
  json::object workers, reasons;
  double prompt = 0, predicted = 0;
  int64_t most = 0, total = 0;
  for (const auto& [key, value] : after) {  // every worker, also one that got nothing
    const std::string healthy = "deepinfer_router_worker_healthy{worker=\"";
    if (key.starts_with(healthy)) {
      workers[key.substr(healthy.size(), key.find('"', healthy.size()) - healthy.size())] =
          json::object{{"requests", 0}};
    }
  }
  for (const auto& [key, value] : after) {
    const std::string requests = "deepinfer_router_requests_total{worker=\"";
    if (key.starts_with(requests)) {
      const size_t end = key.find('"', requests.size());
      const std::string worker = key.substr(requests.size(), end - requests.size());
      const size_t r = key.find("reason=\"");
      const std::string reason = key.substr(r + 8, key.find('"', r + 8) - (r + 8));
      const int64_t n = std::llround(delta(key));
      json::object& w = workers[worker].is_object() ? workers[worker].as_object() : workers[worker].emplace_object();
      w["requests"] = (w.contains("requests") ? w["requests"].as_int64() : 0) + n;
      reasons[reason] = (reasons.contains(reason) ? reasons[reason].as_int64() : 0) + n;
      total += n;
    }
  }
  for (auto& [worker, object] : workers) {
    const std::string label = "{worker=\"" + std::string(worker) + "\"}";
    const double p = delta("deepinfer_router_worker_prompt_tokens_total" + label);
    const double c = delta("deepinfer_router_worker_predicted_cached_tokens_total" + label);
    object.as_object()["prompt_tokens"] = std::llround(p);
    object.as_object()["predicted_cached_tokens"] = std::llround(c);
    prompt += p;
    predicted += c;
    most = std::max(most, object.as_object()["requests"].as_int64());
  }
  const double mean = workers.empty() ? 0.0 : static_cast<double>(total) / static_cast<double>(workers.size());
  return json::object{{"workers", workers},
                      {"reasons", reasons},
                      {"max_over_mean_requests", mean > 0 ? r3(static_cast<double>(most) / mean) : 0.0},
                      {"retries", std::llround(delta("deepinfer_router_retries_total"))},
                      {"predicted_token_hit_rate", prompt > 0 ? r4(predicted / prompt) : 0.0}};
}

// "--label A|B|C" names the URLs in order; one label without "|" names them all.
std::vector<std::string> split_labels(const std::string& label, size_t count) {
  std::vector<std::string> labels;
  size_t begin = 0;
  while (true) {
    const size_t bar = label.find('|', begin);
    labels.push_back(label.substr(begin, bar == std::string::npos ? std::string::npos : bar - begin));
    if (bar == std::string::npos) break;
    begin = bar + 1;
  }
  if (labels.size() != count) labels.assign(count, label);
  return labels;
}

Result<double> parse_number(const std::string& flag, const std::string& value) {
  try {
    size_t used = 0;
    const double parsed = std::stod(value, &used);
    if (used == value.size() && std::isfinite(parsed)) return parsed;
  } catch (const std::exception&) {
  }
  return Status::invalid_argument(flag + " '" + value + "' is not a number");
}

}  // namespace

std::string live_replay_usage() {
  return "usage: bench_replay --live URL[,URL...] --trace FILE [--requests 200] [--block-tokens 64] "
         "[--max-prompt-tokens 960]\n"
         "         [--max-tokens 8] [--concurrency 1] [--time-scale F] [--warmup 1] [--seed 0] [--model NAME]\n"
         "         [--api-key KEY] [--label TEXT]\n"
         "  Replays the trace's first requests against a running server as streaming /v1/completions with token-id\n"
         "  prompts (one fixed block of --block-tokens ids per trace hash id, so the trace's prefix sharing is\n"
         "  kept), closed-loop with --concurrency clients, or open-loop at the trace's timestamps / --time-scale.\n"
         "  Several URLs: each request goes to every server in turn (closed loop), one JSON line per server;\n"
         "  --label 'A|B|...' names them.";
}

Result<LiveReplayOptions> parse_live_replay_args(std::span<const std::string> args) {
  LiveReplayOptions options;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& flag = args[i];
    if (flag == "--help" || flag == "-h") return Status::invalid_argument(live_replay_usage());
    if (i + 1 >= args.size()) return Status::invalid_argument(flag + " needs a value\n" + live_replay_usage());
    const std::string& value = args[++i];
    if (flag == "--live") {
      options.url = value;
    } else if (flag == "--trace") {
      options.trace_path = value;
    } else if (flag == "--model") {
      options.model = value;
    } else if (flag == "--api-key") {
      options.api_key = value;
    } else if (flag == "--label") {
      options.label = value;
    } else if (flag == "--time-scale") {
      Result<double> parsed = parse_number(flag, value);
      if (!parsed.ok()) return parsed.status();
      if (!(*parsed > 0)) return Status::invalid_argument("--time-scale must be positive, got " + value);
      options.time_scale = *parsed;
    } else if (flag == "--requests" || flag == "--block-tokens" || flag == "--max-prompt-tokens" ||
               flag == "--max-tokens" || flag == "--concurrency" || flag == "--warmup" || flag == "--seed") {
      Result<double> parsed = parse_number(flag, value);
      if (!parsed.ok()) return parsed.status();
      const double v = *parsed;
      if (v != std::floor(v) || v < 0 || v > 1e15) {
        return Status::invalid_argument(flag + " must be a non-negative integer, got " + value);
      }
      const auto n = static_cast<int64_t>(v);
      if (flag == "--requests") options.requests = n;
      if (flag == "--block-tokens") options.prompts.block_tokens = static_cast<int32_t>(std::min<int64_t>(n, 1 << 20));
      if (flag == "--max-prompt-tokens") options.prompts.max_prompt_tokens = n;
      if (flag == "--max-tokens") options.prompts.max_tokens = static_cast<int32_t>(std::min<int64_t>(n, 1 << 20));
      if (flag == "--concurrency") options.concurrency = static_cast<int32_t>(std::min<int64_t>(n, 4096));
      if (flag == "--warmup") options.warmup_requests = static_cast<int32_t>(std::min<int64_t>(n, 1000));
      if (flag == "--seed") options.prompts.seed = static_cast<uint64_t>(n);
    } else {
      return Status::invalid_argument("unknown flag " + flag + "\n" + live_replay_usage());
    }
  }
  if (options.url.empty()) return Status::invalid_argument("--live URL is required\n" + live_replay_usage());
  if (options.trace_path.empty()) return Status::invalid_argument("--trace FILE is required\n" + live_replay_usage());
  if (options.concurrency < 1) return Status::invalid_argument("--concurrency must be at least 1");
  if (Status s = validate_live_prompt_config(options.prompts); !s.ok()) return s;
  return options;
}

Status run_live_replay(const LiveReplayOptions& options, std::ostream& out) {
  std::vector<std::string> url_texts;
  for (size_t begin = 0; begin <= options.url.size();) {
    const size_t comma = std::min(options.url.find(',', begin), options.url.size());
    if (comma > begin) url_texts.push_back(options.url.substr(begin, comma - begin));
    begin = comma + 1;
  }
  if (url_texts.empty()) return Status::invalid_argument("--live: no URL");
  if (url_texts.size() > 1 && options.time_scale) {
    return Status::invalid_argument("--time-scale takes one URL; several URLs are replayed closed-loop, interleaved");
  }
  std::vector<HttpUrl> urls;
  for (const std::string& text : url_texts) {
    Result<HttpUrl> url = parse_http_url(text);
    if (!url.ok()) return url.status();
    urls.push_back(*url);
  }
  Result<Trace> trace = load_mooncake_trace(options.trace_path);
  if (!trace.ok()) return trace.status();
  Result<std::vector<LivePrompt>> built = make_live_prompts(*trace, options.requests, options.prompts);
  if (!built.ok()) return built.status();
  const std::vector<LivePrompt>& prompts = *built;
  std::vector<int64_t> reusable_tokens;
  const HitRates ideal = ideal_prompt_hit_rates(prompts, kvcache::kBlockTokens, &reusable_tokens);
  std::vector<std::string> bodies;
  bodies.reserve(prompts.size());
  for (const LivePrompt& prompt : prompts) bodies.push_back(request_body(prompt, options));

  std::vector<std::unique_ptr<HttpClient>> controls;
  std::vector<std::map<std::string, double>> before;
  for (size_t u = 0; u < urls.size(); ++u) {
    controls.push_back(std::make_unique<HttpClient>(urls[u], options.api_key));
    for (int32_t w = 0; w < options.warmup_requests; ++w) {
      Result<LivePrompt> prompt = make_warmup_prompt(w, options.prompts);
      if (!prompt.ok()) return prompt.status();
      const RequestOutcome outcome = send_one(*controls[u], request_body(*prompt, options), BenchClock::now());
      if (!outcome.ok) return Status::io_error("warm-up request to " + url_texts[u] + " failed: " + outcome.error);
    }
    Result<std::map<std::string, double>> metrics = scrape_metrics(*controls[u]);
    if (!metrics.ok()) return metrics.status();
    before.push_back(std::move(metrics).value());
  }

  // With several servers each request goes to all of them, one after another, the first one rotating, so
  // that load from outside (a shared machine) falls on every server alike.
  std::vector<std::vector<RequestOutcome>> outcomes(urls.size(), std::vector<RequestOutcome>(prompts.size()));
  std::vector<double> busy_s(urls.size(), 0.0);
  std::mutex busy_mu;
  std::atomic<size_t> next{0};
  const BenchClock::time_point start = BenchClock::now();
  std::vector<std::thread> clients;
  for (int32_t c = 0; c < options.concurrency; ++c) {
    clients.emplace_back([&] {
      std::vector<std::unique_ptr<HttpClient>> connections;
      for (const HttpUrl& url : urls) connections.push_back(std::make_unique<HttpClient>(url, options.api_key));
      std::vector<double> busy(urls.size(), 0.0);
      for (size_t i = next.fetch_add(1); i < prompts.size(); i = next.fetch_add(1)) {
        for (size_t k = 0; k < urls.size(); ++k) {
          const size_t u = (i + k) % urls.size();
          BenchClock::time_point due = BenchClock::now();
          if (options.time_scale) {
            due = start + std::chrono::duration_cast<BenchClock::duration>(std::chrono::duration<double, std::milli>(
                              static_cast<double>(prompts[i].timestamp_ms) / *options.time_scale));
            std::this_thread::sleep_until(due);
          }
          const BenchClock::time_point sent = BenchClock::now();
          outcomes[u][i] = send_one(*connections[u], bodies[i], due);
          outcomes[u][i].send_lag_ms = ms_between(due, sent);
          busy[u] += std::chrono::duration<double>(BenchClock::now() - sent).count();
        }
      }
      std::lock_guard lock(busy_mu);
      for (size_t u = 0; u < urls.size(); ++u) busy_s[u] += busy[u];
    });
  }
  for (std::thread& t : clients) t.join();
  const double wall_s = std::chrono::duration<double>(BenchClock::now() - start).count();

  for (size_t u = 0; u < urls.size(); ++u) {
    Result<std::map<std::string, double>> after = scrape_metrics(*controls[u]);
    if (!after.ok()) return after.status();
    std::vector<double> ttft, e2e, ttft_mostly_shared, ttft_mostly_new, send_lag;
    int64_t completed = 0, prompt_tokens = 0, cached_tokens = 0, completion_tokens = 0, mostly_shared_requests = 0;
    std::string first_error;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const RequestOutcome& o = outcomes[u][i];
      // At least half of the prompt is a prefix some earlier request had: what the cache can skip.
      const bool mostly_shared = 2 * reusable_tokens[i] >= static_cast<int64_t>(prompts[i].token_ids.size());
      if (mostly_shared) ++mostly_shared_requests;
      if (!o.ok) {
        if (first_error.empty()) first_error = "request " + std::to_string(i) + ": " + o.error;
        continue;
      }
      ++completed;
      ttft.push_back(o.ttft_ms);
      e2e.push_back(o.e2e_ms);
      send_lag.push_back(o.send_lag_ms);
      (mostly_shared ? ttft_mostly_shared : ttft_mostly_new).push_back(o.ttft_ms);
      prompt_tokens += o.prompt_tokens;
      cached_tokens += o.cached_tokens;
      completion_tokens += o.completion_tokens;
    }
    json::object line{{"bench", "live_replay"}};
    const std::vector<std::string> labels = split_labels(options.label, urls.size());
    if (!labels[u].empty()) line["label"] = labels[u];
    line["url"] = url_texts[u];
    if (urls.size() > 1) line["interleaved_with"] = static_cast<int64_t>(urls.size() - 1);
    line["trace"] = trace->name;
    line["requests"] = prompts.size();
    line["completed"] = completed;
    line["failed"] = static_cast<int64_t>(prompts.size()) - completed;
    line["mode"] = options.time_scale ? "open-loop" : "closed-loop";
    line["concurrency"] = options.concurrency;
    if (options.time_scale) line["time_scale"] = *options.time_scale;
    line["block_tokens"] = options.prompts.block_tokens;
    line["max_prompt_tokens"] = options.prompts.max_prompt_tokens;
    line["max_tokens"] = options.prompts.max_tokens;
    line["prompt_tokens"] = prompt_tokens;
    line["prompt_tokens_mean"] = completed > 0 ? r3(static_cast<double>(prompt_tokens) / completed) : 0.0;
    line["cached_prompt_tokens"] = cached_tokens;
    line["cached_token_rate"] = prompt_tokens > 0 ? r4(static_cast<double>(cached_tokens) / prompt_tokens) : 0.0;
    line["ideal_token_hit_rate"] = r4(ideal.token_hit_rate);
    line["ideal_block_hit_rate"] = r4(ideal.block_hit_rate);
    line["completion_tokens"] = completion_tokens;
    line["ttft_ms"] = latency_json(summarize_latencies(ttft));
    line["mostly_shared_requests"] = mostly_shared_requests;
    line["ttft_ms_mostly_shared"] = latency_json(summarize_latencies(ttft_mostly_shared));
    line["ttft_ms_mostly_new"] = latency_json(summarize_latencies(ttft_mostly_new));
    line["e2e_ms"] = latency_json(summarize_latencies(e2e));
    if (options.time_scale) line["send_lag_ms"] = latency_json(summarize_latencies(send_lag));
    line["wall_s"] = r3(wall_s);
    line["busy_s"] = r3(busy_s[u]);  // time this server's requests were in flight, summed over clients
    if (after->contains("deepinfer_router_retries_total")) {
      line["router"] = router_json(before[u], *after);  // a router: its workers' own metrics are not here
    } else {
      line["server"] = server_json(before[u], *after);
    }
    if (!first_error.empty()) line["first_error"] = first_error;
    if (!options.command_line.empty()) line["command"] = options.command_line;
    std::string text;
    write_json(line, text);
    out << text << std::endl;
  }
  return Status::ok_status();
}

}  // namespace deepinfer::bench
