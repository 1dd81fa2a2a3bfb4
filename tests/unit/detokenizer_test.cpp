// Detokenizer tests: append_utf8_lossy's maximal-subpart repair on hand-made bytes, IncrementalDetokenizer
// holding back split characters, and streaming that equals Tokenizer::decode (and the reference's decode)
// for every corpus string in tests/data/tokenizer.
#include "deepinfer/recipe/detokenizer.h"

#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace deepinfer::recipe {
namespace {

namespace json = boost::json;

constexpr const char* kTokenizerPath = DEEPINFER_SOURCE_DIR "/models/deepseek-v3/tokenizer.json";
constexpr const char* kReferencePath = DEEPINFER_SOURCE_DIR "/tests/data/tokenizer/reference-ids.json";

// U+FFFD, as a literal that concatenates with others.
#define U_FFFD "\xEF\xBF\xBD"

// RFC 3629 validity, written independently of the code under test.
bool is_valid_utf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const auto lead = static_cast<unsigned char>(text[i]);
    size_t length = 0;
    uint32_t code_point = 0;
    if (lead < 0x80) {
      length = 1;
      code_point = lead;
    } else if ((lead & 0xE0) == 0xC0) {
      length = 2;
      code_point = lead & 0x1F;
    } else if ((lead & 0xF0) == 0xE0) {
      length = 3;
      code_point = lead & 0x0F;
    } else if ((lead & 0xF8) == 0xF0) {
      length = 4;
      code_point = lead & 0x07;
    } else {
      return false;
    }
    if (i + length > text.size()) return false;
    for (size_t k = 1; k < length; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      if ((next & 0xC0) != 0x80) return false;
      code_point = (code_point << 6) | (next & 0x3F);
    }
    constexpr uint32_t kSmallest[] = {0, 0, 0x80, 0x800, 0x10000};
    if (code_point < kSmallest[length] || code_point > 0x10FFFF || (code_point >= 0xD800 && code_point <= 0xDFFF)) {
      return false;
    }
    i += length;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------------------
// append_utf8_lossy

TEST(AppendUtf8LossyTest, ReplacesEachMaximalInvalidSubpart) {
  struct Case {
    std::string name;
    std::string bytes;
    bool keep_incomplete_tail;
    std::string text;
    size_t held;
  };
  const Case cases[] = {
      {"ascii", "abc", false, "abc", 0},
      {"valid multibyte", "\xC3\xA9\xE4\xBD\xA0\xF0\x9F\x98\x80", false, "\xC3\xA9\xE4\xBD\xA0\xF0\x9F\x98\x80", 0},
      {"lone continuation byte", "\x80", false, U_FFFD, 0},
      {"bytes that never start a character", "\xC0\xC1\xF5\xFF", false, U_FFFD U_FFFD U_FFFD U_FFFD, 0},
      {"overlong three-byte form", "\xE0\x80\x80", false, U_FFFD U_FFFD U_FFFD, 0},
      {"surrogate", "\xED\xA0\x80", false, U_FFFD U_FFFD U_FFFD, 0},
      {"above U+10FFFF", "\xF4\x90\x80\x80", false, U_FFFD U_FFFD U_FFFD U_FFFD, 0},
      {"truncated three-byte, then ASCII",
       "\xE2\x82"
       "A",
       false, U_FFFD "A", 0},
      {"truncated four-byte, then ASCII",
       "\xF0\x9F\x98"
       "A",
       false, U_FFFD "A", 0},
      {"example of Rust's from_utf8_lossy", "Hello \xF0\x90\x80World", false, "Hello " U_FFFD "World", 0},
      {"truncated at the end, repaired", "a\xE2\x82", false, "a" U_FFFD, 0},
      {"truncated at the end, held", "a\xE2\x82", true, "a", 2},
      {"three of four bytes, held", "\xF0\x9F\x98", true, "", 3},
      {"never-valid byte at the end, not held", "a\xFF", true, "a" U_FFFD, 0},
      {"bad second byte at the end, not held", "\xE0\x80", true, U_FFFD U_FFFD, 0},
      {"empty", "", true, "", 0},
  };
  for (const Case& c : cases) {
    const std::string prefix = "prefix:";
    std::string out = prefix;  // appends, never overwrites
    const size_t held = append_utf8_lossy(c.bytes, out, c.keep_incomplete_tail);
    EXPECT_TRUE(out.starts_with(prefix)) << c.name;
    EXPECT_EQ(out.substr(prefix.size()), c.text) << c.name;
    EXPECT_EQ(held, c.held) << c.name;
  }
}

// ---------------------------------------------------------------------------------------------------------
// IncrementalDetokenizer on DeepSeek-V3's tokenizer

class IncrementalDetokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(std::filesystem::exists(kTokenizerPath))
        << kTokenizerPath << " is missing: run scripts/setup.sh to fetch it";
    ASSERT_NE(tokenizer(), nullptr) << "cannot load " << kTokenizerPath;
  }

  static std::shared_ptr<const Tokenizer> tokenizer() {
    static const std::shared_ptr<const Tokenizer> kTokenizer = [] {
      auto loaded = Tokenizer::load(kTokenizerPath);
      return loaded.ok() ? *loaded : nullptr;
    }();
    return kTokenizer;
  }

  // The token whose bytes are exactly `byte` (every byte has one in byte-level BPE).
  static TokenId byte_token(unsigned char byte) {
    for (TokenId id = 0; static_cast<size_t>(id) < tokenizer()->vocab_size(); ++id) {
      const std::string bytes = tokenizer()->token_bytes(id);
      if (bytes.size() == 1 && static_cast<unsigned char>(bytes[0]) == byte) return id;
    }
    ADD_FAILURE() << "no token for byte " << static_cast<int>(byte);
    return 0;
  }

  // One push per step; what it must return and how many bytes it must then hold back.
  struct Step {
    TokenId id;
    std::string output;
    size_t pending;
  };
  static void run_steps(const std::string& name, const std::vector<Step>& steps, const std::string& flushed) {
    IncrementalDetokenizer detokenizer(tokenizer());
    for (size_t i = 0; i < steps.size(); ++i) {
      EXPECT_EQ(detokenizer.push(steps[i].id), steps[i].output) << name << ", step " << i;
      EXPECT_EQ(detokenizer.pending_bytes(), steps[i].pending) << name << ", step " << i;
    }
    EXPECT_EQ(detokenizer.flush(), flushed) << name << ", flush";
    EXPECT_EQ(detokenizer.pending_bytes(), 0u) << name << ", after flush";
  }
};

TEST_F(IncrementalDetokenizerTest, CharacterSplitAcrossTokensWaitsUntilComplete) {
  // U+1F600 as four one-byte tokens.
  run_steps("emoji byte by byte",
            {{byte_token(0xF0), "", 1},
             {byte_token(0x9F), "", 2},
             {byte_token(0x98), "", 3},
             {byte_token(0x80), "\xF0\x9F\x98\x80", 0}},
            "");
  // Text before the split character goes out at once.
  run_steps("ASCII then a split CJK character",
            {{byte_token('a'), "a", 0},
             {byte_token(0xE4), "", 1},
             {byte_token(0xBD), "", 2},
             {byte_token(0xA0), "\xE4\xBD\xA0", 0}},
            "");
}

TEST_F(IncrementalDetokenizerTest, InvalidBytesAreReplacedAtOnce) {
  run_steps("never-valid byte", {{byte_token(0xFF), U_FFFD, 0}}, "");
  run_steps("truncated by ASCII",
            {{byte_token(0xE2), "", 1}, {byte_token(0x82), "", 2}, {byte_token('A'), U_FFFD "A", 0}}, "");
  run_steps("bad second byte", {{byte_token(0xE0), "", 1}, {byte_token(0x80), U_FFFD U_FFFD, 0}}, "");
}

TEST_F(IncrementalDetokenizerTest, FlushReplacesIncompleteTail) {
  run_steps("two of three bytes", {{byte_token(0xE4), "", 1}, {byte_token(0xBD), "", 2}}, U_FFFD);
  run_steps("nothing pending", {{byte_token('x'), "x", 0}}, "");
}

TEST_F(IncrementalDetokenizerTest, AddedTokensAndUnknownIds) {
  const TokenId user = tokenizer()->added_token_id("<｜User｜>").value_or(-1);
  run_steps("added token", {{user, "<｜User｜>", 0}}, "");
  // Unknown ids add nothing, as decode skips them; a pending partial character stays pending.
  run_steps("unknown id", {{byte_token(0xE4), "", 1}, {129000, "", 1}, {-1, "", 1}}, U_FFFD);
}

TEST_F(IncrementalDetokenizerTest, StreamingEqualsDecodeOnCorpus) {
  std::ifstream in(kReferencePath, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  json::error_code error;
  const json::value reference = json::parse(contents.str(), error);
  ASSERT_FALSE(error) << "cannot parse " << kReferencePath << ": " << error.message();
  const json::array& all_ids = reference.at("ids").as_array();
  const json::array& decoded = reference.at("decoded").as_array();
  ASSERT_EQ(all_ids.size(), 1516u);

  size_t mismatches = 0;
  for (size_t i = 0; i < all_ids.size(); ++i) {
    std::vector<TokenId> ids;
    for (const json::value& id : all_ids[i].as_array()) ids.push_back(static_cast<TokenId>(id.as_int64()));
    IncrementalDetokenizer detokenizer(tokenizer());
    std::string streamed;
    for (size_t k = 0; k < ids.size(); ++k) {
      const std::string delta = detokenizer.push(ids[k]);
      ASSERT_TRUE(is_valid_utf8(delta)) << "corpus[" << i << "], token " << k << ": a push emitted a partial character";
      ASSERT_LE(detokenizer.pending_bytes(), 3u) << "corpus[" << i << "], token " << k;
      streamed += delta;
    }
    streamed += detokenizer.flush();
    const std::string whole = tokenizer()->decode(ids);
    if (streamed == whole && whole == decoded[i].as_string()) continue;
    if (++mismatches <= 10) {
      ADD_FAILURE() << "corpus[" << i << "]: streamed " << streamed.size() << " bytes, decode " << whole.size()
                    << " bytes, reference " << decoded[i].as_string().size() << " bytes";
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

}  // namespace
}  // namespace deepinfer::recipe
