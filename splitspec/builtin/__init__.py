"""The built-in model pair: a small Qwen3 target trained on the Python standard library and its
drafts (DFlash, and DFlash2 beside it), shipped as package data (see ``MODEL_CARD.md`` here and
``scripts/build_builtin_pair.py``).

``splitspec serve`` serves it when no ``--target-model`` is given. A source checkout without the
weights has no pair; serve then falls back to a random tiny pair.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
TARGET_FILE = "target.gguf"
DRAFT_DIRS = {"dflash": "draft", "dflash2": "draft-dflash2"}  # draft architecture -> its folder
DRAFT_DIR = DRAFT_DIRS["dflash"]  # the draft served by default
DRAFT_FILES = ("config.json", "model.safetensors")
CARD_FILE = "MODEL_CARD.md"


def builtin_pair(directory: Path = HERE, draft_arch: str = "dflash") -> tuple[Path, Path] | None:
    """(target GGUF, draft directory) of the pair in ``directory`` with its ``draft_arch`` draft, or
    None when any file is missing."""
    if draft_arch not in DRAFT_DIRS:
        raise ValueError(f"built-in draft {draft_arch!r}: choose one of {', '.join(DRAFT_DIRS)}")
    target, draft = directory / TARGET_FILE, directory / DRAFT_DIRS[draft_arch]
    if target.is_file() and all((draft / name).is_file() for name in DRAFT_FILES):
        return target, draft
    return None
