// Every golden case of every format renders to its reference prompt text byte for byte
// (tests/data/chat-templates/goldens: official templates and DeepSeek's reference encoders).
#include <string>

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
