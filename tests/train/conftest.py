"""A small build of the built-in pair's corpus and tokenizer, shared by the training tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import tokenizers

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
