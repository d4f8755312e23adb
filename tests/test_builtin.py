"""The built-in pair: found only when all its files are installed; `serve` falls back to a tiny pair otherwise."""

from __future__ import annotations

import logging
import shutil

import pytest

from splitspec.builtin import builtin_pair
from splitspec.cli.serve import default_pair
from splitspec.fixtures.tiny import TinySpec, make_tiny


def test_builtin_pair_needs_every_file(tmp_path):
    assert builtin_pair(tmp_path) is None
    target, draft = make_tiny(tmp_path, TinySpec(seed=3))  # the same layout: target.gguf, draft/{config.json, model.safetensors}
    assert builtin_pair(tmp_path) == (target, draft)
    (draft / "model.safetensors").unlink()
    assert builtin_pair(tmp_path) is None


def test_builtin_pair_picks_its_draft_by_architecture(tmp_path):
    target, draft = make_tiny(tmp_path, TinySpec(seed=3))
    assert builtin_pair(tmp_path, "dflash2") is None  # DFlash2's folder is not there yet
    _, draft2 = make_tiny(tmp_path / "other", TinySpec(seed=3, draft_arch="dflash2"))
    shutil.copytree(draft2, tmp_path / "draft-dflash2")
    assert builtin_pair(tmp_path, "dflash2") == (target, tmp_path / "draft-dflash2")
    assert builtin_pair(tmp_path, "dflash") == (target, draft)
    with pytest.raises(ValueError, match="'eagle3': choose one of dflash, dflash2"):
        builtin_pair(tmp_path, "eagle3")


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


def test_serve_builtin_draft_flag_serves_the_dflash2_draft(tmp_path, caplog):
    from splitspec.cli.main import build_parser

    installed = tmp_path / "builtin"
    target, _ = make_tiny(installed, TinySpec(seed=3))
    _, draft2 = make_tiny(tmp_path / "other", TinySpec(seed=3, draft_arch="dflash2"))
    shutil.copytree(draft2, installed / "draft-dflash2")
    args = build_parser().parse_args(["serve", "--builtin-draft", "dflash2"])
    with caplog.at_level(logging.INFO, logger="splitspec.cli.serve"):
        assert default_pair(tmp_path / "work", installed, args.builtin_draft) == (target, installed / "draft-dflash2")
    assert "dflash2 draft" in caplog.text
