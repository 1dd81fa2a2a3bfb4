// recipe::detect_format, format_for_model and format_for_chat_template (model_formats.h): the official templates
// (models/deepseek-v3's tokenizer_config.json from scripts/setup.sh; tests/data/chat-templates' R1 and V3.1 files)
// name their formats, and a checkpoint directory is read in the documented order.
#include "deepinfer/recipe/model_formats.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace deepinfer::recipe {
namespace {

namespace fs = std::filesystem;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

const fs::path kSource = DEEPINFER_SOURCE_DIR;

std::string v3_template() {
  boost::json::value config = boost::json::parse(read_text(kSource / "models/deepseek-v3/tokenizer_config.json"));
  return std::string(config.at("chat_template").as_string());
}

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("deepinfer-model-formats-" + std::to_string(getpid()));
  TempDir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  void write(const std::string& name, const std::string& text) const {
    fs::create_directories((path / name).parent_path());
    std::ofstream(path / name, std::ios::binary) << text;
  }
};

TEST(ModelFormatsTest, KnownNames) {
  EXPECT_EQ(format_for_model("deepseek-ai/DeepSeek-V4.1-Flash"), PromptFormat::kDeepSeekV41);
  EXPECT_EQ(format_for_model("deepseek-v3.1-terminus"), PromptFormat::kDeepSeekV31);
  EXPECT_EQ(format_for_model(" DeepSeek-R1 "), PromptFormat::kDeepSeekR1);
  EXPECT_EQ(format_for_model("DeepSeek-V3-0324"), PromptFormat::kDeepSeekV3);
  EXPECT_FALSE(format_for_model("deepseek-ai/DeepSeek-V5").has_value());
  EXPECT_FALSE(format_for_model("").has_value());
  // Every format has a model.
  for (PromptFormat format : all_formats()) {
    bool named = false;
    for (const KnownModel& model : known_models()) named = named || model.format == format;
    EXPECT_TRUE(named) << format_name(format);
  }
}

TEST(ModelFormatsTest, OfficialTemplatesByteForByte) {
  const std::string v3 = v3_template();
  EXPECT_EQ(format_for_chat_template(v3), PromptFormat::kDeepSeekV3);
  EXPECT_EQ(format_for_chat_template(read_text(
                kSource / "tests/data/chat-templates/llamacpp-deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")),
            PromptFormat::kDeepSeekR1);
  EXPECT_EQ(format_for_chat_template(
                read_text(kSource / "tests/data/chat-templates/llamacpp-deepseek-ai-DeepSeek-V3.1.jinja")),
            PromptFormat::kDeepSeekV31);
  EXPECT_FALSE(format_for_chat_template(v3 + " ").has_value());  // byte for byte
  EXPECT_FALSE(format_for_chat_template("").has_value());
}

TEST(ModelFormatsTest, DirectoryReadInOrder) {
  TempDir dir;
  EXPECT_FALSE(detect_format(dir.path).value().has_value());  // nothing names a format
  // 4. a model name in config.json's _name_or_path, then tokenizer_config.json's name_or_path (which wins).
  dir.write("config.json", R"({"model_type": "deepseek_v3", "_name_or_path": "/models/DeepSeek-V4.1-Flash/"})");
  EXPECT_EQ(detect_format(dir.path).value(), PromptFormat::kDeepSeekV41);
  dir.write("tokenizer_config.json", R"({"name_or_path": "deepseek-ai/DeepSeek-V3.1"})");
  EXPECT_EQ(detect_format(dir.path).value(), PromptFormat::kDeepSeekV31);
  // 3. an official template: chat_template.jinja, and tokenizer_config.json's chat_template before it.
  dir.write("chat_template.jinja",
            read_text(kSource / "tests/data/chat-templates/llamacpp-deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"));
  EXPECT_EQ(detect_format(dir.path).value(), PromptFormat::kDeepSeekR1);
  boost::json::object tokenizer_config{{"name_or_path", "deepseek-ai/DeepSeek-V3.1"}, {"chat_template", v3_template()}};
  dir.write("tokenizer_config.json", boost::json::serialize(tokenizer_config));
  EXPECT_EQ(detect_format(dir.path).value(), PromptFormat::kDeepSeekV3);
  // 2. DeepSeek's encoder.
  dir.write("encoding/encoding_dsv32.py", "# V3.2\n");
  EXPECT_EQ(detect_format(dir.path).value(), PromptFormat::kDeepSeekV32);
  dir.write("encoding/encoding_dsv41.py", "# V4.1\n");
  EXPECT_EQ(detect_format(dir.path).value(), PromptFormat::kDeepSeekV41);
  // 1. config.json's chat_format, and a bad one is an error naming the key and the value.
  dir.write("config.json", R"({"model_type": "deepseek_v3", "chat_format": "deepseek-r1"})");
  EXPECT_EQ(detect_format(dir.path).value(), PromptFormat::kDeepSeekR1);
  for (const char* bad : {R"("chatml")", "5"}) {
    dir.write("config.json", std::string(R"({"model_type": "deepseek_v3", "chat_format": )") + bad + "}");
    Result<std::optional<PromptFormat>> refused = detect_format(dir.path);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("config.json's chat_format must be one of deepseek-v3, deepseek-r1"),
              std::string::npos)
        << refused.status().message();
    EXPECT_NE(refused.status().message().find(std::string("got ") + bad), std::string::npos)
        << refused.status().message();
  }
  // A malformed config.json counts as absent.
  dir.write("config.json", "{not json");
  EXPECT_EQ(detect_format(dir.path).value(), PromptFormat::kDeepSeekV41);
}

}  // namespace
}  // namespace deepinfer::recipe
