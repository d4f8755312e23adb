"""The built-in pair: found only when all its files are installed; `serve` falls back to a tiny pair otherwise."""

from __future__ import annotations

import logging

from splitspec.builtin import builtin_pair
from splitspec.cli.serve import default_pair
from splitspec.fixtures.tiny import TinySpec, make_tiny


def test_builtin_pair_needs_every_file(tmp_path):
    assert builtin_pair(tmp_path) is None
    target, draft = make_tiny(tmp_path, TinySpec(seed=3))  # the same layout: target.gguf, draft/{config.json, model.safetensors}
    assert builtin_pair(tmp_path) == (target, draft)
    (draft / "model.safetensors").unlink()
    assert builtin_pair(tmp_path) is None


def test_serve_prefers_the_builtin_pair_and_falls_back_to_a_tiny_one(tmp_path, caplog):
    installed = tmp_path / "builtin"
    target, draft = make_tiny(installed, TinySpec(seed=3))
    work = tmp_path / "work"
    with caplog.at_level(logging.INFO, logger="splitspec.cli.serve"):
        assert default_pair(work, installed) == (target, draft)
        assert "serving the built-in pair" in caplog.text and not work.exists()
        fallback = default_pair(work, tmp_path / "empty")
    assert fallback == (work / "tiny" / "target.gguf", work / "tiny" / "draft") and fallback[0].is_file()
    assert "built-in pair's weights are not installed" in caplog.text
