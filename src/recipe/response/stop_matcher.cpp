// Stop-string matching with hold-back of partial matches.
#include "deepinfer/recipe/stop_matcher.h"

#include <algorithm>

namespace deepinfer::recipe {

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (std::string& stop : stops) {
    if (!stop.empty()) stops_.push_back(std::move(stop));
  }
}

std::string StopMatcher::push(std::string_view text) {
  if (matched_) return {};
  if (stops_.empty()) return std::string(text);
  held_.append(text);
  // The earliest complete match wins (the longest stop at that position on ties).
  size_t best = std::string::npos;
  const std::string* best_stop = nullptr;
  for (const std::string& stop : stops_) {
    size_t at = held_.find(stop);
    if (at == std::string::npos) continue;
    if (at < best || (at == best && stop.size() > best_stop->size())) {
      best = at;
      best_stop = &stop;
    }
  }
  if (best_stop != nullptr) {
    matched_ = *best_stop;
    std::string out = held_.substr(0, best);
    held_.clear();
    return out;
  }
  // Hold back the longest tail that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const std::string& stop : stops_) {
    const size_t longest = std::min(stop.size() - 1, held_.size());
    for (size_t k = longest; k > hold; --k) {
      if (std::string_view(held_).substr(held_.size() - k) == std::string_view(stop).substr(0, k)) {
        hold = k;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return out;
}

std::string StopMatcher::flush() {
  std::string out;
  out.swap(held_);
  return out;
}

}  // namespace deepinfer::recipe
