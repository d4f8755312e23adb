"""Markdown tables of a ``splitspec bench`` result (the JSON it writes), with the goal ratios.

Terms of the concurrency sweep (``--concurrency 1,4,16,32``): at *concurrency N*, N clients
generate at once through the gateway. A row's *aggregate tok/s* is all its clients' generated
tokens over the wall time of the row; its *ms per step* is one sequence's decode step (prefill
excluded) averaged over every step of every sequence, so concurrent steps overlap; for the DFlash
row that is *t_round*, the full round of a real-shaped draft at that concurrency. *× at B* divides
a row's aggregate tok/s by the same kind's at the sweep's lowest level B (usually 1).

The quantized-matmul kernel table (``kernel_table``; ``components.time_quant_kernels`` defines its
terms) has a row per GGUF type and layer size and a column per row count M; the workers' line
(``workers_line``) gives each model worker's ``--memory-cap-gb`` and memory plan as it logged them.
"""

from __future__ import annotations

# Row labels of the end-to-end part (splitspec.bench.system), which the headline reads.
AR_LABEL = "off (AR)"
DFLASH_LABEL = "dflash (random weights)"
BUILTIN_LABEL = "dflash (built-in pair)"  # --pair builtin: the trained draft, a real AL, no oracle
BUILTIN_LABELS = {"dflash": BUILTIN_LABEL, "dflash2": "dflash2 (built-in pair)"}  # by --builtin-draft
ORACLE_NOTE = "benchmark-only: no draft forward pass, no tap-feature traffic"
SHAPED = "shaped-oracle"  # the drafter of a ShapedOracleDrafter row (splitspec.bench.shaped_oracle)


def oracle_label(corruption: float) -> str:
    """The label of an OracleDrafter row: its corruption rate and :data:`ORACLE_NOTE`."""
    return f"oracle {corruption:.2f} ({ORACLE_NOTE})"


def shaped_oracle_label(corruption: float) -> str:
    """The label of a ShapedOracleDrafter row: the real draft shape's passes, the oracle's proposals."""
    return f"dflash shape + oracle {corruption:.2f} (benchmark-only: the draft's real passes, the oracle's proposals)"


HEADLINE_RULE = (
    "speed-up of a real drafter = AL × t_AR / t_round, where AL is the oracle row's acceptance length, t_AR the "
    f"decode ms/step of the `{AR_LABEL}` row and t_round that of the `{DFLASH_LABEL}` row (the full round of the "
    "real draft shape: draft forward pass, tap features on the wire, verify), same wire, same run"
)


AGGREGATE_RULE = (
    "honest aggregate at concurrency N = N × AL / t_round, with AL from the oracle row and t_round the decode ms/step "
    f"of the `{DFLASH_LABEL}` row at N (decode only: the prefill is no step), same wire, same run"
)

MEASURED_RULE = (
    "a `dflash shape + oracle` row (--shaped-oracle) gives both from one row: its own AL and its own round, in which "
    "the real-shaped draft ran every pass and the tap features of every committed row crossed the wire"
)


def _by_level(rows: list[dict]) -> dict[tuple[str, int], list[dict]]:
    """Rows grouped by (wire, concurrency), in the order they first appear."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["wire"], r.get("concurrency", 1)), []).append(r)
    return groups


def _levels(rows: list[dict]) -> list[int]:
    return sorted({r.get("concurrency", 1) for r in rows})


def _row(rows: list[dict], label: str) -> dict | None:
    return next((r for r in rows if r["label"] == label), None)


def _is_oracle(r: dict) -> bool:
    return r.get("drafter", "oracle" if r["label"].startswith("oracle") else "") == "oracle"


def _base(rows: list[dict], wire: str, label: str) -> dict:
    """The row of ``label`` on ``wire`` at the lowest concurrency of the run: what "× at B" divides by."""
    return min((r for r in rows if r["wire"] == wire and r["label"] == label), key=lambda r: r.get("concurrency", 1))


def headline_speedups(rows: list[dict]) -> list[dict]:
    """The speed-up a real drafter of this shape gets at each oracle row's acceptance length, per wire
    and concurrency: ``AL × t_AR / t_round`` (:data:`HEADLINE_RULE`), and what that makes in aggregate,
    ``N × AL / t_round`` (:data:`AGGREGATE_RULE`). The oracle rows' own tok/s are not used: the
    OracleDrafter runs no draft pass and moves no tap features, so its rounds are cheaper than a real one.
    With several levels each line also gives the AR rows' aggregate tok/s at N over that at the lowest level.
    None from the oracle rows under ``--budget auto``: the adaptive budget sizes the oracle's trees and
    the random-weight draft's differently (the draft's are never accepted), so the AL of one and the
    round of the other would belong to different trees. A ``dflash shape + oracle`` row gives its own
    line at any budget, from its own AL and round (:data:`MEASURED_RULE`)."""
    out = []
    sweep = len(_levels(rows)) > 1
    for (wire, n), mine in _by_level(rows).items():
        ar, dflash = _row(mine, AR_LABEL), _row(mine, DFLASH_LABEL)
        if ar is None:
            continue
        t_ar = ar["ms_per_step"]
        base = _base(rows, wire, AR_LABEL)
        ar_scaling = ar["tokens_per_s"] / base["tokens_per_s"]
        # (AL row, t_round): each oracle row with the random draft's round; a shaped row with its own (MEASURED_RULE).
        # The measured lines first: they are what a real drafter gets.
        sources = [(r, r["ms_per_step"]) for r in mine if r.get("drafter") == SHAPED]
        sources += [(r, dflash["ms_per_step"]) for r in mine if _is_oracle(r)] if dflash and dflash["budget"] != "auto" else []
        for r, t_round in sources:
            al = r["acceptance_length"]
            speedup = al * t_ar / t_round
            aggregate = 1e3 * n * al / t_round  # tok/s: N sequences, AL tokens each per round of t_round ms
            source = f"oracle {r['corruption']:.2f}" if r.get("corruption") is not None else r["label"]
            if r.get("drafter") == SHAPED:
                source = f"dflash shape + {source}, measured: AL and round of one row"
            line = (
                f"wire {wire}, budget {r['budget']}, concurrency {n}, AL {al:.2f} (from {source}): "
                f"{al:.2f} × {t_ar:.2f} ms / {t_round:.2f} ms = {speedup:.2f}× AR; "
                f"aggregate {n} × {al:.2f} / {t_round:.2f} ms = {aggregate:.1f} tok/s"
            )
            if sweep and n != base.get("concurrency", 1):
                line += f"; AR aggregate at {n} / at {base.get('concurrency', 1)}: {ar_scaling:.2f}×"
            out.append({
                "wire": wire, "budget": r["budget"], "concurrency": n, "al_from": r["label"],
                "acceptance_length": al, "t_ar_ms": t_ar, "t_round_ms": t_round, "speedup": speedup,
                "aggregate_tokens_per_s": aggregate, "ar_scaling": ar_scaling, "line": line,
            })
    return out


def concurrency_scaling(rows: list[dict]) -> list[dict]:
    """Each kind's aggregate tok/s at every level above the lowest, over its own at the lowest (B):
    how much more the system serves with N clients than with B."""
    out = []
    for r in rows:
        base = _base(rows, r["wire"], r["label"])
        n, b = r.get("concurrency", 1), base.get("concurrency", 1)
        if n == b:
            continue
        ratio = r["tokens_per_s"] / base["tokens_per_s"]
        out.append({
            "wire": r["wire"], "label": r["label"], "concurrency": n, "base_concurrency": b,
            "tokens_per_s": r["tokens_per_s"], "base_tokens_per_s": base["tokens_per_s"], "ratio": ratio,
            "line": f"wire {r['wire']}, {r['label']}: aggregate at {n} {r['tokens_per_s']:.1f} tok/s / at {b} "
                    f"{base['tokens_per_s']:.1f} tok/s = {ratio:.2f}×",
        })
    return out


def _kind_header(label: str) -> str:
    # The oracle's long note is said once under the table; its column keeps the word that matters.
    return label.replace(ORACLE_NOTE, "benchmark-only")


def concurrency_table(rows: list[dict], wire: str) -> list[str]:
    """Markdown: one row per concurrency level, one column per kind (AR, the DFlash draft, each oracle),
    then the honest aggregate at each oracle's AL (:data:`AGGREGATE_RULE`)."""
    mine = [r for r in rows if r["wire"] == wire]
    kinds = list(dict.fromkeys(r["label"] for r in sorted(mine, key=lambda r: (r["label"] != AR_LABEL, _is_oracle(r)))))
    levels = _levels(mine)
    headline = {(h["concurrency"], h["al_from"]): h for h in headline_speedups(mine)}
    honest = [k for k in kinds if any(a == k for _, a in headline)]
    lines = [
        "| concurrency | " + " | ".join(_kind_header(k) for k in kinds)
        + "".join(f" | honest aggregate at {_kind_header(k).split(' (')[0]}'s AL" for k in honest) + " |",
        "|---|" + "---|" * (len(kinds) + len(honest)),
    ]
    for n in levels:
        cells = []
        for k in kinds:
            r = next((r for r in mine if r["label"] == k and r.get("concurrency", 1) == n), None)
            if r is None:
                cells.append("-")
                continue
            base = _base(mine, wire, k)
            cells.append(
                f"{r['tokens_per_s']:.1f} tok/s ({r['tokens_per_s'] / base['tokens_per_s']:.2f}×), "
                f"{r['ms_per_step']:.2f} ms, AL {r['acceptance_length']:.2f}"
            )
        for k in honest:
            h = headline.get((n, k))
            cells.append(f"{h['aggregate_tokens_per_s']:.1f} tok/s ({h['speedup']:.2f}× AR)" if h else "-")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def sweep_markdown(rows: list[dict]) -> list[str]:
    """The concurrency sweep: a table per wire, then each kind's aggregate tok/s at N over at the lowest level."""
    lines = []
    for wire in dict.fromkeys(r["wire"] for r in rows):
        intro = (
            f"Concurrency sweep, wire {wire}. Each cell: aggregate tok/s (× the same column at the lowest level), ms per "
            "step (mean over every sequence's steps; the DFlash column's is t_round), AL."
        )
        if any(map(_is_oracle, rows)):
            intro += (
                f" The oracle columns are benchmark-only ({ORACLE_NOTE.removeprefix('benchmark-only: ')}): only the honest "
                "columns use them, for their AL."
            )
        lines += ["", intro, ""]
        lines += concurrency_table(rows, wire)
    lines += ["", "**Aggregate tok/s at N / at the lowest level:**", ""] + [f"- {s['line']}" for s in concurrency_scaling(rows)]
    return lines


def split_table(rows: list[dict]) -> list[str]:
    """Markdown: where each row's decode step went, by the services' own counts
    (``splitspec.bench.step_split``); nothing when no row has them."""
    counted = [r for r in rows if r.get("split")]
    if not counted:
        return []

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        "",
        "Where a decode step goes, ms (means over each row's timed requests, from the services' /metrics: "
        "`splitspec.bench.step_split`): the gateway's round trip of a Verify (of a pipelined target-only step: its "
        "wait for the answer) and of a Propose; the target's pass that the step ran in, preparation to settle, and the "
        "step's wait in the target for it; the same of the draft's pass that the Propose ran in; the target's prompt "
        "passes over the row a decode step (what each step carries of other requests' prompts).",
        "",
        "| end-to-end | wire | concurrency | decode ms/step | Verify round trip | Propose round trip | target's pass | target queue "
        "| draft's pass | draft queue | target's prompts a step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in counted:
        f = r["split"]
        lines.append(
            f"| {_kind_header(r['label'])} | {r['wire']} | {r['concurrency']} | {r['ms_per_step']:.2f} | {ms(f['verify_rpc_ms'])} "
            f"| {ms(f['propose_rpc_ms'])} | {ms(f['target_pass_ms'])} | {ms(f['target_queue_ms'])} "
            f"| {ms(f.get('draft_pass_ms'))} | {ms(f.get('draft_queue_ms'))} | {ms(f.get('prompt_ms_per_step'))} |"
        )
    return lines


def kernel_table(kernels: list[dict]) -> list[str]:
    """Markdown: one row per (type, layer size), one column per row count M; each cell the median µs
    per call, the share of the copy bandwidth its packed bytes moved at, and × the M = 1 time."""
    ms = sorted({k["rows"] for k in kernels})
    groups: dict[tuple[str, str], dict[int, dict]] = {}
    for k in kernels:
        groups.setdefault((k["qtype"], k["layer"]), {})[k["rows"]] = k
    paths = sorted({k["path"] for k in kernels})
    timings = sorted({k["timing"] for k in kernels})
    lines = [
        f"Quantized-matmul kernel (`native.gguf_matmul`, path: {', '.join(paths)}; {', '.join(timings)}): per GGUF type "
        "and layer size [N × K], each cell the median µs per call, its packed bytes' bandwidth as a share of the copy "
        "bandwidth, and × the M=1 time. `*`: a type the model holds.",
        "",
        "| type | layer [N × K] | packed MB | " + " | ".join(f"M={m}" for m in ms) + " |",
        "|---|---|---|" + "---|" * len(ms),
    ]
    for (qtype, layer), by_m in groups.items():
        first = next(iter(by_m.values()))
        cells = [
            f"{by_m[m]['us']:.1f} µs, {100 * by_m[m]['copy_share']:.0f}%, {by_m[m]['vs_one_row']:.2f}×" if m in by_m else "-" for m in ms
        ]
        name = qtype + ("*" if first["in_model"] else "")
        lines.append(
            f"| {name} | {layer} [{first['out_features']} × {first['in_features']}] | {first['packed_bytes'] / 1e6:.2f} | "
            + " | ".join(cells) + " |"
        )
    return lines


def _gib(figure: float | None) -> str:
    return "-" if figure is None else f"{figure:.2f} GiB"


def workers_line(workers: dict) -> str:
    """One line: whether the blocks stayed quantized, the run's ``--memory-cap-gb``, and each model
    worker's cap, plan total, verdict and (CUDA target) what torch held after start-up."""
    parts = []
    for name in ("target", "draft"):
        w = workers.get(name, {})
        text = f"{name}: plan {_gib(w.get('plan'))}"
        if "cap" in w:
            text += f" of a {_gib(w['cap'])} cap (budget {_gib(w.get('budget'))}: {w.get('verdict', '?')})"
        if "reserved" in w:
            text += f", torch held {_gib(w['reserved'])} after start-up"
        parts.append(text)
    cap = workers.get("memory_cap_gb") or 0
    head = f"--memory-cap-gb {cap:g}" if cap else "no memory cap"
    kept = "blocks kept quantized (--keep-quantized), " if workers.get("keep_quantized") else ""
    return f"Model workers: {kept}{head}; " + "; ".join(parts) + "."


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
        if comp.get("kernels"):
            lines += [""] + kernel_table(comp["kernels"])
        lines.append("")
    rows = result.get("system")
    if rows:
        ar = {(r["wire"], r["concurrency"]): r["tokens_per_s"] for r in rows if r["label"] == AR_LABEL}  # × AR: same wire and level
        lines += [
            "| end-to-end (3 services) | wire | budget | concurrency | AL | tok/s | tok/s while all decode | decode ms/step | × AR "
            "| draft fallbacks |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            wire = r["wire"]
            decoding = f"{r['decode_tokens_per_s']:.1f}" if r.get("decode_tokens_per_s") else "-"
            lines.append(
                f"| {r['label']} | {wire} | {r['budget']} | {r['concurrency']} | {r['acceptance_length']:.2f} | {r['tokens_per_s']:.1f} "
                f"| {decoding} | {r['ms_per_step']:.2f} | {r['tokens_per_s'] / ar[wire, r['concurrency']]:.2f} | {r.get('draft_fallbacks', 0)} |"
            )
        headline = result.get("headline") or headline_speedups(rows)
        note = (
            "AL: tokens committed by verify steps / verify steps (the prefill's token is not counted; target-only is 1.00). "
            "tok/s while all decode: the tokens that arrived while every client was decoding (none waiting for a prefill) "
            "over that time, as llama-batched-bench's S_TG (`splitspec.bench.system.all_decoding`)."
        )
        if any(map(_is_oracle, rows)):
            note += (
                " The `oracle` rows are **benchmark-only**: the OracleDrafter proposes the target's recorded output, corrupted "
                "at the given rate, to set the acceptance length; it skips the draft's forward pass and all tap-feature "
                "traffic, so their tok/s, ms/step and × AR are not what a real drafter gets"
                + (": the headline below is." if headline else ".")
            )
        for label in sorted({r["label"] for r in rows} & set(BUILTIN_LABELS.values())):
            note += (
                f" `{label}`: the built-in pair's trained draft as `splitspec serve` serves it, on held-out "
                "standard-library prompts: its AL and tok/s are a real drafter's."
            )
        lines += ["", note]
        if headline:
            measured = f"; {MEASURED_RULE}" if any(r.get("drafter") == SHAPED for r in rows) else ""
            lines += ["", f"**Headline**, {HEADLINE_RULE}; {AGGREGATE_RULE}{measured}:", ""] + [f"- {h['line']}" for h in headline]
        lines += split_table(rows)
        if len(_levels(rows)) > 1:
            lines += sweep_markdown(rows)
        if result.get("workers"):
            lines += ["", workers_line(result["workers"])]
        spin = result.get("busy_poll_us")
        if spin is not None:
            lines += ["", f"Services' busy polling: {f'{spin} µs' if spin else 'off'}."]
        if result.get("gateways_per_draft", 1) > 1:
            lines += [f"Gateway processes per draft: {result['gateways_per_draft']}, clients spread over them."]
        lines.append("")
    if "baseline_tokens_per_s" in result:
        base = result["baseline_tokens_per_s"]
        # transformers generates one sequence: compare it with our AR row at concurrency 1 only.
        ar1 = next((r for r in rows or [] if r["label"] == AR_LABEL and r.get("concurrency", 1) == 1), None)
        extra = f" (our AR through the services: {ar1['tokens_per_s'] / base:.2f}×)" if ar1 else ""
        lines += [f"transformers eager `generate`, same shape: {base:.1f} tok/s{extra}.", ""]
    return "\n".join(lines)
