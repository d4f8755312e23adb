"""``splitspec gateway``: connect to the workers, check they fit together, serve the public API."""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.gateway.workers import WIRES
from splitspec.transport import busypoll, rpc
from splitspec.transport.security import ServerSecurity, add_client_arguments, add_server_arguments, client_security

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:50051", help="public address (host:port or unix:PATH)")
    p.add_argument("--target", default="127.0.0.1:50052", help="target worker address")
    p.add_argument("--draft", default="127.0.0.1:50053", help="draft worker address; empty = no speculation")
    p.add_argument("--tokenizer", default="", help="GGUF file, tokenizer.json, model directory or hf://... (default: the path the target reports)")
    p.add_argument("--mode", choices=["ddtree", "chain", "off"], default="ddtree", help="default speculation mode")
    p.add_argument("--budget", type=int, default=22, help="default tree nodes per step, root excluded")
    p.add_argument("--chain-seed", action=argparse.BooleanOptionalAction, default=True, help="seed DDTree with the full top-1 chain")
    p.add_argument("--top-k", type=int, default=8, help="candidates per depth asked of the draft (capped by the budget)")
    p.add_argument("--draft-window", type=int, default=0, help="context positions the draft attends to (0 = all)")
    p.add_argument("--feature-dtype", choices=["", "float32", "float16", "bfloat16"], default="", help="wire dtype of tap features ('' = target compute dtype)")
    p.add_argument("--draft-timeout", type=float, default=5.0, help="seconds a Propose may take before the step falls back to target-only")
    p.add_argument(
        "--wire", choices=WIRES, default="auto",
        help="how a sequence's steps reach the workers: socket (a connection per sequence to the worker's step socket, "
        "a plain Unix socket on this host: the least overhead), stream (a gRPC stream per sequence), unary (a gRPC call "
        "per step), or auto (socket where the worker offers one this host can open, else stream)",
    )
    p.add_argument("--max-running", type=int, default=64, help="requests generating at once")
    p.add_argument("--max-waiting", type=int, default=256, help="requests queued for a slot; more get RESOURCE_EXHAUSTED")
    p.add_argument("--max-queue-wait", type=float, default=30.0, help="seconds a request may wait for a slot")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="largest request message accepted")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between worker health checks")
    p.add_argument("--worker-wait", type=float, default=600.0, help="seconds to wait for the workers at start-up")
    p.add_argument("--metrics-port", type=int, default=9451, help="Prometheus /metrics port on the --listen host (0 = off)")
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds in-flight requests may finish after SIGTERM")
    busypoll.add_busy_poll_argument(p)
    add_server_arguments(p)
    add_client_arguments(p, "worker-", "workers")


async def _wait_for(what: str, call, deadline: float):
    """Call ``call()`` until it succeeds; retry while the worker is unreachable or still loading."""
    import grpc

    loop = asyncio.get_running_loop()
    logger.info("waiting for the %s worker", what)
    while True:
        try:
            return await call(timeout=max(1.0, min(10.0, deadline - loop.time())))
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or loop.time() > deadline:
                raise ConnectionError(f"{what} worker: {exc.code().name}: {exc.details()}") from exc
        await asyncio.sleep(0.5)


async def run(args: argparse.Namespace) -> None:
    from services.gateway.admission import Admission
    from services.gateway.monitor import WorkerMonitor
    from services.gateway.server import SERVICE, GatewayServicer, GatewayState, check_compatible, load_chat_template
    from services.gateway.speculation import Mode, SpeculationOptions
    from services.gateway.workers import DraftClient, TargetClient
    from services.metrics import GatewayMetrics, model_name
    from splitspec.errors import FailedPrecondition
    from splitspec.models.hub import resolve_model
    from splitspec.text.tokenizer import Tokenizer
    from splitspec.v1 import gateway_pb2_grpc

    if args.budget < 1:
        raise FailedPrecondition(f"--budget {args.budget} must be >= 1")
    security = client_security(args, "worker-")
    admission = Admission(args.max_running, args.max_waiting, args.max_queue_wait)
    deadline = asyncio.get_running_loop().time() + args.worker_wait
    metrics = GatewayMetrics()
    target = TargetClient(args.target, security, metrics.interceptor(), args.wire)
    target_info = await _wait_for("target", target.info, deadline)
    await target.offer_step_socket(target_info.step_socket)
    busypoll.configure(args.busy_poll, target_info.geometry.device.startswith("cuda"), "gateway")
    draft, draft_info = None, None
    if args.draft:
        draft = DraftClient(args.draft, security, metrics.interceptor(), args.wire)
        draft_info = await _wait_for("draft", draft.info, deadline)
        check_compatible(target_info, draft_info)
        await draft.offer_step_socket(draft_info.step_socket)
    tokenizer = Tokenizer.load(resolve_model(args.tokenizer or target_info.tokenizer_path))
    chat, chat_problem = load_chat_template(tokenizer)
    if chat is None:
        logger.warning("chat requests will be refused: %s", chat_problem)
    defaults = SpeculationOptions(
        mode=Mode(args.mode), budget=args.budget, chain_seed=args.chain_seed, top_k=args.top_k,
        draft_window=args.draft_window, feature_dtype=args.feature_dtype, draft_timeout_s=args.draft_timeout,
    )
    health_holder = {}

    async def target_changed(up: bool) -> None:
        await rpc.set_serving(health_holder["health"], [SERVICE], up)

    async def draft_fits() -> bool:
        try:
            info = await draft.info(timeout=5)
            check_compatible(target_info, info)
            await draft.offer_step_socket(info.step_socket)  # a restarted draft may serve another way
            return True
        except Exception as exc:  # noqa: BLE001 - a draft that does not answer or fit stays down
            logger.error("draft worker is not usable: %s", exc)
            return False

    monitor = WorkerMonitor(target.channel, draft.channel if draft else None, target_changed, draft_fits, args.health_interval)
    metrics.model = model_name(target_info.geometry.path)
    metrics.describe()
    metrics.serve(args.metrics_port, args.listen)
    servicer = GatewayServicer(target, draft, GatewayState(target_info, draft_info, tokenizer, chat, chat_problem), defaults, admission, monitor, metrics)
    server, health = rpc.create_server(
        "gateway", [lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s)], [SERVICE],
        args.listen, ServerSecurity.from_args(args), max_receive_bytes=args.max_request_bytes,
    )
    health_holder["health"] = health

    async def ready() -> None:
        logger.info(
            "gateway serving on %s (target %s on the %s wire, draft %s%s, mode %s, budget %d)",
            args.listen, args.target, target.active_wire, args.draft or "none",
            f" on the {draft.active_wire} wire" if draft else "", args.mode, args.budget,
        )

    def drain() -> None:
        admission.draining = True

    await rpc.serve("gateway", server, health, [SERVICE], ready, args.shutdown_grace, [monitor.run], drain)
