// tokenizer.cpp — GPT-2 byte-level BPE: the rank file, pre-tokenization on UTF-8, the merge loop.
#include "train/data/tokenizer.h"

#include <fstream>
#include <limits>
#include <sstream>

#include "core/message.h"

namespace flare::train {

namespace {

struct CodePointRange {
  uint32_t first, last;  // inclusive
  CharClass cls;
};

// The code points above ASCII that are not letters, by block (see tokenizer.h); sorted. Anything
// above U+007F outside these ranges is a letter.
constexpr CodePointRange kNonLetterRanges[] = {
    {0x0080, 0x0084, CharClass::kOther},   // C1 controls
    {0x0085, 0x0085, CharClass::kSpace},   // next line
    {0x0086, 0x009F, CharClass::kOther},   // C1 controls
    {0x00A0, 0x00A0, CharClass::kSpace},   // no-break space
    {0x00A1, 0x00A9, CharClass::kOther},   // ¡ ¢ £ ¤ ¥ ¦ § ¨ ©
    {0x00AB, 0x00B1, CharClass::kOther},   // « ¬ soft hyphen ® ¯ ° ±
    {0x00B2, 0x00B3, CharClass::kNumber},  // ² ³
    {0x00B4, 0x00B4, CharClass::kOther},   // ´
    {0x00B6, 0x00B8, CharClass::kOther},   // ¶ · ¸
    {0x00B9, 0x00B9, CharClass::kNumber},  // ¹
    {0x00BB, 0x00BB, CharClass::kOther},   // »
    {0x00BC, 0x00BE, CharClass::kNumber},  // ¼ ½ ¾
    {0x00BF, 0x00BF, CharClass::kOther},   // ¿
    {0x00D7, 0x00D7, CharClass::kOther},   // ×
    {0x00F7, 0x00F7, CharClass::kOther},   // ÷
    {0x02C2, 0x02C5, CharClass::kOther},   // modifier symbols
    {0x02D2, 0x02DF, CharClass::kOther},
    {0x02E5, 0x02EB, CharClass::kOther},
    {0x02ED, 0x02ED, CharClass::kOther},
    {0x02EF, 0x02FF, CharClass::kOther},
    {0x0300, 0x036F, CharClass::kOther},   // combining diacritical marks
    {0x0660, 0x0669, CharClass::kNumber},  // Arabic-Indic digits
    {0x06F0, 0x06F9, CharClass::kNumber},  // extended Arabic-Indic digits
    {0x0966, 0x096F, CharClass::kNumber},  // Devanagari digits
    {0x1680, 0x1680, CharClass::kSpace},   // Ogham space mark
    {0x2000, 0x200A, CharClass::kSpace},   // en quad … hair space
    {0x200B, 0x2027, CharClass::kOther},   // zero-width space, dashes, quotes, bullets, ellipsis
    {0x2028, 0x2029, CharClass::kSpace},   // line and paragraph separators
    {0x202A, 0x202E, CharClass::kOther},
    {0x202F, 0x202F, CharClass::kSpace},  // narrow no-break space
    {0x2030, 0x205E, CharClass::kOther},  // ‰ ′ ″ ‹ › ※ …
    {0x205F, 0x205F, CharClass::kSpace},  // medium mathematical space
    {0x2060, 0x206F, CharClass::kOther},
    {0x2070, 0x2070, CharClass::kNumber},  // ⁰
    {0x2074, 0x2079, CharClass::kNumber},  // ⁴ … ⁹
    {0x207A, 0x207E, CharClass::kOther},
    {0x2080, 0x2089, CharClass::kNumber},  // ₀ … ₉
    {0x208A, 0x208E, CharClass::kOther},
    {0x20A0, 0x20FF, CharClass::kOther},   // currency, combining marks for symbols
    {0x2150, 0x2182, CharClass::kNumber},  // vulgar fractions, Roman numerals
    {0x2185, 0x2189, CharClass::kNumber},
    {0x2190, 0x245F, CharClass::kOther},   // arrows, math operators, technical, control pictures
    {0x2460, 0x249B, CharClass::kNumber},  // circled and parenthesised numbers
    {0x249C, 0x24E9, CharClass::kOther},   // parenthesised and circled letters (So)
    {0x24EA, 0x24FF, CharClass::kNumber},
    {0x2500, 0x2775, CharClass::kOther},   // box drawing, blocks, shapes, symbols, dingbats
    {0x2776, 0x2793, CharClass::kNumber},  // dingbat circled digits
    {0x2794, 0x2BFF, CharClass::kOther},   // dingbats, arrows, math, misc symbols
    {0x2E00, 0x2E7F, CharClass::kOther},   // supplemental punctuation
    {0x3000, 0x3000, CharClass::kSpace},   // ideographic space
    {0x3001, 0x3004, CharClass::kOther},   // CJK punctuation
    {0x3008, 0x3020, CharClass::kOther},
    {0xFE30, 0xFE4F, CharClass::kOther},   // CJK compatibility forms
    {0xFF01, 0xFF0F, CharClass::kOther},   // fullwidth punctuation
    {0xFF10, 0xFF19, CharClass::kNumber},  // fullwidth digits
    {0xFF1A, 0xFF20, CharClass::kOther},
    {0xFF3B, 0xFF40, CharClass::kOther},
    {0xFF5B, 0xFF65, CharClass::kOther},
    {0x1F000, 0x1FAFF, CharClass::kOther},  // mahjong, cards, emoji, pictographs
};

// One decoded code point: its value, its length in bytes, and whether the bytes were valid.
struct Decoded {
  uint32_t code_point;
  size_t length;
  bool valid;
};

Decoded decode_utf8(std::string_view text, size_t pos) {
  const auto lead = uint8_t(text[pos]);
  if (lead < 0x80) return {lead, 1, true};
  size_t length = 0;
  uint32_t value = 0;
  if ((lead & 0xE0) == 0xC0) {
    length = 2;
    value = lead & 0x1F;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3;
    value = lead & 0x0F;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4;
    value = lead & 0x07;
  } else
    return {lead, 1, false};
  if (pos + length > text.size()) return {lead, 1, false};
  for (size_t k = 1; k < length; ++k) {
    const auto next = uint8_t(text[pos + k]);
    if ((next & 0xC0) != 0x80) return {lead, 1, false};
    value = (value << 6) | (next & 0x3F);
  }
  // Overlong forms, surrogates and values past U+10FFFF are not valid UTF-8.
  static constexpr uint32_t kSmallest[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (value < kSmallest[length] || value > 0x10FFFF || (value >= 0xD800 && value <= 0xDFFF)) {
    return {lead, 1, false};
  }
  return {value, length, true};
}

CharClass class_at(std::string_view text, size_t pos, size_t* length) {
  const Decoded decoded = decode_utf8(text, pos);
  *length = decoded.length;
  return decoded.valid ? classify_code_point(decoded.code_point) : CharClass::kOther;
}

// The length of GPT-2's contraction ('s 't 're 've 'm 'll 'd) at pos, or 0.
size_t contraction_at(std::string_view text, size_t pos) {
  if (text[pos] != '\'' || pos + 1 >= text.size()) return 0;
  const char c1 = text[pos + 1];
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  if (pos + 2 >= text.size()) return 0;
  const char c2 = text[pos + 2];
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
  return 0;
}

// The end of the run of code points of class `cls` starting at pos.
size_t run_end(std::string_view text, size_t pos, CharClass cls) {
  while (pos < text.size()) {
    size_t length = 0;
    if (class_at(text, pos, &length) != cls) break;
    pos += length;
  }
  return pos;
}

// The end of the piece that starts at pos: the first alternative of the pattern that matches.
size_t piece_end(std::string_view text, size_t pos) {
  if (size_t length = contraction_at(text, pos)) return pos + length;

  size_t first_length = 0;
  const CharClass first = class_at(text, pos, &first_length);
  // " ?X+" for X in letters, numbers, other: one leading ASCII space joins the run after it.
  if (text[pos] == ' ' && pos + 1 < text.size()) {
    size_t next_length = 0;
    const CharClass next = class_at(text, pos + 1, &next_length);
    if (next != CharClass::kSpace) return run_end(text, pos + 1, next);
  }
  if (first != CharClass::kSpace) return run_end(text, pos, first);

  // "\s+(?!\S)|\s+": a whitespace run, less its last code point when a non-space follows and
  // the run is longer than one (that last space then starts the next piece, " word").
  const size_t end = run_end(text, pos, CharClass::kSpace);
  if (end == text.size()) return end;
  size_t last = pos;
  for (size_t p = pos; p < end;) {
    size_t length = 0;
    class_at(text, p, &length);
    last = p;
    p += length;
  }
  return last > pos ? last : end;
}

Status decode_base64(std::string_view text, std::string* bytes) {
  auto value_of = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  if (text.empty() || text.size() % 4 != 0)
    return invalid("base64 length ", text.size(), " is not a positive multiple of 4");
  bytes->clear();
  uint32_t bits = 0;
  int nbits = 0;
  size_t padding = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '=') {
      if (i + 2 < text.size()) return invalid("base64 '=' before the last two characters");
      ++padding;
      continue;
    }
    if (padding > 0) return invalid("base64 character after '='");
    const int value = value_of(text[i]);
    if (value < 0) return invalid("base64 character '", text[i], "' is not in the alphabet");
    bits = (bits << 6) | uint32_t(value);
    nbits += 6;
    if (nbits >= 8) {
      nbits -= 8;
      bytes->push_back(char((bits >> nbits) & 0xFF));
    }
  }
  return Status::ok_status();
}

}  // namespace

CharClass classify_code_point(uint32_t cp) {
  if (cp < 0x80) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return CharClass::kLetter;
    if (cp >= '0' && cp <= '9') return CharClass::kNumber;
    if (cp == ' ' || (cp >= '\t' && cp <= '\r')) return CharClass::kSpace;
    return CharClass::kOther;
  }
  // Binary search for the last range starting at or before cp.
  size_t lo = 0, hi = std::size(kNonLetterRanges);
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (kNonLetterRanges[mid].first <= cp)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo > 0 && cp <= kNonLetterRanges[lo - 1].last) return kNonLetterRanges[lo - 1].cls;
  return CharClass::kLetter;
}

std::vector<std::string_view> split_gpt2_pieces(std::string_view text) {
  std::vector<std::string_view> pieces;
  for (size_t pos = 0; pos < text.size();) {
    const size_t end = piece_end(text, pos);
    pieces.push_back(text.substr(pos, end - pos));
    pos = end;
  }
  return pieces;
}

Status Tokenizer::load(const std::string& path, Tokenizer* tokenizer) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return invalid("tokenizer file ", path, ": cannot open");
  std::ostringstream contents;
  contents << in.rdbuf();
  return parse(contents.str(), path, tokenizer);
}

Status Tokenizer::parse(std::string_view contents, const std::string& source,
                        Tokenizer* tokenizer) {
  Tokenizer parsed;
  std::vector<std::string> by_rank;
  int64_t line_number = 0;
  for (size_t start = 0; start < contents.size();) {
    size_t end = contents.find('\n', start);
    if (end == std::string_view::npos) end = contents.size();
    std::string_view line = contents.substr(start, end - start);
    start = end + 1;
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;

    const size_t space = line.find(' ');
    if (space == std::string_view::npos) {
      return invalid("tokenizer file ", source, ": line ", line_number,
                     ": expected '<base64 bytes> <rank>'");
    }
    std::string bytes;
    Status decoded = decode_base64(line.substr(0, space), &bytes);
    if (!decoded.ok()) {
      return invalid("tokenizer file ", source, ": line ", line_number, ": ", decoded.message());
    }
    const std::string_view rank_text = line.substr(space + 1);
    int64_t rank = 0;
    if (rank_text.empty() || rank_text.size() > 10) rank = -1;
    for (char c : rank_text) {
      if (c < '0' || c > '9') {
        rank = -1;
        break;
      }
      rank = rank * 10 + (c - '0');
    }
    if (rank < 0 || rank >= int64_t(std::numeric_limits<int32_t>::max())) {
      return invalid("tokenizer file ", source, ": line ", line_number, ": rank '", rank_text,
                     "' is not a non-negative 32-bit integer");
    }
    if (rank >= int64_t(contents.size())) {
      return invalid("tokenizer file ", source, ": line ", line_number, ": rank ", rank,
                     " exceeds the number of lines the file can hold");
    }
    if (size_t(rank) >= by_rank.size()) by_rank.resize(size_t(rank) + 1);
    if (!by_rank[size_t(rank)].empty()) {
      return invalid("tokenizer file ", source, ": line ", line_number, ": rank ", rank,
                     " appears twice");
    }
    if (!parsed.ranks_.emplace(bytes, int32_t(rank)).second) {
      return invalid("tokenizer file ", source, ": line ", line_number,
                     ": the same token bytes appear twice");
    }
    by_rank[size_t(rank)] = bytes;
  }
  for (size_t rank = 0; rank < by_rank.size(); ++rank) {
    if (by_rank[rank].empty()) {
      return invalid("tokenizer file ", source, ": rank ", rank, " is missing (ranks must be 0 … ",
                     by_rank.size() - 1, ", each once)");
    }
  }
  for (int byte = 0; byte < 256; ++byte) {
    if (parsed.ranks_.find(std::string(1, char(byte))) == parsed.ranks_.end()) {
      return invalid("tokenizer file ", source, ": byte ", byte,
                     " has no token (a byte-level BPE needs all 256)");
    }
  }
  parsed.token_bytes_ = std::move(by_rank);
  *tokenizer = std::move(parsed);
  return Status::ok_status();
}

int32_t Tokenizer::rank_of(std::string_view bytes) const {
  const auto found = ranks_.find(bytes);
  return found == ranks_.end() ? -1 : found->second;
}

void Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>* tokens) const {
  if (int32_t whole = rank_of(piece); whole >= 0) {
    tokens->push_back(whole);
    return;
  }
  // parts[i] is the byte offset where part i starts; parts.back() == piece.size().
  std::vector<size_t> parts(piece.size() + 1);
  for (size_t i = 0; i <= piece.size(); ++i) parts[i] = i;
  while (parts.size() > 2) {
    int32_t best_rank = -1;
    size_t best = 0;
    for (size_t i = 0; i + 2 < parts.size(); ++i) {
      const int32_t rank = rank_of(piece.substr(parts[i], parts[i + 2] - parts[i]));
      if (rank >= 0 && (best_rank < 0 || rank < best_rank)) {
        best_rank = rank;
        best = i;
      }
    }
    if (best_rank < 0) break;
    parts.erase(parts.begin() + std::ptrdiff_t(best) + 1);
  }
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    tokens->push_back(rank_of(piece.substr(parts[i], parts[i + 1] - parts[i])));
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> tokens;
  for (std::string_view piece : split_gpt2_pieces(text)) encode_piece(piece, &tokens);
  return tokens;
}

Status Tokenizer::decode(std::span<const int32_t> tokens, std::string* text) const {
  std::string out;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t id = tokens[i];
    if (id < 0 || int64_t(id) >= vocab_size()) {
      return invalid("Tokenizer::decode: token ", i, " is ", id,
                     ", not in [0, vocab_size = ", vocab_size(), ")");
    }
    out += id == eot_token() ? std::string("<|endoftext|>") : token_bytes_[size_t(id)];
  }
  *text = std::move(out);
  return Status::ok_status();
}

}  // namespace flare::train
