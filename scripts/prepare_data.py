#!/usr/bin/env python3
"""prepare_data.py — token shards for flare's trainer, made offline from a real English corpus.

Corpus: the Python documentation's reStructuredText sources, which Debian and Ubuntu ship in the
python3.X-doc package (`apt-get install python3-doc`) under
/usr/share/doc/python3.X/html/_sources: about 500 documents, 11 MB of English prose and code
examples. One document is one .rst.txt file.

Tokenizer: GPT-2's byte-level BPE. Its rank file (gpt2.tiktoken) ships in the openai-whisper
package on PyPI (whisper/assets/gpt2.tiktoken, checked by its SHA-256 here); it is taken from an
installed whisper, from --gpt2-ranks, or from the sdist that `pip download` fetches into --cache.
Encoding is done in pure Python here (GPT-2's pattern with exact Unicode categories from
unicodedata), or by tiktoken when it is installed; the C++ tokenizer (src/train/data/tokenizer.h)
reads the same file.

Output (--out DIR):
  <name>_train_NNNNNN.bin, <name>_val_NNNNNN.bin   shards in llm.c's format (see docs/training-data.md);
                                                   every document starts with <|endoftext|>
  tokenizer.tiktoken                               the rank file (end-of-text = number of ranks)
  sample.txt, sample_tokens.bin                    text (validation documents first) and its
                                                   tokens, for checking that the C++ encoder agrees
  dataset.json                                     what was made: vocabulary, splits, counts
The validation split is a fixed set of whole documents: those whose SHA-1 of the document's name
ranks lowest, val_fraction of them (at least one), independent of the shard size or machine.

--tiny makes a small dataset from text built into this script with a byte-level BPE trained
here (a few hundred merges), for tests; it needs nothing but Python.

Examples:
  python3 scripts/prepare_data.py --out data/pydoc
  python3 scripts/prepare_data.py --tiny --out /tmp/tiny
"""

import argparse
import base64
import hashlib
import json
import os
import struct
import subprocess
import sys
import tarfile
import time
import unicodedata
from array import array
from pathlib import Path

SHARD_MAGIC = 20240520
SHARD_HEADER_INTS = 256

WHISPER_SDIST = "openai-whisper==20250625"
WHISPER_RANKS_MEMBER = "openai_whisper-20250625/whisper/assets/gpt2.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


# ---- shards ---------------------------------------------------------------------------------

def write_shard(path, tokens, vocab_size):
    """Writes a shard atomically (temp file + rename): version 1 (uint16) when the vocabulary
    fits 16 bits, else version 2 (uint32)."""
    version = 1 if vocab_size <= 65536 else 2
    header = array("i", [0] * SHARD_HEADER_INTS)
    header[0], header[1], header[2] = SHARD_MAGIC, version, len(tokens)
    body = array("H" if version == 1 else "I", tokens)
    if sys.byteorder != "little":
        header.byteswap()
        body.byteswap()
    temp = f"{path}.tmp"
    with open(temp, "wb") as f:
        f.write(header.tobytes())
        f.write(body.tobytes())
    os.replace(temp, path)


# ---- GPT-2 pre-tokenization and BPE ---------------------------------------------------------

# Unicode White_Space, which is what \s means in GPT-2's pattern.
WHITE_SPACE = set(map(chr, [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                            0x2028, 0x2029, 0x202F, 0x205F, 0x3000]))


CHAR_CLASSES = {}  # character → class, filled as characters are met


def char_class(ch):
    """'L' letter, 'N' number, 'S' whitespace, 'O' anything else (GPT-2's \\p{L}, \\p{N}, \\s)."""
    cls = CHAR_CLASSES.get(ch)
    if cls is None:
        if ch in WHITE_SPACE:
            cls = "S"
        else:
            major = unicodedata.category(ch)[0]
            cls = major if major in "LN" else "O"
        CHAR_CLASSES[ch] = cls
    return cls


CONTRACTIONS = ("'s", "'t", "'m", "'d", "'re", "'ve", "'ll")


def split_pieces(text):
    """GPT-2's pattern 's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+
    written out by hand (the standard re module has no \\p{L})."""
    pieces = []
    n = len(text)
    pos = 0
    while pos < n:
        if text[pos] == "'":
            contraction = next((c for c in CONTRACTIONS if text.startswith(c, pos)), None)
            if contraction:
                pieces.append(contraction)
                pos += len(contraction)
                continue
        start = pos
        cls = char_class(text[pos])
        if text[pos] == " " and pos + 1 < n and char_class(text[pos + 1]) != "S":
            pos += 1
            cls = char_class(text[pos])
        if cls != "S":
            while pos < n and char_class(text[pos]) == cls:
                pos += 1
            pieces.append(text[start:pos])
            continue
        end = pos
        while end < n and char_class(text[end]) == "S":
            end += 1
        # \s+(?!\S): leave the last space of a longer run for the next piece (" word").
        if end < n and end - pos > 1:
            end -= 1
        pieces.append(text[start:end])
        pos = end
    return pieces


class BytePairEncoder:
    """Byte-level BPE over a rank table (bytes → id): repeatedly merge the adjacent pair whose
    concatenation has the lowest rank, as tiktoken and the C++ tokenizer do."""

    def __init__(self, ranks):
        self.ranks = ranks
        self.eot = len(ranks)
        self.vocab_size = len(ranks) + 1
        self.cache = {}

    def encode_piece(self, piece):
        ids = self.cache.get(piece)
        if ids is not None:
            return ids
        data = piece.encode("utf-8")
        parts = [data[i:i + 1] for i in range(len(data))]
        ranks = self.ranks
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                rank = ranks.get(parts[i] + parts[i + 1])
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = i, rank
            if best < 0:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        ids = [ranks[p] for p in parts]
        if len(self.cache) < 500_000:
            self.cache[piece] = ids
        return ids

    def encode(self, text):
        ids = []
        for piece in split_pieces(text):
            ids.extend(self.encode_piece(piece))
        return ids


def gpt2_pattern_encoder(ranks):
    """tiktoken over the same ranks when it is installed (fast, exact), else BytePairEncoder."""
    try:
        import tiktoken
    except ImportError:
        return BytePairEncoder(ranks), "pure Python"
    pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    encoding = tiktoken.Encoding(name="gpt2-local", pat_str=pattern, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": len(ranks)})

    class TiktokenEncoder:
        eot = len(ranks)
        vocab_size = len(ranks) + 1

        def encode(self, text):
            return encoding.encode_ordinary(text)

    return TiktokenEncoder(), f"tiktoken {tiktoken.__version__}"


def read_ranks(path):
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def write_ranks(path, ranks):
    with open(path, "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")


def train_byte_bpe(texts, num_merges):
    """A small byte-level BPE trainer: ranks 0–255 are the bytes, then each merge of the most
    frequent adjacent pair within pieces (ties: the smallest pair of ids) gets the next rank."""
    words = {}
    for text in texts:
        for piece in split_pieces(text):
            key = tuple(piece.encode("utf-8"))
            words[key] = words.get(key, 0) + 1
    vocab = [bytes([b]) for b in range(256)]
    ranks = {token: i for i, token in enumerate(vocab)}
    words = [(list(word), count) for word, count in words.items()]
    for _ in range(num_merges):
        pairs = {}
        for word, count in words:
            for pair in zip(word, word[1:]):
                pairs[pair] = pairs.get(pair, 0) + count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merged = vocab[best[0]] + vocab[best[1]]
        new_id = ranks.get(merged)
        if new_id is None:
            new_id = len(vocab)
            vocab.append(merged)
            ranks[merged] = new_id
        for word, _ in words:
            i = 0
            while i < len(word) - 1:
                if (word[i], word[i + 1]) == best:
                    word[i:i + 2] = [new_id]
                i += 1
    return ranks


# ---- corpora --------------------------------------------------------------------------------

def find_python_docs(explicit):
    """The reST sources of the newest python3.X-doc installed, or the directory given."""
    if explicit:
        root = Path(explicit)
        if not root.is_dir():
            sys.exit(f"prepare_data: --corpus-dir {root}: not a directory")
        return root
    candidates = sorted(Path("/usr/share/doc").glob("python3*/html/_sources"),
                        key=lambda p: [int(x) for x in p.parts[-3][len("python"):].split(".")
                                       if x.isdigit()])
    if not candidates:
        sys.exit("prepare_data: the Python documentation sources are not installed: "
                 "run `apt-get install python3-doc` (Debian/Ubuntu), or give --corpus-dir")
    return candidates[-1]


def python_docs_documents(root):
    documents = []
    for path in sorted(root.rglob("*.rst.txt")):
        text = path.read_text(encoding="utf-8")
        if text.strip():
            documents.append((str(path.relative_to(root)), text))
    if not documents:
        sys.exit(f"prepare_data: no .rst.txt documents under {root}")
    return documents


TINY_DOCUMENTS = [
    ("lighthouse", "The lighthouse keeper climbed the stairs at dusk. There were 114 steps, and "
     "he'd counted them every evening for 23 years. The lamp didn't need him any more—it ran "
     "on a timer—but he liked to watch the beam sweep the water.\n\n“Another quiet night,” "
     "he said to the gulls. They weren't listening.\n"),
    ("bakery", "A small bakery on the corner sells bread, rolls and a café crème for €2.50. "
     "The baker starts at 4:30 a.m.; by 7 the shelves are full. She's kept the same recipe "
     "since 1998: flour, water, salt, yeast, and time.\n\nCustomers ask what the secret is. "
     "\"Patience,\" she'll say, \"and a hot oven.\"\n"),
    ("garden", "In the garden, tomatoes ripen in late summer. Water them in the morning, not "
     "at noon; the leaves scorch in the sun. A row of basil between the plants keeps some "
     "insects away.\n\tTip: pinch off the side shoots.\n  Harvest when the fruit is deep red "
     "and gives a little under your thumb.\n"),
    ("river", "The river runs 340 km from the mountains to the sea. In spring it floods the "
     "meadows; in autumn it's slow and clear enough to see the stones on the bottom. Herons "
     "stand in the shallows — perfectly still — waiting for fish.\n"),
    ("library", "The town library opens at nine. Its reading room has tall windows, long oak "
     "tables and a clock that is always 5 minutes fast. Children's books are upstairs; maps, "
     "newspapers and the archive are in the basement. Borrow up to 10 items for 3 weeks.\n"),
    ("weather", "Tomorrow: cloudy in the morning, sunny spells later. Highs of 18°C, lows of "
     "9°C. Wind from the west at 20 km/h. There's a 30% chance of showers after 6 p.m., so "
     "you'll want an umbrella if you're out late.\n"),
    ("workshop", "The workshop smells of sawdust and oil. Chisels hang on the wall in order of "
     "width: 6, 10, 12, 19 and 25 mm. Measure twice, cut once — that's the rule. A good joint "
     "needs no glue, but we use glue anyway.\n"),
    ("station", "The 8:15 train to the coast leaves from platform 2. It stops at every station "
     "and takes about 1½ hours. Buy tickets at the machine or from the conductor; they'll take "
     "cash or card. The café car closes at noon.\n"),
    ("letters", "Dear Ana,\n\nThank you for your letter. We've had rain all week, and the cat "
     "refuses to go outside. I've started reading the book you sent — it's wonderful so far.\n\n"
     "Write soon,\nMarta\n"),
    ("market", "Saturday market: apples 3 for 1, pears 2 for 1, honey at 6 a jar. The cheese "
     "stall sells out by ten. Bring your own bags; paper ones cost extra.  Parking is free "
     "before 8 a.m.\n"),
]


# ---- GPT-2 ranks ----------------------------------------------------------------------------

def sha256_of(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def find_gpt2_ranks(explicit, cache):
    """gpt2.tiktoken from --gpt2-ranks, an installed whisper, or openai-whisper's sdist."""
    if explicit:
        candidates = [Path(explicit)]
    else:
        candidates = [Path(cache) / "gpt2.tiktoken"]
        try:
            import importlib.util
            spec = importlib.util.find_spec("whisper")
            if spec and spec.origin:
                candidates.insert(0, Path(spec.origin).parent / "assets" / "gpt2.tiktoken")
        except (ImportError, ValueError):
            pass
    for path in candidates:
        if path.is_file():
            if sha256_of(path) != GPT2_RANKS_SHA256:
                sys.exit(f"prepare_data: {path}: SHA-256 differs from GPT-2's rank file "
                         f"({GPT2_RANKS_SHA256})")
            return path
    if explicit:
        sys.exit(f"prepare_data: --gpt2-ranks {explicit}: no such file")

    os.makedirs(cache, exist_ok=True)
    print(f"prepare_data: fetching GPT-2's ranks from the {WHISPER_SDIST} sdist (pip download)")
    fetch = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                            "--no-binary", ":all:", WHISPER_SDIST, "-d", cache])
    if fetch.returncode != 0:
        sys.exit(f"prepare_data: `pip download {WHISPER_SDIST}` failed (exit {fetch.returncode}); "
                 "it needs pip and PyPI, or give --gpt2-ranks")
    sdist = Path(cache) / (WHISPER_RANKS_MEMBER.split("/")[0] + ".tar.gz")
    with tarfile.open(sdist) as tar:
        data = tar.extractfile(WHISPER_RANKS_MEMBER).read()
    target = Path(cache) / "gpt2.tiktoken"
    target.write_bytes(data)
    if sha256_of(target) != GPT2_RANKS_SHA256:
        sys.exit(f"prepare_data: {target}: SHA-256 differs from GPT-2's rank file")
    return target


# ---- splits and output ----------------------------------------------------------------------

def split_documents(documents, val_fraction):
    """Whole documents to validation: the lowest SHA-1s of their names, val_fraction of them."""
    by_hash = sorted(documents, key=lambda doc: hashlib.sha1(doc[0].encode()).hexdigest())
    num_val = max(1, round(len(documents) * val_fraction))
    val_names = {name for name, _ in by_hash[:num_val]}
    train = [doc for doc in documents if doc[0] not in val_names]
    val = [doc for doc in documents if doc[0] in val_names]
    return train, val


def write_split(out, name, split, documents, encoder, shard_tokens):
    """Encodes documents in order, each preceded by end-of-text, into shards of shard_tokens."""
    paths, buffer, total = [], [], 0

    def flush():
        path = out / f"{name}_{split}_{len(paths):06d}.bin"
        write_shard(path, buffer, encoder.vocab_size)
        paths.append(path.name)

    for _, text in documents:
        buffer.append(encoder.eot)
        buffer.extend(encoder.encode(text))
        while len(buffer) >= shard_tokens:
            rest = buffer[shard_tokens:]
            del buffer[shard_tokens:]
            total += len(buffer)
            flush()
            buffer = rest
    if buffer or not paths:
        total += len(buffer)
        flush()
    return paths, total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the shards (created)")
    parser.add_argument("--tiny", action="store_true",
                        help="built-in text and a locally trained tokenizer (tests)")
    parser.add_argument("--corpus-dir", help="reST sources (default: the installed python3-doc)")
    parser.add_argument("--gpt2-ranks", help="gpt2.tiktoken (default: whisper's, fetched if needed)")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/flare-data"),
                        help="where the fetched openai-whisper sdist is kept")
    parser.add_argument("--val-fraction", type=float, default=0.05,
                        help="share of documents held out for validation")
    parser.add_argument("--shard-tokens", type=int, default=None,
                        help="tokens per shard (default 1,000,000; --tiny: 256)")
    parser.add_argument("--tiny-merges", type=int, default=300, help="BPE merges for --tiny")
    parser.add_argument("--sample-chars", type=int, default=50_000,
                        help="characters of validation text in sample.txt")
    args = parser.parse_args()
    if not 0 < args.val_fraction < 1:
        sys.exit(f"prepare_data: --val-fraction {args.val_fraction} must lie in (0, 1)")
    shard_tokens = args.shard_tokens or (256 if args.tiny else 1_000_000)
    if shard_tokens < 1 or shard_tokens > 2**31 - 1:
        sys.exit(f"prepare_data: --shard-tokens {shard_tokens} must lie in [1, 2^31)")

    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        name, corpus = "tiny", "built-in text (prepare_data.py)"
        documents = TINY_DOCUMENTS
        ranks = train_byte_bpe([text for _, text in documents], args.tiny_merges)
        encoder, encoder_name = BytePairEncoder(ranks), "pure Python"
        tokenizer = f"byte-level BPE trained here, {len(ranks) - 256} merges"
    else:
        name = "pydoc"
        root = find_python_docs(args.corpus_dir)
        corpus = f"Python documentation sources, {root}"
        documents = python_docs_documents(root)
        ranks_path = find_gpt2_ranks(args.gpt2_ranks, args.cache)
        ranks = read_ranks(ranks_path)
        encoder, encoder_name = gpt2_pattern_encoder(ranks)
        tokenizer = f"GPT-2 BPE ({ranks_path})"
    write_ranks(out / "tokenizer.tiktoken", ranks)
    print(f"prepare_data: corpus: {corpus}: {len(documents)} documents, "
          f"{sum(len(t) for _, t in documents):,} characters")
    print(f"prepare_data: tokenizer: {tokenizer}; vocab_size {encoder.vocab_size} "
          f"(end-of-text {encoder.eot}); encoding with {encoder_name}")

    train, val = split_documents(documents, args.val_fraction)
    splits = {}
    for split, docs in (("train", train), ("val", val)):
        shards, tokens = write_split(out, name, split, docs, encoder, shard_tokens)
        splits[split] = {"documents": len(docs), "tokens": tokens, "shards": shards}
        print(f"prepare_data: {split}: {len(docs)} documents, {tokens:,} tokens, "
              f"{len(shards)} shard(s) {out / shards[0]} …")

    sample = ""
    for _, text in val + train:
        sample += text
        if len(sample) >= args.sample_chars:
            break
    sample = sample[:args.sample_chars]
    (out / "sample.txt").write_bytes(sample.encode("utf-8"))
    write_shard(out / "sample_tokens.bin", encoder.encode(sample), encoder.vocab_size)

    info = {"corpus": corpus, "tokenizer": tokenizer, "tokenizer_file": "tokenizer.tiktoken",
            "vocab_size": encoder.vocab_size, "eot_token": encoder.eot,
            "shard_version": 1 if encoder.vocab_size <= 65536 else 2,
            "val_fraction": args.val_fraction, "splits": splits,
            "train_pattern": f"{name}_train_*.bin", "val_pattern": f"{name}_val_*.bin"}
    (out / "dataset.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"prepare_data: wrote {out} in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
