"""``splitspec bench`` end to end on the CPU with the tiny random shapes: every part runs through
the real services and the figures hang together (an oracle draft accepts more than AR); the
quantized and hybrid shapes time their components (the quantized ones with a quantized-matmul
kernel table) and run the system part (the quantized ones kept quantized, under --memory-cap-gb),
and the baseline part refuses the shapes it cannot measure."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from splitspec.bench.random_weights import random_draft, random_target, random_target_config
from splitspec.bench.report import ORACLE_NOTE, oracle_label

pytestmark = pytest.mark.slow


def test_random_shapes_load_and_unknown_ones_are_named():
    model, config = random_target("random:tiny")
    assert random_target_config("random:tiny") == config
    draft, draft_config = random_draft("random:tiny-dflash")
    assert draft_config.hidden_size == config.hidden_size
    with pytest.raises(ValueError, match="random:qwen3-8b"):
        random_target_config("random:nope")


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
    assert comp["prefill_ms"]["fixed shapes"] > 0 and "Prefill of the prompt: fixed shapes" in proc.stdout
    for wire in ("stream", "unary"):
        rows = {r["label"]: r for r in result["system"] if r["wire"] == wire}
        # AL counts verify steps only (the prefill's token is no step's): target-only is exactly 1.
        assert rows["off (AR)"]["acceptance_length"] == 1.0 and rows["off (AR)"]["committed_tokens"] == 2 * 23
        # An uncorrupted oracle is the target's own continuation: nearly every drafted token is accepted.
        assert rows[oracle_label(0.0)]["acceptance_length"] > 2 * rows[oracle_label(0.9)]["acceptance_length"]
        assert rows[oracle_label(0.0)]["draft_fallbacks"] == 0
        # Every request commits all its tokens but the prefill's through verify steps.
        assert all(r["committed_tokens"] == r["completion_tokens"] - 2 for r in rows.values())
        assert all(r["acceptance_length"] == r["committed_tokens"] / r["steps"] for r in rows.values())
    # The oracle rows say, in their labels and beside the table, that they are benchmark-only.
    oracle_rows = [r for r in result["system"] if r["drafter"] == "oracle"]
    assert len(oracle_rows) == 2 * 2 and all(ORACLE_NOTE in r["label"] and r["label"].startswith("oracle") for r in oracle_rows)
    assert all(f"| {r['label']} | {r['wire']} |" in proc.stdout for r in oracle_rows)
    assert "The `oracle` rows are **benchmark-only**" in proc.stdout and "skips the draft's forward pass and all tap-feature traffic" in proc.stdout
    # The headline: one line per oracle AL and wire, AL × t_AR / t_round from this run's own rows.
    headline = result["headline"]
    assert "AL × t_AR / t_round" in result["headline_rule"] and "**Headline**, " + result["headline_rule"] in proc.stdout
    assert sorted((h["wire"], h["al_from"]) for h in headline) == sorted((r["wire"], r["label"]) for r in oracle_rows)
    for h in headline:
        rows = {r["label"]: r for r in result["system"] if r["wire"] == h["wire"]}
        al, t_ar, t_round = rows[h["al_from"]]["acceptance_length"], rows["off (AR)"]["ms_per_step"], rows["dflash (random weights)"]["ms_per_step"]
        assert (h["acceptance_length"], h["t_ar_ms"], h["t_round_ms"]) == (al, t_ar, t_round)
        assert h["speedup"] == pytest.approx(al * t_ar / t_round, rel=1e-12) and h["speedup"] > 0
        assert f"- {h['line']}" in proc.stdout and f"= {h['speedup']:.2f}× AR" in h["line"]
    assert len(result["system"]) == 2 * 4 and all(r["completion_tokens"] == 2 * 24 for r in result["system"])
    # Decode steps alone (prefill excluded) are shorter than the whole batch's time per step.
    assert all(0 < r["ms_per_step"] < 1e3 * r["seconds"] / r["steps"] for r in result["system"])
    # Where the steps went, by the services' own /metrics: a drafted step's Verify round trip holds the
    # target's pass and its wait for it (target-only steps are pipelined: their figure is the
    # gateway's wait for each answer); a Propose's only where a draft proposes; both within the step.
    for r in result["system"]:
        f = r["split"]
        assert 0 < f["target_pass_ms"] and 0 < f["verify_rpc_ms"] + (f["propose_rpc_ms"] or 0) < r["ms_per_step"], (r["label"], f)
        if r["drafter"] != "off":
            assert f["target_pass_ms"] + f["target_queue_ms"] <= f["verify_rpc_ms"] and f["propose_rpc_ms"] > 0, (r["label"], f)
        else:
            assert f["propose_rpc_ms"] is None and f["draft_pass_ms"] is None
        # Each row's requests bring their prompts: the target's prompt passes, shared over the row's decode steps.
        assert f["prompt_ms_per_step"] > 0, (r["label"], f)
        if r["drafter"] == "dflash":  # the draft's own pass and wait, within its Propose round trip
            assert 0 < f["draft_pass_ms"] and f["draft_pass_ms"] + f["draft_queue_ms"] <= f["propose_rpc_ms"], (r["label"], f)
        assert f"| {r['label'].replace(ORACLE_NOTE, 'benchmark-only')} | {r['wire']} | 1 | {r['ms_per_step']:.2f} | {f['verify_rpc_ms']:.2f} |" in proc.stdout
    assert {"target.log", "draft0.log", "gateway0-stream.log", "gateway0-unary.log"} <= {p.name for p in (tmp_path / "logs").iterdir()}
    assert result["baseline_tokens_per_s"] > 0
    assert "| off (AR) | stream |" in proc.stdout and "| off (AR) | unary |" in proc.stdout and "transformers eager" in proc.stdout


def _bench(tmp_path, shape: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "splitspec", "bench", "--shape", shape, "--device", "cpu", "--dtype", "float32",
         "--prompt-len", "24", "--iters", "2", "--json", str(tmp_path / "bench.json"), *args],
        capture_output=True, text=True, timeout=600,
    )


@pytest.mark.parametrize("shape, path", [("tiny-q4km", "fixed shapes"), ("tiny-qwen35", "fixed shapes"), ("tiny-qwen35-q4km", "fixed shapes")])
def test_components_of_the_quantized_and_hybrid_shapes(shape, path):
    """Finite, positive timings for every budget; the hybrid target runs the fixed-shape path as
    the dense one does (on a CPU without graphs); the roofline counts the bytes the model holds."""
    from splitspec.bench.components import time_draft, time_target, weight_bytes

    report = time_target(f"random:{shape}", torch.device("cpu"), torch.float32, [4, 22], prompt_len=24, iters=2, graphs=True)
    assert list(report.ar_ms) == [path] and set(report.verify_ms[path]) == {4, 22}
    figures = [report.ar_ms[path], *report.verify_ms[path].values(), *time_draft(f"random:{shape}", torch.device("cpu"), torch.float32, 24, 2).values()]
    assert len(figures) == 4 and all(math.isfinite(ms) and ms > 0 for ms in figures)
    assert report.weight_bytes == weight_bytes(random_target(f"random:{shape}")[0])
    assert 0 < report.roofline_ms < math.inf


def test_bench_components_of_a_quantized_shape_with_the_kernel_table(tmp_path):
    from splitspec.bench.components import KERNEL_ROWS, weight_bytes

    proc = _bench(tmp_path, "tiny-q4km", "--parts", "components", "--budgets", "4,22")
    assert proc.returncode == 0, proc.stderr[-3000:]
    comp = json.loads((tmp_path / "bench.json").read_text())["components"]
    # The roofline reads the packed blocks (test_random_weights checks what weight_bytes counts).
    assert comp["weight_bytes"] == weight_bytes(random_target("random:tiny-q4km")[0])
    assert set(comp["verify_ms"]) == {"fixed shapes"} and all(ms > 0 for ms in comp["verify_ms"]["fixed shapes"].values())
    assert comp["draft_ms"]["eager"] > 0 and "| fixed shapes |" in proc.stdout
    # The kernel table: five types at both MLP sizes, every row count; the model's own types marked.
    kernels = comp["kernels"]
    assert {(k["qtype"], k["layer"], k["rows"]) for k in kernels} == {
        (q, layer, m) for q in ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS") for layer in ("ffn_up", "ffn_down") for m in KERNEL_ROWS
    }
    assert {k["qtype"] for k in kernels if k["in_model"]} == {"Q4_K", "Q6_K"}
    for k in kernels:
        # No Triton kernel on a plain CPU: the row says it timed QuantLinear's reference path.
        assert k["path"] == "reference" and k["timing"] == "wall time" and k["us"] > 0
        assert (k["out_features"], k["in_features"]) == ((512, 256) if k["layer"] == "ffn_up" else (256, 512))
        assert k["bandwidth"] == pytest.approx(k["packed_bytes"] / (k["us"] * 1e-6))
        assert k["copy_share"] == pytest.approx(k["bandwidth"] / comp["copy_bandwidth"])
        one = next(o for o in kernels if (o["qtype"], o["layer"], o["rows"]) == (k["qtype"], k["layer"], 1))
        assert k["vs_one_row"] == pytest.approx(k["us"] / one["us"]) and k["packed_bytes"] == one["packed_bytes"]
    assert "| type | layer [N × K] | packed MB | " + " | ".join(f"M={m}" for m in KERNEL_ROWS) + " |" in proc.stdout
    assert "| Q4_K* | ffn_up [512 × 256] | 0.07 |" in proc.stdout and "| IQ4_XS | ffn_down [256 × 512] |" in proc.stdout
    assert "path: reference; wall time" in proc.stdout


def test_baseline_refuses_a_quantized_shape_in_one_line(tmp_path):
    proc = _bench(tmp_path, "tiny-q4km", "--parts", "baseline")
    assert proc.returncode == 2 and "dense unquantized" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "bench.json").exists()


def test_bench_system_runs_a_hybrid_shape(tmp_path):
    """The hybrid target's greedy output is the same on every pass shape too: an uncorrupted oracle
    is accepted nearly whole."""
    proc = _bench(tmp_path, "tiny-qwen35", "--parts", "system", "--corruptions", "0.0", "--prompts", "1", "--max-tokens", "24")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["label"]: r for r in json.loads((tmp_path / "bench.json").read_text())["system"]}
    assert rows["off (AR)"]["acceptance_length"] == 1.0 and rows[oracle_label(0.0)]["acceptance_length"] > 4
    assert all(r["completion_tokens"] == 24 for r in rows.values())


def test_bench_system_runs_a_quantized_hybrid_shape_kept_quantized_under_a_memory_cap(tmp_path):
    """tiny-qwen35-q4km through the three services: its workers keep the blocks quantized, the cap is
    split as `splitspec serve` splits it on one device (target 2, draft 1 of 3 GiB) and reported with
    each worker's plan; the uncorrupted oracle is accepted nearly whole (the structured Q6_K head
    makes greedy output the same on every pass shape), and the headline uses the DFlash round."""
    proc = _bench(
        tmp_path, "tiny-qwen35-q4km", "--parts", "system", "--corruptions", "0.0", "--prompts", "1", "--max-tokens", "24",
        "--memory-cap-gb", "3", "--log-dir", str(tmp_path / "logs"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["label"]: r for r in result["system"]}
    assert rows["off (AR)"]["acceptance_length"] == 1.0 and rows[oracle_label(0.0)]["acceptance_length"] > 4
    assert all(r["completion_tokens"] == 24 and r["draft_fallbacks"] == 0 for r in rows.values())
    (h,) = result["headline"]
    t_ar, t_round = rows["off (AR)"]["ms_per_step"], rows["dflash (random weights)"]["ms_per_step"]
    assert h["speedup"] == pytest.approx(rows[oracle_label(0.0)]["acceptance_length"] * t_ar / t_round, rel=1e-12)
    workers = result["workers"]
    assert workers["keep_quantized"] and workers["memory_cap_gb"] == 3
    assert workers["target"]["flags"] == ["--keep-quantized", "--memory-cap-gb", "2"]
    assert workers["draft"]["flags"] == ["--keep-quantized", "--memory-cap-gb", "1"]
    for name, cap in (("target", 2.0), ("draft", 1.0)):
        assert workers[name]["cap"] == cap and workers[name]["verdict"] == "fits"
        assert 0 < workers[name]["plan"] <= workers[name]["budget"] < cap
    assert "Model workers: blocks kept quantized (--keep-quantized), --memory-cap-gb 3; target: plan " in proc.stdout
    logs = tmp_path / "logs"
    assert "32 linears in blocks (Q4_K 27, Q6_K 5), 0 dequantized; embedding in blocks (Q4_K)" in (logs / "target.log").read_text()
    assert "the target's embedding in blocks (Q4_K), LM head in blocks (Q6_K)" in (logs / "draft-dflash.log").read_text()


def test_worker_flags_split_the_cap_as_serve_does():
    from splitspec.bench.system import worker_flags

    assert worker_flags(False, 0, 0, True) == ([], [])
    assert worker_flags(True, 0, 0, True) == (["--keep-quantized"], ["--keep-quantized"])
    assert worker_flags(False, 24, 0, False) == (["--memory-cap-gb", "24"], ["--memory-cap-gb", "24"])  # a device each
    assert worker_flags(True, 40, 10, True) == (["--keep-quantized", "--memory-cap-gb", "30"], ["--keep-quantized", "--memory-cap-gb", "10"])
    with pytest.raises(ValueError, match="--draft-memory-gb 30"):
        worker_flags(False, 24, 30, True)
