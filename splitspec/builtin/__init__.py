"""The built-in model pair: a small Qwen3 target trained on the Python standard library and its
DFlash draft, shipped as package data (see ``MODEL_CARD.md`` here and ``scripts/build_builtin_pair.py``).

``splitspec serve`` serves it when no ``--target-model`` is given. A source checkout without the
weights has no pair; serve then falls back to a random tiny pair.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
TARGET_FILE = "target.gguf"
DRAFT_DIR = "draft"
DRAFT_FILES = ("config.json", "model.safetensors")
CARD_FILE = "MODEL_CARD.md"


def builtin_pair(directory: Path = HERE) -> tuple[Path, Path] | None:
    """(target GGUF, draft directory) of the pair in ``directory``, or None when any file is missing."""
    target, draft = directory / TARGET_FILE, directory / DRAFT_DIR
    if target.is_file() and all((draft / name).is_file() for name in DRAFT_FILES):
        return target, draft
    return None
