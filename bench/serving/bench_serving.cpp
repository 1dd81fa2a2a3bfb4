// bench_serving: a load generator for a running `deepinfer serve` (or any OpenAI-compatible server).
//
// For each concurrency level it sends --requests streaming chat completions (`stream: true`,
// `stream_options.include_usage`, temperature 0, `ignore_eos: true`, max_tokens T) from N client threads, each
// with its own keep-alive connection, and prints one JSON line: TTFT, TPOT and end-to-end latency (p50, p90,
// p99, mean, in ms) and throughput (requests/s, output tokens/s). TTFT is the time from sending the request to
// the first chunk that carries content (or reasoning) text; TPOT = (e2e - TTFT) / (completion_tokens - 1),
// with completion_tokens from the final usage chunk. A progress bar goes to stderr when it is a terminal.
//
// --overhead-file FILE measures the server's own work for one large chat request, without the engine:
// the request's messages are truncated (whole messages, from the end) so the rendered prompt is at most
// --overhead-target-tokens, then it times GET /health (HTTP round trip), POST /tokenize with the messages
// (HTTP + JSON parse + render + tokenize + serialising the ids), and POST /detokenize of those ids, each
// --overhead-repeats times, and prints one JSON line with their medians. --overhead-generate also sends the
// request to /v1/chat/completions with max_tokens 1 (needs a server whose max_model_len fits the prompt).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/beast/http/verb.hpp>
#include <boost/json.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "http_client.h"

namespace {

namespace http = boost::beast::http;
namespace json = boost::json;

using deepinfer::bench::HttpClient;
using deepinfer::bench::HttpUrl;
using deepinfer::bench::latency_json;
using deepinfer::bench::scan_sse;
using deepinfer::bench::summarize_latencies;
using Clock = deepinfer::bench::BenchClock;

double ms_since(Clock::time_point start, Clock::time_point end) { return deepinfer::bench::ms_between(start, end); }

// This program reports a failed call by exception, caught in main() or per request.
template <class T>
T value_or_throw(deepinfer::Result<T> result) {
  if (!result.ok()) throw std::runtime_error(result.status().message());
  return std::move(result).value();
}

HttpUrl parse_url(const std::string& text) { return value_or_throw(deepinfer::bench::parse_http_url(text)); }

struct Options {
  std::string url = "http://127.0.0.1:8000";
  std::string model = "demo";
  std::string api_key;
  std::vector<int> concurrency{1};
  int requests = 64;
  int prompt_tokens = 128;
  int max_tokens = 32;
  bool ignore_eos = true;
  uint64_t seed = 0;
  std::string label;
  std::string overhead_file;
  int64_t overhead_target_tokens = 77000;
  int overhead_repeats = 5;
  bool overhead_generate = false;
  bool no_progress = false;
};

// Common short English words; each is one token (with its leading space) in DeepSeek's vocabulary, or close.
const std::vector<std::string>& word_list() {
  static const std::vector<std::string> words = {
      "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school",
      "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week",
      "company", "system", "program", "question", "work", "government", "number", "night", "point", "home",
      "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book",
      "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend", "father",
      "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community", "name", "president",
      "team", "minute", "idea", "kid", "body", "information", "back", "parent", "face", "others", "level",
      "office", "door", "health", "person", "art", "war", "history", "party", "result", "change", "morning",
      "reason", "research", "girl", "guy", "moment", "air", "teacher", "force", "education", "good", "new",
      "first", "last", "long", "great", "little", "own", "other", "old", "big", "high", "different", "small",
      "large", "next", "early", "young", "important", "few", "public", "bad", "same", "able", "green", "blue"};
  return words;
}

std::string random_words(std::mt19937_64& rng, int count) {
  const auto& words = word_list();
  std::uniform_int_distribution<size_t> pick(0, words.size() - 1);
  std::string out;
  for (int i = 0; i < count; ++i) {
    if (i > 0) out += ' ';
    out += words[pick(rng)];
  }
  return out;
}

struct RequestResult {
  bool ok = false;
  std::string error;
  double ttft_ms = 0;
  double e2e_ms = 0;
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t content_chunks = 0;
};

// Tokens the chat template adds around one user message: measured with /tokenize when the server has it.
int template_overhead(HttpClient& client, const Options& opt) {
  json::object body{{"model", opt.model}, {"messages", json::array{json::object{{"role", "user"}, {"content", ""}}}}};
  try {
    deepinfer::Result<HttpClient::Response> r = client.request(http::verb::post, "/tokenize", json::serialize(body));
    if (!r.ok() || r->status != 200) return 0;
    return static_cast<int>(json::parse(r->body).at("count").to_number<int64_t>());
  } catch (const std::exception&) {
    return 0;
  }
}

RequestResult run_one(HttpClient& client, const Options& opt, const std::string& prompt) {
  json::object body{{"model", opt.model},
                    {"messages", json::array{json::object{{"role", "user"}, {"content", prompt}}}},
                    {"max_tokens", opt.max_tokens},
                    {"temperature", 0},
                    {"stream", true},
                    {"stream_options", {{"include_usage", true}}}};
  if (opt.ignore_eos) body["ignore_eos"] = true;
  const std::string text = json::serialize(body);
  RequestResult result;
  std::optional<Clock::time_point> first;
  size_t consumed = 0;
  bool done = false;
  const Clock::time_point start = Clock::now();
  int status = 0;
  std::string error_text;
  try {
    deepinfer::Result<int> streamed =
        client.stream("/v1/chat/completions", text, [&](const std::string& so_far, Clock::time_point now) {
      scan_sse(so_far, consumed, [&](const std::string& data) {
        if (data == "[DONE]") {
          done = true;
          return;
        }
        json::value v;
        try {
          v = json::parse(data);
        } catch (const std::exception&) {
          error_text = "unparsable chunk";
          return;
        }
        const json::object& chunk = v.as_object();
        if (const json::value* err = chunk.if_contains("error")) {
          error_text = json::serialize(*err);
          return;
        }
        if (const json::value* choices = chunk.if_contains("choices"); choices && choices->is_array()) {
          for (const json::value& choice : choices->as_array()) {
            const json::value* delta = choice.as_object().if_contains("delta");
            if (delta == nullptr || !delta->is_object()) continue;
            bool has_text = false;
            for (const char* key : {"content", "reasoning_content"}) {
              const json::value* piece = delta->as_object().if_contains(key);
              if (piece && piece->is_string() && !piece->as_string().empty()) has_text = true;
            }
            if (has_text) {
              ++result.content_chunks;
              if (!first) first = now;
            }
          }
        }
        if (const json::value* usage = chunk.if_contains("usage"); usage && usage->is_object()) {
          result.prompt_tokens = usage->as_object().at("prompt_tokens").to_number<int64_t>();
          result.completion_tokens = usage->as_object().at("completion_tokens").to_number<int64_t>();
        }
      });
    });
    if (!streamed.ok()) {
      result.error = streamed.status().message();
      return result;
    }
    status = *streamed;
  } catch (const std::exception& e) {  // a malformed usage object (json::at) in the callback
    client.disconnect();
    result.error = e.what();
    return result;
  }
  const Clock::time_point end = Clock::now();
  if (status != 200) {
    result.error = "HTTP " + std::to_string(status);
    return result;
  }
  if (!error_text.empty()) {
    result.error = error_text;
    return result;
  }
  if (!done) {
    result.error = "stream ended without [DONE]";
    return result;
  }
  if (result.completion_tokens == 0) result.completion_tokens = result.content_chunks;
  result.e2e_ms = ms_since(start, end);
  result.ttft_ms = first ? ms_since(start, *first) : result.e2e_ms;
  result.ok = true;
  return result;
}

class ProgressBar {
 public:
  ProgressBar(bool enabled, int total, std::string label) : enabled_(enabled), total_(total), label_(std::move(label)) {}

  void update(int done, int failed, double elapsed_s) {
    if (!enabled_) return;
    constexpr int kWidth = 40;
    const int filled = total_ > 0 ? done * kWidth / total_ : kWidth;
    std::string bar(static_cast<size_t>(filled), '#');
    bar.append(static_cast<size_t>(kWidth - filled), '.');
    const double rate = elapsed_s > 0 ? done / elapsed_s : 0.0;
    std::fprintf(stderr, "\r%s [%s] %d/%d  %.1fs  %.2f req/s%s", label_.c_str(), bar.c_str(), done, total_, elapsed_s,
                 rate, failed > 0 ? ("  failed " + std::to_string(failed)).c_str() : "");
    std::fflush(stderr);
  }
  void finish() {
    if (enabled_) std::fprintf(stderr, "\n");
  }

 private:
  bool enabled_;
  int total_;
  std::string label_;
};

json::object run_level(const Options& opt, int concurrency, const std::vector<std::string>& prompts) {
  std::atomic<int> next{0}, done{0}, failed{0};
  std::vector<RequestResult> results(prompts.size());
  const bool show = !opt.no_progress && isatty(STDERR_FILENO);
  ProgressBar bar(show, static_cast<int>(prompts.size()), "concurrency " + std::to_string(concurrency));
  const HttpUrl url = parse_url(opt.url);
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> workers;
  for (int w = 0; w < concurrency; ++w) {
    workers.emplace_back([&] {
      HttpClient client(url, opt.api_key);
      while (true) {
        const int i = next.fetch_add(1);
        if (i >= static_cast<int>(prompts.size())) break;
        results[static_cast<size_t>(i)] = run_one(client, opt, prompts[static_cast<size_t>(i)]);
        if (!results[static_cast<size_t>(i)].ok) failed.fetch_add(1);
        done.fetch_add(1);
      }
    });
  }
  while (done.load() < static_cast<int>(prompts.size())) {
    bar.update(done.load(), failed.load(), std::chrono::duration<double>(Clock::now() - start).count());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (auto& t : workers) t.join();
  const double duration_s = std::chrono::duration<double>(Clock::now() - start).count();
  bar.update(done.load(), failed.load(), duration_s);
  bar.finish();

  std::vector<double> ttft, tpot, e2e;
  int64_t output_tokens = 0, prompt_tokens = 0;
  int completed = 0;
  std::string first_error;
  for (const RequestResult& r : results) {
    if (!r.ok) {
      if (first_error.empty()) first_error = r.error;
      continue;
    }
    ++completed;
    ttft.push_back(r.ttft_ms);
    e2e.push_back(r.e2e_ms);
    if (r.completion_tokens > 1) tpot.push_back((r.e2e_ms - r.ttft_ms) / static_cast<double>(r.completion_tokens - 1));
    output_tokens += r.completion_tokens;
    prompt_tokens += r.prompt_tokens;
  }
  auto r3 = [](double v) { return std::round(v * 1000.0) / 1000.0; };
  json::object line{{"bench", "serving"},
                    {"url", opt.url},
                    {"model", opt.model},
                    {"concurrency", concurrency},
                    {"requests", prompts.size()},
                    {"completed", completed},
                    {"failed", static_cast<int>(prompts.size()) - completed},
                    {"prompt_tokens_target", opt.prompt_tokens},
                    {"prompt_tokens_mean", completed ? r3(static_cast<double>(prompt_tokens) / completed) : 0.0},
                    {"max_tokens", opt.max_tokens},
                    {"ignore_eos", opt.ignore_eos},
                    {"output_tokens_total", output_tokens},
                    {"duration_s", r3(duration_s)},
                    {"requests_per_s", r3(completed / duration_s)},
                    {"output_tokens_per_s", r3(static_cast<double>(output_tokens) / duration_s)},
                    {"total_tokens_per_s", r3(static_cast<double>(output_tokens + prompt_tokens) / duration_s)},
                    {"ttft_ms", latency_json(summarize_latencies(ttft))},
                    {"tpot_ms", latency_json(summarize_latencies(tpot))},
                    {"e2e_ms", latency_json(summarize_latencies(e2e))}};
  if (!opt.label.empty()) line["label"] = opt.label;
  if (!first_error.empty()) line["first_error"] = first_error;
  return line;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json::object run_overhead(const Options& opt) {
  const HttpUrl url = parse_url(opt.url);
  HttpClient client(url, opt.api_key);
  const json::value original = json::parse(read_file(opt.overhead_file));
  const json::array& all_messages = original.at("messages").as_array();

  auto request_with = [&](size_t keep) {
    json::object body = original.as_object();
    body["model"] = opt.model;
    json::array messages(all_messages.begin(), all_messages.begin() + static_cast<std::ptrdiff_t>(keep));
    body["messages"] = std::move(messages);
    return body;
  };
  auto count_tokens = [&](const json::object& body) -> int64_t {
    HttpClient::Response r = value_or_throw(client.request(http::verb::post, "/tokenize", json::serialize(body)));
    if (r.status != 200) throw std::runtime_error("/tokenize: HTTP " + std::to_string(r.status) + ": " + r.body);
    return json::parse(r.body).at("count").to_number<int64_t>();
  };

  // The largest prefix of whole messages whose rendered prompt fits the target (binary search).
  const int64_t full_tokens = count_tokens(request_with(all_messages.size()));
  size_t lo = 1, hi = all_messages.size();
  while (lo < hi) {
    const size_t mid = (lo + hi + 1) / 2;
    if (count_tokens(request_with(mid)) <= opt.overhead_target_tokens) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const json::object body = request_with(lo);
  const std::string body_text = json::serialize(body);

  std::vector<double> health_ms, tokenize_ms, detokenize_ms, generate_ms;
  int64_t prompt_tokens = 0;
  std::string ids_body;
  for (int i = 0; i < opt.overhead_repeats + 1; ++i) {  // the first round warms up and is not counted
    auto t0 = Clock::now();
    HttpClient::Response h = value_or_throw(client.request(http::verb::get, "/health", ""));
    auto t1 = Clock::now();
    if (h.status != 200) throw std::runtime_error("/health: HTTP " + std::to_string(h.status));
    HttpClient::Response tok = value_or_throw(client.request(http::verb::post, "/tokenize", body_text));
    auto t2 = Clock::now();
    if (tok.status != 200) throw std::runtime_error("/tokenize: HTTP " + std::to_string(tok.status));
    json::value parsed = json::parse(tok.body);
    prompt_tokens = parsed.at("count").to_number<int64_t>();
    json::object detok{{"model", opt.model}, {"tokens", parsed.at("tokens")}};
    ids_body = json::serialize(detok);
    auto t3 = Clock::now();
    HttpClient::Response de = value_or_throw(client.request(http::verb::post, "/detokenize", ids_body));
    auto t4 = Clock::now();
    if (de.status != 200) throw std::runtime_error("/detokenize: HTTP " + std::to_string(de.status));
    if (i > 0) {
      health_ms.push_back(ms_since(t0, t1));
      tokenize_ms.push_back(ms_since(t1, t2));
      detokenize_ms.push_back(ms_since(t3, t4));
    }
  }
  auto r3 = [](double v) { return std::round(v * 1000.0) / 1000.0; };
  json::object line{{"bench", "serving_overhead"},
                    {"url", opt.url},
                    {"file", opt.overhead_file},
                    {"messages_total", all_messages.size()},
                    {"messages_kept", lo},
                    {"full_prompt_tokens", full_tokens},
                    {"prompt_tokens", prompt_tokens},
                    {"request_bytes", body_text.size()},
                    {"detokenize_request_bytes", ids_body.size()},
                    {"repeats", opt.overhead_repeats},
                    {"health_ms_median", r3(median(health_ms))},
                    {"tokenize_ms_median", r3(median(tokenize_ms))},
                    {"detokenize_ms_median", r3(median(detokenize_ms))},
                    {"tokenize_ms_min", r3(*std::min_element(tokenize_ms.begin(), tokenize_ms.end()))},
                    {"detokenize_ms_min", r3(*std::min_element(detokenize_ms.begin(), detokenize_ms.end()))},
                    {"measured",
                     "client wall time on loopback, keep-alive: /tokenize = HTTP + JSON parse + OpenAI request to "
                     "Conversation + render + tokenize + JSON of the ids; /detokenize = HTTP + JSON parse of the ids "
                     "+ detokenize + JSON of the text; /health = bare HTTP round trip"}};
  if (opt.overhead_generate) {
    json::object gen = body;
    gen["max_tokens"] = 1;
    gen["temperature"] = 0;
    gen["stream"] = false;
    const std::string gen_text = json::serialize(gen);
    for (int i = 0; i < opt.overhead_repeats; ++i) {
      auto t0 = Clock::now();
      HttpClient::Response r = value_or_throw(client.request(http::verb::post, "/v1/chat/completions", gen_text));
      auto t1 = Clock::now();
      generate_ms.push_back(ms_since(t0, t1));
      if (r.status != 200) {
        // Over max_model_len: the chat path still parses, renders and tokenizes before it refuses, so its
        // time is the server's overhead without the engine.
        line["generate_error"] = "HTTP " + std::to_string(r.status) + ": " + r.body.substr(0, 300);
      }
    }
    line[line.contains("generate_error") ? "chat_rejected_ms_median" : "chat_max_tokens_1_ms_median"] =
        r3(median(generate_ms));
  }
  if (!opt.label.empty()) line["label"] = opt.label;
  return line;
}

std::vector<int> parse_int_list(const std::string& text) {
  std::vector<int> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    const int v = std::stoi(item);
    if (v <= 0) throw std::runtime_error("concurrency must be positive: " + item);
    out.push_back(v);
  }
  if (out.empty()) throw std::runtime_error("no concurrency given");
  return out;
}

void usage() {
  std::cerr << "usage: bench_serving [--url http://127.0.0.1:8000] [--model default] [--api-key KEY]\n"
               "         [--concurrency N[,M,...]] [--requests R] [--prompt-tokens P] [--max-tokens T]\n"
               "         [--no-ignore-eos] [--seed S] [--label TEXT] [--no-progress]\n"
               "         [--overhead-file agent-session.json [--overhead-target-tokens 77000]\n"
               "          [--overhead-repeats 5] [--overhead-generate]]\n";
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::runtime_error(arg + " needs a value");
        return argv[++i];
      };
      if (arg == "--url") {
        opt.url = value();
      } else if (arg == "--model") {
        opt.model = value();
      } else if (arg == "--api-key") {
        opt.api_key = value();
      } else if (arg == "--concurrency") {
        opt.concurrency = parse_int_list(value());
      } else if (arg == "--requests") {
        opt.requests = std::stoi(value());
      } else if (arg == "--prompt-tokens") {
        opt.prompt_tokens = std::stoi(value());
      } else if (arg == "--max-tokens") {
        opt.max_tokens = std::stoi(value());
      } else if (arg == "--no-ignore-eos") {
        opt.ignore_eos = false;
      } else if (arg == "--seed") {
        opt.seed = std::stoull(value());
      } else if (arg == "--label") {
        opt.label = value();
      } else if (arg == "--no-progress") {
        opt.no_progress = true;
      } else if (arg == "--overhead-file") {
        opt.overhead_file = value();
      } else if (arg == "--overhead-target-tokens") {
        opt.overhead_target_tokens = std::stoll(value());
      } else if (arg == "--overhead-repeats") {
        opt.overhead_repeats = std::max(1, std::stoi(value()));
      } else if (arg == "--overhead-generate") {
        opt.overhead_generate = true;
      } else if (arg == "--help" || arg == "-h") {
        usage();
        return 0;
      } else {
        throw std::runtime_error("unknown argument " + arg);
      }
    }
    if (opt.requests <= 0 || opt.prompt_tokens <= 0 || opt.max_tokens <= 0)
      throw std::runtime_error("--requests, --prompt-tokens and --max-tokens must be positive");

    if (!opt.overhead_file.empty()) {
      std::cout << json::serialize(run_overhead(opt)) << std::endl;
      return 0;
    }

    // Prompts: random words, sized so the rendered prompt is about --prompt-tokens tokens.
    HttpClient probe(parse_url(opt.url), opt.api_key);
    const int words = std::max(1, opt.prompt_tokens - template_overhead(probe, opt));
    probe.disconnect();
    std::mt19937_64 rng(opt.seed);
    std::vector<std::string> prompts;
    for (int i = 0; i < opt.requests; ++i) prompts.push_back(random_words(rng, words));

    for (int concurrency : opt.concurrency) {
      std::cout << json::serialize(run_level(opt, concurrency, prompts)) << std::endl;
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_serving: " << e.what() << "\n";
    usage();
    return 1;
  }
  return 0;
}
