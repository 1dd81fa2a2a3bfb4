// Protocol-layer benchmark, one thread: tokenizer throughput over the tokenizer corpus (per string and as
// one concatenated string, as bench-peers/peer_recipe_bench.py measures Hugging Face `tokenizers`), and
// the time to render + tokenize the 88K-token agent session (the peer: transformers' apply_chat_template).
// Prints one JSON line per measurement: median and min/max over repetitions.
//
// Usage: bench_recipe [--tokenizer DIR] [--corpus FILE] [--conversation FILE] [--format NAME] [--reps N]
#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <boost/json.hpp>

#include "deepinfer/recipe/openai_request.h"
#include "deepinfer/recipe/renderer.h"
#include "deepinfer/recipe/tokenizer.h"

namespace {

using namespace deepinfer;
using namespace deepinfer::recipe;
using Clock = std::chrono::steady_clock;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

struct Stats {
  double median_ms, min_ms, max_ms, first_ms;  // first_ms: the first repetition (cold caches)
};

template <class F>
Stats time_ms(int reps, F&& fn) {
  std::vector<double> samples;
  for (int i = 0; i < reps; ++i) {
    auto start = Clock::now();
    fn();
    samples.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  double first = samples.front();
  std::sort(samples.begin(), samples.end());
  return {samples[samples.size() / 2], samples.front(), samples.back(), first};
}

void print(boost::json::object line) { std::cout << boost::json::serialize(line) << std::endl; }

}  // namespace

int main(int argc, char** argv) {
  std::string root = DEEPINFER_SOURCE_DIR;
  std::string tokenizer_path = root + "/models/deepseek-v3";
  std::string corpus_path = root + "/tests/data/tokenizer/corpus.json";
  std::string conversation_path = root + "/tests/data/conversations/agent-session.json";
  std::string format_arg = "deepseek-v3";
  int reps = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--tokenizer") tokenizer_path = argv[i + 1];
    else if (flag == "--corpus") corpus_path = argv[i + 1];
    else if (flag == "--conversation") conversation_path = argv[i + 1];
    else if (flag == "--format") format_arg = argv[i + 1];
    else if (flag == "--reps") reps = std::stoi(argv[i + 1]);
    else {
      std::cerr << "unknown flag " << flag << "\n";
      return 2;
    }
  }
  auto tokenizer = Tokenizer::load(tokenizer_path);
  if (!tokenizer.ok()) {
    std::cerr << tokenizer.status().to_string() << "\n";
    return 1;
  }
  const Tokenizer& tok = **tokenizer;

  // Tokenizer throughput over the corpus, one encode call per string (the peer's method), then one string.
  std::vector<std::string> corpus;
  boost::json::value corpus_json = boost::json::parse(read_file(corpus_path));
  for (const auto& item : corpus_json.as_array()) corpus.emplace_back(item.as_string());
  size_t corpus_bytes = 0;
  for (const auto& s : corpus) corpus_bytes += s.size();
  std::vector<TokenId> ids;
  for (TextTrust trust : {TextTrust::kTrusted, TextTrust::kUntrusted}) {
    // The first pass warms the per-word cache, as the peer's first repetition does.
    Stats s = time_ms(reps, [&] {
      for (const auto& text : corpus) {
        ids.clear();
        tok.encode(text, trust, ids);
      }
    });
    print({{"bench", "tokenizer_corpus"}, {"trust", trust == TextTrust::kTrusted ? "trusted" : "untrusted"},
           {"strings", corpus.size()}, {"bytes", corpus_bytes}, {"median_ms", s.median_ms}, {"min_ms", s.min_ms},
           {"max_ms", s.max_ms}, {"MBps", corpus_bytes / (s.median_ms / 1e3) / 1e6},
           {"first_pass_MBps", corpus_bytes / (s.first_ms / 1e3) / 1e6}});
  }
  std::string concatenated;
  for (size_t i = 0; i < corpus.size(); ++i) concatenated += (i ? "\n" : "") + corpus[i];
  Stats concat = time_ms(reps, [&] {
    ids.clear();
    tok.encode(concatenated, TextTrust::kTrusted, ids);
  });
  print({{"bench", "tokenizer_concat"}, {"bytes", concatenated.size()}, {"median_ms", concat.median_ms},
         {"min_ms", concat.min_ms}, {"max_ms", concat.max_ms},
         {"MBps", concatenated.size() / (concat.median_ms / 1e3) / 1e6}});

  // Agent session: parse + render, then tokenize, then both end to end.
  Result<PromptFormat> format = parse_format(format_arg);
  if (!format.ok()) {
    std::cerr << format.status().to_string() << "\n";
    return 1;
  }
  std::string request = read_file(conversation_path);
  Result<Conversation> conversation = conversation_from_openai_chat(std::string_view(request));
  if (!conversation.ok()) {
    std::cerr << conversation.status().to_string() << "\n";
    return 1;
  }
  Result<RenderedPrompt> prompt = render_prompt(*conversation, *format);
  if (!prompt.ok()) {
    std::cerr << prompt.status().to_string() << "\n";
    return 1;
  }
  Stats parse = time_ms(reps, [&] { (void)conversation_from_openai_chat(std::string_view(request)); });
  Stats render = time_ms(reps, [&] { (void)render_prompt(*conversation, *format); });
  Stats tokenize = time_ms(reps, [&] { tokenize_prompt(tok, *prompt); });
  Stats end_to_end = time_ms(reps, [&] {
    auto c = conversation_from_openai_chat(std::string_view(request));
    (void)render_and_tokenize(*c, *format, tok);
  });
  print({{"bench", "agent_session"}, {"format", format_arg}, {"messages", conversation->messages.size()},
         {"chars_bytes", prompt->text.size()}, {"tokens", prompt->token_ids.size()},
         {"parse_request_ms", parse.median_ms}, {"render_ms", render.median_ms}, {"tokenize_ms", tokenize.median_ms},
         {"render_plus_tokenize_ms", render.median_ms + tokenize.median_ms},
         {"parse_render_tokenize_ms", end_to_end.median_ms}, {"end_to_end_min_ms", end_to_end.min_ms},
         {"end_to_end_max_ms", end_to_end.max_ms}});
  return 0;
}
