// deepinfer tokenize --tokenizer DIR [--untrusted]: stdin a JSON list of strings, stdout a JSON list of id
// lists (one per string).
#include <iostream>
#include <iterator>
#include <memory>
#include <string>

#include <boost/json.hpp>

#include "commands.h"
#include "deepinfer/recipe/tokenizer.h"

namespace deepinfer::apps {

std::function<int()> add_tokenize_command(CLI::App& app) {
  struct Options {
    std::string tokenizer;
    bool untrusted = false;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("tokenize", "Token ids of a JSON list of strings read from stdin");
  cmd->add_option("--tokenizer", options->tokenizer, "Directory holding tokenizer.json (or the file)")->required();
  cmd->add_flag("--untrusted", options->untrusted, "Match no added tokens: control-token text becomes plain text");
  return [options]() -> int {
    Result<std::shared_ptr<const recipe::Tokenizer>> tokenizer = recipe::Tokenizer::load(options->tokenizer);
    if (!tokenizer.ok()) {
      std::cerr << "deepinfer tokenize: " << tokenizer.status().to_string() << "\n";
      return 1;
    }
    std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    boost::system::error_code ec;
    boost::json::value strings = boost::json::parse(input, ec);
    if (ec || !strings.is_array()) {
      std::cerr << "deepinfer tokenize: stdin must be a JSON list of strings"
                << (ec ? " (" + ec.message() + ")" : std::string()) << "\n";
      return 1;
    }
    recipe::TextTrust trust = options->untrusted ? recipe::TextTrust::kUntrusted : recipe::TextTrust::kTrusted;
    boost::json::array result;
    std::vector<recipe::TokenId> ids;
    for (size_t i = 0; i < strings.get_array().size(); ++i) {
      const boost::json::value& item = strings.get_array()[i];
      if (!item.is_string()) {
        std::cerr << "deepinfer tokenize: element " << i << " of the input list is not a string\n";
        return 1;
      }
      ids.clear();
      (*tokenizer)->encode(item.get_string(), trust, ids);
      result.emplace_back(boost::json::array(ids.begin(), ids.end()));
    }
    std::cout << boost::json::serialize(result) << "\n";
    return 0;
  };
}

}  // namespace deepinfer::apps
