"""Shared by the training tests: a small build of the built-in pair's corpus and tokenizer, and a
tiny target with text it wrote itself (``looping``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch

from splitspec.fixtures.tiny import TinySpec, gguf_weights, random_target, write_target_gguf
from splitspec.models.loader import load_target
from splitspec.text.tokenizer import Tokenizer, byte_level_vocab
from splitspec.train import corpus

# A few real stdlib files: email/ to train on; json/, string.py and textwrap.py are held out.
SMALL_ONLY = ("email/", "json/", "string.py", "textwrap.py")
SMALL_VOCAB = 512


@dataclass(frozen=True)
class SmallBuild:
    """``corpus.build_corpus`` of :data:`SMALL_ONLY` in ``root``."""

    root: Path
    config: corpus.CorpusConfig
    counts: dict

    @property
    def tokenizer(self) -> Path:
        return self.root / corpus.TOKENIZER_FILE

    @property
    def packed(self) -> Path:
        return self.root / corpus.PACKED_FILE

    def backend(self) -> tokenizers.Tokenizer:
        return tokenizers.Tokenizer.from_file(str(self.tokenizer))

    def heldout_texts(self) -> list[str]:
        return corpus.read_texts(self.config.root, corpus.select_files(self.config), corpus.HELDOUT_SPLIT)


@pytest.fixture(scope="session")
def small_build(tmp_path_factory) -> SmallBuild:
    root = tmp_path_factory.mktemp("small-build")
    config = corpus.CorpusConfig(only=SMALL_ONLY)
    return SmallBuild(root, config, corpus.build_corpus(root, config, SMALL_VOCAB))


PRINTABLE = [10, *range(32, 127)]  # byte tokens of "\n" and printable ASCII


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models gain nothing from threads, and on a shared small machine they stall on each other.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """The target's greedy continuation of ``prompt``, one cached step per token."""
    cache = model.new_cache(len(prompt) + new_tokens, "cpu", torch.float32)
    ids, block, start = list(prompt), torch.tensor(prompt), 0
    for _ in range(new_tokens):
        positions = torch.arange(start, start + len(block))
        mask = torch.arange(start + len(block))[None, :] <= positions[:, None]
        logits, _ = model(block, positions, cache, start, mask, logit_rows=torch.tensor([len(block) - 1]))
        ids.append(int(logits[-1].argmax()))
        start += len(block)
        block = torch.tensor(ids[-1:])
    return ids


@pytest.fixture(scope="module")
def looping(tmp_path_factory):
    """A tiny target whose LM head can only emit printable ASCII, and 12 documents it wrote greedily.

    Small random models fall into short cycles, so the text is repetitive, and it is exactly what
    the target predicts: a draft that learns it raises the acceptance estimate.
    """
    root = tmp_path_factory.mktemp("looping")
    vocab = byte_level_vocab()
    config, state = random_target(TinySpec(seed=3), len(vocab.tokens), np.random.default_rng(3))
    silent = np.ones(len(vocab.tokens), bool)
    silent[PRINTABLE] = False
    state["lm_head.weight"][silent] = 0.0
    target = root / "target.gguf"
    write_target_gguf(target, config, gguf_weights(config, state), vocab)
    model, _ = load_target(target)
    tokenizer = Tokenizer.load(target)
    rng = np.random.default_rng(0)
    data = root / "data"
    data.mkdir()
    for i in range(12):
        ids = _greedy(model, rng.choice(PRINTABLE, 4).tolist(), 200)
        text = tokenizer.decode(ids)
        assert tokenizer.encode(text, add_special_tokens=False) == ids  # the text reads back as the target's tokens
        (data / f"doc{i}.txt").write_text(text)
    return target, data
