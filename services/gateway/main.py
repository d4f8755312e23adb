"""``splitspec gateway``: connect to the workers, check they fit together, serve the public API."""

from __future__ import annotations

import argparse
import logging

from splitspec import rpc

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:50051", help="public address (host:port or unix:PATH)")
    p.add_argument("--target", default="127.0.0.1:50052", help="target worker address")
    p.add_argument("--draft", default="127.0.0.1:50053", help="draft worker address; empty = no speculation")
    p.add_argument("--tokenizer", default="", help="GGUF file or tokenizer.json (default: the path the target reports)")
    p.add_argument("--mode", choices=["ddtree", "chain", "off"], default="ddtree", help="default speculation mode")
    p.add_argument("--budget", type=int, default=22, help="default tree nodes per step, root excluded")
    p.add_argument("--chain-seed", action=argparse.BooleanOptionalAction, default=True, help="seed DDTree with the full top-1 chain")
    p.add_argument("--top-k", type=int, default=8, help="candidates per depth asked of the draft (capped by the budget)")
    p.add_argument("--draft-window", type=int, default=0, help="context positions the draft attends to (0 = all)")
    p.add_argument("--feature-dtype", choices=["", "float32", "float16", "bfloat16"], default="", help="wire dtype of tap features ('' = target compute dtype)")
    p.add_argument("--draft-timeout", type=float, default=5.0, help="seconds a Propose may take before the step falls back to target-only")
    p.add_argument("--worker-wait", type=float, default=600.0, help="seconds to wait for the workers at start-up")
    p.add_argument("--metrics-port", type=int, default=9451, help="Prometheus /metrics port on the --listen host (0 = off)")


async def run(args: argparse.Namespace) -> None:
    from splitspec.errors import FailedPrecondition
    from splitspec.metrics import GatewayMetrics, model_name
    from splitspec.tokenizer import Tokenizer
    from splitspec.v1 import gateway_pb2_grpc
    from splitspec.services.gateway.server import SERVICE, GatewayServicer, GatewayState, check_compatible
    from splitspec.services.gateway.speculation import DraftShape, Mode, SpeculationOptions
    from splitspec.services.gateway.workers import DraftClient, TargetClient

    metrics = GatewayMetrics()
    target = TargetClient(args.target, [metrics.interceptor()])
    logger.info("waiting for the target worker at %s", args.target)
    target_info = await target.info(timeout=args.worker_wait)
    draft, shape = None, None
    if args.draft:
        draft = DraftClient(args.draft, [metrics.interceptor()])
        logger.info("waiting for the draft worker at %s", args.draft)
        draft_info = await draft.info(timeout=args.worker_wait)
        check_compatible(target_info, draft_info)
        shape = DraftShape(draft_info.block_size, tuple(draft_info.target_layer_ids))
    if args.budget < 1:
        raise FailedPrecondition(f"--budget {args.budget} must be >= 1")
    tokenizer = Tokenizer.load(args.tokenizer or target_info.tokenizer_path)
    defaults = SpeculationOptions(
        mode=Mode(args.mode), budget=args.budget, chain_seed=args.chain_seed, top_k=args.top_k,
        draft_window=args.draft_window, feature_dtype=args.feature_dtype, draft_timeout_s=args.draft_timeout,
    )
    metrics.model = model_name(target_info.geometry.path)
    metrics.describe()
    metrics.serve(args.metrics_port, args.listen)
    servicer = GatewayServicer(target, draft, GatewayState(target_info, shape, tokenizer), defaults, metrics)
    server, health, _ = rpc.create_server(
        "gateway", [lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s)], [SERVICE], args.listen
    )
    await server.start()
    await rpc.set_serving(health, [SERVICE], True)
    logger.info(
        "gateway serving on %s (target %s, draft %s, mode %s, budget %d)",
        args.listen, args.target, args.draft or "none", args.mode, args.budget,
    )
    await rpc.serve_until_terminated(server, health, [SERVICE])
