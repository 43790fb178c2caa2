// tokenizer.h — GPT-2's byte-level BPE: text ↔ token ids, offline, from a rank file.
//
// The vocabulary comes from a file in tiktoken's format: one line per token, "<base64 of the
// token's bytes> <rank>", ranks 0 … n−1 each exactly once and every single byte among them (a
// byte-level BPE can then encode any input). The token id is the rank; the end-of-text token,
// which such files leave out, gets id n (GPT-2: 50256, vocab_size 50257). GPT-2's own file ships
// in the openai-whisper package as whisper/assets/gpt2.tiktoken; scripts/prepare_data.py copies
// it next to the shards as tokenizer.tiktoken, or writes a locally trained one in the same format.
//
// Encoding is GPT-2's two steps:
//  1. pre-tokenization splits the text into pieces with GPT-2's pattern
//       's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//     implemented by hand on UTF-8 (split_gpt2_pieces);
//  2. each piece is merged byte pair by byte pair, always the adjacent pair whose concatenation
//     has the lowest rank, until no adjacent pair is a token (equivalent to GPT-2's merge list).
//
// Unicode classes are approximated (classify_code_point): ASCII exactly; Latin-1, the Unicode
// White_Space set, combining diacritics (U+0300–036F), general punctuation, currency, arrows,
// mathematical operators, box drawing, shapes, dingbats, CJK and fullwidth punctuation, emoji,
// and the common digit blocks (Arabic-Indic, Devanagari, super/subscripts, number forms,
// circled numbers, fullwidth digits) by explicit ranges; every other code point counts as a
// letter. Text in any alphabet tokenizes exactly; a symbol or number outside the listed blocks
// joins a neighbouring word where GPT-2 would have split it (tests/train/test_cpu_data_tokenizer
// lists examples). Bytes that are not valid UTF-8 are each a piece of class "other".
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "flare/status.h"

namespace flare::train {

// The Unicode categories GPT-2's pattern distinguishes.
enum class CharClass { kLetter, kNumber, kSpace, kOther };
CharClass classify_code_point(uint32_t code_point);

// Step 1 of encoding: the pieces of `text`, in order; concatenated they are `text`.
std::vector<std::string_view> split_gpt2_pieces(std::string_view text);

class Tokenizer {
 public:
  // Reads a tiktoken-format rank file (see above); errors name the file, line and rule.
  static Status load(const std::string& path, Tokenizer* tokenizer);
  // The same from text already in memory; `source` names it in errors.
  static Status parse(std::string_view contents, const std::string& source, Tokenizer* tokenizer);

  // Any bytes encode (the end-of-text token is never produced: "<|endoftext|>" in the text is
  // ordinary text, as with tiktoken's encode_ordinary).
  std::vector<int32_t> encode(std::string_view text) const;
  // The bytes of the tokens, concatenated (they need not be valid UTF-8 when a multi-byte
  // character is split across the end); the end-of-text token decodes as "<|endoftext|>".
  Status decode(std::span<const int32_t> tokens, std::string* text) const;

  int64_t vocab_size() const { return int64_t(token_bytes_.size()) + 1; }  // ranks + end-of-text
  int32_t eot_token() const { return int32_t(token_bytes_.size()); }

 private:
  // string → rank, looked up with string_views of the text without copying.
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  void encode_piece(std::string_view piece, std::vector<int32_t>* tokens) const;
  int32_t rank_of(std::string_view bytes) const;

  std::unordered_map<std::string, int32_t, Hash, std::equal_to<>> ranks_;
  std::vector<std::string> token_bytes_;  // rank → bytes
};

}  // namespace flare::train
