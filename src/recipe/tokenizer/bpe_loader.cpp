// Reading a tokenizer.json into Tokenizer::Impl: which models, normalizers, pre-tokenizers and decoders are
// accepted, and the tables built from them. Every error names the file and the JSON field.
// Reference: `tokenizers` models/bpe/serialization.rs, pre_tokenizers/{split,byte_level}.rs.
#include <algorithm>
#include <boost/json.hpp>
#include <cstdio>

#include "bpe_tokenizer_impl.h"

namespace deepinfer::recipe::bpe {
namespace {

namespace json = boost::json;
using Impl = Tokenizer::Impl;

// The bytes a vocabulary string decodes to, as the ByteLevel decoder does: when every character is in
// the byte alphabet, the bytes they stand for; otherwise (added tokens such as `<｜User｜>`) the string's
// own UTF-8 bytes.
std::string piece_bytes(std::string_view piece) {
  std::string bytes;
  for (size_t i = 0; i < piece.size();) {
    const size_t length = utf8_char_length(piece, i);
    uint32_t code_point = UINT32_MAX;
    const auto byte = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(piece[i + k])); };
    if (length == 1 && byte(0) < 0x80) code_point = byte(0);
    if (length == 2) code_point = ((byte(0) & 0x1F) << 6) | (byte(1) & 0x3F);
    if (code_point >= kByteAlphabet.byte_of_char.size() || kByteAlphabet.byte_of_char[code_point] < 0) {
      return std::string(piece);
    }
    bytes += static_cast<char>(kByteAlphabet.byte_of_char[code_point]);
    i += length;
  }
  return bytes;
}

// Concatenates message parts (chains of "literal" + std::string trip a false -Wrestrict in GCC 12 at -O3).
std::string concat(std::initializer_list<std::string_view> parts) {
  std::string out;
  for (const std::string_view part : parts) out += part;
  return out;
}

// The regex ByteLevel splits with when use_regex is true (GPT-2's, as pre_tokenizers/byte_level.rs has it).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Reads tokenizer.json into an Impl, naming the file and the field in every error.
class Loader {
 public:
  Loader(const std::string& path, Impl& impl) : path_(path), impl_(impl) {}

  Status load(const json::object& root) {
    // The model first: a WordPiece or Unigram file should be told so, not about its normalizer.
    const json::value* model = root.if_contains("model");
    if (model == nullptr || !model->is_object()) return fail(StatusCode::kCorruption, "model", "is not an object");
    if (Status s = load_model(model->get_object()); !s.ok()) return s;
    if (Status s = load_normalizer(root.if_contains("normalizer"), "normalizer"); !s.ok()) return s;
    const json::value* pre_tokenizer = root.if_contains("pre_tokenizer");
    if (pre_tokenizer == nullptr || pre_tokenizer->is_null()) {
      return fail(StatusCode::kUnsupported, "pre_tokenizer", "is missing; only byte-level BPE is supported");
    }
    if (Status s = load_pre_tokenizer(*pre_tokenizer, "pre_tokenizer"); !s.ok()) return s;
    if (!saw_byte_level_) {
      return fail(StatusCode::kUnsupported, "pre_tokenizer", "has no ByteLevel step; only byte-level BPE is supported");
    }
    if (Status s = load_decoder(root.if_contains("decoder")); !s.ok()) return s;
    if (Status s = load_added_tokens(root.if_contains("added_tokens")); !s.ok()) return s;
    return build_id_tables();
  }

 private:
  Status fail(StatusCode code, std::string_view field, std::string_view what) const {
    std::string message = concat({path_, ": field '", field, "' ", what});
    switch (code) {
      case StatusCode::kUnsupported:
        return Status::unsupported(std::move(message));
      case StatusCode::kInvalidArgument:
        return Status::invalid_argument(std::move(message));
      case StatusCode::kInternal:
        return Status::internal(std::move(message));
      default:
        return Status::corruption(std::move(message));
    }
  }

  static std::string_view type_of(const json::value& value) {
    const json::object* object = value.if_object();
    const json::value* type = object != nullptr ? object->if_contains("type") : nullptr;
    return type != nullptr && type->is_string() ? std::string_view(type->get_string()) : std::string_view();
  }

  // A boolean field with its default when absent or null.
  Status read_bool(const json::object& object, std::string_view key, const std::string& field, bool& out) const {
    const json::value* value = object.if_contains(key);
    if (value == nullptr || value->is_null()) return Status::ok_status();
    if (!value->is_bool()) return fail(StatusCode::kCorruption, concat({field, ".", key}), "is not a boolean");
    out = value->get_bool();
    return Status::ok_status();
  }

  Status load_normalizer(const json::value* value, const std::string& field) {
    if (value == nullptr || value->is_null()) return Status::ok_status();
    // An empty Sequence (DeepSeek's) changes nothing; any real normalizer would change what is matched.
    if (type_of(*value) == "Sequence") {
      const json::value* list = value->get_object().if_contains("normalizers");
      if (list == nullptr || !list->is_array())
        return fail(StatusCode::kCorruption, field + ".normalizers", "is not a list");
      for (size_t i = 0; i < list->get_array().size(); ++i) {
        Status s = load_normalizer(&list->get_array()[i], concat({field, ".normalizers[", std::to_string(i), "]"}));
        if (!s.ok()) return s;
      }
      return Status::ok_status();
    }
    return fail(StatusCode::kUnsupported, field,
                concat({"has type '", type_of(*value), "'; only null or an empty Sequence is supported"}));
  }

  Status load_pre_tokenizer(const json::value& value, const std::string& field) {
    const std::string_view type = type_of(value);
    if (!value.is_object()) return fail(StatusCode::kCorruption, field, "is not an object");
    if (saw_byte_level_) {
      // ByteLevel maps text to its alphabet; a later step would see that alphabet, which we do not model.
      return fail(StatusCode::kUnsupported, field, "follows ByteLevel; ByteLevel must be the last pre-tokenizer");
    }
    const json::object& object = value.get_object();
    if (type == "Sequence") {
      const json::value* list = object.if_contains("pretokenizers");
      if (list == nullptr || !list->is_array())
        return fail(StatusCode::kCorruption, field + ".pretokenizers", "is not a list");
      for (size_t i = 0; i < list->get_array().size(); ++i) {
        Status s = load_pre_tokenizer(list->get_array()[i], concat({field, ".pretokenizers[", std::to_string(i), "]"}));
        if (!s.ok()) return s;
      }
      return Status::ok_status();
    }
    if (type == "Split") return load_split(object, field);
    if (type == "ByteLevel") {
      saw_byte_level_ = true;
      bool use_regex = true;
      impl_.add_prefix_space = true;  // the reference's defaults
      if (Status s = read_bool(object, "add_prefix_space", field, impl_.add_prefix_space); !s.ok()) return s;
      if (Status s = read_bool(object, "use_regex", field, use_regex); !s.ok()) return s;
      if (use_regex) {
        auto regex = Regex::compile(kGpt2Pattern);
        if (!regex.ok()) return fail(StatusCode::kInternal, field, regex.status().message());
        impl_.byte_level_regex = std::move(regex).value();
      }
      return Status::ok_status();
    }
    return fail(StatusCode::kUnsupported, field,
                concat({"has type '", type, "'; supported: Sequence, Split, ByteLevel"}));
  }

  Status load_split(const json::object& object, const std::string& field) {
    SplitStep step;
    const json::value* pattern = object.if_contains("pattern");
    const json::object* pattern_object = pattern != nullptr ? pattern->if_object() : nullptr;
    const json::value* regex_text = pattern_object != nullptr ? pattern_object->if_contains("Regex") : nullptr;
    const json::value* string_text = pattern_object != nullptr ? pattern_object->if_contains("String") : nullptr;
    std::string regex_source;
    if (regex_text != nullptr && regex_text->is_string()) {
      regex_source = std::string(regex_text->get_string());
    } else if (string_text != nullptr && string_text->is_string()) {
      regex_source = escape_literal(string_text->get_string());
    } else {
      return fail(StatusCode::kCorruption, field + ".pattern", "is neither {\"Regex\": ...} nor {\"String\": ...}");
    }
    auto regex = Regex::compile(regex_source);
    if (!regex.ok()) return fail(StatusCode::kInvalidArgument, field + ".pattern", regex.status().message());
    step.regex = std::move(regex).value();

    const json::value* behavior = object.if_contains("behavior");
    const std::string_view name =
        behavior != nullptr && behavior->is_string() ? std::string_view(behavior->get_string()) : "";
    static constexpr std::pair<std::string_view, SplitBehavior> kBehaviors[] = {
        {"Isolated", SplitBehavior::kIsolated},
        {"Removed", SplitBehavior::kRemoved},
        {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
        {"MergedWithNext", SplitBehavior::kMergedWithNext},
        {"Contiguous", SplitBehavior::kContiguous},
    };
    const auto* found = std::find_if(std::begin(kBehaviors), std::end(kBehaviors),
                                     [&](const auto& entry) { return entry.first == name; });
    if (found == std::end(kBehaviors)) {
      return fail(StatusCode::kUnsupported, field + ".behavior", concat({"is '", name, "'"}));
    }
    step.behavior = found->second;
    if (Status s = read_bool(object, "invert", field, step.invert); !s.ok()) return s;
    impl_.splits.push_back(std::move(step));
    return Status::ok_status();
  }

  Status load_decoder(const json::value* value) {
    if (value != nullptr && type_of(*value) == "ByteLevel") return Status::ok_status();
    const std::string type = value == nullptr || value->is_null() ? "null" : concat({"'", type_of(*value), "'"});
    return fail(StatusCode::kUnsupported, "decoder", concat({"is ", type, "; only ByteLevel is supported"}));
  }

  Status load_model(const json::object& model) {
    const json::value* type = model.if_contains("type");
    // Files from before the "type" field had only BPE models with merges.
    if (type != nullptr && !(type->is_string() && type->get_string() == "BPE")) {
      return fail(StatusCode::kUnsupported, "model.type",
                  concat({"is ", json::serialize(*type), "; only BPE is supported"}));
    }
    for (const std::string_view key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      const json::value* affix = model.if_contains(key);
      if (affix != nullptr && !affix->is_null() && !(affix->is_string() && affix->get_string().empty())) {
        return fail(StatusCode::kUnsupported, concat({"model.", key}), "is set; byte-level BPE has none");
      }
    }
    const json::value* dropout = model.if_contains("dropout");
    if (dropout != nullptr && !dropout->is_null() && !(dropout->is_number() && dropout->to_number<double>() == 0.0)) {
      return fail(StatusCode::kUnsupported, "model.dropout", "is set; inference needs deterministic merges");
    }
    bool byte_fallback = false;
    if (Status s = read_bool(model, "fuse_unk", "model", impl_.fuse_unk); !s.ok()) return s;
    if (Status s = read_bool(model, "byte_fallback", "model", byte_fallback); !s.ok()) return s;
    if (Status s = read_bool(model, "ignore_merges", "model", impl_.ignore_merges); !s.ok()) return s;

    const json::value* vocab = model.if_contains("vocab");
    if (vocab == nullptr || !vocab->is_object())
      return fail(StatusCode::kCorruption, "model.vocab", "is not an object");
    impl_.vocab.reserve(vocab->get_object().size());
    for (const auto& [piece, id_value] : vocab->get_object()) {
      const std::optional<TokenId> id = read_id(id_value);
      if (!id) return fail(StatusCode::kCorruption, "model.vocab", concat({"maps '", piece, "' to a bad id"}));
      impl_.vocab.emplace(std::string(piece), *id);
    }

    const json::value* unk = model.if_contains("unk_token");
    if (unk != nullptr && unk->is_string()) {
      auto it = impl_.vocab.find(std::string(unk->get_string()));
      if (it == impl_.vocab.end()) return fail(StatusCode::kCorruption, "model.unk_token", "is not in the vocabulary");
      impl_.unk_id = it->second;
    }
    for (int byte = 0; byte < 256; ++byte) {
      std::string spelling;
      append_utf8(kByteAlphabet.char_of_byte[byte], spelling);
      auto it = impl_.vocab.find(spelling);
      impl_.byte_symbol[byte] = it != impl_.vocab.end() ? it->second : -1;
      if (byte_fallback && it == impl_.vocab.end()) {
        // The reference falls back to "<0xXX>" for each UTF-8 byte of the missing character.
        std::vector<TokenId> ids;
        for (const char c : spelling) {
          char name[8];
          std::snprintf(name, sizeof(name), "<0x%02X>", static_cast<unsigned char>(c));
          auto fallback = impl_.vocab.find(name);
          if (fallback == impl_.vocab.end()) break;
          ids.push_back(fallback->second);
        }
        if (ids.size() == spelling.size()) impl_.byte_fallback_ids[byte] = std::move(ids);
      }
    }
    return load_merges(model.if_contains("merges"));
  }

  static std::optional<TokenId> read_id(const json::value& value) {
    json::error_code error;
    const auto id = value.to_number<int64_t>(error);
    if (error || id < 0 || id >= INT32_MAX) return std::nullopt;
    return static_cast<TokenId>(id);
  }

  Status load_merges(const json::value* merges) {
    if (merges == nullptr || !merges->is_array()) return fail(StatusCode::kCorruption, "model.merges", "is not a list");
    const json::array& list = merges->get_array();
    impl_.merges.reserve(list.size());
    std::string merged;
    for (size_t rank = 0; rank < list.size(); ++rank) {
      const std::string field = concat({"model.merges[", std::to_string(rank), "]"});
      std::string_view left;
      std::string_view right;
      const json::value& entry = list[rank];
      if (entry.is_string()) {
        // Legacy form "left right": the first space separates (byte-level pieces never contain one).
        const std::string_view text = entry.get_string();
        const size_t space = text.find(' ');
        if (space == std::string_view::npos) return fail(StatusCode::kCorruption, field, "has no space");
        left = text.substr(0, space);
        right = text.substr(space + 1);
      } else if (entry.is_array() && entry.get_array().size() == 2 && entry.get_array()[0].is_string() &&
                 entry.get_array()[1].is_string()) {
        left = entry.get_array()[0].get_string();
        right = entry.get_array()[1].get_string();
      } else {
        return fail(StatusCode::kCorruption, field, "is neither \"a b\" nor [\"a\", \"b\"]");
      }
      merged.assign(left);
      merged.append(right);
      const auto left_id = impl_.vocab.find(std::string(left));
      const auto right_id = impl_.vocab.find(std::string(right));
      const auto merged_id = impl_.vocab.find(merged);
      if (left_id == impl_.vocab.end() || right_id == impl_.vocab.end() || merged_id == impl_.vocab.end()) {
        return fail(StatusCode::kCorruption, field, "names a piece that is not in model.vocab");
      }
      impl_.merges.insert(left_id->second, right_id->second, static_cast<uint32_t>(rank), merged_id->second);
    }
    return Status::ok_status();
  }

  Status load_added_tokens(const json::value* value) {
    if (value == nullptr || value->is_null()) return build_matchers();
    if (!value->is_array()) return fail(StatusCode::kCorruption, "added_tokens", "is not a list");
    const json::array& list = value->get_array();
    impl_.added.reserve(list.size());  // piece_of_id keeps views into these strings: no reallocation later
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string field = concat({"added_tokens[", std::to_string(i), "]"});
      const json::object* object = list[i].if_object();
      const json::value* content = object != nullptr ? object->if_contains("content") : nullptr;
      const json::value* id = object != nullptr ? object->if_contains("id") : nullptr;
      const std::optional<TokenId> token_id = id != nullptr ? read_id(*id) : std::nullopt;
      if (content == nullptr || !content->is_string() || !token_id) {
        return fail(StatusCode::kCorruption, field, "needs a string 'content' and a non-negative 'id'");
      }
      AddedToken token;
      token.content = std::string(content->get_string());
      token.id = *token_id;
      for (auto [key, flag] : {std::pair{"special", &token.special}, std::pair{"single_word", &token.single_word},
                               std::pair{"lstrip", &token.lstrip}, std::pair{"rstrip", &token.rstrip},
                               std::pair{"normalized", &token.normalized}}) {
        if (Status s = read_bool(*object, key, field, *flag); !s.ok()) return s;
      }
      impl_.added_by_content.emplace(token.content, token.id);
      impl_.added.push_back(std::move(token));
    }
    return build_matchers();
  }

  Status build_matchers() {
    // The reference's tries list special tokens before the others; that order breaks ties between equal
    // contents. With no normalizer, "normalized" tokens are matched on the raw text, in a second pass.
    std::vector<const AddedToken*> raw;
    std::vector<const AddedToken*> normalized;
    for (const bool special : {true, false}) {
      for (const AddedToken& token : impl_.added) {
        if (token.special != special) continue;
        (token.normalized ? normalized : raw).push_back(&token);
      }
    }
    if (Status s = impl_.raw_matcher.build(raw); !s.ok()) return s;
    return impl_.normalized_matcher.build(normalized);
  }

  Status build_id_tables() {
    size_t size = 0;
    for (const auto& [piece, id] : impl_.vocab) size = std::max(size, static_cast<size_t>(id) + 1);
    for (const AddedToken& token : impl_.added) size = std::max(size, static_cast<size_t>(token.id) + 1);
    // Tables are indexed by id; a stray huge id would make them huge. Real vocabularies stay below 2^20.
    constexpr size_t kMaxIds = size_t{1} << 24;
    if (size > kMaxIds) {
      return fail(StatusCode::kCorruption, "model.vocab",
                  concat({"or added_tokens has id ", std::to_string(size - 1), ", above 2^24"}));
    }
    impl_.piece_of_id.assign(size, std::string_view());
    impl_.id_flags.assign(size, 0);
    for (const auto& [piece, id] : impl_.vocab) {
      impl_.piece_of_id[id] = piece;
      impl_.id_flags[id] = kKnown;
    }
    // An added token's content wins over a vocabulary string with the same id, as in the reference.
    for (const AddedToken& token : impl_.added) {
      impl_.piece_of_id[token.id] = token.content;
      impl_.id_flags[token.id] = kKnown | kAdded | (token.special ? kSpecial : 0);
    }
    impl_.bytes_offset.assign(size + 1, 0);
    for (size_t id = 0; id < size; ++id) {
      impl_.bytes_offset[id] = static_cast<uint32_t>(impl_.bytes_arena.size());
      if (impl_.id_flags[id] & kKnown) impl_.bytes_arena += piece_bytes(impl_.piece_of_id[id]);
    }
    impl_.bytes_offset[size] = static_cast<uint32_t>(impl_.bytes_arena.size());
    return Status::ok_status();
  }

  const std::string& path_;
  Impl& impl_;
  bool saw_byte_level_ = false;
};

}  // namespace

Status load_tokenizer_json(const std::string& path, const json::object& root, Impl& impl) {
  return Loader(path, impl).load(root);
}

}  // namespace deepinfer::recipe::bpe
