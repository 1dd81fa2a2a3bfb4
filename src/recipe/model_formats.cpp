// Model names, chat-template fingerprints and checkpoint directories -> prompt formats (model_formats.h).
#include "deepinfer/recipe/model_formats.h"

#include <xxhash.h>

#include <algorithm>
#include <array>
#include <boost/json.hpp>
#include <cctype>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>

namespace deepinfer::recipe {
namespace {

namespace json = boost::json;

constexpr KnownModel kModels[] = {
    {"deepseek-ai/DeepSeek-V3", PromptFormat::kDeepSeekV3},
    {"deepseek-ai/DeepSeek-V3-0324", PromptFormat::kDeepSeekV3},
    {"deepseek-ai/DeepSeek-R1", PromptFormat::kDeepSeekR1},
    {"deepseek-ai/DeepSeek-V3.1", PromptFormat::kDeepSeekV31},
    {"deepseek-ai/DeepSeek-V3.1-Terminus", PromptFormat::kDeepSeekV31},
    {"deepseek-ai/DeepSeek-V3.2", PromptFormat::kDeepSeekV32},
    {"deepseek-ai/DeepSeek-V4-Flash", PromptFormat::kDeepSeekV4},
    {"deepseek-ai/DeepSeek-V4-Pro", PromptFormat::kDeepSeekV4},
    {"deepseek-ai/DeepSeek-V4.1-Flash", PromptFormat::kDeepSeekV41},
};

// XXH3-128 (high, low) of official chat templates' text: DeepSeek-V3's tokenizer_config.json template (the one
// scripts/setup.sh puts in models/deepseek-v3), DeepSeek-R1-Distill's and DeepSeek-V3.1's as llama.cpp keeps them
// (tests/data/chat-templates/*.jinja).
struct TemplatePrint {
  uint64_t high;
  uint64_t low;
  PromptFormat format;
};
constexpr TemplatePrint kTemplates[] = {
    {0x4539344e06ec0b77, 0x6878d9ac13b3ef51, PromptFormat::kDeepSeekV3},
    {0xaafd6a95d0a442dd, 0x35a082857f21ae45, PromptFormat::kDeepSeekR1},
    {0x045f87cb32228bbd, 0x96e042beb0e15e14, PromptFormat::kDeepSeekV31},
};

constexpr std::pair<std::string_view, PromptFormat> kEncoders[] = {
    {"encoding_dsv41.py", PromptFormat::kDeepSeekV41},
    {"encoding_dsv4.py", PromptFormat::kDeepSeekV4},
    {"encoding_dsv32.py", PromptFormat::kDeepSeekV32},
};

std::string lower_key(std::string_view name) {
  while (!name.empty() && std::isspace(static_cast<unsigned char>(name.front()))) name.remove_prefix(1);
  while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.remove_suffix(1);
  std::string key(name);
  std::transform(key.begin(), key.end(), key.begin(), [](unsigned char c) { return std::tolower(c); });
  constexpr std::string_view kOrg = "deepseek-ai/";
  if (key.starts_with(kOrg)) key.erase(0, kOrg.size());
  return key;
}

std::optional<std::string> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return std::nullopt;
  return text;
}

// A JSON object file, or nullopt (missing, unreadable, malformed or not an object).
std::optional<json::object> read_object(const std::filesystem::path& path) {
  std::optional<std::string> text = read_file(path);
  if (!text) return std::nullopt;
  boost::system::error_code ec;
  json::value value = json::parse(*text, ec);
  if (ec || !value.is_object()) return std::nullopt;
  return std::move(value.get_object());
}

const json::string* string_field(const std::optional<json::object>& object, std::string_view key) {
  if (!object) return nullptr;
  const json::value* value = object->if_contains(key);
  return value != nullptr ? value->if_string() : nullptr;
}

}  // namespace

std::span<const KnownModel> known_models() { return kModels; }

std::optional<PromptFormat> format_for_model(std::string_view name) {
  const std::string key = lower_key(name);
  for (const KnownModel& model : kModels) {
    if (lower_key(model.name) == key) return model.format;
  }
  return std::nullopt;
}

std::optional<PromptFormat> format_for_chat_template(std::string_view template_text) {
  const XXH128_hash_t hash = XXH3_128bits(template_text.data(), template_text.size());
  for (const TemplatePrint& print : kTemplates) {
    if (print.high == hash.high64 && print.low == hash.low64) return print.format;
  }
  return std::nullopt;
}

Result<std::optional<PromptFormat>> detect_format(const std::filesystem::path& directory) {
  const std::optional<json::object> model_config = read_object(directory / "config.json");
  if (const json::value* named = model_config ? model_config->if_contains("chat_format") : nullptr) {
    Result<PromptFormat> format = named->is_string() ? parse_format(std::string_view(named->get_string()))
                                                     : Result<PromptFormat>(Status::invalid_argument(""));
    if (format.ok()) return std::optional<PromptFormat>(*format);
    std::string formats;
    for (PromptFormat f : all_formats()) formats += (formats.empty() ? "" : ", ") + std::string(format_name(f));
    return Status::invalid_argument(directory.string() + ": config.json's chat_format must be one of " + formats +
                                    ", got " + json::serialize(*named));
  }
  for (const auto& [file, format] : kEncoders) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(directory / "encoding" / file, ec)) return std::optional<PromptFormat>(format);
  }
  const std::optional<json::object> tokenizer_config = read_object(directory / "tokenizer_config.json");
  if (const json::string* text = string_field(tokenizer_config, "chat_template")) {
    if (std::optional<PromptFormat> format = format_for_chat_template(*text)) return format;
  }
  if (std::optional<std::string> text = read_file(directory / "chat_template.jinja")) {
    if (std::optional<PromptFormat> format = format_for_chat_template(*text)) return format;
  }
  const std::pair<const std::optional<json::object>*, std::string_view> names[] = {{&tokenizer_config, "name_or_path"},
                                                                                   {&model_config, "_name_or_path"}};
  for (const auto& [config, key] : names) {
    const json::string* path = string_field(*config, key);
    if (path == nullptr) continue;
    std::string_view name(*path);
    while (name.ends_with('/')) name.remove_suffix(1);
    if (const size_t slash = name.rfind('/'); slash != std::string_view::npos) name.remove_prefix(slash + 1);
    if (std::optional<PromptFormat> format = format_for_model(name)) return format;
  }
  return std::optional<PromptFormat>();
}

}  // namespace deepinfer::recipe
