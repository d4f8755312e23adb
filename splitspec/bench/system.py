"""End-to-end throughput through the three real services, on random weights of a real shape.

The target's output is meaningless on random weights, so acceptance is set from outside: the
benchmark first records the target's own greedy continuation of each prompt (speculation off,
which is also the AR row), then feeds it to the **OracleDrafter** (benchmark-only),
corrupted at a chosen rate per depth, so the whole gateway → draft → target path runs at a
chosen acceptance length. The oracle runs no draft forward pass and asks the target for no tap
features, so its rows' times are not a real drafter's: their labels say so
(``report.ORACLE_NOTE``), and they only set the acceptance length. A random DFlash draft of the
real draft shape runs too: it accepts almost nothing, but its row is the true cost of a full
round (draft pass, features on the wire, verify) at that budget. The report's headline speed-up
combines the two (``report.headline_speedups``).

Acceptance length (AL) is :mod:`splitspec.spec.acceptance_length`'s: tokens committed by verify
steps over verify steps, from each request's usage; the prefill's token is not counted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from splitspec.bench.report import AR_LABEL, DFLASH_LABEL, oracle_label
from splitspec.bench.workers import BENCH_WORKERS
from splitspec.cli.serve import wait_ready
from splitspec.spec.acceptance_length import acceptance_length, committed_tokens
from splitspec.v1 import gateway_pb2, gateway_pb2_grpc

Spec = gateway_pb2.Speculation


@dataclass
class SystemRow:
    label: str
    budget: int
    completion_tokens: int  # tokens the clients received (each request's first from its prefill)
    steps: int  # verify steps
    committed_tokens: int  # tokens committed by the verify steps (usage: AL x steps)
    seconds: float  # wall time of the whole batch
    concurrency: int
    wire: str = "socket"  # the gateway's --wire
    decode_seconds: float = 0.0  # per request, first response to last, summed: steps without prefill
    draft_fallbacks: int = 0  # steps that ran target-only because the draft failed or was late
    drafter: str = ""  # "off", "oracle" (benchmark-only) or "dflash"
    corruption: float | None = None  # the oracle's corruption rate

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds

    @property
    def acceptance_length(self) -> float:
        """AL (splitspec.spec.acceptance_length): committed tokens over verify steps; exactly 1 target-only."""
        return acceptance_length(self.committed_tokens, self.steps)

    @property
    def ms_per_step(self) -> float:
        """Wall time of one sequence's decode step (prefill excluded; concurrent steps overlap)."""
        return 1e3 * self.decode_seconds / max(1, self.steps)


def synthetic_tokenizer(vocab_size: int, path: Path) -> Path:
    """A word-level tokenizer.json with ``vocab_size`` tokens ``t0 t1 ...``, for a random target
    (which has none): the gateway streams text, and this makes any id decodable."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


class Cluster:
    """Service processes on Unix sockets in a private directory, stopped together."""

    def __init__(self, log_dir: Path, busy_poll_us: int = 0) -> None:
        self.sockets = Path(tempfile.mkdtemp(prefix="splitspec-bench-"))
        self.log_dir = log_dir
        self.busy_poll_us = busy_poll_us  # every service's --busy-poll
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *args: str, timeout: float = 600.0) -> str:
        """Start ``args[0]``: a ``splitspec`` service or a benchmark-only worker of
        ``splitspec.bench.workers`` (random-target, random-draft, oracle-draft)."""
        address = f"unix:{self.sockets / name}.sock"
        log = (self.log_dir / f"{name}.log").open("w")
        module = "splitspec.bench.workers" if args[0] in BENCH_WORKERS else "splitspec"
        proc = subprocess.Popen(
            [sys.executable, "-m", module, args[0], "--listen", address, "--metrics-port", "0",
             "--busy-poll", str(self.busy_poll_us), *args[1:]],
            stdout=log, stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        wait_ready(address, [proc], timeout)
        return address

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *_) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def generate(address: str, request: gateway_pb2.GenerateRequest) -> tuple[list[int], gateway_pb2.Usage, float]:
    """Token ids, usage, and seconds from the first response (prefill done) to the last."""
    with grpc.insecure_channel(address) as ch:
        tokens, usage, first = [], None, None
        for r in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=600):
            first = first or time.perf_counter()
            tokens.extend(r.token_ids)
            if r.HasField("final"):
                usage = r.final.usage
    return tokens, usage, time.perf_counter() - first


def run_batch(
    address: str, requests: list[gateway_pb2.GenerateRequest], concurrency: int, label: str, budget: int, wire: str = "socket",
    drafter: str = "", corruption: float | None = None,
) -> tuple[SystemRow, list[list[int]]]:
    """All ``requests``, ``concurrency`` at a time; one row of aggregate figures."""
    outputs: list[list[int]] = [[] for _ in requests]
    usages: list[gateway_pb2.Usage | None] = [None] * len(requests)
    decode = [0.0] * len(requests)
    queue = list(range(len(requests)))
    lock = threading.Lock()
    errors: list[Exception] = []

    def worker() -> None:
        while True:
            with lock:
                if not queue or errors:
                    return
                i = queue.pop(0)
            try:
                outputs[i], usages[i], decode[i] = generate(address, requests[i])
            except grpc.RpcError as exc:
                errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{label}: {errors[0].code().name}: {errors[0].details()}")
    steps = sum(u.steps for u in usages)
    row = SystemRow(
        label, budget, sum(len(o) for o in outputs), steps, sum(committed_tokens(u) for u in usages), seconds, concurrency,
        wire, sum(decode), sum(u.draft_fallbacks for u in usages), drafter, corruption,
    )
    return row, outputs


def run_system(
    shape: str,
    device: str,
    draft_device: str,
    dtype: str,
    corruptions: list[float],
    budget: int,
    prompts: int,
    prompt_len: int,
    max_tokens: int,
    concurrency: int,
    work_dir: Path,
    log_dir: Path,
    wires: tuple[str, ...] = ("socket",),
    busy_poll_us: int = 0,
) -> list[SystemRow]:
    """The AR row, then one row per draft, for each gateway ``--wire`` in ``wires``: the workers are
    shared and the wires take turns row by row, so both see the same machine state."""
    from splitspec.bench.random_weights import random_target_config

    target_model = f"random:{shape}"
    config = random_target_config(target_model)
    tokenizer = synthetic_tokenizer(config.vocab_size, work_dir / "tokenizer.json")
    table = work_dir / "oracle.jsonl"
    table.write_text("")
    rng = np.random.default_rng(0)
    prompt_ids = [rng.integers(0, config.vocab_size, prompt_len).tolist() for _ in range(prompts + concurrency)]
    warm, timed = prompt_ids[:concurrency], prompt_ids[concurrency:]
    context = str(prompt_len + max_tokens + 2 * budget + 64)

    def requests(ids: list[list[int]], spec: gateway_pb2.Speculation) -> list[gateway_pb2.GenerateRequest]:
        return [
            gateway_pb2.GenerateRequest(tokens=gateway_pb2.TokenIds(ids=p), max_tokens=max_tokens, ignore_eos=True, speculation=spec)
            for p in ids
        ]

    rows = []
    with Cluster(log_dir, busy_poll_us) as c:
        target = c.start(
            "target", "random-target", "--model", target_model, "--device", device, "--dtype", dtype,
            "--graph-slots", str(max(2, concurrency)), "--graph-context", context,
        )
        drafts = {oracle_label(p): ("oracle-draft", "--table", str(table), "--corruption", str(p)) for p in corruptions}
        drafts[DFLASH_LABEL] = ("random-draft", "--model", f"{target_model}-dflash", "--device", draft_device, "--dtype", dtype)
        kinds = {oracle_label(p): ("oracle", p) for p in corruptions} | {DFLASH_LABEL: ("dflash", None)}
        draft_addresses = {
            label: c.start(f"draft{i}", args[0], "--target-model", target_model, *args[1:]) for i, (label, args) in enumerate(drafts.items())
        }
        gateways = {
            (wire, label): c.start(
                f"gateway{i}-{wire}", "gateway", "--target", target, "--draft", draft, "--tokenizer", str(tokenizer), "--wire", wire
            )
            for wire in wires
            for i, (label, draft) in enumerate(draft_addresses.items())
        }
        off = Spec(mode=Spec.OFF)
        tree = Spec(mode=Spec.DDTREE, budget=budget)
        for wire in wires:
            first = gateways[wire, next(iter(drafts))]
            run_batch(first, requests(warm, off), concurrency, "warm-up", 0, wire)  # captures graphs, fills caches
            row, outputs = run_batch(first, requests(timed, off), concurrency, AR_LABEL, 0, wire, "off")
            rows.append(row)
            if wire == wires[0]:
                with table.open("w") as f:
                    for p, out in zip(timed + warm, outputs + [[]] * len(warm)):
                        f.write(json.dumps({"tokens": p + out}) + "\n")
        for label in drafts:
            for wire in wires:
                run_batch(gateways[wire, label], requests(warm, tree), concurrency, "warm-up", budget, wire)
                rows.append(run_batch(gateways[wire, label], requests(timed, tree), concurrency, label, budget, wire, *kinds[label])[0])
    return rows
