// Stop strings over a stream of text deltas: text that could still be the start of a stop string is held
// back until it is decided, so nothing is ever streamed and then retracted, and the stop string itself is
// never returned (OpenAI's `stop`, Anthropic's `stop_sequences`).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace deepinfer::recipe {

// Not thread-safe: one per text stream. Cost per push: O((held + new text) * total stop length).
class StopMatcher {
 public:
  // Empty strings in `stops` are ignored. REQUIRES: stops are valid UTF-8 (then so is every returned piece,
  // for valid UTF-8 input).
  explicit StopMatcher(std::vector<std::string> stops = {});

  bool empty() const { return stops_.empty(); }
  // Appends `text` and returns the part that can be emitted now: everything up to the earliest complete
  // stop string (then matched() is set and later pushes return ""), or everything except the longest tail
  // that is a proper prefix of a stop string.
  std::string push(std::string_view text);
  // The stream ended (or its kind changed): returns the held-back tail, which can no longer become a match.
  std::string flush();
  // The stop string that matched, if any.
  const std::optional<std::string>& matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  std::optional<std::string> matched_;
};

}  // namespace deepinfer::recipe
