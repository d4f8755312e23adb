"""Training text: read documents, split off a held-out set, tokenize, pack into fixed-length rows.

Terms used here:

- *document*: one unit of text. A text file is one document; a JSONL file holds one per line,
  its ``"text"`` field, or ``"prompt"`` + ``"completion"`` concatenated.
- *held-out split*: by document, so that no held-out text is trained on. It depends only on the
  documents' contents (see :func:`split_heldout`), not on the order the files were named in.
- *packed sequence*: ``seq_len`` consecutive token ids of the documents laid end to end, each
  document followed by a separator token (the tokenizer's end-of-text) when there is one. The
  tail that does not fill a whole row is dropped.

Pure functions, no torch: ``read_documents`` -> ``split_heldout`` -> ``tokenize`` -> ``pack``, or
all four at once with :func:`load_corpus`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import numpy as np

from splitspec.text.tokenizer import Tokenizer

DEFAULT_GLOB = "*.py,*.txt,*.md"


def read_documents(paths: Iterable[str | os.PathLike], glob: str = DEFAULT_GLOB) -> list[str]:
    """The documents of ``paths``: files as given, directories searched recursively for file names
    matching any of the comma-separated patterns of ``glob`` (a ``*.jsonl`` match is read as
    JSONL). Blank documents are skipped; no text at all is an error naming the paths."""
    patterns = [p.strip() for p in glob.split(",") if p.strip()]
    documents: list[str] = []
    names = []
    for raw in paths:
        path = Path(raw)
        names.append(str(path))
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.is_file() and any(fnmatch(f.name, p) for p in patterns))
            if not files:
                raise ValueError(f"{path}: no files match --glob {glob!r}")
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
        for f in files:
            documents += jsonl_documents(f) if f.suffix == ".jsonl" else [_read_text(f)]
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise ValueError(f"no text in {', '.join(names)}")
    return documents


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (bad byte at offset {exc.start})") from exc


def jsonl_documents(path: str | os.PathLike) -> list[str]:
    """One document per non-blank line of a JSONL file: ``text``, or ``prompt`` + ``completion``."""
    documents = []
    for number, line in enumerate(_read_text(Path(path)).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            documents.append(record["text"])
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
            documents.append(record["prompt"] + record["completion"])
        else:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{path}:{number}: a record needs a string 'text', or 'prompt' and 'completion' (found {keys})")
    return documents


def split_heldout(documents: Sequence[str], fraction: float) -> tuple[list[str], list[str]]:
    """(train, held-out) documents. Documents are ordered by the SHA-256 of their text and the first
    ones are held out until they hold at least ``fraction`` of all characters; at least one
    document is held out and at least one kept for training."""
    if not 0 < fraction < 1:
        raise ValueError(f"--heldout-fraction {fraction}: must be between 0 and 1 (exclusive)")
    if len(documents) < 2:
        raise ValueError(f"a held-out split needs at least 2 documents, got {len(documents)}; add files or JSONL records")
    order = sorted(range(len(documents)), key=lambda i: hashlib.sha256(documents[i].encode()).digest())
    total = sum(len(d) for d in documents)
    held, chars = [], 0
    for i in order[:-1]:
        if held and chars >= fraction * total:
            break
        held.append(i)
        chars += len(documents[i])
    chosen = set(held)
    return [d for i, d in enumerate(documents) if i not in chosen], [documents[i] for i in sorted(held)]


def tokenize(documents: Sequence[str], tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids of each document, without BOS/EOS (``pack`` places the separators)."""
    return [tokenizer.encode(d, add_special_tokens=False) for d in documents]


def pack(token_lists: Sequence[Sequence[int]], seq_len: int, separator: int | None = None) -> np.ndarray:
    """Lay the documents end to end (each followed by ``separator`` if given) and cut rows of
    ``seq_len`` tokens -> int64 [N, seq_len]; the incomplete tail is dropped (N may be 0)."""
    if seq_len < 1:
        raise ValueError(f"--seq-len {seq_len}: must be positive")
    tail = [separator] if separator is not None else []
    stream = np.fromiter((t for ids in token_lists for t in (*ids, *tail)), dtype=np.int64)
    rows = len(stream) // seq_len
    return stream[: rows * seq_len].reshape(rows, seq_len)


@dataclass(frozen=True)
class PackedCorpus:
    train: np.ndarray  # [N, seq_len] int64
    heldout: np.ndarray  # [M, seq_len] int64
    train_documents: int
    heldout_documents: int


def load_corpus(
    paths: Iterable[str | os.PathLike],
    tokenizer: Tokenizer,
    seq_len: int,
    heldout_fraction: float,
    glob: str = DEFAULT_GLOB,
) -> PackedCorpus:
    """Read, split, tokenize and pack; the separator is the tokenizer's first end-of-text id.

    A single ``.npz`` path is a corpus already packed by ``splitspec.train.corpus`` (ids of the
    target's own tokenizer, such as the built-in pair's): its training and held-out streams are
    cut into sequences as they are."""
    paths = [str(p) for p in paths]
    if len(paths) == 1 and paths[0].endswith(".npz"):
        return _load_packed_corpus(Path(paths[0]), tokenizer, seq_len)
    train_docs, heldout_docs = split_heldout(read_documents(paths, glob), heldout_fraction)
    separator = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    train = pack(tokenize(train_docs, tokenizer), seq_len, separator)
    heldout = pack(tokenize(heldout_docs, tokenizer), seq_len, separator)
    for name, rows, docs in (("training", train, train_docs), ("held-out", heldout, heldout_docs)):
        if len(rows) == 0:
            raise ValueError(
                f"the {name} documents ({len(docs)}) hold fewer tokens than one sequence of --seq-len {seq_len}; "
                "add text, lower --seq-len or change --heldout-fraction"
            )
    return PackedCorpus(train, heldout, len(train_docs), len(heldout_docs))


def _load_packed_corpus(path: Path, tokenizer: Tokenizer, seq_len: int) -> PackedCorpus:
    from splitspec.train.corpus import load_packed

    train, heldout, _ = load_packed(path)
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else -1
    rows = [stream[: len(stream) // seq_len * seq_len].astype(np.int64).reshape(-1, seq_len) for stream in (train, heldout)]
    if not (len(rows[0]) and len(rows[1])):
        raise ValueError(f"{path}: fewer tokens than one sequence of --seq-len {seq_len} in a split")
    return PackedCorpus(rows[0], rows[1], int((train == eos).sum()), int((heldout == eos).sum()))
