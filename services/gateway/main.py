"""``splitspec gateway``: connect to the workers, check they fit together, serve the public API."""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.gateway.budget import AUTO, DEFAULT_BUDGET, DEFAULT_MAX_BUDGET, parse_budget
from services.gateway.workers import WIRES
from splitspec.spec.tree import DEFAULT_TOP_K
from splitspec.transport import busypoll, rpc
from splitspec.transport.security import ServerSecurity, add_client_arguments, add_server_arguments, client_security

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:50051", help="public address (host:port or unix:PATH)")
    p.add_argument("--target", default="127.0.0.1:50052", help="target worker address")
    p.add_argument("--draft", default="127.0.0.1:50053", help="draft worker address; empty = no speculation")
    p.add_argument("--tokenizer", default="", help="GGUF file, tokenizer.json, model directory or hf://... (default: the path the target reports)")
    p.add_argument("--mode", choices=["ddtree", "chain", "off"], default="ddtree", help="default speculation mode")
    p.add_argument(
        "--budget", type=parse_budget, default=DEFAULT_BUDGET,
        help=f"default DDTree nodes per step, root excluded (default {DEFAULT_BUDGET}): a fixed N, or auto (one budget for "
        "all the gateway's sequences, for the most tokens per second at the load the target reports: large trees while "
        "few sequences share its passes, small ones under load, 0 (target-only steps that skip the draft) where the "
        f"draft costs more than it saves; at most --max-budget, {DEFAULT_BUDGET} until it has measured a few passes; "
        "experimental: on an H200 it reached 0.70-1.01 of the best fixed budget, see BENCHMARKS.md). A request's "
        f"own speculation.budget wins. Chain mode's default length is N, or {DEFAULT_BUDGET} under auto",
    )
    p.add_argument(
        "--max-budget", type=int, default=DEFAULT_MAX_BUDGET,
        help="the largest budget --budget auto chooses (also capped by the target's largest tree): its trees are built "
        "at this size, then cut per step",
    )
    p.add_argument(
        "--chain-seed", action=argparse.BooleanOptionalAction, default=False,
        help="seed DDTree with the full top-1 chain before best-first growth (off by default: with the built-in pair at "
        "budget 22 it lowered AL, greedy 3.41 -> 3.14 and sampled 1.89 -> 1.79 on 40 HumanEval prompts)",
    )
    p.add_argument(
        "--top-k", type=int, default=DEFAULT_TOP_K,
        help="candidates per depth asked of the draft (capped by the budget; a DFlash2 draft scored by its lattice is "
        "asked for at least the top-K its selector was trained at)",
    )
    p.add_argument(
        "--tree-scores", choices=["lattice", "independent"], default="lattice",
        help="a DFlash2 draft's candidates: chained by its selector's walk and grown into trees by its pair scores "
        "(lattice), or by each depth's log-probabilities alone, as a DFlash draft's (independent); a request's "
        "speculation.scores wins",
    )
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
    p.add_argument("--max-waiting", type=int, default=256, help="requests waiting (for their prompt's preparation or a slot); more get RESOURCE_EXHAUSTED")
    p.add_argument("--max-queue-wait", type=float, default=30.0, help="seconds a request may wait for its preparation and a slot")
    p.add_argument(
        "--client-identity", default="peer",
        help="how requests are told apart by client, for fairness: peer (the connection's address: each gRPC channel "
        "is a client; all Unix-socket connections are one), host (the peer address without its port), or header:NAME "
        "(request metadata NAME set by a trusted proxy, e.g. header:x-forwarded-for; peer when absent)",
    )
    p.add_argument(
        "--max-running-per-client", type=int, default=0,
        help="requests one client may have generating at once (0 = no limit but --max-running); waiting requests are "
        "served round-robin by client either way",
    )
    p.add_argument(
        "--max-waiting-per-client", type=int, default=64,
        help="requests one client may have waiting; one more is refused at once with RESOURCE_EXHAUSTED (0 = no limit but --max-waiting)",
    )
    p.add_argument(
        "--prepare-threads", type=int, default=2,
        help="threads that tokenize prompts and render chat templates, off the event loop (turns given round-robin by client)",
    )
    p.add_argument(
        "--chat-special-tokens", action=argparse.BooleanOptionalAction, default=False,
        help="let special-token strings typed in chat messages (e.g. <|im_end|>) act as control tokens; only for trusted "
        "callers (default: they are plain text, so a user cannot forge turns)",
    )
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="largest request message (gRPC) or body (HTTP) accepted")
    p.add_argument(
        "--http-listen", default="",
        help="also serve the OpenAI- and Anthropic-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, "
        "/v1/messages, /health) on HOST:PORT or unix:PATH, with the same admission, auth token and TLS ('' = off; "
        "splitspec serve turns it on at 127.0.0.1:8000)",
    )
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between worker health checks")
    p.add_argument("--worker-wait", type=float, default=600.0, help="seconds to wait for the workers at start-up")
    p.add_argument("--metrics-port", type=int, default=9451, help="Prometheus /metrics port on the --listen host (0 = off)")
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds in-flight requests may finish after SIGTERM")
    busypoll.add_busy_poll_argument(p)
    add_server_arguments(p)
    add_client_arguments(p, "worker-", "workers")


WAIT_REPORT_S = 10.0  # while waiting for a worker at start-up, a progress line this often


async def _worker_state(channel, timeout: float) -> str:
    """``serving``, ``loading its model`` (listening, health NOT_SERVING) or why it cannot be reached."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        return f"not reachable: {exc.code().name}"
    return "serving" if reply.status == health_pb2.HealthCheckResponse.SERVING else "loading its model"


async def _wait_for(what: str, call, deadline: float, channel=None):
    """Call ``call()`` until it succeeds; retry while the worker is unreachable or still loading.

    With ``channel``, a worker is asked only its gRPC health until it reports SERVING: a loading
    worker answers health quietly, whereas it refuses each ``Info`` with UNAVAILABLE and logs every
    refusal (splitspec/transport/interceptors.py), a line per probe. The wait is logged once, then
    every ``WAIT_REPORT_S`` seconds with the time waited and the worker's state."""
    import grpc

    loop = asyncio.get_running_loop()
    start = loop.time()
    next_report = start + WAIT_REPORT_S
    logger.info("waiting for the %s worker", what)
    state = "not reachable yet"
    while True:
        remaining = deadline - loop.time()
        if channel is not None:
            state = await _worker_state(channel, max(0.5, min(5.0, remaining)))
        if channel is None or state == "serving":
            try:
                return await call(timeout=max(1.0, min(10.0, remaining)))
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or loop.time() > deadline:
                    raise ConnectionError(f"{what} worker: {exc.code().name}: {exc.details()}") from exc
                state = f"{exc.code().name}: {exc.details()}"
        elif loop.time() > deadline:
            raise ConnectionError(f"{what} worker: {state} after {loop.time() - start:.0f} s (--worker-wait)")
        if loop.time() >= next_report:
            logger.info("still waiting for the %s worker after %.0f s (%s)", what, loop.time() - start, state)
            next_report += WAIT_REPORT_S * (1 + (loop.time() - next_report) // WAIT_REPORT_S)
        await asyncio.sleep(0.5)


async def run(args: argparse.Namespace) -> None:
    from services.gateway.admission import Admission, check_identity
    from services.gateway.budget import BudgetPolicy
    from services.gateway.monitor import WorkerMonitor
    from services.gateway.server import SERVICE, GatewayServicer, GatewayState, check_compatible, load_chat_template
    from services.gateway.speculation import Mode, SpeculationOptions
    from services.gateway.workers import DraftClient, TargetClient
    from services.metrics import GatewayMetrics, model_name
    from splitspec.errors import FailedPrecondition
    from splitspec.models.hub import resolve_model
    from splitspec.text.tokenizer import Tokenizer
    from splitspec.v1 import gateway_pb2_grpc

    adaptive = args.budget == AUTO
    if args.max_budget < 1:
        raise FailedPrecondition(f"--max-budget {args.max_budget} must be >= 1")
    fixed_budget = DEFAULT_BUDGET if adaptive else args.budget
    security = client_security(args, "worker-")
    try:
        identity = check_identity(args.client_identity)
        admission = Admission(
            args.max_running, args.max_waiting, args.max_queue_wait, max_running_per_client=args.max_running_per_client,
            max_waiting_per_client=args.max_waiting_per_client, prepare_threads=args.prepare_threads,
        )
    except ValueError as exc:
        raise FailedPrecondition(str(exc)) from None
    deadline = asyncio.get_running_loop().time() + args.worker_wait
    metrics = GatewayMetrics()
    target = TargetClient(args.target, security, metrics.interceptor(), args.wire)
    target_info = await _wait_for("target", target.info, deadline, target.channel)
    await target.offer_step_socket(target_info.step_socket)
    busypoll.configure(args.busy_poll, target_info.geometry.device.startswith("cuda"), "gateway")
    draft, draft_info = None, None
    if args.draft:
        draft = DraftClient(args.draft, security, metrics.interceptor(), args.wire)
        draft_info = await _wait_for("draft", draft.info, deadline, draft.channel)
        check_compatible(target_info, draft_info)
        await draft.offer_step_socket(draft_info.step_socket)
    tokenizer = Tokenizer.load(resolve_model(args.tokenizer or target_info.tokenizer_path))
    chat, chat_problem = load_chat_template(tokenizer)
    if chat is None:
        logger.warning("chat requests will be refused: %s", chat_problem)
    defaults = SpeculationOptions(
        mode=Mode(args.mode), budget=fixed_budget, adaptive=adaptive, chain_seed=args.chain_seed, top_k=args.top_k,
        lattice=args.tree_scores == "lattice", draft_window=args.draft_window, feature_dtype=args.feature_dtype, draft_timeout_s=args.draft_timeout,
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
    most = tokenizer.max_input_bytes_per_token  # computed once here, not in a request
    logger.info(
        "prompts are checked for size before tokenization: %s",
        f"a token stands for at most {most} bytes" if most else "no bound for this tokenizer (prompts are tokenized, off the event loop)",
    )
    state = GatewayState(target_info, draft_info, tokenizer, chat, chat_problem, chat_special_tokens=args.chat_special_tokens)
    policy = BudgetPolicy(min(DEFAULT_BUDGET, args.max_budget), args.max_budget)
    metrics.watch_budget(policy.figures)
    servicer = GatewayServicer(target, draft, state, defaults, admission, monitor, metrics, policy, identity=identity)
    server, health = rpc.create_server(
        "gateway", [lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s)], [SERVICE],
        args.listen, ServerSecurity.from_args(args), max_receive_bytes=args.max_request_bytes,
    )
    health_holder["health"] = health
    http = None
    if args.http_listen:
        from services.gateway.http.app import HttpApi, HttpService

        security_in = ServerSecurity.from_args(args)
        api = HttpApi(servicer, token=security_in.token, identity=identity, max_request_bytes=args.max_request_bytes)
        try:
            http = HttpService(
                api, args.http_listen, cert=security_in.cert, key=security_in.key, client_ca=security_in.client_ca, grace_s=args.shutdown_grace,
            )
        except ValueError as exc:
            raise FailedPrecondition(str(exc)) from None

    async def ready() -> None:
        if http is not None:
            http.start()
        logger.info(
            "gateway serving on %s (target %s on the %s wire, draft %s%s, mode %s, budget %s)",
            args.listen, args.target, target.active_wire, args.draft or "none",
            f" on the {draft.active_wire} wire" if draft else "", args.mode,
            f"auto (at most {args.max_budget})" if adaptive else args.budget,
        )
        if http is not None:
            logger.info("gateway HTTP API (OpenAI, Anthropic) on %s%s", "https://" if args.tls_cert else "http://", args.http_listen)

    def drain() -> None:
        admission.draining = True
        if http is not None:
            http.stop()  # stops accepting; its requests in flight finish within the grace

    await rpc.serve("gateway", server, health, [SERVICE], ready, args.shutdown_grace, [monitor.run], drain)
    if http is not None:
        await http.wait(args.shutdown_grace)
