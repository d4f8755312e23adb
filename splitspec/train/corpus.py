"""The built-in target's corpus: the running interpreter's standard-library ``.py`` sources.

The standard library is permissively licensed (PSF-2.0), present on every machine that runs
splitspec, and real Python code, so a model trained on it completes code prompts sensibly.

*Selection*: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``, sorted by relative
path, except test suites, installed third-party packages, build-specific files and generated
tables (see :data:`EXCLUDED_DIRS` and :func:`excluded`). *Held-out split*: the modules named in
:data:`HELDOUT` (about 4% of the bytes) are never trained on, tokenizer included; they measure
the held-out loss. *Packing*: each file's token ids followed by ``<|endoftext|>``, concatenated
per split, stored as uint16 in one ``.npz`` so the GPU host needs neither this interpreter nor
the tokenizer's training.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from splitspec.train import bpe

# Path components that mark a file as not part of the library proper.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "pydoc_data"})
# Relative paths (a trailing "/" names a package) kept out of training and used to evaluate.
HELDOUT = (
    "argparse.py", "calendar.py", "csv.py", "dataclasses.py", "fractions.py", "heapq.py", "json/",
    "shlex.py", "statistics.py", "string.py", "textwrap.py",
)
# Larger files are generated data (pydoc_data/topics.py is 750 kB), not code worth learning.
MAX_FILE_BYTES = 256_000
LICENSE = "PSF-2.0"
TRAIN, HELDOUT_SPLIT = "train", "heldout"
# What build_corpus writes into its folder.
MANIFEST_FILE, TOKENIZER_FILE, PACKED_FILE = "manifest.json", "tokenizer.json", "corpus.npz"


@dataclass(frozen=True)
class CorpusFile:
    """One source file: ``path`` relative to the stdlib root (POSIX separators), its size and
    SHA-256, and its split (``train`` or ``heldout``)."""

    path: str
    bytes: int
    sha256: str
    split: str


@dataclass(frozen=True)
class CorpusConfig:
    """``root``: the stdlib folder (default: this interpreter's). ``only``: if not empty, keep
    just the files whose path starts with one of these prefixes (small builds for tests)."""

    root: Path = field(default_factory=lambda: Path(sysconfig.get_paths()["stdlib"]))
    heldout: tuple[str, ...] = HELDOUT
    only: tuple[str, ...] = ()
    max_file_bytes: int = MAX_FILE_BYTES


def excluded(relative: str, head: bytes) -> str | None:
    """Why the file at ``relative`` (whose first bytes are ``head``) is left out, or None."""
    parts = relative.split("/")
    if EXCLUDED_DIRS.intersection(parts[:-1]):
        return "test suite, third-party or generated package"
    if parts[0].startswith("config-") or parts[-1].startswith("_sysconfigdata"):
        return "build-specific"
    if b"gencodec.py" in head:
        return "generated codec table"
    return None


def _in(relative: str, prefixes: Sequence[str]) -> bool:
    return any(relative == p or (p.endswith("/") and relative.startswith(p)) for p in prefixes)


def select_files(config: CorpusConfig = CorpusConfig()) -> list[CorpusFile]:
    """The corpus files, sorted by path, each with its split."""
    root = Path(config.root)
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib folder {root} does not exist")
    files = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        relative = path.relative_to(root).as_posix()
        if config.only and not any(relative.startswith(p) for p in config.only):
            continue
        data = path.read_bytes()
        if len(data) > config.max_file_bytes or excluded(relative, data[:1000]):
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        split = HELDOUT_SPLIT if _in(relative, config.heldout) else TRAIN
        files.append(CorpusFile(relative, len(data), hashlib.sha256(data).hexdigest(), split))
    if not any(f.split == TRAIN for f in files):
        raise ValueError(f"no training files under {root} (only={list(config.only)})")
    return files


def read_texts(root: Path, files: Sequence[CorpusFile], split: str) -> list[str]:
    """The texts of the files of ``split``, in order."""
    return [(Path(root) / f.path).read_text(encoding="utf-8") for f in files if f.split == split]


def manifest(config: CorpusConfig, files: Sequence[CorpusFile]) -> dict:
    """What the model card cites: source, licence, interpreter, totals per split and every file."""
    root = Path(config.root)
    licence_file = next((p for p in (root / "LICENSE.txt", root / "LICENSE") if p.is_file()), None)
    totals = {s: {"files": sum(f.split == s for f in files), "bytes": sum(f.bytes for f in files if f.split == s)} for s in (TRAIN, HELDOUT_SPLIT)}
    return {
        "source": "Python standard library (.py sources)",
        "licence": LICENSE,
        "licence_file": str(licence_file) if licence_file else None,
        "python": platform.python_version(),
        "root": str(root),
        "heldout": list(config.heldout),
        "only": list(config.only),
        "max_file_bytes": config.max_file_bytes,
        "totals": totals,
        "files": [asdict(f) for f in files],
    }


def pack(encode_batch, texts: Sequence[str], eot_id: int) -> np.ndarray:
    """``texts`` as one uint16 stream: each text's ids (``encode_batch(texts)`` -> lists of ids) then ``eot_id``."""
    ids = encode_batch(list(texts))
    if max(eot_id, *(max(i, default=0) for i in ids)) > np.iinfo(np.uint16).max:
        raise ValueError("token ids do not fit uint16; use a vocabulary of at most 65536 tokens")
    stream = [np.asarray([*doc, eot_id], dtype=np.uint16) for doc in ids]
    return np.concatenate(stream) if stream else np.zeros(0, np.uint16)


def save_packed(path: Path, train: np.ndarray, heldout: np.ndarray, info: dict) -> None:
    """``train`` and ``heldout`` uint16 streams, plus ``info`` (e.g. the special token ids) as JSON."""
    np.savez_compressed(path, train=train, heldout=heldout, info=np.frombuffer(json.dumps(info).encode(), np.uint8))


def load_packed(path: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """The ``train`` and ``heldout`` streams and the info dict written by :func:`save_packed`."""
    with np.load(path) as data:
        for key in ("train", "heldout", "info"):
            if key not in data:
                raise ValueError(f"{path}: packed corpus has no {key!r} array")
        return data["train"], data["heldout"], json.loads(data["info"].tobytes())


def build_corpus(out_dir: Path, config: CorpusConfig = CorpusConfig(), vocab_size: int = 8192) -> dict:
    """Select the files (``manifest.json``), train the tokenizer on the training split
    (``tokenizer.json``) and pack both splits (``corpus.npz``) into ``out_dir``; returns the counts."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = select_files(config)
    listing = manifest(config, files)
    (out_dir / MANIFEST_FILE).write_text(json.dumps(listing, indent=1) + "\n")
    train_texts, heldout_texts = (read_texts(config.root, files, split) for split in (TRAIN, HELDOUT_SPLIT))
    if not heldout_texts:
        raise ValueError(f"no held-out files among the selection (held-out list: {list(config.heldout)})")
    backend = bpe.train_bpe(train_texts, vocab_size)
    backend.save(str(out_dir / TOKENIZER_FILE))

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]

    eot = backend.token_to_id(bpe.EOT)
    train, heldout = pack(encode_batch, train_texts, eot), pack(encode_batch, heldout_texts, eot)
    info = {"eot_id": eot, "mask_id": backend.token_to_id(bpe.MASK), "vocab_size": backend.get_vocab_size(with_added_tokens=True)}
    save_packed(out_dir / PACKED_FILE, train, heldout, info)
    totals = listing["totals"]
    return {
        **info, "train_tokens": len(train), "heldout_tokens": len(heldout),
        "train_bytes": totals[TRAIN]["bytes"], "heldout_bytes": totals[HELDOUT_SPLIT]["bytes"],
        "bytes_per_token": round(totals[TRAIN]["bytes"] / len(train), 3), "packed_bytes": (out_dir / PACKED_FILE).stat().st_size,
    }
