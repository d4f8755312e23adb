"""``splitspec bench --concurrency``: the levels it accepts, how each level's requests are planned,
the sweep's table, and the sweep end to end through the real services on the tiny random pair and
on the built-in pair."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from splitspec.bench.report import AR_LABEL, BUILTIN_LABELS, DFLASH_LABEL, concurrency_table, headline_speedups, oracle_label, shaped_oracle_label
from splitspec.bench.system import MAX_CONCURRENCY, all_decoding, decoding_windows, parse_concurrency, plan_levels, random_prompts, requests_per_level


def test_concurrency_levels_are_parsed_ascending():
    assert parse_concurrency("1") == [1]
    assert parse_concurrency("16, 1,4,32") == [1, 4, 16, 32]


@pytest.mark.parametrize(
    "text, message",
    [
        ("1,x", "'x' is not a whole number"),
        ("", "'' is not a whole number"),
        ("1,,4", "'' is not a whole number"),
        ("2.5", "'2.5' is not a whole number"),
        ("0,4", "0 is out of range"),
        ("-1", "-1 is out of range"),
        (str(MAX_CONCURRENCY + 1), f"{MAX_CONCURRENCY + 1} is out of range"),
        ("1,4,1", "1 is given twice"),
    ],
)
def test_bad_concurrency_values_are_rejected_with_the_flag_and_the_value(text, message):
    with pytest.raises(ValueError) as exc:
        parse_concurrency(text)
    assert str(exc.value).startswith(f"--concurrency {text!r}: {message}") and "e.g. 1,4,16,32" in str(exc.value)


def test_the_cli_refuses_a_bad_level_in_one_line_before_starting_anything(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "splitspec", "bench", "--parts", "system", "--concurrency", "1,x", "--json", str(tmp_path / "b.json")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "--concurrency '1,x': 'x' is not a whole number" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "b.json").exists()


def test_each_level_gets_its_own_prompts_and_the_same_number_per_client():
    assert [requests_per_level(4, n) for n in (1, 3, 4, 16)] == [4, 6, 4, 16]
    plan = plan_levels(random_prompts(100, 5), [1, 3], prompts=2)
    assert [(p.concurrency, len(p.warm), len(p.timed)) for p in plan] == [(1, 2, 2), (3, 6, 3)]  # two warm-up rounds
    drawn = [tuple(ids) for p in plan for ids in p.warm + p.timed]
    assert len(set(drawn)) == len(drawn) == 13 and all(len(ids) == 5 for ids in drawn)
    # Warm-up first, then the timed prompts, in the pool's order.
    rng_order = plan_levels(random_prompts(100, 5), [1], prompts=2)[0]
    assert rng_order.warm + rng_order.timed == [ids for ids, _ in zip(random_prompts(100, 5), range(4))]


def test_all_decoding_counts_only_the_times_every_client_decodes():
    """Client A decodes over [0, 10] then, after a prefill, over [12, 20]; client B over [3, 15].
    Both decode over (3, 10] and (12, 15]: 10 s. A first arrival (the prefill's token) at a window's
    start is not counted, nor any token outside the windows."""
    a = [[(0.0, 1), (2.0, 1), (5.0, 2), (10.0, 1)], [(12.0, 1), (14.0, 3), (20.0, 1)]]
    b = [[(3.0, 1), (4.0, 4), (9.0, 1), (13.0, 2), (15.0, 1)]]
    # In the windows: A's 5.0 (2), 10.0 (1), 14.0 (3); B's 4.0 (4), 9.0 (1), 13.0 (2), 15.0 (1).
    assert all_decoding([a, b]) == (14, 10.0)
    assert decoding_windows([a, b]) == [(3.0, 10.0), (12.0, 15.0)]
    assert all_decoding([a]) == ((1 + 2 + 1) + (3 + 1), 18.0)  # one client: every token after each request's first
    assert all_decoding([a, [[(10.5, 1), (11.5, 1)]]]) == (0, 0.0)  # never both at once
    assert all_decoding([a, []]) == (0, 0.0)  # a client that made no request


def _row(label: str, n: int, tok_s: float, ms: float, al: float, drafter: str, corruption: float | None = None) -> dict:
    steps = 10
    return {
        "label": label, "wire": "socket", "budget": 22, "concurrency": n, "tokens_per_s": tok_s, "ms_per_step": ms,
        "acceptance_length": al, "steps": steps, "committed_tokens": al * steps, "drafter": drafter, "corruption": corruption,
    }


def test_the_sweep_table_has_a_row_per_level_and_a_column_per_kind():
    rows = [
        r
        for n, ar_tok_s, t_ar, t_round in ((1, 100.0, 5.0, 8.0), (4, 300.0, 6.0, 10.0))
        for r in (
            _row(AR_LABEL, n, ar_tok_s, t_ar, 1.0, "off"),
            _row(oracle_label(0.1), n, 5 * ar_tok_s, 7.0, 8.0, "oracle", 0.1),
            _row(DFLASH_LABEL, n, 0.6 * ar_tok_s, t_round, 1.0, "dflash"),
        )
    ]
    table = concurrency_table(rows, "socket")
    assert table[0] == (
        "| concurrency | off (AR) | dflash (random weights) | oracle 0.10 (benchmark-only) | honest aggregate at oracle 0.10's AL |"
    )
    assert table[1] == "|---|---|---|---|---|" and len(table) == 2 + 2
    assert table[2] == (
        "| 1 | 100.0 tok/s (1.00×), 5.00 ms, AL 1.00 | 60.0 tok/s (1.00×), 8.00 ms, AL 1.00 "
        "| 500.0 tok/s (1.00×), 7.00 ms, AL 8.00 | 1000.0 tok/s (5.00× AR) |"
    )
    # At 4: 4 × AL 8 / t_round 10 ms = 3200 tok/s; AL × t_AR / t_round = 8 × 6 / 10 = 4.80× AR; AR 300 / 100 = 3.00×.
    assert table[3].startswith("| 4 | 300.0 tok/s (3.00×), 6.00 ms, AL 1.00 |") and table[3].endswith("| 3200.0 tok/s (4.80× AR) |")
    h = {x["concurrency"]: x for x in headline_speedups(rows)}
    assert h[4]["aggregate_tokens_per_s"] == pytest.approx(3200.0) and h[4]["ar_scaling"] == pytest.approx(3.0)
    assert "aggregate 4 × 8.00 / 10.00 ms = 3200.0 tok/s; AR aggregate at 4 / at 1: 3.00×" in h[4]["line"]
    assert "AR aggregate" not in h[1]["line"]
    # Under the adaptive budget the oracle's and the draft's trees differ: no honest figure is made of them.
    assert headline_speedups([dict(r, budget="auto") for r in rows]) == []
    # A shaped oracle's row gives its line from its own AL and round, first at its level: it is measured.
    shaped = _row(shaped_oracle_label(0.1), 4, 200.0, 20.0, 8.0, "shaped-oracle", 0.1)
    at_4 = [x for x in headline_speedups([*rows, shaped]) if x["concurrency"] == 4]
    assert [x["al_from"] for x in at_4] == [shaped["label"], oracle_label(0.1)]
    assert at_4[0]["speedup"] == pytest.approx(8 * 6.0 / 20.0) and at_4[1]["speedup"] == pytest.approx(4.8)


def _sweep(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "splitspec", "bench", "--parts", "system", "--device", "cpu", "--dtype", "float32",
         "--prompts", "1", "--max-tokens", "8", "--concurrency", "1,3", "--json", str(out), *args],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_bench_sweeps_concurrency_through_the_services(tmp_path):
    """Every kind at every level; 3 clients at once each generate their own prompt. The shaped
    oracle's row (the random draft's passes, the oracle's answers) has the oracle's AL and its own round."""
    logs = tmp_path / "logs"
    proc, result = _sweep(tmp_path, "--shape", "tiny", "--corruptions", "0.0", "--prompt-len", "16", "--shaped-oracle", "0.0", "--log-dir", str(logs))
    assert result["concurrency"] == [1, 3]
    # The shaped draft's worker is a model worker as the DFlash draft's is: it logs its memory plan.
    assert "memory plan:" in (logs / "draft-shaped-oracle.log").read_text() and "SHAPED ORACLE" in (logs / "draft-shaped-oracle.log").read_text()
    shaped = shaped_oracle_label(0.0)
    kinds = [AR_LABEL, oracle_label(0.0), DFLASH_LABEL, shaped]
    for n in (1, 3):
        rows = {r["label"]: r for r in result["system"] if r["concurrency"] == n}
        assert sorted(rows) == sorted(kinds)
        assert all(r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and r["completion_tokens"] == n * 8 for r in rows.values())
        if n == 1:  # one client decodes from its first token to its last: every token but the prefill's
            assert rows[AR_LABEL]["all_decoding_tokens"] == 7 and rows[AR_LABEL]["all_decoding_seconds"] == pytest.approx(rows[AR_LABEL]["decode_seconds"])
        assert proc.stdout.count(f"\n| {n} | ") == 1  # one row of the sweep table per level
    assert (
        f"| concurrency | off (AR) | dflash (random weights) | {shaped} | oracle 0.00 (benchmark-only) "
        "| honest aggregate at dflash shape + oracle 0.00's AL | honest aggregate at oracle 0.00's AL |"
    ) in proc.stdout
    # The honest headline at each level, in aggregate: N × AL / t_round, and AR at N over AR at 1; the
    # shaped row's from its own AL and round.
    ar1 = next(r for r in result["system"] if r["label"] == AR_LABEL and r["concurrency"] == 1)
    assert sorted((h["concurrency"], h["al_from"]) for h in result["headline"]) == [(n, k) for n in (1, 3) for k in sorted((oracle_label(0.0), shaped))]
    for h in result["headline"]:
        rows = {r["label"]: r for r in result["system"] if r["concurrency"] == h["concurrency"]}
        assert rows[shaped]["acceptance_length"] == rows[oracle_label(0.0)]["acceptance_length"] > 1
        t_round = rows[shaped if h["al_from"] == shaped else DFLASH_LABEL]["ms_per_step"]
        expected = 1e3 * h["concurrency"] * rows[h["al_from"]]["acceptance_length"] / t_round
        assert h["aggregate_tokens_per_s"] == pytest.approx(expected, rel=1e-12) and f"- {h['line']}" in proc.stdout
        assert h["ar_scaling"] == pytest.approx(rows[AR_LABEL]["tokens_per_s"] / ar1["tokens_per_s"], rel=1e-12)
    assert {(s["label"], s["concurrency"], s["base_concurrency"]) for s in result["concurrency_scaling"]} == {(k, 3, 1) for k in kinds}


@pytest.mark.slow
@pytest.mark.parametrize("draft_arch", ["dflash", "dflash2"])
def test_bench_sweeps_the_builtin_pair_through_serve(tmp_path, draft_arch):
    """--pair builtin: `splitspec serve` with no model flags but --builtin-draft, the trained draft
    on held-out code (no oracle); --budget auto: the requests name no budget and serve's gateway
    chooses each step's."""
    proc, result = _sweep(tmp_path, "--pair", "builtin", "--prompt-len", "32", "--budget", "auto", "--builtin-draft", draft_arch)
    label = BUILTIN_LABELS[draft_arch]
    assert result["pair"] == "builtin" and "built-in pair" in proc.stdout.splitlines()[0]
    assert {r["budget"] for r in result["system"] if r["label"] == label} == {"auto"}
    assert f"| {label} | socket | auto |" in proc.stdout
    assert sorted((r["label"], r["concurrency"]) for r in result["system"]) == sorted(
        (k, n) for k in (AR_LABEL, label) for n in (1, 3)
    )
    assert all(r["tokens_per_s"] > 0 and r["completion_tokens"] == r["concurrency"] * 8 for r in result["system"])
    assert all(r["acceptance_length"] > 1 for r in result["system"] if r["label"] == label)  # a trained draft
    assert f"| concurrency | off (AR) | {label} |" in proc.stdout and "oracle" not in proc.stdout
    assert f"{label}: aggregate at 3 " in proc.stdout and not result["headline"]


def test_pair_flags_are_refused_where_they_do_not_apply():
    import argparse

    from splitspec.bench.main import add_arguments, check_pair

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ValueError, match="--builtin-draft: only with --pair builtin"):
        check_pair(p.parse_args(["--builtin-draft", "dflash2"]), {"system"})
    with pytest.raises(ValueError, match="runs the system part only"):
        check_pair(p.parse_args(["--pair", "builtin", "--builtin-draft", "dflash2"]), {"system", "components"})
    check_pair(p.parse_args(["--pair", "builtin", "--builtin-draft", "dflash2"]), {"system"})
    with pytest.raises(ValueError, match="--shaped-oracle: the built-in pair"):
        check_pair(p.parse_args(["--pair", "builtin", "--shaped-oracle", "0.1"]), {"system"})


def test_the_shaped_oracle_row_runs_by_default_on_a_gpu_at_the_longest_al():
    """Its measured round is the honest one; on a CPU (close to the composed figure, and slow) and
    under a memory cap (split between one target and one draft) auto leaves it out."""
    from splitspec.bench.main import shaped_corruption

    assert shaped_corruption("auto", [0.6, 0.15, 0.3], "cuda:0") == 0.15
    assert shaped_corruption("auto", [0.6, 0.15], "cpu") is None
    assert shaped_corruption("auto", [0.6, 0.15], "cuda:0", capped=True) is None
    assert shaped_corruption("off", [0.15], "cuda:0") is None
    assert shaped_corruption("0.3", [0.15], "cpu") == 0.3
    for bad, message in (("1.5", "must be in"), ("some", "a corruption rate in")):
        with pytest.raises(ValueError, match=message):
            shaped_corruption(bad, [0.15], "cuda:0")
