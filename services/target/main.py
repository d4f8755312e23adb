"""``splitspec target``: load a target model and serve the TargetWorker API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from splitspec import rpc

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="target model: a GGUF file (architecture qwen3)")
    p.add_argument("--listen", default="127.0.0.1:50052", help="address to serve on (host:port or unix:PATH)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (ROCm builds of torch answer to cuda:N too)")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto (bfloat16 on GPU, float32 on CPU), float32, float16, bfloat16, float64")
    p.add_argument("--max-sequences", type=int, default=64, help="live sequences at most")
    p.add_argument("--max-kv-tokens", type=int, default=1 << 20, help="KV positions reserved over all sequences at most")
    p.add_argument("--max-tree-nodes", type=int, default=256, help="largest tree a Verify accepts")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default)")
    p.add_argument("--sequence-ttl", type=float, default=600.0, help="release sequences idle this many seconds")
    p.add_argument("--metrics-port", type=int, default=9452, help="Prometheus /metrics port on the --listen host (0 = off)")


async def run(args: argparse.Namespace) -> None:
    import torch

    from splitspec.devices import backend_name, resolve_device, resolve_dtype
    from splitspec.metrics import WorkerMetrics, model_name
    from splitspec.models.loader import load_target
    from splitspec.tokenizer import Tokenizer
    from splitspec.v1 import common_pb2, target_pb2_grpc
    from splitspec.services.target.engine import TargetEngine, TargetLimits
    from splitspec.services.target.server import SERVICE, TargetDescription, TargetServicer

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    t0 = time.perf_counter()
    model, config = load_target(args.model, device, dtype)
    tokenizer = Tokenizer.load(args.model)
    load_s = time.perf_counter() - t0
    logger.info(
        "loaded target %s: %d layers, hidden %d, vocab %d, on %s (%s, %s) in %.1f s",
        args.model, config.num_layers, config.hidden_size, config.vocab_size, device, backend_name(device),
        str(dtype).removeprefix("torch."), load_s,
    )
    limits = TargetLimits(max_sequences=args.max_sequences, max_kv_tokens=args.max_kv_tokens, max_tree_nodes=args.max_tree_nodes)
    engine = TargetEngine(model, limits)
    geometry = common_pb2.ModelGeometry(
        architecture="qwen3", vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_layers=config.num_layers, max_context=config.max_context,
        dtype=str(dtype).removeprefix("torch."), device=str(device), path=str(args.model),
    )
    metrics = WorkerMetrics("target", model_name(args.model))
    metrics.describe(device=str(device), backend=backend_name(device), dtype=geometry.dtype)
    metrics.loaded(load_s)
    metrics.watch(
        live_sequences=lambda: len(engine.sequences), max_sequences=lambda: limits.max_sequences,
        kv_cache_reserved_tokens=lambda: engine.reserved_tokens, kv_cache_capacity_tokens=lambda: limits.max_kv_tokens,
    )
    metrics.serve(args.metrics_port, args.listen)
    servicer = TargetServicer(engine, TargetDescription(geometry, list(tokenizer.eos_token_ids), str(args.model)), metrics)
    server, health, _ = rpc.create_server(
        "target", [lambda s: target_pb2_grpc.add_TargetWorkerServicer_to_server(servicer, s)], [SERVICE], args.listen
    )
    await server.start()
    await rpc.set_serving(health, [SERVICE], True)
    logger.info("target worker serving on %s", args.listen)
    expiry = asyncio.create_task(rpc.expire_periodically(servicer.executor, engine.expire_idle, args.sequence_ttl, "target"))
    try:
        await rpc.serve_until_terminated(server, health, [SERVICE])
    finally:
        expiry.cancel()
