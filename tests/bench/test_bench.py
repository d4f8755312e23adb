"""``splitspec bench`` end to end on the CPU with the tiny random shape: every part runs through
the real services and the figures hang together (a replayed draft accepts more than AR)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from splitspec.models.loader import load_dflash_draft, load_target, read_target_config

pytestmark = pytest.mark.slow


def test_random_shapes_load_and_unknown_ones_are_named():
    model, config = load_target("random:tiny")
    assert read_target_config("random:tiny") == config
    draft, draft_config = load_dflash_draft("random:tiny-dflash")
    assert draft_config.hidden_size == config.hidden_size
    with pytest.raises(ValueError, match="random:qwen3-8b"):
        read_target_config("random:nope")


def test_bench_runs_every_part(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "splitspec", "bench", "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
         "--budgets", "4,22", "--corruptions", "0.9,0.0", "--prompts", "2", "--prompt-len", "24", "--max-tokens", "24",
         "--iters", "3", "--wire", "stream,unary", "--json", str(out), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    comp = result["components"]
    assert set(comp["verify_ms"]["fixed shapes"]) == {"4", "22"} and comp["draft_ms"]["eager"] > 0
    for wire in ("stream", "unary"):
        rows = {r["label"]: r for r in result["system"] if r["wire"] == wire}
        assert rows["off (AR)"]["acceptance_length"] < 1.2
        # An uncorrupted replay is the target's own continuation: nearly every drafted token is accepted.
        assert rows["replay 0.00"]["acceptance_length"] > 2 * rows["replay 0.90"]["acceptance_length"]
        assert rows["replay 0.00"]["draft_fallbacks"] == 0
    assert len(result["system"]) == 2 * 4 and all(r["completion_tokens"] == 2 * 24 for r in result["system"])
    # Decode steps alone (prefill excluded) are shorter than the whole batch's time per step.
    assert all(0 < r["ms_per_step"] < 1e3 * r["seconds"] / r["steps"] for r in result["system"])
    assert {"target.log", "draft0.log", "gateway0-stream.log", "gateway0-unary.log"} <= {p.name for p in (tmp_path / "logs").iterdir()}
    assert result["baseline_tokens_per_s"] > 0
    assert "| off (AR) | stream |" in proc.stdout and "| off (AR) | unary |" in proc.stdout and "transformers eager" in proc.stdout
