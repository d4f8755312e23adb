"""Model locations: a local path, or a Hugging Face Hub reference resolved through its cache.

A *model reference* is either a plain path (always used as is) or ``hf://OWNER/REPO[@REVISION][/FILE]``:

- ``hf://Qwen/Qwen3-8B-GGUF/Qwen3-8B-Q4_K_M.gguf``: one file of the repository (a GGUF, or the
  first part of a split GGUF, whose other parts come along);
- ``hf://Qwen/Qwen3-8B``: the repository as a model directory (config, safetensors, tokenizer).

Files come through ``huggingface_hub`` and its cache (``HF_HOME``), so a cached model resolves
with ``HF_HUB_OFFLINE=1`` and no network. This module needs no torch: the gateway uses it too.
"""

from __future__ import annotations

import os
from pathlib import Path

from splitspec.models.gguf_file import ModelFileError, split_parts

HF_SCHEME = "hf://"
# What a model directory needs; weights in other formats (*.bin, *.pt, ...) are never fetched.
DIRECTORY_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


def parse_hf_reference(reference: str) -> tuple[str, str | None, str | None]:
    """``hf://owner/repo[@revision][/file]`` -> (repo_id, revision, filename or None)."""
    rest = reference[len(HF_SCHEME):]
    parts = rest.split("/", 2)
    if len(parts) < 2 or not all(parts[:2]):
        raise ModelFileError(f"{reference}: a Hub reference is hf://OWNER/REPO[@REVISION][/FILE]")
    owner, repo = parts[0], parts[1]
    revision = None
    if "@" in repo:
        repo, revision = repo.split("@", 1)
    filename = parts[2] if len(parts) == 3 and parts[2] else None
    return f"{owner}/{repo}", revision, filename


def resolve_model(reference: str | os.PathLike) -> Path:
    """The local path of a model reference, downloading (or finding in the cache) a Hub reference."""
    text = str(reference)
    if not text.startswith(HF_SCHEME):
        return Path(text)
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, OfflineModeIsEnabled

    repo_id, revision, filename = parse_hf_reference(text)
    try:
        if filename is None:
            return Path(snapshot_download(repo_id, revision=revision, allow_patterns=DIRECTORY_PATTERNS))
        # The other parts of a split GGUF sit next to the first in the repository (and the cache).
        paths = [Path(hf_hub_download(repo_id, str(part), revision=revision)) for part in split_parts(filename)]
        return paths[0]
    except (EntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError, ValueError) as exc:
        offline = " (HF_HUB_OFFLINE is set: only cached files can be used)" if _offline() else ""
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelFileError(f"{text}: cannot fetch from the Hugging Face Hub{offline}: {first_line}") from exc


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
