// What the consistent-hash policy hashes (policy.h, affinity_key): the seed gateway's "system + user text" of a
// request body, in the order the request gives it. No tokenizer, no rendering: the gateway it reproduces
// hashes text.
#pragma once

#include <boost/json.hpp>
#include <string>

#include "deepinfer/recipe/tokenizer.h"

namespace deepinfer::router {

// Concatenates, in order: Anthropic's `system` (a string or text blocks), the Responses API's `instructions`,
// then every `messages` (or Responses `input`) item whose role is system, developer or user — its content as
// a string or the `text` of its parts — and a completions `prompt` (a string, strings, or token ids: decoded
// with `tokenizer` when given, else written as decimal ids). Items are separated by "\n". Unknown shapes add
// nothing (the worker validates the request, not the router).
std::string affinity_text(const boost::json::object& body, const recipe::Tokenizer* tokenizer);

}  // namespace deepinfer::router
