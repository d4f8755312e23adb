"""``splitspec target``: serve the TargetWorker API, loading the target model after binding."""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import replace

from splitspec.models import keep_quantized
from splitspec.models.gguf_file import ModelFileError
from splitspec.spec.budget import ADAPTIVE_BUDGETS
from splitspec.transport import busypoll, rpc
from splitspec.transport.security import ServerSecurity, add_server_arguments
from splitspec.transport.stepwire import Opener, add_step_socket_argument, step_server_from_args

logger = logging.getLogger(__name__)

WARM_UP_SEQUENCES = 32  # the largest batch whose passes are captured at start (on CUDA)


def _blocks(text: str) -> tuple[int, ...]:
    """``--warm-up-blocks``: comma-separated row counts, each a row bucket of the fixed shapes."""
    try:
        blocks = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of row counts") from None
    from services.target.graphs import ROW_BUCKETS

    wrong = [b for b in blocks if b not in ROW_BUCKETS]
    if wrong:
        raise argparse.ArgumentTypeError(f"{wrong} are not row buckets of the fixed shapes {list(ROW_BUCKETS)}")
    return blocks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True,
        help="target model: a GGUF file (llama, qwen2, qwen3, qwen35; a split GGUF by any part), a Hugging Face "
        "directory (config.json + safetensors), or hf://OWNER/REPO[/FILE.gguf] resolved through the Hugging Face cache",
    )
    p.add_argument("--listen", default="127.0.0.1:50052", help="address to serve on (host:port or unix:PATH)")
    p.add_argument("--device", default="cpu", help="cpu, cuda:N (ROCm builds of torch answer to cuda:N too) or auto (cuda:0 when torch sees a GPU, else cpu)")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto (bfloat16 on GPU, float32 on CPU), float32, float16, bfloat16, float64")
    p.add_argument(
        "--state-dtype", default="auto",
        help="hybrid (qwen35) targets: storage of recurrent states, per sequence and per tree node: "
        "auto (float32; float64 with --dtype float64), float32, bfloat16, float16",
    )
    keep_quantized.add_argument(
        p, "GGUF targets (llama, qwen2, qwen3 and the hybrid qwen35): keep linear weights of the types with a matmul kernel "
        "(native.gguf_matmul.KERNEL_TYPES: Q8_0, Q4_K, Q6_K, ...) in their GGUF blocks and multiply with kernels that "
        "read the blocks (on the CPU each call dequantizes: slow), and a quantized token embedding too (a lookup "
        "dequantizes only the rows it reads); other weights dequantize as usual",
    )
    p.add_argument("--max-sequences", type=int, default=64, help="live sequences at most")
    p.add_argument(
        "--max-kv-tokens", type=int, default=0,
        help="positions of the paged KV cache, over all sequences, allocated at start (0 = auto: on a GPU what "
        "--kv-memory-fraction of its free memory holds after the model loaded, on a CPU 1 GiB's worth; at most "
        "--max-sequences x the context length). Sequences take blocks as they grow; when none is free the newest "
        "sequence is preempted and prefilled again later, and prefills wait for blocks",
    )
    p.add_argument("--kv-memory-fraction", type=float, default=0.85, help="share of the GPU memory free after loading that --max-kv-tokens auto takes")
    p.add_argument(
        "--memory-cap-gb", type=float, default=0.0,
        help="device memory this worker may use, GiB (0 = no cap). On CUDA torch's allocator is held to it from before "
        "the weights load; on a CPU it is the budget of the memory plan only. The plan (weights, KV cache, state slots, "
        "tree buffers, workspace; logged at start) must fit the cap less 1/24 of it (at most 1 GiB): a configuration "
        "that does not is refused, naming what to lower; --max-kv-tokens auto takes only the room the cap leaves",
    )
    p.add_argument("--kv-block-size", type=int, default=16, help="positions per KV cache block")
    p.add_argument("--max-tree-nodes", type=int, default=256, help="largest tree a Verify accepts")
    p.add_argument(
        "--fixed-shapes", choices=("auto", "on", "off"), default="auto",
        help="pad every forward pass (the verify steps of all ready sequences together, or a prompt chunk) to bucketed "
        "shapes and replay them as CUDA graphs on a GPU (on a CPU the same fixed shapes run eagerly); off runs each "
        "pass eagerly at its exact shape (auto: on on CUDA, off on a CPU)",
    )
    p.add_argument("--no-cuda-graphs", action="store_true", help="run the fixed shapes without capturing graphs (debugging)")
    p.add_argument(
        "--warm-up-blocks", type=_blocks, default=None, metavar="ROWS,...",
        help="rows per sequence of the batch passes captured as CUDA graphs at start, for every batch of up to "
        f"{WARM_UP_SEQUENCES} sequences and --max-sequences (default: a decode step's 1 and every adaptive budget's "
        f"tree, {','.join(str(b + 1) for b in ADAPTIVE_BUDGETS)}); a shape left out runs eagerly until its third pass, "
        "then is captured. Fewer start sooner",
    )
    p.add_argument(
        "--draft-taps", default="", metavar="IDS|DRAFT",
        help="the target layers whose outputs the served draft reads (its target_layer_ids): comma-separated layer ids, "
        "or the draft model's path (its config names them). The passes captured at start record their features, so a "
        "draft's verify steps replay graphs from the first step; without it the first steps of each new shape run "
        "eagerly (on the 27B hybrid 75-200 ms a step against a 24 ms replay). splitspec serve sets it (default: none)",
    )
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default while loading, then 1 with a GPU --device)")
    p.add_argument(
        "--cpu-pass-thread", choices=("on", "off"), default="on",
        help="on a CPU, compute each verify pass on a thread of its own, as a GPU's pass runs on its stream, so that the next "
        "pass is prepared meanwhile: the staged passes a GPU serves (passes at exact shapes only; on the 2-core CI machine "
        "the built-in pair's rates with it on and off were within their run-to-run spread)",
    )
    p.add_argument("--sequence-ttl", type=float, default=600.0, help="release sequences idle this many seconds")
    p.add_argument("--metrics-port", type=int, default=9452, help="Prometheus /metrics port on the --listen host (0 = off)")
    p.add_argument("--shutdown-grace", type=float, default=10.0, help="seconds in-flight calls may finish after SIGTERM")
    add_step_socket_argument(p)
    busypoll.add_busy_poll_argument(p)
    add_server_arguments(p)


def draft_taps(value: str, num_layers: int) -> tuple[int, ...]:
    """``--draft-taps``: layer ids, or a draft model's taps (its default ones for a target of
    ``num_layers`` layers, where its file lists none); each must be a layer of the target."""
    if not value.strip():
        return ()
    try:
        taps = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        from splitspec.models.loader import read_draft_config

        taps = tuple(read_draft_config(value, num_layers).target_layer_ids)
    wrong = [t for t in taps if not 0 <= t < num_layers]
    if wrong:
        raise ValueError(f"--draft-taps {value}: layers {wrong} are outside the target's {num_layers}")
    return taps


def kv_tokens(args: argparse.Namespace, model, config, device, dtype, plan_at=None) -> int:
    """Positions of the paged KV cache (``--max-kv-tokens``, or its auto size). With a memory cap,
    ``plan_at(positions)`` is the worker's memory plan at that size, and the auto size is the most
    whose plan fits the cap as well (``services.worker.memory_plan.most_kv_tokens``)."""
    import torch

    from services.worker.memory_plan import most_kv_tokens

    most = args.max_sequences * config.max_context
    if args.max_kv_tokens > 0:
        return min(args.max_kv_tokens, most)
    per_position = model.position_bytes(config, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * args.kv_memory_fraction)
    else:
        budget = 1 << 30
    tokens = max(args.kv_block_size, min(most, budget // per_position))
    return tokens if plan_at is None else most_kv_tokens(plan_at, tokens, args.kv_block_size)


def load_model(args: argparse.Namespace, device, dtype, state_dtype):
    """The target named by ``--model``: (model, config, end-of-sequence ids, tokenizer path)."""
    from services.worker.memory_plan import cap_bytes
    from splitspec.models.hub import resolve_model
    from splitspec.models.loader import load_target
    from splitspec.text.tokenizer import Tokenizer

    path = resolve_model(args.model)
    keep = keep_quantized.decide(
        args.keep_quantized, keep_quantized.dequantized_bytes(path, dtype),
        keep_quantized.available_bytes(device, cap_bytes(args.memory_cap_gb)), dtype,
    )
    logger.info("target weights: %s", keep.reason)
    model, config = load_target(path, device, dtype, state_dtype, keep_quantized=keep.keep)
    return model, config, list(Tokenizer.load(path).eos_token_ids), str(path)


async def run(args: argparse.Namespace, build=load_model) -> None:
    """Serve the target worker; ``build(args, device, dtype, state_dtype)`` makes its model once the
    socket listens (the benchmark passes its own: splitspec/bench/workers.py)."""
    import torch

    from services.metrics import WorkerMetrics, model_name
    from services.target.engine import TargetEngine, TargetLimits
    from services.target.graphs import WARM_BLOCKS
    from services.target.server import SERVICE, TargetDescription, TargetServicer
    from services.worker import memory_plan
    from services.worker.hosting import model_geometry, serve_worker, settle_threads
    from splitspec.models.devices import DTYPES, backend_name, resolve_device, resolve_dtype
    from splitspec.models.qwen35 import Qwen35Config, tree_row_bytes
    from splitspec.v1 import target_pb2, target_pb2_grpc

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    busypoll.configure(args.busy_poll, device.type == "cuda", "target")
    if args.state_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"--state-dtype {args.state_dtype}: choose auto, float32, bfloat16 or float16")
    state_dtype = None if args.state_dtype == "auto" else DTYPES[args.state_dtype]
    cap = memory_plan.cap_bytes(args.memory_cap_gb)
    metrics = WorkerMetrics("target", model_name(args.model))
    metrics.serve(args.metrics_port, args.listen)
    servicer = TargetServicer(metrics)
    server, health = rpc.create_server(
        "target", [lambda s: target_pb2_grpc.add_TargetWorkerServicer_to_server(servicer, s)], [SERVICE],
        args.listen, ServerSecurity.from_args(args),
    )

    def load() -> None:
        t0 = time.perf_counter()
        memory_plan.apply_cap(device, cap)
        try:
            model, config, eos, tokenizer_path = build(args, device, dtype, state_dtype)
        except torch.OutOfMemoryError as exc:
            if cap is None:
                raise
            raise memory_plan.out_of_memory("target", cap, exc) from exc
        if isinstance(config, Qwen35Config):
            logger.info(
                "hybrid target: %d DeltaNet + %d attention layers; a verify pass keeps %.3g MB per tree row until its commit "
                "(conv and delta-rule inputs: the commit recomputes the accepted path's state)",
                config.num_linear_layers, config.num_full_layers, tree_row_bytes(config, dtype) / 1e6,
            )
        try:
            taps = draft_taps(args.draft_taps, config.num_layers)
        except ModelFileError as exc:  # a deployment without its draft still serves target-only steps
            logger.warning("--draft-taps: %s; the passes captured at start record no features", exc)
            taps = ()
        fixed = args.fixed_shapes == "on" or (args.fixed_shapes == "auto" and device.type == "cuda")
        capture = fixed and device.type == "cuda" and not args.no_cuda_graphs
        warm_up = min(args.max_sequences, WARM_UP_SEQUENCES) if capture else 0
        warm_blocks = args.warm_up_blocks or WARM_BLOCKS
        limits = TargetLimits(max_sequences=args.max_sequences, max_tree_nodes=args.max_tree_nodes, block_size=args.kv_block_size)

        def plan_at(positions: int) -> memory_plan.MemoryPlan:
            return memory_plan.target_plan(model, config, dtype, replace(limits, max_kv_tokens=positions), warm_up, cap, warm_blocks)

        limits.max_kv_tokens = kv_tokens(args, model, config, device, dtype, plan_at if cap is not None else None)
        # Checked before the pools exist: a refusal allocates nothing more than the weights.
        plan = plan_at(limits.max_kv_tokens)
        logger.info("%s", plan.describe())
        plan.check()
        geometry = model_geometry(config, str(dtype).removeprefix("torch."), str(device), str(args.model))
        engine = TargetEngine(model, limits, fixed_shapes=fixed, capture=capture, cpu_pass_thread=args.cpu_pass_thread == "on")
        logger.info(
            "paged KV cache: %d positions in blocks of %d (%.2f GB); passes %s",
            engine.capacity_tokens, limits.block_size, engine.kv.nbytes / 1e9,
            ("replayed as CUDA graphs" if engine.runner.capture else "at fixed shapes, eagerly") if fixed else "eager at exact shapes",
        )
        if engine.runner.capture:
            t1 = time.perf_counter()
            try:
                made = engine.runner.warm_up(warm_up, warm_blocks, taps=taps, prompt_chunk=engine.prompt_chunk)
                logger.info(
                    "captured %d passes (batches of up to %d sequences, prompt chunks of up to %d rows) in %.1f s, %s",
                    made, warm_up, engine.prompt_chunk, time.perf_counter() - t1,
                    f"recording the features of the draft's taps {list(taps)}" if taps else "without features (no --draft-taps)",
                )
            except Exception:  # a pass not made now is made on first use: serve anyway
                logger.exception("capturing the batch passes at start failed; they will be captured on first use")
        if device.type == "cuda":  # the measure of the plan's estimates (its workspace above all)
            logger.info(
                "memory after start-up: torch holds %.2f GiB (reserved) against a plan of %.2f GiB",
                torch.cuda.memory_reserved(device) / memory_plan.GiB, plan.total / memory_plan.GiB,
            )
        settle_threads(args.threads, device.type, "target")  # on the engine thread, where passes run
        servicer.host.attach(engine, TargetDescription(geometry, eos, tokenizer_path))
        metrics.describe(device=str(device), backend=backend_name(device), dtype=geometry.dtype)
        metrics.loaded(time.perf_counter() - t0)
        metrics.watch(
            live_sequences=lambda: len(engine.sequences), max_sequences=lambda: limits.max_sequences,
            kv_cache_reserved_tokens=lambda: engine.reserved_tokens, kv_cache_capacity_tokens=lambda: engine.capacity_tokens,
            kv_blocks_used=lambda: engine.kv.usable_blocks - engine.kv.free_blocks, kv_blocks_capacity=lambda: engine.kv.usable_blocks,
            graph_capture_failures=lambda: engine.runner.capture_failures,
        )
        metrics.watch_board(servicer.budget_board.figures)
        logger.info(
            "loaded target %s: %d layers, hidden %d, vocab %d, on %s (%s, %s) in %.1f s; serving on %s",
            args.model, config.num_layers, config.hidden_size, config.vocab_size, device, backend_name(device),
            str(dtype).removeprefix("torch."), time.perf_counter() - t0, args.listen,
        )

    logger.info("target worker listening on %s, loading %s", args.listen, args.model)
    step_server = step_server_from_args(
        args, "target", f"/{SERVICE}/Verify", target_pb2.VerifyRequest, servicer.verify_on_socket,
        Opener(f"/{SERVICE}/Prefill", target_pb2.PrefillRequest, servicer.prefill_on_socket),
    )
    servicer.step_server = step_server
    await serve_worker("target", server, health, SERVICE, servicer.host, load, args.shutdown_grace, args.sequence_ttl, step_server)
