"""A byte-level BPE tokenizer trained on the corpus, in the form a GGUF stores it.

The tokenizer is built exactly as ``splitspec.text.tokenizer`` rebuilds a GGUF's "gpt2" tokenizer
(:func:`splitspec.text.tokenizer.byte_level_backend` with the Qwen2 pre-tokenizer split, which keeps
digits single and runs of indentation whole), then trained with the ``tokenizers`` library's BPE
trainer. So the GGUF embedded in the target encodes and decodes identically to the trained object.

Special tokens: ``<|endoftext|>`` separates documents and is the BOS/EOS of the model; ``<|mask|>``
is the DFlash mask token the draft fills its block with. Both are CONTROL tokens in the GGUF.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import gguf
import tokenizers
from tokenizers import pre_tokenizers, trainers

from splitspec.text.tokenizer import ByteLevelVocab, byte_level_backend

EOT = "<|endoftext|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (EOT, MASK)
PRE = "qwen2"  # llama.cpp's tokenizer.ggml.pre name of the split pattern


def train_bpe(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> tokenizers.Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (special tokens and the 256 bytes included)
    trained on ``texts``; special tokens take ids 0 and 1."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is below the 256 byte tokens plus {len(SPECIAL_TOKENS)} special tokens")
    backend = byte_level_backend({}, [], PRE)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return backend


def gguf_vocab(backend: tokenizers.Tokenizer) -> ByteLevelVocab:
    """``backend``'s tokens in id order, merges as ``"a b"``, llama.cpp token types (special
    tokens CONTROL) and the special token ids, ready for ``write_gguf_tokenizer``."""
    by_id = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError("tokenizer ids are not contiguous from 0")
    tokens = [by_id[i] for i in range(len(by_id))]
    # Byte-level token text never holds a space (GPT-2 spells it "Ġ"), so "a b" is unambiguous.
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(backend.to_str())["model"]["merges"]]
    special_ids = {t: backend.token_to_id(t) for t in SPECIAL_TOKENS}
    control, normal = int(gguf.TokenType.CONTROL), int(gguf.TokenType.NORMAL)
    types = [control if t in special_ids else normal for t in tokens]
    return ByteLevelVocab(tokens=tokens, merges=merges, token_types=types, special_ids=special_ids)
