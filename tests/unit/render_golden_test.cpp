// Every golden case of every format renders to its reference prompt text byte for byte
// (tests/data/chat-templates/goldens: official templates and DeepSeek's reference encoders).
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "golden_cases.h"

namespace deepinfer::recipe {
namespace {

namespace json = boost::json;

std::string first_difference(const std::string& expected, const std::string& actual) {
  size_t i = 0;
  while (i < expected.size() && i < actual.size() && expected[i] == actual[i]) ++i;
  return "first difference at byte " + std::to_string(i) + "\n  expected: ..." +
         json::serialize(json::value(expected.substr(i > 40 ? i - 40 : 0, 120))) + "\n  actual:   ..." +
         json::serialize(json::value(actual.substr(i > 40 ? i - 40 : 0, 120)));
}

class GoldenTest : public ::testing::TestWithParam<PromptFormat> {};

TEST_P(GoldenTest, RendersEveryCaseByteForByte) {
  PromptFormat format = GetParam();
  json::value file = deepinfer::testing::golden_file(format);
  int compared = 0;
  for (const json::value& item : file.at("cases").as_array()) {
    const json::object& golden = item.as_object();
    if (!golden.contains("prompt")) continue;  // the reference could not render it (no switch for it)
    std::string name = deepinfer::testing::golden_name(golden);
    Conversation conversation = deepinfer::testing::golden_conversation(golden);
    Result<RenderedPrompt> prompt = render_prompt(conversation, format);
    ASSERT_TRUE(prompt.ok()) << name << ": " << prompt.status().to_string();
    std::string expected(golden.at("prompt").as_string());
    EXPECT_EQ(prompt->text, expected) << name << ": " << first_difference(expected, prompt->text);
    ++compared;
  }
  EXPECT_GE(compared, 11) << "too few golden cases compared";
}

// The released V4 revision ("0731") differs from the preview encoder only in its effort preambles (issue 16):
// `low` (the default) adds nothing, `high` adds the preview's `max` text byte for byte, `max` and `xhigh` add
// the "Beyond maximum" text, in thinking mode only, at message 0. So every 0731 prompt follows from a preview
// golden: the thinking case without effort for low/none, the `max` case for high, and that case with the text
// swapped for max/xhigh.
TEST(V4RevisionTest, The0731EffortPreamblesFollowFromThePreviewGoldens) {
  const std::string preview_max =
      "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
      "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
      "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
      "scenarios.\n"
      "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
      "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";
  const std::string beyond_max =
      "Reasoning Effort: Beyond maximum \xE2\x80\x94 exhaustive, relentless, and uncompromising.\n"
      "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
      "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
      "resolve the underlying cause rather than any surface symptom.\n"
      "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
      "certain that no assumption remains unchecked and no error remains undiscovered.\n\n";
  json::value file = deepinfer::testing::golden_file(PromptFormat::kDeepSeekV4);
  int compared = 0;
  for (const json::value& item : file.at("cases").as_array()) {
    const json::object& golden = item.as_object();
    if (!golden.contains("prompt")) continue;
    const json::object& options = golden.at("options").as_object();
    const bool thinking = options.at("thinking_mode").as_string() == "thinking";
    const bool max = options.contains("reasoning_effort");
    std::string expected(golden.at("prompt").as_string());
    Conversation conversation = deepinfer::testing::golden_conversation(golden);
    conversation.options.v4_revision = V4Revision::k0731;
    std::vector<std::pair<std::string, std::string>> efforts;  // effort -> expected prompt
    if (!thinking) {
      efforts = {{"low", expected}, {"high", expected}, {"max", expected}};  // chat mode: never a preamble
    } else if (!max) {
      efforts = {{"", expected}, {"low", expected}};
    } else {
      ASSERT_NE(expected.find(preview_max), std::string::npos) << deepinfer::testing::golden_name(golden);
      std::string beyond = expected;
      beyond.replace(beyond.find(preview_max), preview_max.size(), beyond_max);
      efforts = {{"high", expected}, {"max", beyond}, {"xhigh", beyond}};
    }
    for (const auto& [effort, prompt] : efforts) {
      conversation.options.reasoning_effort = effort.empty() ? std::nullopt : std::optional<std::string>(effort);
      Result<RenderedPrompt> rendered = render_prompt(conversation, PromptFormat::kDeepSeekV4);
      ASSERT_TRUE(rendered.ok()) << rendered.status().to_string();
      EXPECT_EQ(rendered->text, prompt) << deepinfer::testing::golden_name(golden) << " effort " << effort << ": "
                                        << first_difference(prompt, rendered->text);
      ++compared;
    }
  }
  EXPECT_GE(compared, 30);
  // Unknown levels are refused, naming the revision's levels; the preview keeps its own.
  Conversation conversation = deepinfer::testing::golden_conversation(file.at("cases").as_array()[0].as_object());
  conversation.options.thinking = true;
  for (const char* bad : {"medium", "minimal", "50", "MAX"}) {
    conversation.options.reasoning_effort = bad;
    conversation.options.v4_revision = V4Revision::k0731;
    Result<RenderedPrompt> rendered = render_prompt(conversation, PromptFormat::kDeepSeekV4);
    ASSERT_FALSE(rendered.ok()) << bad;
    EXPECT_NE(rendered.status().message().find("low, high, xhigh or max"), std::string::npos) << rendered.status().to_string();
  }
  conversation.options.reasoning_effort = "medium";
  conversation.options.v4_revision = V4Revision::kPreview;
  EXPECT_TRUE(render_prompt(conversation, PromptFormat::kDeepSeekV4).ok());
  conversation.options.reasoning_effort = "xhigh";
  EXPECT_FALSE(render_prompt(conversation, PromptFormat::kDeepSeekV4).ok());
  EXPECT_EQ(*parse_v4_revision("0731"), V4Revision::k0731);
  EXPECT_EQ(*parse_v4_revision("preview"), V4Revision::kPreview);
  EXPECT_FALSE(parse_v4_revision("0801").ok());
}

INSTANTIATE_TEST_SUITE_P(AllFormats, GoldenTest, ::testing::ValuesIn(all_formats()),
                         [](const ::testing::TestParamInfo<PromptFormat>& info) {
                           std::string name(format_name(info.param));
                           for (char& c : name) {
                             if (c == '-' || c == '.') c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace deepinfer::recipe
