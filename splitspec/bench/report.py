"""Markdown tables of a ``splitspec bench`` result (the JSON it writes), with the goal ratios."""

from __future__ import annotations


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
        ar = {r["wire"]: r["tokens_per_s"] for r in rows if r["label"] == "off (AR)"}  # × AR: same wire
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
        spin = result.get("busy_poll_us")
        if spin is not None:
            lines += ["", f"Services' busy polling: {f'{spin} µs' if spin else 'off'}."]
        lines.append("")
    if "baseline_tokens_per_s" in result:
        base = result["baseline_tokens_per_s"]
        extra = f" (our AR through the services: {rows[0]['tokens_per_s'] / base:.2f}×)" if rows else ""
        lines += [f"transformers eager `generate`, same shape: {base:.1f} tok/s{extra}.", ""]
    return "\n".join(lines)
