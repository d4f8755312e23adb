"""Markdown tables of a ``splitspec bench`` result (the JSON it writes), with the goal ratios."""

from __future__ import annotations

# Row labels of the end-to-end part (splitspec.bench.system), which the headline reads.
AR_LABEL = "off (AR)"
DFLASH_LABEL = "dflash (random weights)"
ORACLE_NOTE = "benchmark-only: no draft forward pass, no tap-feature traffic"


def oracle_label(corruption: float) -> str:
    """The label of an OracleDrafter row: its corruption rate and :data:`ORACLE_NOTE`."""
    return f"oracle {corruption:.2f} ({ORACLE_NOTE})"


HEADLINE_RULE = (
    "speed-up of a real drafter = AL × t_AR / t_round, where AL is the oracle row's acceptance length, t_AR the "
    f"decode ms/step of the `{AR_LABEL}` row and t_round that of the `{DFLASH_LABEL}` row (the full round of the "
    "real draft shape: draft forward pass, tap features on the wire, verify), same wire, same run"
)


def headline_speedups(rows: list[dict]) -> list[dict]:
    """The speed-up a real drafter of this shape gets at each oracle row's acceptance length, per wire:
    ``AL × t_AR / t_round`` (:data:`HEADLINE_RULE`). The oracle rows' own tok/s are not used: the
    OracleDrafter runs no draft pass and moves no tap features, so its rounds are cheaper than a real one."""
    out = []
    for wire in dict.fromkeys(r["wire"] for r in rows):
        mine = [r for r in rows if r["wire"] == wire]
        ar = next((r for r in mine if r["label"] == AR_LABEL), None)
        dflash = next((r for r in mine if r["label"] == DFLASH_LABEL), None)
        if ar is None or dflash is None:
            continue
        t_ar, t_round = ar["ms_per_step"], dflash["ms_per_step"]
        for r in mine:
            if r.get("drafter", "oracle" if r["label"].startswith("oracle") else "") != "oracle":
                continue
            al = r["acceptance_length"]
            speedup = al * t_ar / t_round
            source = f"oracle {r['corruption']:.2f}" if r.get("corruption") is not None else r["label"]
            out.append({
                "wire": wire, "budget": dflash["budget"], "concurrency": dflash["concurrency"], "al_from": r["label"],
                "acceptance_length": al, "t_ar_ms": t_ar, "t_round_ms": t_round, "speedup": speedup,
                "line": f"wire {wire}, budget {dflash['budget']}, AL {al:.2f} (from {source}): "
                        f"{al:.2f} × {t_ar:.2f} ms / {t_round:.2f} ms = {speedup:.2f}× AR",
            })
    return out


def markdown(result: dict) -> str:
    lines = [f"### {result['shape']} ({result['dtype']}) on {result['card']}, {result['date']}, torch {result['torch']}", ""]
    comp = result.get("components")
    if comp:
        roof = comp["roofline_ms"]
        lines += [
            f"Weights {comp['weight_bytes'] / 1e9:.2f} GB; copy bandwidth {comp['copy_bandwidth'] / 1e12:.2f} TB/s; "
            f"roofline {roof:.2f} ms per step"
            + (f"; peak device memory {comp['peak_bytes'] / 1e9:.1f} GB while timing the target." if comp.get("peak_bytes") else "."),
            "",
            "| path | AR step ms (% of roofline) | " + " | ".join(f"verify b{b} ms (×AR)" for b in next(iter(comp["verify_ms"].values()))) + " |",
            "|---|---|" + "---|" * len(next(iter(comp["verify_ms"].values()))),
        ]
        for path, ar in comp["ar_ms"].items():
            cells = [f"{ms:.2f} ({ms / ar:.2f}×)" for ms in comp["verify_ms"][path].values()]
            lines.append(f"| {path} | {ar:.2f} ({100 * roof / ar:.0f}%) | " + " | ".join(cells) + " |")
        if comp.get("draft_ms"):
            verify = comp["verify_ms"][next(iter(comp["verify_ms"]))]
            v22 = verify.get(22) or verify.get("22") or next(iter(verify.values()))
            steps = "; ".join(f"{path} {ms:.2f} ms ({100 * ms / v22:.0f}% of the verify step at budget 22)" for path, ms in comp["draft_ms"].items())
            lines += ["", f"Draft step (16-token block, top-8): {steps}."]
        if comp.get("prefill_ms"):
            prefills = "; ".join(f"{path} {ms:.1f} ms" for path, ms in comp["prefill_ms"].items())
            lines += ["", f"Prefill of the prompt: {prefills}."]
        lines.append("")
    rows = result.get("system")
    if rows:
        ar = {r["wire"]: r["tokens_per_s"] for r in rows if r["label"] == AR_LABEL}  # × AR: same wire
        lines += [
            "| end-to-end (3 services) | wire | budget | concurrency | AL | tok/s | decode ms/step | × AR | draft fallbacks |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            wire = r["wire"]
            lines.append(
                f"| {r['label']} | {wire} | {r['budget']} | {r['concurrency']} | {r['acceptance_length']:.2f} | {r['tokens_per_s']:.1f} "
                f"| {r['ms_per_step']:.2f} | {r['tokens_per_s'] / ar[wire]:.2f} | {r.get('draft_fallbacks', 0)} |"
            )
        headline = result.get("headline") or headline_speedups(rows)
        lines += [
            "",
            "AL: tokens committed by verify steps / verify steps (the prefill's token is not counted; target-only is 1.00). "
            "The `oracle` rows are **benchmark-only**: the OracleDrafter proposes the target's recorded output, corrupted "
            "at the given rate, to set the acceptance length; it skips the draft's forward pass and all tap-feature "
            "traffic, so their tok/s, ms/step and × AR are not what a real drafter gets"
            + (": the headline below is." if headline else "."),
        ]
        if headline:
            lines += ["", f"**Headline**, {HEADLINE_RULE}:", ""] + [f"- {h['line']}" for h in headline]
        spin = result.get("busy_poll_us")
        if spin is not None:
            lines += ["", f"Services' busy polling: {f'{spin} µs' if spin else 'off'}."]
        lines.append("")
    if "baseline_tokens_per_s" in result:
        base = result["baseline_tokens_per_s"]
        extra = f" (our AR through the services: {rows[0]['tokens_per_s'] / base:.2f}×)" if rows else ""
        lines += [f"transformers eager `generate`, same shape: {base:.1f} tok/s{extra}.", ""]
    return "\n".join(lines)
