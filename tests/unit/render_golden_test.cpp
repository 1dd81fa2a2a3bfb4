// Every golden case of every format renders to its reference prompt text byte for byte
// (tests/data/chat-templates/goldens: official templates and DeepSeek's reference encoders).
#include <string>

#include <gtest/gtest.h>

#include "deepinfer/recipe/openai_request.h"
#include "deepinfer/recipe/renderer.h"
#include "test_data.h"

namespace deepinfer::recipe {
namespace {

namespace json = boost::json;

// Options as the goldens write them: V3.1 `thinking`, encoders' `thinking_mode` and `reasoning_effort`.
Conversation conversation_for_case(const json::object& golden) {
  Result<Conversation> conversation = conversation_from_openai_chat(golden.at("request"));
  EXPECT_TRUE(conversation.ok()) << conversation.status().to_string();
  if (!conversation.ok()) return {};
  const json::object& options = golden.at("options").as_object();
  if (const json::value* thinking = options.if_contains("thinking")) conversation->options.thinking = thinking->as_bool();
  if (const json::value* mode = options.if_contains("thinking_mode")) {
    conversation->options.thinking = mode->as_string() == "thinking";
  }
  if (const json::value* effort = options.if_contains("reasoning_effort")) {
    conversation->options.reasoning_effort =
        effort->is_string() ? std::string(effort->as_string()) : std::to_string(effort->to_number<int64_t>());
  }
  return std::move(conversation).value();
}

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
  json::value file = deepinfer::testing::read_json("tests/data/chat-templates/goldens/" +
                                                   std::string(format_name(format)) + ".json");
  int compared = 0;
  for (const json::value& item : file.at("cases").as_array()) {
    const json::object& golden = item.as_object();
    if (!golden.contains("prompt")) continue;  // the reference could not render it (no switch for it)
    std::string name = std::string(golden.at("case").as_string()) + " " + json::serialize(golden.at("options"));
    Conversation conversation = conversation_for_case(golden);
    Result<RenderedPrompt> prompt = render_prompt(conversation, format);
    ASSERT_TRUE(prompt.ok()) << name << ": " << prompt.status().to_string();
    std::string expected(golden.at("prompt").as_string());
    EXPECT_EQ(prompt->text, expected) << name << ": " << first_difference(expected, prompt->text);
    ++compared;
  }
  EXPECT_GE(compared, 11) << "too few golden cases compared";
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
