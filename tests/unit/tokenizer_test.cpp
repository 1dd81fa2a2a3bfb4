// Tokenizer tests: DeepSeek-V3's ids against Hugging Face `tokenizers` 0.23.2 on the corpus in
// tests/data/tokenizer (copied from shared/data/tokenizers/deepseek-v3), decode, lookups, load errors, and
// small hand-written tokenizer.json files for the pre-tokenizers DeepSeek does not use.
#include "deepinfer/recipe/tokenizer.h"

#include <gtest/gtest.h>

#include <atomic>
#include <boost/json.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "deepinfer/recipe/detokenizer.h"

namespace deepinfer::recipe {
namespace {

namespace json = boost::json;

constexpr const char* kTokenizerPath = DEEPINFER_SOURCE_DIR "/models/deepseek-v3/tokenizer.json";
constexpr const char* kCorpusPath = DEEPINFER_SOURCE_DIR "/tests/data/tokenizer/corpus.json";
constexpr const char* kReferencePath = DEEPINFER_SOURCE_DIR "/tests/data/tokenizer/reference-ids.json";
constexpr size_t kMaxReportedMismatches = 10;

// ---------------------------------------------------------------------------------------------------------
// Helpers

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// A test string as a C literal for failure messages (control and non-ASCII bytes escaped), cut at 200 bytes.
std::string escaped(std::string_view text) {
  constexpr size_t kMaxBytes = 200;
  std::string out = "\"";
  for (size_t i = 0; i < text.size() && i < kMaxBytes; ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte == '"' || byte == '\\') {
      out += '\\';
      out += static_cast<char>(byte);
    } else if (byte >= 0x20 && byte < 0x7F) {
      out += static_cast<char>(byte);
    } else {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02X", byte);
      out += hex;
    }
  }
  out += text.size() > kMaxBytes ? "\"... (" + std::to_string(text.size()) + " bytes)" : "\"";
  return out;
}

template <class Sequence>
size_t first_difference(const Sequence& a, const Sequence& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}

// ids[at - 2, at + 6) as "ids[i..] = [a, b, ...]", to show where two id lists part.
std::string id_window(const std::vector<TokenId>& ids, size_t at) {
  const size_t begin = at >= 2 ? at - 2 : 0;
  std::string out = "ids[" + std::to_string(begin) + "..] = [";
  for (size_t i = begin; i < ids.size() && i < at + 6; ++i) {
    out += (i > begin ? ", " : "") + std::to_string(ids[i]);
  }
  return out + "]";
}

std::string describe_id_mismatch(size_t index, std::string_view text, const std::vector<TokenId>& expected,
                                 const std::vector<TokenId>& actual) {
  const size_t at = first_difference(expected, actual);
  return "corpus[" + std::to_string(index) + "] " + escaped(text) + ": first difference at id " + std::to_string(at) +
         " of " + std::to_string(expected.size()) + " expected (" + std::to_string(actual.size()) + " got); expected " +
         id_window(expected, at) + ", got " + id_window(actual, at);
}

std::string describe_text_mismatch(size_t index, std::string_view text, std::string_view expected,
                                   std::string_view actual) {
  const size_t at = first_difference(expected, actual);
  return "corpus[" + std::to_string(index) + "] " + escaped(text) + ": first difference at byte " + std::to_string(at) +
         "; expected " + escaped(expected.substr(at, 24)) + ", got " + escaped(actual.substr(at, 24));
}

std::vector<TokenId> to_ids(const json::value& value) {
  std::vector<TokenId> ids;
  for (const json::value& id : value.as_array()) ids.push_back(static_cast<TokenId>(id.as_int64()));
  return ids;
}

// ---------------------------------------------------------------------------------------------------------
// DeepSeek-V3 against the reference

struct CorpusCase {
  std::string text;
  std::vector<TokenId> ids;            // encode, added tokens matched
  std::vector<TokenId> ids_untrusted;  // encode with the added-token table emptied
  std::string decoded;                 // decode(ids)
};

struct Reference {
  std::shared_ptr<const Tokenizer> tokenizer;
  std::vector<CorpusCase> cases;
  std::vector<std::string> corpus;  // corpus.json, which must equal the reference's "texts"
  std::string error;                // why the above could not be loaded
};

Reference load_reference() {
  Reference reference;
  if (!std::filesystem::exists(kTokenizerPath)) {
    reference.error = std::string(kTokenizerPath) + " is missing: run scripts/setup.sh to fetch it";
    return reference;
  }
  auto tokenizer = Tokenizer::load(kTokenizerPath);
  if (!tokenizer.ok()) {
    reference.error = tokenizer.status().to_string();
    return reference;
  }
  reference.tokenizer = *tokenizer;
  json::error_code ids_error;
  json::error_code corpus_error;
  const json::value ids = json::parse(read_text_file(kReferencePath), ids_error);
  const json::value corpus = json::parse(read_text_file(kCorpusPath), corpus_error);
  if (ids_error || corpus_error || !ids.is_object() || !corpus.is_array()) {
    reference.error = std::string("cannot parse ") + kReferencePath + " or " + kCorpusPath;
    return reference;
  }
  const json::object& fields = ids.as_object();
  const json::array& texts = fields.at("texts").as_array();
  for (size_t i = 0; i < texts.size(); ++i) {
    reference.cases.push_back(CorpusCase{std::string(texts[i].as_string()), to_ids(fields.at("ids").as_array()[i]),
                                         to_ids(fields.at("ids_untrusted").as_array()[i]),
                                         std::string(fields.at("decoded").as_array()[i].as_string())});
  }
  for (const json::value& text : corpus.as_array()) reference.corpus.emplace_back(text.as_string());
  return reference;
}

class DeepSeekTokenizerTest : public ::testing::Test {
 protected:
  // Parsed once for all tests of the binary.
  static const Reference& reference() {
    static const Reference kReference = load_reference();
    return kReference;
  }
  void SetUp() override { ASSERT_TRUE(reference().error.empty()) << reference().error; }
  const Tokenizer& tokenizer() const { return *reference().tokenizer; }
  const std::vector<CorpusCase>& cases() const { return reference().cases; }
};

TEST_F(DeepSeekTokenizerTest, CorpusMatchesReferenceTexts) {
  ASSERT_EQ(cases().size(), 1516u);
  ASSERT_EQ(reference().corpus.size(), cases().size());
  for (size_t i = 0; i < cases().size(); ++i)
    EXPECT_EQ(reference().corpus[i], cases()[i].text) << "corpus[" << i << "]";
  EXPECT_EQ(tokenizer().vocab_size(), 128815u);
}

TEST_F(DeepSeekTokenizerTest, TrustedEncodeMatchesReference) {
  size_t mismatches = 0;
  for (size_t i = 0; i < cases().size(); ++i) {
    const std::vector<TokenId> ids = tokenizer().encode(cases()[i].text, TextTrust::kTrusted);
    if (ids == cases()[i].ids) continue;
    if (++mismatches <= kMaxReportedMismatches)
      ADD_FAILURE() << describe_id_mismatch(i, cases()[i].text, cases()[i].ids, ids);
  }
  EXPECT_EQ(mismatches, 0u) << "of " << cases().size() << " corpus strings";
}

TEST_F(DeepSeekTokenizerTest, UntrustedEncodeMatchesReference) {
  size_t mismatches = 0;
  for (size_t i = 0; i < cases().size(); ++i) {
    const std::vector<TokenId> ids = tokenizer().encode(cases()[i].text, TextTrust::kUntrusted);
    if (ids == cases()[i].ids_untrusted) continue;
    if (++mismatches <= kMaxReportedMismatches) {
      ADD_FAILURE() << describe_id_mismatch(i, cases()[i].text, cases()[i].ids_untrusted, ids);
    }
  }
  EXPECT_EQ(mismatches, 0u) << "of " << cases().size() << " corpus strings";
}

// What makes untrusted mode safe: no text, whatever it spells, becomes an added (control) token.
TEST_F(DeepSeekTokenizerTest, UntrustedEncodeNeverYieldsAddedTokens) {
  for (size_t i = 0; i < cases().size(); ++i) {
    for (const TokenId id : tokenizer().encode(cases()[i].text, TextTrust::kUntrusted)) {
      EXPECT_FALSE(tokenizer().is_added_token(id))
          << "corpus[" << i << "] " << escaped(cases()[i].text) << " gave " << id;
    }
  }
}

TEST_F(DeepSeekTokenizerTest, DecodeMatchesReference) {
  size_t mismatches = 0;
  for (size_t i = 0; i < cases().size(); ++i) {
    const std::string decoded = tokenizer().decode(cases()[i].ids);
    if (decoded == cases()[i].decoded) continue;
    if (++mismatches <= kMaxReportedMismatches) {
      ADD_FAILURE() << describe_text_mismatch(i, cases()[i].text, cases()[i].decoded, decoded);
    }
  }
  EXPECT_EQ(mismatches, 0u) << "of " << cases().size() << " corpus strings";
}

TEST_F(DeepSeekTokenizerTest, UntrustedEncodeRoundTripsValidText) {
  size_t checked = 0;
  for (size_t i = 0; i < cases().size(); ++i) {
    const std::string& text = cases()[i].text;
    std::string repaired;
    append_utf8_lossy(text, repaired, /*keep_incomplete_tail=*/false);
    if (repaired != text) continue;  // not valid UTF-8: decode repairs it, by contract
    ++checked;
    const std::string decoded = tokenizer().decode(tokenizer().encode(text, TextTrust::kUntrusted));
    EXPECT_EQ(decoded, text) << describe_text_mismatch(i, text, text, decoded);
  }
  EXPECT_EQ(checked, cases().size());
}

// Cases the corpus lacks, run through tokenizers 0.23.2 on the H200 machine (2026-11-30): Unicode
// whitespace that Oniguruma's \s has and PCRE2's lacks (U+0085), the other White_Space characters, and
// characters of Unicode 15.0-16.0 (the reference's tables are 16.0, PCRE2 10.42's are 14.0).
struct EdgeCase {
  std::string text;
  std::vector<TokenId> ids;
  std::vector<TokenId> ids_untrusted;
};

const EdgeCase kEdgeCases[] = {
    {"a\xC2\x85"
     "b",
     {67, 129, 230, 68},
     {67, 129, 230, 68}},
    {"a \xC2\x85 b", {67, 1203, 230, 291}, {67, 1203, 230, 291}},
    {"x\xE2\x80\xA8\xE2\x80\xA9y", {90, 300, 104, 300, 105, 91}, {90, 300, 104, 300, 105, 91}},
    {"\x0B\x0B a", {202, 202, 260}, {202, 202, 260}},
    {"word\xC2\xA0\xC2\xA0next", {3899, 2162, 2162, 6695}, {3899, 2162, 2162, 6695}},
    {"  \xE3\x80\x80 \xE3\x80\x80x", {262, 18524, 223, 18524, 90}, {262, 18524, 223, 18524, 90}},
    {"\x1C\x1D\x1E\x1F text", {219, 220, 221, 222, 3051}, {219, 220, 221, 222, 3051}},
    {"a\xE1\xA0\x8E"
     "b",
     {67, 115522, 239, 68},
     {67, 115522, 239, 68}},
    {"a\xE1\x9A\x80 b", {67, 160, 251, 225, 291}, {67, 160, 251, 225, 291}},
    {"1\xE2\x80\x80\xE2\x80\x81\xE2\x80\x8A"
     "2",
     {19, 300, 225, 300, 226, 300, 235, 20},
     {19, 300, 225, 300, 226, 300, 235, 20}},
    {"p\xE2\x80\xAF\xE2\x81\x9Fq", {82, 300, 110, 15371, 256, 83}, {82, 300, 110, 15371, 256, 83}},
    {"tab\x09\x0B\x0C\x0D"
     "end",
     {14278, 200, 202, 203, 204, 523},
     {14278, 200, 202, 203, 204, 523}},
    {"\xC2\x85\xC2\x85", {129, 230, 129, 230}, {129, 230, 129, 230}},
    {"end \xC2\x85", {523, 1203, 230}, {523, 1203, 230}},
    {"\xE2\x80\xA9", {300, 105}, {300, 105}},
    {"x \xC2\xA0", {90, 13714}, {90, 13714}},
    {"\xF0\x9F\xAB\xA8 \xF0\x9F\xAB\xB7\xF0\x9F\xAB\xB8",
     {3574, 107, 104, 7351, 107, 118, 3574, 107, 119},
     {3574, 107, 104, 7351, 107, 118, 3574, 107, 119}},
    {"\xF0\x9E\x93\x90\xF0\x9E\x93\x91x",
     {175, 255, 244, 241, 175, 255, 244, 242, 90},
     {175, 255, 244, 241, 175, 255, 244, 242, 90}},
    {"\xF0\xB1\x8D\x90\xF0\xB1\x8D\x91",
     {175, 112, 238, 241, 175, 112, 238, 242},
     {175, 112, 238, 241, 175, 112, 238, 242}},
    {"\xC2\xBD\xE2\x91\xA0\xE2\x91\xA1\xD9\xA3\xD9\xA4",
     {23951, 104894, 127056, 152, 100},
     {23951, 104894, 127056, 152, 100}},
    {"\xEA\xAC\xB0\xF0\x91\xBC\x80", {169, 108, 111, 175, 242, 123, 225}, {169, 108, 111, 175, 242, 123, 225}},
    {"a\xE2\x80\x8B"
     "b\xEF\xBB\xBF"
     "c",
     {67, 35020, 68, 15251, 69},
     {67, 35020, 68, 15251, 69}},
    {"e\xCC\x81\xCC\x82 x", {71, 17793, 75274, 1527}, {71, 17793, 75274, 1527}},
    {"<\xEF\xBD\x9CUser\xEF\xBD\x9C>\xC2\x85<\xEF\xBD\x9C"
     "Assistant\xEF\xBD\x9C>",
     {128803, 129, 230, 128804},
     {30, 28217, 6756, 28217, 32, 129, 230, 30, 28217, 88031, 28217, 32}},
    {"<think>\xE2\x80\xA8</think>",
     {30, 37947, 32, 300, 104, 1718, 37947, 32},
     {30, 37947, 32, 300, 104, 1718, 37947, 32}},
    {"\xE1\xB2\x89\xF0\x96\xB5\x80 z",
     {160, 113, 234, 175, 247, 116, 225, 961},
     {160, 113, 234, 175, 247, 116, 225, 961}},
    {"a\xC2\x85\x0A"
     "b",
     {67, 129, 230, 201, 68},
     {67, 129, 230, 201, 68}},
    {"  \xC2\x85\x0A", {262, 129, 230, 201}, {262, 129, 230, 201}},
    {"\x0B\x0A\x0B", {202, 201, 202}, {202, 201, 202}},
    {"\xE3\x80\x80\xE3\x80\x80\x0A", {36759, 201}, {36759, 201}},
};

TEST_F(DeepSeekTokenizerTest, EdgeCasesOutsideCorpusMatchReference) {
  for (size_t i = 0; i < std::size(kEdgeCases); ++i) {
    const EdgeCase& edge = kEdgeCases[i];
    const std::vector<TokenId> trusted = tokenizer().encode(edge.text, TextTrust::kTrusted);
    EXPECT_EQ(trusted, edge.ids) << describe_id_mismatch(i, edge.text, edge.ids, trusted);
    const std::vector<TokenId> untrusted = tokenizer().encode(edge.text, TextTrust::kUntrusted);
    EXPECT_EQ(untrusted, edge.ids_untrusted) << describe_id_mismatch(i, edge.text, edge.ids_untrusted, untrusted);
  }
}

TEST_F(DeepSeekTokenizerTest, LooksUpAddedAndSpecialTokens) {
  const std::string user = "<｜User｜>";
  EXPECT_EQ(tokenizer().added_token_id(user), 128803);
  EXPECT_EQ(tokenizer().piece_to_id(user), 128803);
  EXPECT_EQ(tokenizer().id_to_piece(128803), user);
  EXPECT_TRUE(tokenizer().is_added_token(128803));
  EXPECT_FALSE(tokenizer().is_special_token(128803));  // <｜User｜> is added but not flagged special

  EXPECT_EQ(tokenizer().added_token_id("<｜end▁of▁sentence｜>"), 1);
  EXPECT_TRUE(tokenizer().is_special_token(1));
  EXPECT_EQ(tokenizer().token_bytes(1), "<｜end▁of▁sentence｜>");

  EXPECT_EQ(tokenizer().piece_to_id("Ġt"), 259);  // the first merge, "Ġ t"
  EXPECT_EQ(tokenizer().added_token_id("Ġt"), std::nullopt);
  EXPECT_EQ(tokenizer().id_to_piece(223), "Ġ");
  EXPECT_EQ(tokenizer().token_bytes(223), " ");
  EXPECT_FALSE(tokenizer().is_added_token(223));

  // Ids past the vocabulary or in its unused gaps are unknown, never an error.
  EXPECT_EQ(tokenizer().id_to_piece(129000), std::nullopt);
  EXPECT_EQ(tokenizer().id_to_piece(-1), std::nullopt);
  EXPECT_EQ(tokenizer().token_bytes(129000), "");
  EXPECT_EQ(tokenizer().decode(std::vector<TokenId>{129000, -5, 223}), " ");
  EXPECT_EQ(tokenizer().piece_to_id("not a piece"), std::nullopt);
}

TEST_F(DeepSeekTokenizerTest, InvalidUtf8IsEncodedAsItsBytes) {
  const std::string text = "ok \xFF\xFE tail \xE4\xBD";  // stray bytes and a truncated character
  const std::vector<TokenId> ids = tokenizer().encode(text, TextTrust::kTrusted);
  std::string bytes;
  for (const TokenId id : ids) bytes += tokenizer().token_bytes(id);
  EXPECT_EQ(bytes, text);
  EXPECT_EQ(tokenizer().decode(ids), "ok \xEF\xBF\xBD\xEF\xBF\xBD tail \xEF\xBF\xBD");
}

TEST_F(DeepSeekTokenizerTest, ConcurrentEncodesAgree) {
  constexpr int kThreads = 4;
  std::atomic<size_t> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<TokenId> ids;
      for (size_t i = static_cast<size_t>(t); i < cases().size() + static_cast<size_t>(t); ++i) {
        const CorpusCase& c = cases()[i % cases().size()];
        ids.clear();
        tokenizer().encode(c.text, TextTrust::kTrusted, ids);
        if (ids != c.ids) ++mismatches;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0u);
}

// ---------------------------------------------------------------------------------------------------------
// Small tokenizers written by the tests

// A directory of its own under the system temp directory, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("deepinfer-tokenizer-test-" + std::string(test->name()) + "-" +
             std::to_string(std::hash<std::thread::id>()(std::this_thread::get_id())));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  std::string write(const std::string& name, std::string_view contents) const {
    const std::filesystem::path file = path_ / name;
    std::ofstream(file, std::ios::binary) << contents;
    return file.string();
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// GPT-2's byte-level alphabet (bytes_to_unicode), written out independently of the tokenizer's copy.
std::vector<std::string> byte_alphabet() {
  std::vector<std::string> alphabet(256);
  int next_extra = 0x100;
  for (int byte = 0; byte < 256; ++byte) {
    const bool printable = (byte >= 0x21 && byte <= 0x7E) || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
    const int code_point = printable ? byte : next_extra++;
    std::string& utf8 = alphabet[byte];
    if (code_point < 0x80) {
      utf8 += static_cast<char>(code_point);
    } else {
      utf8 += static_cast<char>(0xC0 | (code_point >> 6));
      utf8 += static_cast<char>(0x80 | (code_point & 0x3F));
    }
  }
  return alphabet;
}

using Merge = std::pair<std::string, std::string>;

// A byte-level BPE tokenizer.json: the 256 byte characters are ids 0..255, each merge's result the next id.
// `pair_merges` writes merges as ["a", "b"] instead of the legacy "a b".
std::string small_tokenizer_json(json::value pre_tokenizer, const std::vector<Merge>& merges, bool pair_merges = false,
                                 json::array added_tokens = {}) {
  json::object vocab;
  int64_t next_id = 0;
  for (const std::string& piece : byte_alphabet()) vocab[piece] = next_id++;
  json::array merge_list;
  for (const auto& [left, right] : merges) {
    if (!vocab.contains(left + right)) vocab[left + right] = next_id++;
    merge_list.push_back(pair_merges ? json::value(json::array{json::string(left), json::string(right)})
                                     : json::value(json::string(left + " " + right)));
  }
  json::object model{{"type", "BPE"},
                     {"dropout", nullptr},
                     {"unk_token", nullptr},
                     {"vocab", std::move(vocab)},
                     {"merges", std::move(merge_list)}};
  json::object root{{"version", "1.0"},
                    {"added_tokens", std::move(added_tokens)},
                    {"normalizer", nullptr},
                    {"pre_tokenizer", std::move(pre_tokenizer)},
                    {"post_processor", nullptr},
                    {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}}},
                    {"model", std::move(model)}};
  return json::serialize(root);
}

std::shared_ptr<const Tokenizer> load_or_fail(const std::string& path) {
  auto tokenizer = Tokenizer::load(path);
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status().to_string();
  return tokenizer.ok() ? *tokenizer : nullptr;
}

std::vector<std::string> pieces_of(const Tokenizer& tokenizer, const std::vector<TokenId>& ids) {
  std::vector<std::string> pieces;
  for (const TokenId id : ids) pieces.emplace_back(tokenizer.id_to_piece(id).value_or("<unknown>"));
  return pieces;
}

// GPT-2's setup: ByteLevel alone, adding a prefix space and splitting with GPT-2's own regex.
TEST(SmallTokenizerTest, Gpt2StyleByteLevelWithRegex) {
  TempDir dir;
  const std::vector<Merge> merges = {{"h", "e"},     {"l", "l"},     {"he", "ll"}, {"hell", "o"},
                                     {"Ġ", "hello"}, {"Ġ", "w"},     {"o", "r"},   {"Ġw", "or"},
                                     {"Ġwor", "l"},  {"Ġworl", "d"}, {"t", "'"}};
  const json::array added{json::object{{"id", 300}, {"content", "<eos>"}, {"special", true}, {"normalized", false}}};
  const json::value pre_tokenizer = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  auto tokenizer = load_or_fail(dir.write("tokenizer.json", small_tokenizer_json(pre_tokenizer, merges, false, added)));
  ASSERT_NE(tokenizer, nullptr);

  struct Case {
    std::string text;
    std::vector<std::string> pieces;
    std::string decoded;
  };
  const Case cases[] = {
      {"hello world", {"Ġhello", "Ġworld"}, " hello world"},
      // Each stretch between added tokens gets its own prefix space.
      {"hello<eos>world", {"Ġhello", "<eos>", "Ġworld"}, " hello<eos> world"},
      // The regex isolates "'s", so the merge "t '" cannot apply.
      {"it's", {"Ġ", "i", "t", "'", "s"}, " it's"},
      {"", {}, ""},
  };
  for (const Case& c : cases) {
    const std::vector<TokenId> ids = tokenizer->encode(c.text, TextTrust::kTrusted);
    EXPECT_EQ(pieces_of(*tokenizer, ids), c.pieces) << escaped(c.text);
    EXPECT_EQ(tokenizer->decode(ids), c.decoded) << escaped(c.text);
  }
  EXPECT_EQ(pieces_of(*tokenizer, tokenizer->encode("hello<eos>", TextTrust::kUntrusted)),
            (std::vector<std::string>{"Ġhello", "<", "e", "o", "s", ">"}));
  EXPECT_TRUE(tokenizer->is_special_token(300));
  EXPECT_EQ(tokenizer->vocab_size(), 301u);
}

// Split's behaviors, on "-" between the letters; merges that would cross a split show where it fell.
TEST(SmallTokenizerTest, SplitBehaviors) {
  struct Case {
    std::string behavior;
    bool invert;
    std::string text;
    std::vector<std::string> pieces;
  };
  const Case cases[] = {
      {"Isolated", false, "a-b", {"a", "-", "b"}},
      {"Isolated", false, "a--b", {"a", "-", "-", "b"}},
      {"Removed", false, "a-b", {"a", "b"}},
      {"Removed", true, "a-b", {"-"}},
      {"MergedWithPrevious", false, "a-b", {"a-", "b"}},
      {"MergedWithNext", false, "a-b", {"a", "-b"}},
      {"Contiguous", false, "a--b", {"a", "--", "b"}},
  };
  const std::vector<Merge> merges = {{"a", "-"}, {"-", "b"}, {"-", "-"}, {"a", "b"}};
  for (const Case& c : cases) {
    TempDir dir;
    const json::value pre_tokenizer = {
        {"type", "Sequence"},
        {"pretokenizers",
         json::array{
             json::object{
                 {"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", c.behavior}, {"invert", c.invert}},
             json::object{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
    auto tokenizer = load_or_fail(dir.write("tokenizer.json", small_tokenizer_json(pre_tokenizer, merges, true)));
    ASSERT_NE(tokenizer, nullptr) << c.behavior;
    EXPECT_EQ(pieces_of(*tokenizer, tokenizer->encode(c.text, TextTrust::kUntrusted)), c.pieces)
        << c.behavior << (c.invert ? " inverted" : "") << " on " << escaped(c.text);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Load errors: each names the file, and the field where there is one.

TEST(TokenizerLoadTest, MissingFileIsNotFound) {
  const std::string path = "/nonexistent/deepinfer/tokenizer.json";
  auto tokenizer = Tokenizer::load(path);
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_EQ(tokenizer.status().code(), StatusCode::kNotFound);
  EXPECT_NE(tokenizer.status().message().find(path), std::string::npos) << tokenizer.status().to_string();
}

TEST(TokenizerLoadTest, DirectoryLoadsItsTokenizerJson) {
  TempDir dir;
  const json::value pre_tokenizer = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  dir.write("tokenizer.json", small_tokenizer_json(pre_tokenizer, {{"h", "i"}}));
  auto tokenizer = Tokenizer::load(dir.path());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().to_string();
  EXPECT_EQ(pieces_of(**tokenizer, (*tokenizer)->encode("hi", TextTrust::kTrusted)), std::vector<std::string>{"hi"});
}

TEST(TokenizerLoadTest, BadFilesNameFileAndField) {
  const json::value byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  const std::string valid = small_tokenizer_json(byte_level, {{"h", "i"}});
  const auto replace = [&](std::string_view from, std::string_view to) {
    std::string text = valid;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return at == std::string::npos ? text : text.replace(at, from.size(), to);
  };
  struct Case {
    std::string name;
    std::string contents;
    StatusCode code;
    std::string field;  // must appear in the message
  };
  const Case cases[] = {
      {"malformed JSON", "{\"model\": {", StatusCode::kCorruption, "JSON"},
      {"not an object", "[1, 2]", StatusCode::kCorruption, "object"},
      {"WordPiece model", replace("\"type\":\"BPE\"", "\"type\":\"WordPiece\""), StatusCode::kUnsupported,
       "model.type"},
      {"NFC normalizer", replace("\"normalizer\":null", "\"normalizer\":{\"type\":\"NFC\"}"), StatusCode::kUnsupported,
       "normalizer"},
      {"Whitespace pre-tokenizer",
       replace("\"type\":\"ByteLevel\",\"add_prefix_space\":false", "\"type\":\"Whitespace\",\"x\":false"),
       StatusCode::kUnsupported, "pre_tokenizer"},
      {"merge outside vocabulary", replace("\"h i\"", "\"h zz\""), StatusCode::kCorruption, "model.merges[0]"},
      {"bad regex",
       replace("\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true",
               "\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(\"},"
               "\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"ByteLevel\",\"use_regex\":false}]"),
       StatusCode::kInvalidArgument, "pre_tokenizer.pretokenizers[0].pattern"},
  };
  for (const Case& c : cases) {
    TempDir dir;
    const std::string path = dir.write("tokenizer.json", c.contents);
    auto tokenizer = Tokenizer::load(path);
    ASSERT_FALSE(tokenizer.ok()) << c.name;
    EXPECT_EQ(tokenizer.status().code(), c.code) << c.name << ": " << tokenizer.status().to_string();
    EXPECT_NE(tokenizer.status().message().find(path), std::string::npos)
        << c.name << ": " << tokenizer.status().to_string();
    EXPECT_NE(tokenizer.status().message().find(c.field), std::string::npos)
        << c.name << ": " << tokenizer.status().to_string();
  }
}

}  // namespace
}  // namespace deepinfer::recipe
