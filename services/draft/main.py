"""``splitspec draft``: load a DFlash draft (plus the target's embedding and LM head) and serve it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from splitspec import rpc

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", help="DFlash draft directory (config.json + model.safetensors)")
    p.add_argument("--target-model", required=True, help="the target's GGUF file: its embedding and LM head are read from it")
    p.add_argument("--listen", default="127.0.0.1:50053", help="address to serve on (host:port or unix:PATH)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), float32, float16, bfloat16")
    p.add_argument("--max-sequences", type=int, default=256, help="live draft contexts at most")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default)")
    p.add_argument("--sequence-ttl", type=float, default=600.0, help="release contexts idle this many seconds")
    p.add_argument("--metrics-port", type=int, default=9453, help="Prometheus /metrics port on the --listen host (0 = off)")
    p.add_argument(
        "--replay", default="",
        help="BENCHMARK/TEST ONLY: instead of a model, replay the continuations in this JSONL table "
        "({\"tokens\": [...]} per line), corrupted at --replay-corruption",
    )
    p.add_argument("--replay-corruption", type=float, default=0.0, help="BENCHMARK/TEST ONLY: per-depth corruption rate of the replay drafter")


async def run(args: argparse.Namespace) -> None:
    import torch

    from splitspec.devices import backend_name, resolve_device, resolve_dtype
    from splitspec.metrics import WorkerMetrics, model_name
    from splitspec.models.gguf_file import GGUFFile, ModelFileError
    from splitspec.models.loader import load_dflash_draft, load_target_head, qwen3_config_from_gguf
    from splitspec.v1 import common_pb2, draft_pb2_grpc
    from splitspec.services.draft.engine import DraftEngine
    from splitspec.services.draft.replay import ReplayDrafter, ReplayTable
    from splitspec.services.draft.server import SERVICE, DraftServicer

    if args.threads:
        torch.set_num_threads(args.threads)
    if bool(args.model) == bool(args.replay):
        raise ValueError("give exactly one of --model (a DFlash draft) or --replay (benchmark/test only)")
    t0 = time.perf_counter()
    if args.replay:
        target_config = qwen3_config_from_gguf(GGUFFile(args.target_model))
        engine = ReplayDrafter(ReplayTable(args.replay), target_config.vocab_size, corruption=args.replay_corruption)
        logger.warning("REPLAY drafter (benchmark/test only): %s, corruption %.2f", args.replay, args.replay_corruption)
        dtype, device = "n/a", torch.device("cpu")
    else:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        model, config = load_dflash_draft(args.model, device, dtype)
        embed, head, target_config = load_target_head(args.target_model, device, dtype)
        if config.hidden_size != target_config.hidden_size:
            raise ModelFileError(f"{args.model}: draft hidden_size {config.hidden_size} != target hidden_size {target_config.hidden_size}")
        if not 0 <= config.mask_token_id < target_config.vocab_size:
            raise ModelFileError(f"{args.model}: mask_token_id {config.mask_token_id} outside the target vocabulary of {target_config.vocab_size}")
        logger.info(
            "loaded draft %s: %d layers, block %d, taps %s, on %s in %.1f s",
            args.model, config.num_layers, config.block_size, list(config.target_layer_ids), device, time.perf_counter() - t0,
        )
        engine = DraftEngine(model, embed, head, max_sequences=args.max_sequences)
    geometry = common_pb2.ModelGeometry(
        architecture="qwen3", vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
        num_layers=target_config.num_layers, max_context=target_config.max_context,
        dtype=str(dtype).removeprefix("torch."), device=str(device), path=str(args.target_model),
    )
    metrics = WorkerMetrics("draft", model_name(args.target_model))
    metrics.describe(device=str(device), backend=backend_name(device), dtype=geometry.dtype, draft=model_name(args.model or args.replay))
    metrics.loaded(time.perf_counter() - t0)
    metrics.watch(live_sequences=lambda: len(engine.sequences))
    if isinstance(engine, DraftEngine):
        metrics.watch(max_sequences=lambda: engine.max_sequences)
    metrics.serve(args.metrics_port, args.listen)
    servicer = DraftServicer(engine, geometry, str(args.model or args.replay), metrics)
    server, health, _ = rpc.create_server(
        "draft", [lambda s: draft_pb2_grpc.add_DraftWorkerServicer_to_server(servicer, s)], [SERVICE], args.listen
    )
    await server.start()
    await rpc.set_serving(health, [SERVICE], True)
    logger.info("draft worker serving on %s", args.listen)
    expiry = asyncio.create_task(rpc.expire_periodically(servicer.executor, engine.expire_idle, args.sequence_ttl, "draft"))
    try:
        await rpc.serve_until_terminated(server, health, [SERVICE])
    finally:
        expiry.cancel()
