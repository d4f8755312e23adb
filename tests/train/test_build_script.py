"""scripts/build_builtin_pair.py end to end on a tiny configuration, as real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from splitspec.models.loader import check_draft_fits, load_dflash_draft, load_target

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_builtin_pair.py"
TINY_TARGET = {
    "hidden-size": 64, "num-layers": 2, "num-heads": 4, "num-kv-heads": 2, "head-dim": 16, "intermediate-size": 128,
    "seq-len": 64, "batch-size": 8, "max-steps": 10, "eval-every": 5, "eval-tokens": 1024, "warmup-steps": 2,
}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_help_lists_the_stages_and_target_flags():
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    for word in ("corpus", "target", "draft", "card", "install", "--target-hidden-size", "--target-compile", "--draft-arg"):
        assert word in done.stdout


def test_corpus_target_and_card_stages(tmp_path, small_build):
    build = tmp_path / "build"
    only = [arg for prefix in small_build.config.only for arg in ("--only", prefix)]
    target = [arg for key, value in TINY_TARGET.items() for arg in (f"--target-{key}", str(value))]
    done = _run("corpus", "target", "card", "--build-dir", str(build), "--seed", "3", "--vocab-size", "512", *only, *target, "--no-progress")
    assert done.returncode == 0, done.stderr
    corpus_log = json.loads((build / "corpus_log.json").read_text())
    target_log = json.loads((build / "target_log.json").read_text())
    assert corpus_log["vocab_size"] == 512 and corpus_log["train_tokens"] > 10_000
    assert "--vocab-size 512" in corpus_log["command"] and corpus_log["packed_bytes"] == (build / "corpus.npz").stat().st_size
    result = target_log["result"]
    assert target_log["config"]["seed"] == 3 and target_log["config"]["hidden_size"] == 64 and result["steps"] == 10
    assert result["heldout_loss_best"] < result["heldout_loss_initial"]
    _, dense = load_target(build / "target.gguf")
    assert (dense.hidden_size, dense.num_layers, dense.vocab_size, dense.max_context) == (64, 2, 512, 64)

    card = (build / "MODEL_CARD.md").read_text()
    assert "PSF-2.0" in card and "Restricted build" in card and "`argparse.py`" in card
    assert f"**{result['heldout_loss_best']:.3f}**" in card and target_log["command"] in card and corpus_log["command"] in card
    assert "## DFlash draft\n\nNot built yet." in card and "not measured yet" in card

    rows = [{"prompt_set": "stdlib held-out", "mode": "ddtree", "budget": 22, "acceptance_length": 3.456, "tokens_per_s": 812.0, "device": "H100"}]
    (tmp_path / "al.json").write_text(json.dumps(rows))
    done = _run("card", "--build-dir", str(build), "--measurements", str(tmp_path / "al.json"))
    assert done.returncode == 0, done.stderr
    assert "| stdlib held-out | ddtree | 22 | dflash | 3.46 | 812.0 | H100 |" in (build / "MODEL_CARD.md").read_text()

    done = _run("install", "--build-dir", str(build), "--install-dir", str(tmp_path / "installed"))
    assert done.returncode != 0 and f"install: missing {build / 'draft' / 'config.json'}" in done.stderr

    # The draft stage trains on the packed corpus with splitspec.train.draft; then the pair installs.
    draft_args = [a for kv in ("steps=4", "seq_len=32", "batch_size=2", "anchors=4", "eval_every=2", "layers=1") for a in ("--draft-arg", kv)]
    done = _run("draft", "card", "--build-dir", str(build), *draft_args)
    assert done.returncode == 0, done.stderr
    draft_log = json.loads((build / "draft_log.json").read_text())
    assert draft_log["result"]["step"] == 4
    assert "## DFlash draft\n" in (build / "MODEL_CARD.md").read_text() and "DFlash2" not in (build / "MODEL_CARD.md").read_text()
    done = _run("install", "--build-dir", str(build), "--install-dir", str(tmp_path / "installed"))
    assert done.returncode == 0, done.stderr
    draft, draft_config = load_dflash_draft(tmp_path / "installed" / "draft")
    check_draft_fits(draft_config, dense, "draft", "target")
    assert not (tmp_path / "installed" / "draft-dflash2").exists()


def test_dflash2_draft_stage_and_its_comparison_in_the_card(tmp_path, small_build):
    """The draft stage's DFlash2 draft goes to draft-dflash2/ with its own log; the card gets its
    section and the AL ratios against DFlash; install ships it beside the DFlash draft."""
    build = tmp_path / "build"
    only = [arg for prefix in small_build.config.only for arg in ("--only", prefix)]
    target = [arg for key, value in TINY_TARGET.items() for arg in (f"--target-{key}", str(value))]
    tiny = ("steps=2", "seq_len=32", "batch_size=2", "anchors=4", "eval_every=2", "layers=1")
    draft_args = [a for kv in tiny for a in ("--draft-arg", kv)]
    done = _run("corpus", "target", "draft", "--build-dir", str(build), "--seed", "3", "--vocab-size", "512", *only, *target, *draft_args, "--no-progress")
    assert done.returncode == 0, done.stderr
    more = [a for kv in ("arch=dflash2", "selector_top_k=4", "selector_rank=8") for a in ("--draft-arg", kv)]
    done = _run("draft", "--build-dir", str(build), *draft_args, *more, "--no-progress")
    assert done.returncode == 0, done.stderr
    log2 = json.loads((build / "draft-dflash2_log.json").read_text())
    assert log2["config"]["arch"] == "dflash2" and log2["result"]["step"] == 2 and "acceptance_top1" in log2["result"]["evals"][-1]
    assert json.loads((build / "draft_log.json").read_text())["config"]["arch"] == "dflash"  # the DFlash draft's log is kept

    def row(draft, al, scores=None):
        return {"prompt_set": "HumanEval", "mode": "chain", "budget": 8, "acceptance_length": al, "tokens_per_s": 1.0, "device": "cpu",
                "draft": draft, **({"tree_scores": scores} if scores else {})}

    rows = [row("dflash", 2.0), row("dflash2", 2.5, "lattice"), row("dflash2", 2.2, "independent")]
    (tmp_path / "al.json").write_text(json.dumps(rows))
    done = _run("card", "--build-dir", str(build), "--measurements", str(tmp_path / "al.json"))
    assert done.returncode == 0, done.stderr
    card = (build / "MODEL_CARD.md").read_text()
    assert "## DFlash draft\n" in card and "## DFlash2 draft\n" in card and log2["command"] in card
    assert "| HumanEval | chain | 8 | dflash2 (lattice) | 2.50 | 1.0 | cpu |" in card
    assert "| HumanEval | chain | 8 | cpu | 2.00 | 2.50 | 1.25x | 2.20 | 1.14x |" in card

    assert _run("install", "--build-dir", str(build), "--install-dir", str(tmp_path / "installed")).returncode == 0
    _, config2 = load_dflash_draft(tmp_path / "installed" / "draft-dflash2")
    assert type(config2).__name__ == "DFlash2Config" and config2.selector_top_k == 4
