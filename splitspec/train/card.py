"""The built-in pair's model card, rendered from the build's manifest and stage logs.

Inputs are what ``scripts/build_builtin_pair.py`` writes: the corpus manifest
(``corpus.manifest``), one log dict per stage (``corpus``, ``target``, ``draft`` and
``draft-dflash2``; None when the stage has not run) and acceptance-length measurements (rows of
``prompt_set``, ``mode``, ``budget``, ``acceptance_length``, ``tokens_per_s``, ``device`` and,
from ``scripts/measure_builtin_pair.py --drafts``, ``draft`` and ``tree_scores``). Nothing is typed
in by hand, so the card states what was actually run. ``acceptance_length`` is AL as
:mod:`splitspec.spec.acceptance_length` defines it (tokens committed by verify steps / verify
steps), which ``scripts/measure_builtin_pair.py`` reports.
"""

from __future__ import annotations

import math
from collections import defaultdict


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _package_summary(files: list[dict], top: int = 25) -> list[str]:
    """Rows ``| top-level module or package | files | bytes | split |``, largest first."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for f in files:
        head = f["path"].split("/")[0]
        groups[head, f["split"]][0] += 1
        groups[head, f["split"]][1] += f["bytes"]
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])
    rows = [f"| `{name}` | {count} | {size:,} | {split} |" for (name, split), (count, size) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        rows.append(f"| {len(rest)} others | {sum(c for _, (c, _) in rest)} | {sum(s for _, (_, s) in rest):,} | train |")
    return rows


def _corpus_section(manifest: dict, corpus: dict | None) -> list[str]:
    totals = manifest["totals"]
    lines = [
        "## Training data",
        "",
        f"The `.py` sources of the Python {manifest['python']} standard library, licensed under "
        f"**{manifest['licence']}** (the interpreter's licence file: `{manifest['licence_file']}`). "
        "Test suites (`test/`, `tests/`, `idle_test/`), installed packages (`site-packages/`), "
        f"build-specific files (`config-*/`, `_sysconfigdata*`), generated codec tables and files over "
        f"{manifest['max_file_bytes']:,} bytes (generated data such as `pydoc_data/topics.py`) are left out.",
        "",
        "| split | files | bytes |" + (" tokens |" if corpus else ""),
        "|---|---|---|" + ("---|" if corpus else ""),
    ]
    for split in ("train", "heldout"):
        tokens = f" {corpus[f'{split}_tokens']:,} |" if corpus else ""
        lines.append(f"| {split} | {totals[split]['files']} | {totals[split]['bytes']:,} |{tokens}")
    lines += [
        "",
        f"Held out (never trained on, tokenizer included): {', '.join(f'`{m}`' for m in manifest['heldout'])}.",
        "`manifest.json` next to this card lists every file with its size, SHA-256 and split.",
    ]
    if manifest.get("only"):
        lines.append(f"**Restricted build**: only files under {manifest['only']}.")
    lines += ["", "| module / package | files | bytes | split |", "|---|---|---|---|", *_package_summary(manifest["files"]), ""]
    return lines


def _target_section(target: dict | None, corpus: dict | None) -> list[str]:
    if target is None:
        return ["## Target", "", "Not built yet.", ""]
    c, r = target["config"], target["result"]
    lines = [
        "## Target",
        "",
        f"Qwen3 architecture (GGUF `qwen3`, F16 matrices, tied embeddings), {r['parameters'] / 1e6:.2f}M parameters: "
        f"hidden {c['hidden_size']}, {c['num_layers']} layers, {c['num_heads']} heads / {c['num_kv_heads']} KV heads of "
        f"{c['head_dim']}, MLP {c['intermediate_size']}, vocabulary {corpus['vocab_size'] if corpus else '?'}, "
        f"context {c['seq_len']} tokens, RoPE theta {c['rope_theta']:g}. File: {_mb(target['file_bytes'])}.",
        "",
        f"Trained from scratch: {r['steps']} steps of {c['batch_size']} x {c['seq_len']} tokens "
        f"({r['tokens'] / r['train_tokens_available']:.2f} passes over {r['train_tokens_available']:,} tokens), AdamW "
        f"(lr {c['lr']:g}, warmup {c['warmup_steps']}, cosine to {c['min_lr_ratio']:g} x lr, weight decay {c['weight_decay']:g}), "
        f"seed {c['seed']}, on {target['device_name']} (torch {target['torch']}): {r['wall_s']:.0f} s of training "
        f"at {r['tokens_per_s']:,.0f} tokens/s, {target['wall_s']:.0f} s for the whole stage.",
        "",
        f"Held-out loss (nats/token over {r['heldout_tokens_scored']:,} tokens): {r['heldout_loss_initial']:.3f} at "
        f"initialisation, {r['heldout_loss_final']:.3f} at the end, **{r['heldout_loss_best']:.3f}** at step "
        f"{r['best_step']} (the weights shipped).",
    ]
    if corpus:
        bits = r["heldout_loss_best"] / math.log(2) * corpus["heldout_tokens"] / corpus["heldout_bytes"]
        lines[-1] += f" That is about {bits:.2f} bits per byte of held-out source."
    return lines + [""]


DRAFT_TITLES = {"draft": "DFlash draft", "draft-dflash2": "DFlash2 draft"}  # stage (= folder) -> section title


def _draft_section(draft: dict | None, stage: str = "draft") -> list[str]:
    title = DRAFT_TITLES[stage]
    if draft is None:
        return [f"## {title}", "", "Not built yet.", ""]
    lines = [f"## {title}", "", f"{title} (`{stage}/config.json`, `{stage}/model.safetensors`), {_mb(draft['file_bytes'])}, "
             f"trained on {draft['device_name']} (torch {draft['torch']}) in {draft['wall_s']:.0f} s."]
    if draft["config"].get("resume"):
        lines[-1] += (" That time is the last run's only: this run resumed, exactly, from the checkpoint an earlier run "
                      "left (the same data order and optimizer state); the earlier steps are not timed here.")
    lines.append("")
    lines += [f"- `{k}`: {v}" for k, v in draft["config"].items()]
    result = draft["result"]
    if isinstance(result, dict):
        lines += [f"- result `{k}`: {v}" for k, v in result.items() if not isinstance(v, (list, dict))]
    return lines + [""]


AL_DEFINITION = (
    "Mean acceptance length (AL): tokens committed by verify steps / verify steps, the bonus token included. "
    "Each request's first token comes from the prompt's prefill, not from a verify step, and is not counted, "
    "so target-only decoding (`off`) has AL 1.00 exactly."
)


def _draft_label(row: dict) -> str:
    """A measurement row's draft: its label (``dflash`` when the row predates several drafts), its
    DFlash2 candidates' scoring and any --top-k it was measured at."""
    extra = [row["tree_scores"]] if "tree_scores" in row else []
    if "top_k" in row:
        extra.append(f"top-k {row['top_k']}")
    return row.get("draft", "dflash") + (f" ({', '.join(extra)})" if extra else "")


def _measurements_section(rows: list[dict]) -> list[str]:
    lines = [
        "## Speculative decoding", "", "| prompt set | mode | budget | draft | mean acceptance length | tokens/s | device |",
        "|---|---|---|---|---|---|---|",
    ]
    if not rows:
        lines.append("| not measured yet | | | | | | |")
    for m in rows:
        if m["mode"] == "off" and m["acceptance_length"] != 1.0:
            raise ValueError(
                f"measurements: {m['prompt_set']} off has AL {m['acceptance_length']}, not 1: measured as generated tokens / steps "
                "(before splitspec.spec.acceptance_length); measure again with scripts/measure_builtin_pair.py"
            )
        draft = "none" if m["mode"] == "off" else _draft_label(m)
        lines.append(
            f"| {m['prompt_set']} | {m['mode']} | {m['budget']} | {draft} | {m['acceptance_length']:.2f} | {m['tokens_per_s']:.1f} | {m['device']} |"
        )
    return lines + ["", AL_DEFINITION, "", *_comparison_section(rows)]


def _comparison_section(rows: list[dict]) -> list[str]:
    """DFlash2 against DFlash, and the lattice's trees against independent scores, row by row: the
    AL ratios of the same prompt set, mode, budget and device. Empty without DFlash2 rows."""
    al = {(r["prompt_set"], r["mode"], r["budget"], r["device"], _draft_label(r)): r["acceptance_length"] for r in rows}
    keys = sorted({k[:4] for k in al if k[4] == "dflash2 (lattice)"}, key=lambda k: (k[3], k[0], k[1], k[2]))
    if not keys:
        return []
    lines = [
        "### DFlash2 against DFlash", "",
        "AL ratios: the DFlash2 draft scored by its lattice (selector walk in chains, pair scores in trees) over the "
        "DFlash draft, and over the same DFlash2 draft scored by independent per-depth log-probabilities.", "",
        "| prompt set | mode | budget | device | DFlash | DFlash2 (lattice) | DFlash2 / DFlash | DFlash2 (independent) | lattice / independent |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in keys:
        ours, dflash, independent = (al.get((*key, label)) for label in ("dflash2 (lattice)", "dflash", "dflash2 (independent)"))
        cells = [f"{v:.2f}" if v else "-" for v in (dflash, ours)] + [f"{ours / dflash:.2f}x" if dflash else "-"]
        cells += [f"{independent:.2f}" if independent else "-", f"{ours / independent:.2f}x" if independent else "-"]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    return lines + [""]


def render_card(manifest: dict, logs: dict[str, dict | None], measurements: list[dict]) -> str:
    """MODEL_CARD.md for the pair described by ``manifest`` and the stage ``logs``."""
    corpus, target, draft, draft2 = (logs.get(stage) for stage in ("corpus", "target", "draft", "draft-dflash2"))
    drafts = "DFlash and DFlash2 drafts" if draft2 else "DFlash draft"
    lines = [
        f"# splitspec built-in pair: a Python stdlib target and its {drafts}",
        "",
        "A small code model trained from scratch, offline, on the Python standard library's source, with its "
        "own byte-level BPE tokenizer, and a DFlash block draft trained for it"
        + (" (and a DFlash2 draft beside it, served with `splitspec serve --builtin-draft dflash2`)" if draft2 else "")
        + ". `splitspec serve` serves the pair when no model is given. It exists to demonstrate and test speculative decoding end to end on "
        "any machine: it continues Python code in the style of the standard library; it is not an assistant, "
        "follows no instructions and knows nothing beyond its corpus. Its output may reproduce passages of the "
        "standard library.",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE ({corpus['vocab_size'] if corpus else '?'} tokens) trained with the `tokenizers` library on the "
        "training split, Qwen2 pre-tokenizer split (llama.cpp `tokenizer.ggml.pre = qwen2`). Special tokens: "
        "`<|endoftext|>` (document separator, BOS and EOS) and `<|mask|>` (the DFlash mask token). Embedded in "
        "`target.gguf` as a \"gpt2\" tokenizer; no chat template."
        + (f" {corpus['bytes_per_token']:.2f} bytes per token on the training split." if corpus else ""),
        "",
        *_corpus_section(manifest, corpus),
        *_target_section(target, corpus),
        *_draft_section(draft),
        *(_draft_section(draft2, "draft-dflash2") if draft2 else []),
        *_measurements_section(measurements),
        "## Reproduce",
        "",
        "```bash",
        *dict.fromkeys(log["command"] for log in (corpus, target, draft, draft2) if log),  # one line per invocation
        "```",
        "",
        "Wall time per stage: " + ", ".join(f"{log['stage']} {log['wall_s']:.0f} s on {log['host']}" for log in (corpus, target, draft, draft2) if log) + ".",
        "",
    ]
    return "\n".join(lines)
