"""``splitspec serve``: run target, draft and gateway as three local processes, and keep them running.

The workers listen on Unix sockets in a private directory (no ports to collide, and cheaper
than TCP loopback); the gateway listens on ``--listen``. Without ``--target-model`` it serves the
built-in pair (``splitspec.builtin``: a small target trained on Python's standard library and
its DFlash draft, or with ``--builtin-draft dflash2`` its DFlash2 draft); a checkout without
those weights writes a random tiny pair to ``--work-dir`` and serves that instead.

``serve`` supervises its three children. One that dies after start-up is started again, after a
back-off (1 s, doubling with each restart of that process in the last minute, at most 30 s);
more than ``--max-restarts`` restarts of one process within a minute and serve gives up, stops the
others and exits 1. Meanwhile the gateway does what it does with separate services: with the draft
down, sequences run target-only with the same output, and with the target down requests get
UNAVAILABLE until it is back (then the gateway prefills the live sequences again). A child that
fails during start-up is taken as a configuration error: serve stops and exits 1.

SIGTERM, SIGINT or SIGHUP drain in order: the gateway first (it stops admitting and lets requests
in flight finish within ``--shutdown-grace``), then the two workers; serve then exits 0. The
children run in their own process group, so a Ctrl-C in the terminal reaches serve alone and
cannot stop the workers under the gateway's requests. A second signal stops everything at once.

``--device auto`` is resolved by the workers themselves (``splitspec.models.devices``), which
import torch anyway: serve, which stays up for as long as the services do, does not load torch
(importing it took 3.7 s and 218 MB on the 2-core CPU machine, against 50 MB for serve's own
imports, and on a GPU host it would initialise the driver in a process that never computes).
It asks the workers which device they took and names it in its ready line.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import splitspec
from services.gateway.budget import DEFAULT_BUDGET, parse_budget
from services.gateway.workers import WIRES
from splitspec.builtin import DRAFT_DIRS
from splitspec.models import keep_quantized

logger = logging.getLogger(__name__)

DEFAULT_WORK_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "splitspec"
RESTART_WINDOW_S = 60.0  # --max-restarts counts the restarts of one process within this window
MAX_BACKOFF_S = 30.0
PROGRESS_S = 10.0  # while a restarted process is not serving yet, a line this often
WORKER_STOP_S = 20.0  # after SIGTERM, how long a worker may take before it is killed (its own grace is 10 s)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# A draft sharing its target's device gets this share of --memory-cap-gb unless --draft-memory-gb
# says otherwise: the Qwen3-8B pair's draft plans 8.3 GiB at its defaults (4.3 of weights with its
# own bf16 copy of the target's embedding and LM head, 2.5 of 32 context slots of 4096 positions,
# 1.5 of workspace), about a third of a 24 GiB card.
DRAFT_MEMORY_SHARE = 1 / 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-model", default="", help="target model: GGUF file, model directory or hf://... (default: the built-in pair)")
    p.add_argument("--draft-model", default="", help="DFlash or DFlash2 draft: directory, GGUF (DFlash) or hf://... (default: the built-in pair's; 'none' = no draft)")
    p.add_argument(
        "--builtin-draft", choices=list(DRAFT_DIRS), default="dflash",
        help="which draft of the built-in pair serves beside its target (when no --target-model is given)",
    )
    p.add_argument("--listen", default="127.0.0.1:50051", help="public gateway address")
    p.add_argument(
        "--http-listen", default="127.0.0.1:8000",
        help="the gateway's OpenAI- and Anthropic-compatible HTTP API, HOST:PORT ('' = off)",
    )
    p.add_argument(
        "--device", default="auto",
        help="target device: auto (cuda:0 when the workers' torch sees a CUDA or ROCm GPU, else cpu), cpu or cuda:N",
    )
    p.add_argument("--draft-device", default="", help="draft device: auto, cpu or cuda:N (default: the same as --device)")
    p.add_argument("--dtype", default="auto", help="compute dtype of both workers")
    keep_quantized.add_argument(p, "both workers keep a GGUF model's quantized weights in their blocks (see splitspec target --help and splitspec draft --help)")
    p.add_argument("--mode", choices=["ddtree", "chain", "off"], default="ddtree", help="default speculation mode")
    p.add_argument(
        "--budget", type=parse_budget, default=DEFAULT_BUDGET,
        help=f"default tree nodes per step: a fixed N (default {DEFAULT_BUDGET}) or auto (chosen per step from the load; "
        "experimental, see splitspec gateway --help)",
    )
    p.add_argument(
        "--wire", choices=WIRES, default="auto",
        help="gateway-to-worker steps: the workers' step sockets (auto: the workers here listen on Unix sockets), "
        "one gRPC stream per sequence, or one gRPC call per step",
    )
    p.add_argument("--work-dir", default=str(DEFAULT_WORK_DIR), help="where the random tiny pair is written when the built-in weights are absent")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the gateway to be ready")
    p.add_argument(
        "--metrics-port", type=int, default=9451,
        help="Prometheus port of the gateway; the target and draft get the next two (0 = off)",
    )
    p.add_argument(
        "--shutdown-grace", type=float, default=30.0,
        help="on SIGTERM/SIGINT: seconds the gateway lets requests in flight finish before the workers are stopped",
    )
    p.add_argument(
        "--memory-cap-gb", type=float, default=0.0,
        help="device memory the workers may use, GiB (0 = no cap; see splitspec target --help): a worker on a device of "
        "its own is capped at all of it; when the draft shares the target's device they split it, the draft taking "
        "--draft-memory-gb and the target the rest",
    )
    p.add_argument(
        "--draft-memory-gb", type=float, default=0.0,
        help="with --memory-cap-gb and both workers on one device: the draft's share, GiB (0 = a third of the cap)",
    )
    p.add_argument(
        "--max-restarts", type=int, default=5,
        help="restarts of one crashed process within a minute; at the next crash serve stops everything and exits 1",
    )


def memory_caps(cap_gb: float, draft_gb: float, shared: bool) -> tuple[list[str], list[str]]:
    """The ``--memory-cap-gb`` flags of the target and the draft under ``serve --memory-cap-gb cap_gb``:
    none without a cap; the whole cap each when they do not ``share`` a device; else the draft
    ``draft_gb`` (0: ``DRAFT_MEMORY_SHARE`` of the cap) and the target the rest, since the caps of two
    processes on one device add up."""
    if cap_gb <= 0:
        return [], []
    if not shared:
        return ["--memory-cap-gb", f"{cap_gb:.6g}"], ["--memory-cap-gb", f"{cap_gb:.6g}"]
    draft = draft_gb or cap_gb * DRAFT_MEMORY_SHARE
    if not 0 < draft < cap_gb:
        raise ValueError(f"--draft-memory-gb {draft:g}: the draft's share of --memory-cap-gb {cap_gb:g} must be above 0 and below the cap")
    return ["--memory-cap-gb", f"{cap_gb - draft:.6g}"], ["--memory-cap-gb", f"{draft:.6g}"]


def wait_ready(address: str, procs: list[subprocess.Popen], timeout: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[3]} exited with code {p.returncode} during start-up")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"gateway at {address} not ready after {timeout:.0f} s")


def _default_pair(work_dir: Path, builtin_dir: Path | None = None, draft_arch: str = "dflash") -> tuple[Path, Path, str]:
    from splitspec.builtin import HERE, builtin_pair

    pair = builtin_pair(builtin_dir or HERE, draft_arch)
    if pair is not None:
        logger.info("serving the built-in pair: target %s, %s draft %s", pair[0], draft_arch, pair[1])
        return *pair, "the built-in pair"
    from splitspec.fixtures.tiny import DRAFT_DIR, TARGET_FILE, make_tiny

    tiny = Path(work_dir) / "tiny"
    logger.warning("the built-in pair's weights are not installed; serving a random tiny pair from %s", tiny)
    if not (tiny / TARGET_FILE).exists():
        make_tiny(tiny)
    return tiny / TARGET_FILE, tiny / DRAFT_DIR, "a random tiny pair (the built-in weights are not installed; its text is noise)"


def default_pair(work_dir: Path, builtin_dir: Path | None = None, draft_arch: str = "dflash") -> tuple[Path, Path]:
    """(target, draft) served without ``--target-model``: the built-in pair in ``builtin_dir``
    (default: the installed one) with its ``draft_arch`` draft when their weights are there, else a
    random tiny pair in ``work_dir/tiny``."""
    target, draft, _ = _default_pair(work_dir, builtin_dir, draft_arch)
    return target, draft


def metrics_url(port: int, listen: str) -> str:
    """Where a process given ``--metrics-port port --listen listen`` serves /metrics (see services/metrics.py)."""
    if not port:
        return "metrics off"
    host = "127.0.0.1" if listen.startswith("unix:") else listen.rsplit(":", 1)[0].strip("[]")
    return f"metrics http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Child:
    """One supervised process: its command, its gRPC address, and its restart history."""

    role: str  # target, draft or gateway
    command: list[str]
    address: str
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    died_at: float = 0.0
    restart_at: float | None = None  # when a dead child is due to start again
    restarts: collections.deque = field(default_factory=collections.deque)  # monotonic times of restarts
    awaiting: object = None  # a health channel while a restarted child is not serving yet
    next_check: float = 0.0
    next_report: float = 0.0

    @property
    def name(self) -> str:
        return "gateway" if self.role == "gateway" else f"{self.role} worker"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        # A process group of its own: a terminal's Ctrl-C reaches serve only, which then drains in order.
        self.proc = subprocess.Popen(self.command, process_group=0, env=child_environment())
        self.started_at = time.monotonic()

    def remove_stale_sockets(self) -> None:
        """A killed process leaves its Unix socket files behind; its successor binds the same paths."""
        if not self.address.startswith("unix:"):
            return
        path = Path(self.address.removeprefix("unix:"))
        for candidate in (path, Path(f"{path}.steps")):
            try:
                if stat.S_ISSOCK(candidate.lstat().st_mode):
                    candidate.unlink()
            except FileNotFoundError:
                pass


def child_environment() -> dict[str, str]:
    """The environment of a child: its ``python -P -m splitspec`` imports the very package this
    process runs (its root first on PYTHONPATH; -P keeps the current directory off the path), so
    serve started from some other checkout's root cannot mix two copies of the code."""
    root = str(Path(splitspec.__file__).resolve().parents[1])
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def _health_channel(address: str):
    """A channel for serve's own health checks; it retries a connection at least every second (gRPC's
    default back-off grows to minutes), so a restarted process is seen serving soon after it is."""
    import grpc

    return grpc.insecure_channel(address, options=[("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)])


def _health(channel, timeout: float = 0.5) -> str:
    """``serving``, ``not serving yet`` (listening: a worker loading its model, a gateway waiting for
    its workers), ``not listening yet`` or ``late to its health check``, from its gRPC health service."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        return "late to its health check" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "not listening yet"
    return "serving" if reply.status == health_pb2.HealthCheckResponse.SERVING else "not serving yet"


def _serving(channel, timeout: float = 0.5) -> bool:
    return _health(channel, timeout) == "serving"


def _worker_placement(child: Child, requested: str) -> str:
    """``cpu (float32)``: the device and dtype a worker reports in its Info (``requested`` if it does not answer)."""
    import grpc

    from splitspec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

    try:
        with grpc.insecure_channel(child.address) as ch:
            if child.role == "target":
                geometry = target_pb2_grpc.TargetWorkerStub(ch).Info(common_pb2.InfoRequest(), timeout=5).geometry
            else:
                geometry = draft_pb2_grpc.DraftWorkerStub(ch).Info(common_pb2.InfoRequest(), timeout=5).target_geometry
    except grpc.RpcError:
        return f"{requested} (did not answer Info)"
    return f"{geometry.device} ({geometry.dtype}{'; --device auto' if requested == 'auto' else ''})"


class Supervisor:
    def __init__(self, children: list[Child], max_restarts: int, shutdown_grace: float) -> None:
        self.children = children
        self.max_restarts = max_restarts
        self.shutdown_grace = shutdown_grace
        self.signals = 0

    def child(self, role: str) -> Child | None:
        return next((c for c in self.children if c.role == role), None)

    def on_signal(self, signum, _frame) -> None:
        self.signals += 1
        if self.signals == 1:
            logger.info("serve: %s received; draining: the gateway first, then the workers", signal.Signals(signum).name)
        elif self.signals == 2:
            logger.warning("serve: %s received again; stopping every process now", signal.Signals(signum).name)

    def start_all(self) -> None:
        for c in self.children:
            c.start()
        logger.info("serve: started %s", ", ".join(f"the {c.name} (pid {c.proc.pid})" for c in self.children))

    def wait_ready(self, timeout: float) -> bool:
        """Until the gateway reports SERVING: True; False after a stop signal. Raises when a
        process exits or the time runs out."""
        gateway = self.child("gateway")
        deadline = time.monotonic() + timeout
        with _health_channel(gateway.address) as ch:
            while not self.signals:
                for c in self.children:
                    if not c.alive:
                        raise RuntimeError(f"the {c.name} {describe_exit(c.proc.returncode)} during start-up")
                if _serving(ch, 1.0):
                    return True
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gateway at {gateway.address} not ready after {timeout:.0f} s")
                time.sleep(0.2)
        return False

    def supervise(self) -> int:
        """Keep the children running until a stop signal (0) or too many restarts (1)."""
        while not self.signals:
            now = time.monotonic()
            for c in self.children:
                if c.proc is not None and c.proc.poll() is not None:
                    if not self._schedule_restart(c, now):
                        return 1
                elif c.proc is None and c.restart_at is not None and now >= c.restart_at:
                    self._restart(c, now)
                elif c.awaiting is not None and now >= c.next_check:
                    self._check_back(c, now)
            time.sleep(0.1)
        return 0

    def _schedule_restart(self, c: Child, now: float) -> bool:
        code, pid = c.proc.returncode, c.proc.pid
        c.proc, c.died_at = None, now
        self._stop_awaiting(c)
        while c.restarts and now - c.restarts[0] > RESTART_WINDOW_S:
            c.restarts.popleft()
        if len(c.restarts) >= self.max_restarts:
            logger.error(
                "serve: the %s (pid %d) %s after %d restarts within %.0f s (--max-restarts %d); giving up",
                c.name, pid, describe_exit(code), len(c.restarts), RESTART_WINDOW_S, self.max_restarts,
            )
            return False
        delay = min(MAX_BACKOFF_S, 2.0 ** len(c.restarts))
        c.restart_at = now + delay
        effect = {
            "draft": "requests continue target-only meanwhile",
            "target": "requests get UNAVAILABLE until it is back",
            "gateway": "clients cannot connect until it is back",
        }[c.role]
        logger.warning(
            "serve: the %s (pid %d) %s after %.0f s; restarting it in %.0f s (%s; restart %d of at most %d a minute)",
            c.name, pid, describe_exit(code), now - c.started_at, delay, effect, len(c.restarts) + 1, self.max_restarts,
        )
        return True

    def _restart(self, c: Child, now: float) -> None:
        c.restart_at = None
        c.restarts.append(now)
        c.remove_stale_sockets()
        c.start()
        c.awaiting, c.next_check, c.next_report = _health_channel(c.address), now + 0.5, now + PROGRESS_S
        logger.info("serve: restarted the %s (pid %d)", c.name, c.proc.pid)

    def _check_back(self, c: Child, now: float) -> None:
        """Log once when a restarted process serves again, and every PROGRESS_S seconds until then."""
        state = _health(c.awaiting, 0.5)
        if state == "serving":
            logger.info("serve: the %s (pid %d) is serving again, %.1f s after it died", c.name, c.proc.pid, time.monotonic() - c.died_at)
            self._stop_awaiting(c)
            return
        if now >= c.next_report:
            logger.info("serve: the %s (pid %d) is %s, %.0f s after it died", c.name, c.proc.pid, state, now - c.died_at)
            c.next_report = now + PROGRESS_S
        c.next_check = time.monotonic() + 0.5

    @staticmethod
    def _stop_awaiting(c: Child) -> None:
        if c.awaiting is not None:
            c.awaiting.close()
            c.awaiting = None

    def _wait(self, procs: list[subprocess.Popen], timeout: float, signals_before: int) -> bool:
        """Wait for ``procs`` to exit; False when the time ran out or another signal came."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or self.signals > signals_before:
                return False
            time.sleep(0.05)
        return True

    def stop_all(self) -> None:
        """The gateway first (SIGTERM: it drains its requests), then the workers; kill what lingers."""
        signals = max(self.signals, 1)
        for c in self.children:
            self._stop_awaiting(c)
        gateway = [c.proc for c in self.children if c.role == "gateway" and c.alive]
        workers = [c.proc for c in self.children if c.role != "gateway" and c.alive]
        for group, timeout in ((gateway, self.shutdown_grace + 15.0), (workers, WORKER_STOP_S)):
            if self.signals > signals:
                break
            t0 = time.monotonic()
            for p in group:
                p.send_signal(signal.SIGTERM)
            if self._wait(group, timeout, signals) and group is gateway:
                logger.info("serve: the gateway stopped (code %d) %.1f s after SIGTERM; stopping the workers", gateway[0].returncode, time.monotonic() - t0)
        for c in self.children:
            if c.alive:
                logger.warning("serve: the %s (pid %d) did not stop; killing it", c.name, c.proc.pid)
                c.proc.kill()
                c.proc.wait()


def run(args: argparse.Namespace, log_args: list[str]) -> int:
    target_model, draft_model = args.target_model, args.draft_model
    pair = "target and draft as given"
    if not target_model:
        target, draft, pair = _default_pair(Path(args.work_dir), draft_arch=args.builtin_draft)
        target_model, draft_model = str(target), draft_model or str(draft)
    sockets = Path(tempfile.mkdtemp(prefix="splitspec-"))
    target_addr, draft_addr = f"unix:{sockets / 'target.sock'}", f"unix:{sockets / 'draft.sock'}"
    base = [sys.executable, "-P", "-m", "splitspec"]
    draft_device = args.draft_device or args.device
    # Two CPU workers that each spin all cores slow each other down; split the cores between them.
    # With `auto` the workers may land on the CPU; on a GPU the split only bounds their CPU-side torch ops.
    both_cpu = {args.device, draft_device} <= {"cpu", "auto"}
    threads = ["--threads", str(max(1, (os.cpu_count() or 2) // 2))] if both_cpu else []
    gateway_port, target_port, draft_port = (args.metrics_port + i if args.metrics_port else 0 for i in range(3))
    use_draft = bool(draft_model) and draft_model != "none"
    shared = use_draft and draft_device == args.device
    target_cap, draft_cap = memory_caps(args.memory_cap_gb, args.draft_memory_gb, shared)
    # The target sizes its KV cache from the GPU memory free once its model is loaded (85% of it
    # alone); sharing the GPU with the draft, which may load later, it takes half, unless memory
    # caps split the device between them already.
    kv_share = ["--kv-memory-fraction", "0.5"] if shared and not target_cap else []
    keep = ["--keep-quantized", args.keep_quantized]
    children = [Child("target", [
        *base, "target", *log_args, "--model", target_model, "--listen", target_addr, "--device", args.device, "--dtype", args.dtype, *threads,
        "--metrics-port", str(target_port), *kv_share, *keep, *target_cap, *(["--draft-taps", draft_model] if use_draft else []),
    ], target_addr)]
    if use_draft:
        children.append(Child("draft", [
            *base, "draft", *log_args, "--model", draft_model, "--target-model", target_model, "--listen", draft_addr,
            "--device", draft_device, "--dtype", args.dtype, *threads, "--metrics-port", str(draft_port), *keep, *draft_cap,
        ], draft_addr))
    children.append(Child("gateway", [
        *base, "gateway", *log_args, "--listen", args.listen, "--target", target_addr,
        "--draft", draft_addr if use_draft else "", "--mode", args.mode, "--budget", str(args.budget), "--wire", args.wire,
        "--metrics-port", str(gateway_port), "--shutdown-grace", str(args.shutdown_grace), "--http-listen", args.http_listen,
    ], args.listen))
    supervisor = Supervisor(children, args.max_restarts, args.shutdown_grace)
    previous = {sig: signal.signal(sig, supervisor.on_signal) for sig in STOP_SIGNALS}
    code = 0
    try:
        supervisor.start_all()
        if supervisor.wait_ready(args.ready_timeout):
            placement = {"target": _worker_placement(children[0], args.device)}
            if use_draft:
                placement["draft"] = _worker_placement(supervisor.child("draft"), draft_device)
            print(
                f"splitspec serve: ready on {args.listen} (gateway gRPC, {metrics_url(gateway_port, args.listen)}"
                + (f", HTTP API http://{args.http_listen}/v1" if args.http_listen else "") + "); "
                f"target worker on {placement['target']}, {metrics_url(target_port, target_addr)}; "
                + (f"draft worker on {placement['draft']}, {metrics_url(draft_port, draft_addr)}; " if use_draft else "no draft worker; ")
                + f"serving {pair}: target {target_model}, draft {draft_model if use_draft else 'none'}",
                file=sys.stderr, flush=True,
            )
            code = supervisor.supervise()
    except (RuntimeError, TimeoutError) as exc:
        logger.error("serve: %s", exc)
        code = 1
    finally:
        supervisor.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sock in sockets.iterdir():
            sock.unlink()
        sockets.rmdir()
    if code == 0:
        logger.info("serve: all processes stopped")
    return code
