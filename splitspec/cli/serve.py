"""``splitspec serve``: run target, draft and gateway as three local processes, stopped together.

The workers listen on Unix sockets in a private directory (no ports to collide, and cheaper
than TCP loopback); the gateway listens on ``--listen``. Without ``--target-model`` it serves the
built-in pair (``splitspec.builtin``: a small target trained on Python's standard library and
its DFlash draft); a checkout without those weights writes a random tiny pair to ``--work-dir``
and serves that instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.gateway.workers import WIRES

logger = logging.getLogger(__name__)

DEFAULT_WORK_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "splitspec"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-model", default="", help="target model: GGUF file, model directory or hf://... (default: the built-in pair)")
    p.add_argument("--draft-model", default="", help="DFlash draft: directory, GGUF or hf://... (default: the built-in pair's; 'none' = no draft)")
    p.add_argument("--listen", default="127.0.0.1:50051", help="public gateway address")
    p.add_argument("--device", default="cpu", help="target device (cpu or cuda:N)")
    p.add_argument("--draft-device", default="", help="draft device (default: same as --device)")
    p.add_argument("--dtype", default="auto", help="compute dtype of both workers")
    p.add_argument("--mode", choices=["ddtree", "chain", "off"], default="ddtree", help="default speculation mode")
    p.add_argument("--budget", type=int, default=22, help="default tree nodes per step")
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


def default_pair(work_dir: Path, builtin_dir: Path | None = None) -> tuple[Path, Path]:
    """(target, draft) served without ``--target-model``: the built-in pair in ``builtin_dir``
    (default: the installed one) when its weights are there, else a random tiny pair in ``work_dir/tiny``."""
    from splitspec.builtin import HERE, builtin_pair

    pair = builtin_pair(builtin_dir or HERE)
    if pair is not None:
        logger.info("serving the built-in pair: target %s, draft %s", *pair)
        return pair
    from splitspec.fixtures.tiny import DRAFT_DIR, TARGET_FILE, make_tiny

    tiny = Path(work_dir) / "tiny"
    logger.warning("the built-in pair's weights are not installed; serving a random tiny pair from %s", tiny)
    if not (tiny / TARGET_FILE).exists():
        make_tiny(tiny)
    return tiny / TARGET_FILE, tiny / DRAFT_DIR


def run(args: argparse.Namespace, log_args: list[str]) -> int:
    target_model, draft_model = args.target_model, args.draft_model
    if not target_model:
        target, draft = default_pair(Path(args.work_dir))
        target_model, draft_model = str(target), draft_model or str(draft)
    sockets = Path(tempfile.mkdtemp(prefix="splitspec-"))
    target_addr, draft_addr = f"unix:{sockets / 'target.sock'}", f"unix:{sockets / 'draft.sock'}"
    base = [sys.executable, "-m", "splitspec"]
    # Two CPU workers that each spin all cores slow each other down; split the cores between them.
    both_cpu = args.device == "cpu" and (args.draft_device or args.device) == "cpu"
    threads = ["--threads", str(max(1, (os.cpu_count() or 2) // 2))] if both_cpu else []
    gateway_port, target_port, draft_port = (args.metrics_port + i if args.metrics_port else 0 for i in range(3))
    commands = [
        [*base, "target", *log_args, "--model", target_model, "--listen", target_addr, "--device", args.device, "--dtype", args.dtype, *threads,
         "--metrics-port", str(target_port)],
    ]
    use_draft = draft_model and draft_model != "none"
    if use_draft:
        commands.append([
            *base, "draft", *log_args, "--model", draft_model, "--target-model", target_model, "--listen", draft_addr,
            "--device", args.draft_device or args.device, "--dtype", args.dtype, *threads, "--metrics-port", str(draft_port),
        ])
    commands.append([
        *base, "gateway", *log_args, "--listen", args.listen, "--target", target_addr,
        "--draft", draft_addr if use_draft else "", "--mode", args.mode, "--budget", str(args.budget), "--wire", args.wire,
        "--metrics-port", str(gateway_port),
    ])
    procs: list[subprocess.Popen] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    try:
        procs = [subprocess.Popen(c) for c in commands]
        wait_ready(args.listen, procs, args.ready_timeout)
        metrics = f", metrics on ports {gateway_port}-{draft_port if use_draft else target_port}" if args.metrics_port else ""
        print(
            f"splitspec serve: ready on {args.listen} (target {target_model}, draft {draft_model or 'none'}{metrics})",
            file=sys.stderr, flush=True,
        )
        while not stopping:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                logger.error("%s exited with code %d; stopping the others", dead[0].args[3], dead[0].returncode)
                code = 1
                break
            time.sleep(0.2)
    except (RuntimeError, TimeoutError) as exc:
        logger.error("%s", exc)
        code = 1
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        for sock in sockets.iterdir():
            sock.unlink()
        sockets.rmdir()
    return code
