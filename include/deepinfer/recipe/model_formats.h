// Which prompt format a model name or a checkpoint directory names. One implementation: `deepinfer serve` uses it
// when --chat-format is not given (server.h's checkpoint_chat_format), and the Python module resolves a
// tokenizer_model with it (deepseek_recipe.detect_format, format_for_model, MODELS).
//
// Thread-safety: every function is pure or reads files only; safe from any thread.
#pragma once

#include <filesystem>
#include <optional>
#include <span>
#include <string_view>

#include "deepinfer/core/status.h"
#include "deepinfer/recipe/renderer.h"

namespace deepinfer::recipe {

// DeepSeek's chat models by their Hugging Face names ("deepseek-ai/DeepSeek-V3.1") and the format each renders in.
struct KnownModel {
  std::string_view name;
  PromptFormat format;
};
std::span<const KnownModel> known_models();

// The format of a known model name: with or without the "deepseek-ai/" prefix, any case, surrounding whitespace
// ignored ("deepseek-v3.1-terminus" -> deepseek-v3.1). nullopt for any other name.
std::optional<PromptFormat> format_for_model(std::string_view name);

// The format of an official chat template we know, byte for byte (DeepSeek-V3's tokenizer_config.json template,
// the R1 and V3.1 templates as llama.cpp keeps them), by an XXH3-128 fingerprint of its text. nullopt otherwise.
std::optional<PromptFormat> format_for_chat_template(std::string_view template_text);

// The format a checkpoint or tokenizer directory names, first match in this order:
//   1. config.json's "chat_format" (a format name; the demo model's way);
//   2. DeepSeek's reference encoder in encoding/ (encoding_dsv41.py, encoding_dsv4.py, encoding_dsv32.py);
//   3. an official chat template we know: tokenizer_config.json's "chat_template", or chat_template.jinja;
//   4. a known model name as the last path component of tokenizer_config.json's "name_or_path" or config.json's
//      "_name_or_path".
// nullopt when nothing names one (the caller decides: the server falls back on config.json's model_type).
// Errors: InvalidArgument when config.json's chat_format is not a format name (the message names the directory,
// the key, the formats and what was there). Unreadable or malformed files count as absent.
Result<std::optional<PromptFormat>> detect_format(const std::filesystem::path& directory);

}  // namespace deepinfer::recipe
