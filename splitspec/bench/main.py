"""``splitspec bench``: component timings, end-to-end throughput and a transformers baseline.

All on random weights of a real shape drawn on the device (``random:NAME``, benchmark-only), so
it runs on a machine with no network and no model files. Prints Markdown tables (ready for
BENCHMARKS.md) and writes every figure as JSON with ``--json``.

The end-to-end part's OracleDrafter rows are benchmark-only (no draft forward pass, no tap-feature
traffic; their labels say so): they set the acceptance length and nothing else. The headline
speed-up of the shape, printed and written as ``headline``, is a real drafter's: ``AL × t_AR /
t_round`` with each oracle row's AL, the AR row's decode ms/step as t_AR and the random-weight
DFlash row's as t_round, all from the same run (``splitspec.bench.report.headline_speedups``).

``--concurrency 1,4,16,32`` sweeps the end-to-end part over clients generating at once: every row
at every level, a table with a row per level (``report.concurrency_table``), and the headline at
each level in aggregate, ``N × AL / t_round``. ``--pair builtin`` runs that part on the built-in
pair as ``splitspec serve`` serves it (its trained draft: a real AL, no oracle), e.g.
``splitspec bench --pair builtin --concurrency 1,8`` on a CPU.

Quantized shapes (``*-q4km``) run every part but the transformers baseline: their system part
serves the blocks kept quantized (``--keep-quantized`` on both workers), and their components add
a table of the quantized-matmul kernel per GGUF type and row count
(``splitspec.bench.components.time_quant_kernels``). ``--memory-cap-gb`` caps the system part's
two model workers as ``splitspec serve`` does, and the report states each one's cap and plan.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import tempfile
import time
from dataclasses import asdict
from datetime import date
from pathlib import Path

from services.gateway.budget import DEFAULT_BUDGET, parse_budget
from splitspec.builtin import DRAFT_DIRS
from splitspec.transport import busypoll

logger = logging.getLogger(__name__)

PARTS = ("components", "system", "baseline")
PAIRS = ("random", "builtin")
# What an unset flag means for each --pair: the random shapes' defaults as before; the built-in pair
# as `splitspec serve` runs it (device and dtype auto) with a prompt that fits its 512-token context.
PAIR_DEFAULTS = {
    "random": {"parts": ",".join(PARTS), "device": "cuda:0", "dtype": "bfloat16", "prompt_len": 512},
    "builtin": {"parts": "system", "device": "auto", "dtype": "auto", "prompt_len": 256},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shape", default="qwen3-8b",
        help="random-weight shape: qwen3-8b, qwen3-0.6b, qwen3-8b-q4km (linear weights in Q4_K_M-style GGUF blocks), "
        "qwen35-27b (hybrid Qwen3.5-27B geometry, with the 27B DFlash draft's shape), qwen35-27b-q4km; tiny, tiny-q4km, "
        "tiny-qwen35, tiny-qwen35-q4km (CPU). Components and system parts run every shape (a -q4km shape's workers "
        "with --keep-quantized, and its components add a quantized-matmul kernel table); the baseline part runs the "
        "dense unquantized shapes only",
    )
    p.add_argument(
        "--pair", choices=PAIRS, default="random",
        help="random: random weights of --shape (every part); builtin: the built-in pair as `splitspec serve` serves it "
        "with no model flags, on held-out standard-library prompts (system part only: its trained DFlash draft gives a "
        "real AL, no oracle)",
    )
    p.add_argument(
        "--builtin-draft", choices=list(DRAFT_DIRS), default="dflash",
        help="--pair builtin: which of the built-in pair's drafts serve runs (its --builtin-draft)",
    )
    p.add_argument("--parts", default="", help=f"comma-separated parts to run: {', '.join(PARTS)} (default: all; system with --pair builtin)")
    p.add_argument("--device", default="", help="target device (default: cuda:0; auto with --pair builtin: cuda:0 when torch sees a GPU, else cpu)")
    p.add_argument("--draft-device", default="", help="draft device (default: --device; --pair builtin: always --device, as serve does)")
    p.add_argument("--dtype", default="", help="compute dtype (default: bfloat16; auto with --pair builtin: bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--budgets", default="16,22,32,64", help="verify budgets (tree nodes) of the component table")
    p.add_argument(
        "--budget", type=parse_budget, default=DEFAULT_BUDGET,
        help="tree budget of the end-to-end runs: nodes, or auto (the requests name none; the gateways' adaptive budget chooses each step's)",
    )
    p.add_argument(
        "--corruptions", default="0.6,0.3,0.15,0.05",
        help="OracleDrafter corruption rates of the end-to-end runs (lower = longer acceptance); its rows are "
        "benchmark-only (no draft forward pass, no tap features) and set the AL of the headline speed-up",
    )
    p.add_argument(
        "--shaped-oracle", default="auto", metavar="CORRUPTION",
        help="a `dflash shape + oracle` row (benchmark-only): the random DFlash draft runs every pass, tap features "
        "included, and answers with the OracleDrafter's proposals at this corruption: the honest round at a real AL, "
        "measured in one row (one more draft worker's memory); its headline line comes first. A rate in [0, 1], off, or "
        "auto: the lowest of --corruptions (the longest AL) when the target's --device is a GPU, off on a CPU (where "
        "the composed headline was within 11-42%% of it: BENCHMARKS.md [L11]; on an H100 at 32 users 2-5x: [S15], [S16]) "
        "or with --memory-cap-gb (split between one target and one draft)",
    )
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default: 512; 256 with --pair builtin)")
    p.add_argument("--max-tokens", "--new-tokens", type=int, default=128, help="generated tokens per request")
    p.add_argument(
        "--prompts", type=int, default=4,
        help="timed requests per end-to-end row, at least: at concurrency N, N × ceil(prompts / N), so all N stay busy",
    )
    p.add_argument(
        "--concurrency", default="1",
        help="clients generating at once in the end-to-end runs; several levels, e.g. 1,4,16,32, sweep: every row at each "
        "level, after a warm-up at that level, and a table of aggregate tok/s per level",
    )
    p.add_argument(
        "--gateways", type=int, default=0,
        help="gateway processes per draft in the end-to-end runs, the clients spread over them (0 = one per 16 clients "
        "of the top --concurrency level): one gateway's event loop handles a few thousand sequence steps a second",
    )
    p.add_argument(
        "--wire", default="socket",
        help="gateway wire(s) of the end-to-end runs, comma-separated: socket (the workers' step sockets), stream, unary, "
        "or several (rows of each, taking turns)",
    )
    p.add_argument(
        "--busy-poll", default="auto",
        help="the services' --busy-poll in the end-to-end runs: microseconds, off, or auto (the services' default: "
        "on with a GPU --device and 8+ cores, as one value for every service of the run)",
    )
    p.add_argument(
        "--memory-cap-gb", type=float, default=0.0,
        help="system part: device memory the two model workers may use, GiB (0 = no cap), passed as `splitspec serve` "
        "passes it: each worker all of it on devices of their own, split when they share one (the draft "
        "--draft-memory-gb, the target the rest); the report gives each worker's cap and memory plan",
    )
    p.add_argument(
        "--draft-memory-gb", type=float, default=0.0,
        help="with --memory-cap-gb and both workers on one device: the draft's share, GiB (0 = a third of the cap)",
    )
    p.add_argument("--iters", type=int, default=30, help="timed calls per component figure (median)")
    p.add_argument("--json", default="", help="write all figures to this JSON file")
    p.add_argument("--log-dir", default="", help="keep the end-to-end services' logs in this directory (default: discarded)")


def transformers_tokens_per_s(shape: str, device: str, dtype: str, prompt_len: int, new_tokens: int) -> float:
    """Hugging Face ``generate`` (eager, greedy) on the same random shape: the baseline a user would
    otherwise pick."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from splitspec.bench.random_weights import random_target_config

    c = random_target_config(f"random:{shape}")
    config = Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=prompt_len + new_tokens + 16, tie_word_embeddings=c.tie_word_embeddings,
    )
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype)).eval()
    ids = torch.randint(0, c.vocab_size, (1, prompt_len), device=device)
    kwargs = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kwargs)
    torch.cuda.synchronize() if device.startswith("cuda") else None
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    torch.cuda.synchronize() if device.startswith("cuda") else None
    return (out.shape[1] - prompt_len) / (time.perf_counter() - t0)


def check_parts(shape: str, parts: set[str]) -> None:
    """Refuse, in one line, a part that cannot give honest figures for ``shape``."""
    from splitspec.bench.random_weights import random_shape
    from splitspec.models.dense import DenseConfig

    s = random_shape(f"random:{shape}")
    if "baseline" in parts and (s.quantized or not isinstance(s.config, DenseConfig)):
        raise ValueError(f"--parts baseline: the transformers baseline runs the dense unquantized shapes only, not {shape}")


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def resolve_pair_defaults(args: argparse.Namespace) -> None:
    """Fill the flags left unset with the defaults of ``--pair`` (:data:`PAIR_DEFAULTS`); ``auto``
    device and dtype become what the services would pick, so the report names them."""
    for name, value in PAIR_DEFAULTS[args.pair].items():
        if getattr(args, name) in (None, ""):
            setattr(args, name, value)
    if args.device == "auto" or args.dtype == "auto":
        import torch

        from splitspec.models.devices import auto_device, resolve_dtype

        args.device = auto_device() if args.device == "auto" else args.device
        args.dtype = str(resolve_dtype(args.dtype, torch.device(args.device))).removeprefix("torch.")


def shaped_corruption(value: str, corruptions: list[float], device: str, capped: bool = False) -> float | None:
    """``--shaped-oracle``'s corruption rate, None for no such row: ``off``; ``auto`` is the lowest
    of ``corruptions`` on a GPU target, and off on a CPU or under a memory cap (split between one
    target and one draft, as `splitspec serve` splits it); otherwise a rate in [0, 1]."""
    if value == "off" or (value == "auto" and (capped or not device.startswith("cuda"))):
        return None
    if value == "auto":
        return min(corruptions)
    try:
        rate = float(value)
    except ValueError:
        raise ValueError(f"--shaped-oracle {value!r}: a corruption rate in [0, 1], off or auto") from None
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"--shaped-oracle {value}: a corruption rate must be in [0, 1]")
    return rate


def check_pair(args: argparse.Namespace, parts: set[str]) -> None:
    """Refuse, in one line, what ``--pair builtin`` cannot do: it runs `splitspec serve` unchanged."""
    if args.pair != "builtin":
        if args.builtin_draft != "dflash":
            raise ValueError("--builtin-draft: only with --pair builtin")
        return
    if parts != {"system"}:
        raise ValueError("--pair builtin runs the system part only (components and baseline time random weights of --shape)")
    if args.busy_poll != "auto":
        raise ValueError("--busy-poll: --pair builtin runs `splitspec serve`, whose services keep their own default (auto)")
    if args.draft_device and args.draft_device != args.device:
        raise ValueError("--draft-device: --pair builtin runs `splitspec serve` with one --device for both workers")
    if args.memory_cap_gb:
        raise ValueError("--memory-cap-gb: --pair builtin runs `splitspec serve` unchanged; the random pair's system part takes it")
    if args.shaped_oracle not in ("auto", "off"):
        raise ValueError("--shaped-oracle: the built-in pair's trained draft gives a real AL; the random pair's system part takes it")


def run(args: argparse.Namespace) -> int:
    from splitspec.bench.system import parse_concurrency

    levels = parse_concurrency(args.concurrency)  # before anything slow: a bad value fails at once
    resolve_pair_defaults(args)
    parts = set(args.parts.split(","))
    if parts - set(PARTS):
        raise ValueError(f"--parts: unknown {sorted(parts - set(PARTS))}; choose from {', '.join(PARTS)}")
    check_pair(args, parts)
    if args.pair == "random":
        check_parts(args.shape, parts)
    corruptions = [float(c) for c in args.corruptions.split(",")]
    shaped = shaped_corruption(args.shaped_oracle, corruptions, args.device, args.memory_cap_gb > 0) if args.pair == "random" else None
    if args.memory_cap_gb < 0 or args.draft_memory_gb < 0:
        raise ValueError("--memory-cap-gb and --draft-memory-gb cannot be negative (0 = no cap, a third of the cap)")
    if args.pair == "random" and "system" in parts:  # a bad --draft-memory-gb fails here, before anything slow
        from splitspec.bench.random_weights import random_shape
        from splitspec.bench.system import worker_flags

        quantized = random_shape(f"random:{args.shape}").quantized
        target_flags, draft_flags = worker_flags(
            quantized, args.memory_cap_gb, args.draft_memory_gb, (args.draft_device or args.device) == args.device,
        )

    import torch

    from splitspec.bench.report import HEADLINE_RULE, concurrency_scaling, headline_speedups, markdown

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    draft_device = args.draft_device or args.device
    budgets = [int(b) for b in args.budgets.split(",")]
    from services.gateway.workers import WIRES

    wires = tuple(args.wire.split(","))
    if set(wires) - set(WIRES):
        raise ValueError(f"--wire: unknown {sorted(set(wires) - set(WIRES))}; choose from {', '.join(WIRES)}")
    result: dict = {
        "date": date.today().isoformat(), "card": device_name(args.device), "draft_card": device_name(draft_device),
        "shape": args.shape if args.pair == "random" else "built-in pair", "pair": args.pair, "dtype": args.dtype,
        "torch": torch.__version__, "concurrency": levels, "args": vars(args),
    }
    path = f"random:{args.shape}"
    if "components" in parts:
        from splitspec.bench.components import time_draft, time_quant_kernels, time_target
        from splitspec.bench.random_weights import random_shape

        logger.info("component timings: %s on %s", path, args.device)
        report = time_target(path, device, dtype, budgets, args.prompt_len, args.iters, graphs=True)
        report.draft_ms = time_draft(path, torch.device(draft_device), dtype, args.prompt_len, args.iters)
        if random_shape(path).quantized:  # the kernels those blocks run on, type by type and row count by row count
            logger.info("quantized-matmul kernel timings on %s", args.device)
            report.kernels = time_quant_kernels(path, device, dtype, args.iters, report.copy_bandwidth)
        result["components"] = {**asdict(report), "roofline_ms": report.roofline_ms}
    if "system" in parts:
        from splitspec.bench.system import DFLASH_LOG, run_builtin_system, run_system, worker_memory

        busy_poll_us = busypoll.spin_us_for(args.busy_poll, device.type == "cuda", busypoll.usable_cpus())
        result["busy_poll_us"] = busy_poll_us
        logger.info("end-to-end runs through the three services")
        with tempfile.TemporaryDirectory(prefix="splitspec-bench-") as work:
            if args.log_dir:
                Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            log_dir = Path(args.log_dir) if args.log_dir else Path(work)
            if args.pair == "builtin":
                rows = run_builtin_system(
                    args.device, args.dtype, args.budget, args.prompts, args.prompt_len, args.max_tokens, levels, log_dir, wires,
                    args.builtin_draft,
                )
            else:
                result["gateways_per_draft"] = args.gateways or -(-max(levels) // 16)
                rows = run_system(
                    args.shape, args.device, draft_device, args.dtype, corruptions,
                    args.budget, args.prompts, args.prompt_len, args.max_tokens, levels, Path(work), log_dir, wires, busy_poll_us,
                    result["gateways_per_draft"], target_flags, draft_flags, shaped,
                )
                # Each model worker's cap and memory plan as it logged them (GiB), and its flags.
                result["workers"] = {
                    "keep_quantized": quantized, "memory_cap_gb": args.memory_cap_gb,
                    "target": {"flags": target_flags, **worker_memory(log_dir / "target.log")},
                    "draft": {"flags": draft_flags, **worker_memory(log_dir / f"{DFLASH_LOG}.log")},
                }
        result["system"] = [
            {**asdict(r), "tokens_per_s": r.tokens_per_s, "acceptance_length": r.acceptance_length, "ms_per_step": r.ms_per_step,
             "decode_tokens_per_s": r.decode_tokens_per_s}
            for r in rows
        ]
        # The speed-up a real drafter gets: oracle ALs with the real draft's round time (report.HEADLINE_RULE).
        result["headline_rule"] = HEADLINE_RULE
        result["headline"] = headline_speedups(result["system"])
        if len(levels) > 1:  # each kind's aggregate tok/s at N over at the lowest level
            result["concurrency_scaling"] = concurrency_scaling(result["system"])
    if "baseline" in parts:
        logger.info("transformers baseline")
        result["baseline_tokens_per_s"] = transformers_tokens_per_s(args.shape, args.device, args.dtype, args.prompt_len, args.max_tokens)
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0
