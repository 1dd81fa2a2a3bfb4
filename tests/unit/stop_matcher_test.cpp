// StopMatcher: hold-back of partial matches, earliest match wins, nothing emitted is ever retracted.
#include "deepinfer/recipe/stop_matcher.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace deepinfer::recipe {
namespace {

// Feeds `pieces` one by one; returns everything emitted (pushes, then a flush unless a stop matched).
std::string run(StopMatcher& matcher, const std::vector<std::string>& pieces,
                std::vector<std::string>* emitted = nullptr) {
  std::string out;
  for (const std::string& piece : pieces) {
    std::string part = matcher.push(piece);
    if (emitted) emitted->push_back(part);
    out += part;
  }
  if (!matcher.matched()) out += matcher.flush();
  return out;
}

TEST(StopMatcherTest, NoStopsPassesThrough) {
  StopMatcher matcher;
  EXPECT_EQ(matcher.push("abc"), "abc");
  EXPECT_EQ(matcher.flush(), "");
}

TEST(StopMatcherTest, HoldsBackAPartialMatchUntilDecided) {
  StopMatcher matcher({"END"});
  std::vector<std::string> emitted;
  EXPECT_EQ(run(matcher, {"abc E", "N", "D more"}, &emitted), "abc ");
  EXPECT_EQ(emitted, (std::vector<std::string>{"abc ", "", ""}));
  EXPECT_EQ(matcher.matched(), "END");
  EXPECT_EQ(matcher.push("ignored"), "");
}

TEST(StopMatcherTest, ReleasesAPartialMatchThatFails) {
  StopMatcher matcher({"END"});
  std::vector<std::string> emitted;
  EXPECT_EQ(run(matcher, {"E", "N", "d"}, &emitted), "ENd");
  EXPECT_EQ(emitted, (std::vector<std::string>{"", "", "ENd"}));
  EXPECT_FALSE(matcher.matched());
}

TEST(StopMatcherTest, FlushReleasesTheTailAtTheEnd) {
  StopMatcher matcher({"END"});
  EXPECT_EQ(matcher.push("xEN"), "x");
  EXPECT_EQ(matcher.flush(), "EN");
}

TEST(StopMatcherTest, EarliestMatchWinsAcrossStops) {
  StopMatcher matcher({"world", "lo w"});
  EXPECT_EQ(run(matcher, {"hel", "lo wor", "ld"}), "hel");
  EXPECT_EQ(matcher.matched(), "lo w");
}

TEST(StopMatcherTest, OverlappingSelfPrefix) {
  // "aab" inside "aaab": the hold-back must keep "aa" and then still match.
  StopMatcher matcher({"aab"});
  EXPECT_EQ(run(matcher, {"a", "a", "a", "b"}), "a");
  EXPECT_EQ(matcher.matched(), "aab");
}

TEST(StopMatcherTest, EveryByteSplitGivesTheSameResult) {
  const std::string text = "The answer is 42. ###\nDone";
  for (size_t split = 0; split <= text.size(); ++split) {
    StopMatcher matcher({"###", "answer was"});
    EXPECT_EQ(run(matcher, {text.substr(0, split), text.substr(split)}), "The answer is 42. ") << split;
    EXPECT_EQ(matcher.matched(), "###");
  }
}

TEST(StopMatcherTest, MultibyteTextIsNotCutInsideACharacter) {
  StopMatcher matcher({"你好吗"});
  EXPECT_EQ(matcher.push("说你好"), "说");  // "你好" is held, whole characters only
  EXPECT_EQ(matcher.push("呀"), "你好呀");
}

}  // namespace
}  // namespace deepinfer::recipe
