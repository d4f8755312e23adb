"""Tests for splitspec.text.tokenizer: GGUF byte-level BPE tokenizers and the tiny-vocabulary writer."""

import json
import random
import subprocess
import sys

import gguf
import pytest
import tokenizers

from splitspec.text.tokenizer import ByteLevelVocab, Tokenizer, byte_level_vocab, write_gguf_tokenizer
from tests.tools import write_gguf

MIXED_TEXT = (
    "The quick brown fox jumps over the lazy dog. It's 2024; we'll see what they've done.\n"
    "def fibonacci(n: int) -> int:\n"
    "    if n < 2:\n"
    "        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "\n\n    \t  trailing   whitespace runs   \n"
    "Windows line endings\r\nare here\r\n\r\n"
    "中文测试：你好，世界！这是一个分词器的测试。日本語のテキストも少し。한국어 문장입니다.\n"
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇩🇪 ❤️ 🦀\n"
    "Combining marks: e\u0301 a\u0308 n\u0303 o\u0302\u0323 and precomposed é ä ñ.\n"
    "Numbers 1234567890 3.14159 -42 1e-9, URLs https://example.com/a?b=c&d=e.\n"
    "Ελληνικά, русский текст, العربية, עברית, हिन्दी.\n"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")


@pytest.fixture(scope="module")
def vocab():
    return byte_level_vocab(MIXED_TEXT * 2, num_merges=300)


@pytest.fixture(scope="module")
def gguf_path(vocab, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(path, lambda w: write_gguf_tokenizer(w, vocab, chat_template="{{ messages }}"))


@pytest.fixture(scope="module")
def tok(gguf_path):
    return Tokenizer.load(gguf_path)


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "def f(x):\n\tif x:\n        return  x   \n\n\n",
        "中文测试，你好世界",
        "😀👍🏽👨‍👩‍👧‍👦🇩🇪",
        "e\u0301a\u0308o\u0302\u0323 \u0301leading combining",
        "line one\r\nline two\r\n\r\n",
        "   ",
        "",
        MIXED_TEXT,
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids(tok, vocab):
    start, end = vocab.special_ids["<|im_start|>"], vocab.special_ids["<|im_end|>"]
    text = "<|im_start|>user\nhi 你好<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == start and ids.count(start) == 2 and ids.count(end) == 1
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\nhi 你好\nassistant\n"
    assert tok.special_ids == frozenset(vocab.special_ids.values())
    assert tok.token_to_id("<|im_end|>") == end


def test_user_defined_tokens_are_matched_and_kept(tmp_path):
    vocab = byte_level_vocab(special_tokens=("<|endoftext|>", "<|im_end|>", "<think>"))
    think = vocab.special_ids["<think>"]
    vocab.token_types[think] = int(gguf.TokenType.USER_DEFINED)
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "user.gguf", lambda w: write_gguf_tokenizer(w, vocab)))
    ids = tok.encode("<think>x<|im_end|>")
    assert ids == [think, ord("x"), vocab.special_ids["<|im_end|>"]]
    assert tok.decode(ids) == "<think>x"
    assert think not in tok.special_ids


def test_metadata(tok, vocab):
    assert tok.vocab_size == len(vocab.tokens)
    assert tok.eos_token_ids == (vocab.special_ids["<|im_end|>"],)
    assert tok.bos_token_id == vocab.special_ids["<|endoftext|>"]
    assert tok.chat_template == "{{ messages }}"
    # Qwen files do not ask for BOS.
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


def test_eot_joins_eos_deduplicated(vocab, tmp_path):
    def metadata(writer):
        write_gguf_tokenizer(writer, vocab)
        writer.add_eot_token_id(vocab.special_ids["<|endoftext|>"])

    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "eot.gguf", metadata))
    assert tok.eos_token_ids == (vocab.special_ids["<|im_end|>"], vocab.special_ids["<|endoftext|>"])
    assert tok.chat_template is None

    def same(writer):
        write_gguf_tokenizer(writer, vocab)
        writer.add_eot_token_id(vocab.special_ids["<|im_end|>"])

    assert Tokenizer.from_gguf(write_gguf(tmp_path / "same.gguf", same)).eos_token_ids == (
        vocab.special_ids["<|im_end|>"],
    )


def test_add_bos_token(vocab, tmp_path):
    bos = vocab.special_ids["<|endoftext|>"]

    def metadata(writer):
        write_gguf_tokenizer(writer, vocab)
        writer.add_add_bos_token(True)

    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "bos.gguf", metadata))
    plain = tok.encode("hello", add_special_tokens=False)
    assert bos not in plain
    assert tok.encode("hello") == [bos, *plain]
    # llama.cpp adds BOS for Llama-3 vocabularies that do not say otherwise.
    llama3 = Tokenizer.from_gguf(
        write_gguf(tmp_path / "llama3.gguf", lambda w: write_gguf_tokenizer(w, vocab, pre="llama-bpe"))
    )
    assert llama3.encode("hello")[0] == bos


def test_merges_are_used(tok, vocab):
    assert len(vocab.merges) == 300
    assert len(tok.encode(MIXED_TEXT)) < len(MIXED_TEXT.encode("utf-8")) // 2


def test_bytes_only_vocab(tmp_path):
    vocab = byte_level_vocab()
    assert len(vocab.tokens) == 256 + len(SPECIALS) and vocab.merges == []
    assert vocab.special_ids == {s: 256 + i for i, s in enumerate(SPECIALS)}
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "bytes.gguf", lambda w: write_gguf_tokenizer(w, vocab)))
    text = "byte ids: é 😀\r\n"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text


def test_byte_level_vocab_is_deterministic():
    first = byte_level_vocab(MIXED_TEXT, num_merges=120)
    assert first == byte_level_vocab(MIXED_TEXT, num_merges=120)
    assert len(first.tokens) == len(set(first.tokens))
    assert len(first.merges) == 120
    assert first.token_types.count(int(gguf.TokenType.CONTROL)) == len(SPECIALS)


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("qwen2", ["x", " ", "1", "2", "3", "4", "5"]),  # digits one by one
        ("llama-bpe", ["x", " ", "123", "45"]),  # up to 3 digits; "45" is in the vocabulary whole
        ("default", ["x", " 1", "2", "3", "4", "5"]),  # GPT-2: a space joins the digits that follow
    ],
)
def test_pre_tokenizer_patterns(tmp_path, pre, pieces):
    base = byte_level_vocab(special_tokens=("<|endoftext|>", "<|im_end|>"))
    extra = ["Ġ1", "12", "123", "45"]  # "Ġ" spells the space byte
    vocab = ByteLevelVocab(
        tokens=base.tokens[:256] + extra + base.tokens[256:],
        merges=["Ġ 1", "1 2", "12 3"],
        token_types=base.token_types[:256] + [int(gguf.TokenType.NORMAL)] * len(extra) + base.token_types[256:],
        special_ids={t: i + len(extra) for t, i in base.special_ids.items()},
    )
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "pre.gguf", lambda w: write_gguf_tokenizer(w, vocab, pre=pre)))
    assert [tok.decode([i]) for i in tok.encode("x 12345", add_special_tokens=False)] == pieces


def test_missing_tokens_is_a_clear_error(tmp_path):
    def metadata(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_token_merges(["a b"])

    path = write_gguf(tmp_path / "no_tokens.gguf", metadata)
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens") as info:
        Tokenizer.load(path)
    assert path in str(info.value)


def test_unknown_tokenizer_model_is_an_error(tmp_path):
    def metadata(writer):
        writer.add_tokenizer_model("bert")
        writer.add_token_list(["[UNK]", "a"])

    path = write_gguf(tmp_path / "bert.gguf", metadata)
    with pytest.raises(ValueError, match="'bert'") as info:
        Tokenizer.from_gguf(path)
    assert path in str(info.value) and "tokenizer.ggml.model" in str(info.value)


def test_sentencepiece_without_scores_is_a_clear_error(tmp_path):
    def metadata(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(["<unk>", "<s>", "</s>", "\u2581a"])

    path = write_gguf(tmp_path / "spm.gguf", metadata)
    with pytest.raises(ValueError, match="tokenizer.ggml.scores") as info:
        Tokenizer.from_gguf(path)
    assert path in str(info.value)


def test_unknown_pre_tokenizer_is_an_error(vocab, tmp_path):
    path = write_gguf(tmp_path / "pre.gguf", lambda w: write_gguf_tokenizer(w, vocab, pre="no-such-pre"))
    with pytest.raises(ValueError, match="no-such-pre"):
        Tokenizer.from_gguf(path)


def test_load_tokenizer_json_directory(vocab, tmp_path):
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE({t: i for i, t in enumerate(vocab.tokens)}, [tuple(m.split(" ")) for m in vocab.merges])
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIALS))
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": {"content": "<|im_end|>"}, "bos_token": None, "chat_template": "T"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 256]}))

    for tok in (Tokenizer.load(tmp_path), Tokenizer.load(tmp_path / "tokenizer.json")):
        assert tok.eos_token_ids == (vocab.special_ids["<|im_end|>"], 257, 256)
        assert tok.bos_token_id is None
        assert tok.chat_template == "T"
        assert tok.vocab_size == len(vocab.tokens)
        assert tok.decode(tok.encode("hi 你好<|im_end|>")) == "hi 你好"


def test_same_ids_as_transformers(vocab, gguf_path):
    pytest.importorskip("torch", reason="transformers' GGUF loader needs torch")
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(gguf_path.rsplit("/", 1)[0]), gguf_file="tiny.gguf")
    lines = MIXED_TEXT.splitlines(keepends=True)
    shuffled = [random.Random(seed).sample(lines, len(lines)) for seed in range(6)]
    text = "".join(map("".join, shuffled)) + "<|im_start|>user\n" + MIXED_TEXT[::-1] + "<|im_end|><|endoftext|>"
    assert len(text.encode()) > 4000
    tok = Tokenizer.from_gguf(gguf_path)
    assert tok.encode(text) == reference.encode(text)
    assert tok.encode(MIXED_TEXT, add_special_tokens=False) == reference.encode(MIXED_TEXT, add_special_tokens=False)


def test_modules_do_not_import_torch():
    code = "import sys, splitspec.text.tokenizer, splitspec.text.textstream; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
