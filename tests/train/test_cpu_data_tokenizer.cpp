// The byte-level BPE tokenizer: GPT-2's pre-tokenization (expected pieces produced by GPT-2's
// regular expression with Unicode categories), the lowest-rank-first merge order, lossless round
// trips of any bytes, and errors in rank files and token ids.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "test_cpu_data_util.h"
#include "train/data/tokenizer.h"

namespace flare::train {
namespace {

using Pieces = std::vector<std::string>;

Pieces pieces_of(std::string_view text) {
  Pieces pieces;
  for (std::string_view piece : split_gpt2_pieces(text)) pieces.emplace_back(piece);
  return pieces;
}

// Each expected split is what GPT-2's pattern (the `regex` module, \p{L} and \p{N} from Unicode)
// gives for the text.
TEST(SplitGpt2Pieces, MatchesGpt2Pattern) {
  const std::vector<std::pair<std::string, Pieces>> cases = {
      {"Hello world", {"Hello", " world"}},
      {"I'm here, aren't you? We'll see.",
       {"I", "'m", " here", ",", " aren", "'t", " you", "?", " We", "'ll", " see", "."}},
      {"It's 2024 and x=3.5!", {"It", "'s", " 2024", " and", " x", "=", "3", ".", "5", "!"}},
      {"don't  stop\n\n  now ", {"don", "'t", " ", " stop", "\n\n ", " now", " "}},
      {"a  b   c\t\td\n", {"a", " ", " b", "  ", " c", "\t", "\t", "d", "\n"}},
      {"''s 'S 'rex", {"''", "s", " '", "S", " '", "rex"}},
      {"tab\tthen\n\nnewlines \n", {"tab", "\t", "then", "\n", "\n", "newlines", " \n"}},
      {"  leading", {" ", " leading"}},
      {"trailing   ", {"trailing", "   "}},
      {"café — “quoted” ½ naïve", {"café", " —", " “", "quoted", "”", " ½", " naïve"}},
      {"x\u00a0y", {"x", "\u00a0", "y"}},
      {"😀😀 ok", {"😀😀", " ok"}},
      {"日本語のテキスト。", {"日本語のテキスト", "。"}},
      {"", {}},
      {"'", {"'"}},
      {"'l", {"'", "l"}},
  };
  for (const auto& [text, expected] : cases) EXPECT_EQ(pieces_of(text), expected) << text;
}

// Where the approximation of Unicode categories (tokenizer.h) parts from GPT-2: symbols and
// digits outside the listed blocks count as letters. GPT-2 splits each of these in three or two.
TEST(SplitGpt2Pieces, DocumentedApproximations) {
  EXPECT_EQ(pieces_of("a\u2116b"), Pieces({"a\u2116b"}));    // № (So): GPT-2 "a", "№", "b"
  EXPECT_EQ(pieces_of("x\u0e3fy"), Pieces({"x\u0e3fy"}));    // ฿ (Sc): GPT-2 "x", "฿", "y"
  EXPECT_EQ(pieces_of("7\u09e9"), Pieces({"7", "\u09e9"}));  // ৩ (Nd): GPT-2 "7৩"
}

TEST(SplitGpt2Pieces, InvalidUtf8BytesArePiecesOfTheirOwnClass) {
  const std::string text = std::string("ab") + char(0xFF) + char(0xC3) + "cd " + char(0x80);
  EXPECT_EQ(pieces_of(text), Pieces({"ab", std::string() + char(0xFF) + char(0xC3), "cd",
                                     std::string(" ") + char(0x80)}));
  std::string concatenated;
  for (const auto& piece : pieces_of(text)) concatenated += piece;
  EXPECT_EQ(concatenated, text);
}

TEST(ClassifyCodePoint, Classes) {
  EXPECT_EQ(classify_code_point('a'), CharClass::kLetter);
  EXPECT_EQ(classify_code_point('7'), CharClass::kNumber);
  EXPECT_EQ(classify_code_point('\n'), CharClass::kSpace);
  EXPECT_EQ(classify_code_point('_'), CharClass::kOther);
  EXPECT_EQ(classify_code_point(0x00E9), CharClass::kLetter);  // é
  EXPECT_EQ(classify_code_point(0x00BD), CharClass::kNumber);  // ½
  EXPECT_EQ(classify_code_point(0x00D7), CharClass::kOther);   // ×
  EXPECT_EQ(classify_code_point(0x2014), CharClass::kOther);   // —
  EXPECT_EQ(classify_code_point(0x3000), CharClass::kSpace);   // ideographic space
  EXPECT_EQ(classify_code_point(0x0416), CharClass::kLetter);  // Ж
  EXPECT_EQ(classify_code_point(0x0661), CharClass::kNumber);  // Arabic-Indic one
  EXPECT_EQ(classify_code_point(0x1F600), CharClass::kOther);  // 😀
}

std::string base64(const std::string& bytes) {
  static const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t chunk = uint32_t(uint8_t(bytes[i])) << 16;
    if (i + 1 < bytes.size()) chunk |= uint32_t(uint8_t(bytes[i + 1])) << 8;
    if (i + 2 < bytes.size()) chunk |= uint32_t(uint8_t(bytes[i + 2]));
    out += alphabet[(chunk >> 18) & 63];
    out += alphabet[(chunk >> 12) & 63];
    out += i + 1 < bytes.size() ? alphabet[(chunk >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? alphabet[chunk & 63] : '=';
  }
  return out;
}

// A rank file: the 256 bytes at ranks 0–255 (in byte order), then `merged` at 256, 257, …
std::string rank_file(const std::vector<std::string>& merged) {
  std::string file;
  for (int byte = 0; byte < 256; ++byte)
    file += base64(std::string(1, char(byte))) + " " + std::to_string(byte) + "\n";
  for (size_t i = 0; i < merged.size(); ++i)
    file += base64(merged[i]) + " " + std::to_string(256 + i) + "\n";
  return file;
}

Tokenizer parse_or_fail(const std::string& contents) {
  Tokenizer tokenizer;
  Status status = Tokenizer::parse(contents, "test.tiktoken", &tokenizer);
  EXPECT_TRUE(status.ok()) << status.to_string();
  return tokenizer;
}

TEST(Tokenizer, MergesLowestRankFirst) {
  // " the": the pairs " t" (258), "th" (257), "he" (256). Lowest first: "he", then " t"; " the"
  // is no token, so [" t", "he"]. Merging left to right would have given [" th", "e"].
  const Tokenizer tokenizer = parse_or_fail(rank_file({"he", "th", " t", " th"}));
  EXPECT_EQ(tokenizer.vocab_size(), 261);
  EXPECT_EQ(tokenizer.eot_token(), 260);
  EXPECT_EQ(tokenizer.encode(" the"), std::vector<int32_t>({258, 256}));
  EXPECT_EQ(tokenizer.encode("the the"), std::vector<int32_t>({'t', 256, 258, 256}));
  EXPECT_EQ(tokenizer.encode(" th"), std::vector<int32_t>({259}));  // a whole piece is one token
  EXPECT_EQ(tokenizer.encode(""), std::vector<int32_t>());
}

TEST(Tokenizer, AnyBytesRoundTrip) {
  const Tokenizer tokenizer = parse_or_fail(rank_file({"he", "th", " t", " th", "  ", "\n\n"}));
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 50; ++trial) {
    std::string text(size_t(rng() % 200), '\0');
    for (char& c : text) c = (trial % 2) ? char(rng() % 256) : " the\n\t'sx1é"[rng() % 12];
    const std::vector<int32_t> tokens = tokenizer.encode(text);
    std::string decoded;
    ASSERT_TRUE(tokenizer.decode(tokens, &decoded).ok());
    ASSERT_EQ(decoded, text) << "trial " << trial;
  }
}

TEST(Tokenizer, DecodesEndOfTextAndRejectsUnknownIds) {
  const Tokenizer tokenizer = parse_or_fail(rank_file({"he"}));
  std::string text;
  ASSERT_TRUE(tokenizer.decode(std::vector<int32_t>{'h', 257, 256}, &text).ok());
  EXPECT_EQ(text, "h<|endoftext|>he");
  Status status = tokenizer.decode(std::vector<int32_t>{'a', 258}, &text);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("token 1 is 258, not in [0, vocab_size = 258)"),
            std::string::npos)
      << status.message();
  EXPECT_EQ(text, "h<|endoftext|>he") << "nothing written on error";
  EXPECT_FALSE(tokenizer.decode(std::vector<int32_t>{-1}, &text).ok());
}

void expect_parse_error(const std::string& contents, std::initializer_list<const char*> parts) {
  Tokenizer tokenizer;
  Status status = Tokenizer::parse(contents, "bad.tiktoken", &tokenizer);
  ASSERT_FALSE(status.ok()) << "accepted: " << contents.substr(0, 40);
  EXPECT_NE(status.message().find("bad.tiktoken"), std::string::npos) << status.message();
  for (const char* part : parts) {
    EXPECT_NE(status.message().find(part), std::string::npos)
        << "message '" << status.message() << "' lacks '" << part << "'";
  }
}

TEST(Tokenizer, RankFileErrors) {
  const std::string good = rank_file({"he"});
  expect_parse_error(good + "aGU=\n", {"line 258", "<base64 bytes> <rank>"});
  expect_parse_error(good + "a$U= 300\n", {"line 258", "'$'"});
  expect_parse_error(good + "aGU 300\n", {"line 258", "multiple of 4"});
  expect_parse_error(good + "aGVs 25x\n", {"line 258", "rank '25x'"});
  expect_parse_error(good + "aGVs 256\n", {"line 258", "rank 256 appears twice"});
  expect_parse_error(good + "aGU= 257\n", {"line 258", "same token bytes"});
  expect_parse_error(good + "aGVs 258\n", {"rank 257 is missing"});
  expect_parse_error(good + "aGVs 99999999\n", {"line 258", "exceeds"});
  const std::string all_bytes = rank_file({});
  const std::string without_byte_0 =
      base64("he") + " 0\n" + all_bytes.substr(all_bytes.find('\n') + 1);
  expect_parse_error(without_byte_0, {"byte 0 has no token"});
  Tokenizer tokenizer;
  Status status = Tokenizer::load("/no/such/file.tiktoken", &tokenizer);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("/no/such/file.tiktoken"), std::string::npos);
}

TEST(Tokenizer, AcceptsCrlfAndBlankLines) {
  std::string contents = rank_file({"he"});
  std::string crlf;
  for (char c : contents) crlf += c == '\n' ? std::string("\r\n") : std::string(1, c);
  const Tokenizer tokenizer = parse_or_fail(crlf + "\n\n");
  EXPECT_EQ(tokenizer.encode("he"), std::vector<int32_t>({256}));
}

}  // namespace
}  // namespace flare::train
