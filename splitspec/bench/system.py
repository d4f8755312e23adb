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
combines the two (``report.headline_speedups``). With ``--shaped-oracle`` a third drafter runs both
in one row (``splitspec.bench.shaped_oracle``): the random draft's passes, with the tap features of
every committed row (a random draft commits about one token a step, so its row moves fewer), and
the oracle's proposals, so that row's AL and round are measured together.

Acceptance length (AL) is :mod:`splitspec.spec.acceptance_length`'s: tokens committed by verify
steps over verify steps, from each request's usage; the prefill's token is not counted.

**Concurrency sweep.** Every row is measured at each level N of ``--concurrency``: N clients
generate at once through the gateway, each its own prompt, after a warm-up of 2N requests, N at a time
(it captures the graphs of N sequences and fills caches). A level times N × ceil(prompts / N)
requests, which the N clients take from one queue, so N are in flight until the queue runs dry.
Each level draws prompts no other level uses, and the oracle reads the AR rows' output of its own
level.

**Quantized shapes** (``*-q4km``) run their workers with ``--keep-quantized``: the target's linears
and LM head stay in GGUF blocks (``native.gguf_matmul``), and the DFlash draft borrows the head in
its Q6_K blocks, as a real Q4_K_M pair is served. ``--memory-cap-gb`` reaches both workers as
``splitspec serve`` passes it (:func:`splitspec.cli.serve.memory_caps`), and each worker's memory
plan, as its log states it, is reported (:func:`worker_memory`).

``--pair builtin`` (:func:`run_builtin_system`) runs the sweep on the built-in pair instead, served
by ``splitspec serve`` with no model flags, on held-out standard-library prompts: the trained
DFlash draft, so its AL is real and no oracle is needed.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import numpy as np

from services.gateway.budget import AUTO, DEFAULT_MAX_BUDGET
from splitspec.bench.report import AR_LABEL, BUILTIN_LABELS, DFLASH_LABEL, SHAPED, oracle_label, shaped_oracle_label
from splitspec.bench.step_split import StepSplit, means, scrape
from splitspec.bench.workers import BENCH_WORKERS
from splitspec.cli.serve import wait_ready
from splitspec.spec.acceptance_length import acceptance_length, committed_tokens
from splitspec.transport.ports import free_port
from splitspec.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger(__name__)
Spec = gateway_pb2.Speculation
# The gateway's --max-running and the target's --max-sequences by default: more clients than this
# would wait in the gateway's queue, not generate at once.
MAX_CONCURRENCY = 64


@dataclass
class SystemRow:
    label: str
    budget: int | str  # the request's tree budget, or "auto": the gateway's adaptive budget chose each step's
    completion_tokens: int  # tokens the clients received (each request's first from its prefill)
    steps: int  # verify steps
    committed_tokens: int  # tokens committed by the verify steps (usage: AL x steps)
    seconds: float  # wall time of the whole batch, all clients together
    concurrency: int  # clients generating at once
    wire: str = "socket"  # the gateway's --wire
    decode_seconds: float = 0.0  # per request, first response to last, summed: steps without prefill
    # Times when every client was decoding (none waiting for its prompt's prefill), and the tokens
    # that arrived in them: llama-batched-bench's S_TG measure (:func:`all_decoding`).
    all_decoding_tokens: int = 0
    all_decoding_seconds: float = 0.0
    all_decoding_windows: tuple[tuple[float, float], ...] = ()  # those times, (start, end) in time.perf_counter()
    draft_fallbacks: int = 0  # steps that ran target-only because the draft failed or was late
    drafter: str = ""  # "off", "oracle" or "shaped-oracle" (benchmark-only), "dflash" or "dflash2"
    corruption: float | None = None  # the oracle's corruption rate
    split: StepSplit | None = None  # where its steps went, by the services' /metrics (None: not read)

    @property
    def tokens_per_s(self) -> float:
        """Aggregate: every client's tokens over the wall time of the batch."""
        return self.completion_tokens / self.seconds

    @property
    def acceptance_length(self) -> float:
        """AL (splitspec.spec.acceptance_length): committed tokens over verify steps; exactly 1 target-only."""
        return acceptance_length(self.committed_tokens, self.steps)

    @property
    def decode_tokens_per_s(self) -> float:
        """Aggregate while all clients decode (prefills excluded); 0.0 when no such time was seen."""
        return self.all_decoding_tokens / self.all_decoding_seconds if self.all_decoding_seconds else 0.0

    @property
    def ms_per_step(self) -> float:
        """Wall time of one sequence's decode step (prefill excluded; concurrent steps overlap),
        averaged over every step of every sequence; a DFlash row's is t_round."""
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
    """Service processes on Unix sockets in a private directory, stopped together; each but ``serve``
    serves its /metrics on a free loopback port (``metrics_ports``: address -> port), which a row
    reads for where its steps go (:mod:`splitspec.bench.step_split`)."""

    def __init__(self, log_dir: Path, busy_poll_us: int = 0) -> None:
        self.sockets = Path(tempfile.mkdtemp(prefix="splitspec-bench-"))
        self.log_dir = log_dir
        self.busy_poll_us = busy_poll_us  # every service's --busy-poll
        self.procs: list[subprocess.Popen] = []
        self.metrics_ports: dict[str, int] = {}

    def start(self, name: str, *args: str, timeout: float = 600.0) -> str:
        """Start ``args[0]``: a ``splitspec`` service (or ``serve``, all three) or a benchmark-only
        worker of ``splitspec.bench.workers`` (random-target, random-draft, oracle-draft)."""
        address = f"unix:{self.sockets / name}.sock"
        log = (self.log_dir / f"{name}.log").open("w")
        module = "splitspec.bench.workers" if args[0] in BENCH_WORKERS else "splitspec"
        # `splitspec serve` has no --busy-poll: its services keep their own default, as a user's do.
        # Its --metrics-port would be the first of three ports: it serves none here.
        busy_poll = [] if args[0] == "serve" else ["--busy-poll", str(self.busy_poll_us)]
        port = 0 if args[0] == "serve" else free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", module, args[0], "--listen", address, "--metrics-port", str(port), *busy_poll, *args[1:]],
            stdout=log, stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        wait_ready(address, [proc], timeout)
        if port:
            self.metrics_ports[address] = port
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


def generate(address: str, request: gateway_pb2.GenerateRequest) -> tuple[list[int], gateway_pb2.Usage, list[tuple[float, int]]]:
    """Token ids, usage, and each response's arrival (``time.perf_counter()``, token count): the
    first arrives when the prefill is done."""
    with grpc.insecure_channel(address) as ch:
        tokens, usage, arrivals = [], None, []
        for r in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=600):
            arrivals.append((time.perf_counter(), len(r.token_ids)))
            tokens.extend(r.token_ids)
            if r.HasField("final"):
                usage = r.final.usage
    return tokens, usage, arrivals


Interval = tuple[float, float]


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The intersection of two sorted lists of disjoint intervals, sorted and disjoint."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def decoding_windows(clients: list[list[list[tuple[float, int]]]]) -> list[Interval]:
    """The times when every client was decoding (:func:`all_decoding`), in order."""
    window: list[Interval] | None = None
    for requests in clients:
        mine = sorted((a[0][0], a[-1][0]) for a in requests if a)
        window = mine if window is None else _intersect(window, mine)
    return window or []


def all_decoding(clients: list[list[list[tuple[float, int]]]], window: list[Interval] | None = None) -> tuple[int, float]:
    """Tokens and seconds of the times when every client was decoding.

    ``clients[k]`` holds client ``k``'s requests in the order it made them, each as its responses'
    arrivals ``(time, tokens)``. A client *decodes* from its request's first arrival (the prefill's
    token) to its last; between requests it waits for the next prefill. Over the times when all
    decode (the intersection of the clients' decoding intervals), the tokens that arrived inside
    them (a window's start excluded: a first arrival is the prefill's token) over their length is
    the aggregate decode rate alone, which llama-batched-bench reports as S_TG. ``window``: those
    times, where :func:`decoding_windows` already gave them.
    """
    window = decoding_windows(clients) if window is None else window
    if not window:
        return 0, 0.0
    tokens = sum(
        n for requests in clients for arrivals in requests for t, n in arrivals
        if any(lo < t <= hi for lo, hi in window)
    )
    return tokens, sum(hi - lo for lo, hi in window)


def run_batch(
    addresses: str | Sequence[str], requests: list[gateway_pb2.GenerateRequest], concurrency: int, label: str, budget: int,
    wire: str = "socket", drafter: str = "", corruption: float | None = None,
) -> tuple[SystemRow, list[list[int]]]:
    """All ``requests``, ``concurrency`` at a time, request ``i`` to gateway ``i mod len(addresses)``
    (gateways scale out: one Python event loop streams a few thousand steps a second); one row of
    aggregate figures."""
    addresses = [addresses] if isinstance(addresses, str) else list(addresses)
    outputs: list[list[int]] = [[] for _ in requests]
    usages: list[gateway_pb2.Usage | None] = [None] * len(requests)
    clients: list[list[list[tuple[float, int]]]] = [[] for _ in range(concurrency)]  # each client's requests' arrivals
    queue = list(range(len(requests)))
    lock = threading.Lock()
    errors: list[Exception] = []

    def worker(arrivals: list[list[tuple[float, int]]]) -> None:
        while True:
            with lock:
                if not queue or errors:
                    return
                i = queue.pop(0)
            try:
                outputs[i], usages[i], times = generate(addresses[i % len(addresses)], requests[i])
                arrivals.append(times)
            except grpc.RpcError as exc:
                errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(mine,)) for mine in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{label}: {errors[0].code().name}: {errors[0].details()}")
    steps = sum(u.steps for u in usages)
    decode = sum(a[-1][0] - a[0][0] for mine in clients for a in mine)
    windows = decoding_windows(clients)
    window_tokens, window_seconds = all_decoding(clients, windows)
    row = SystemRow(
        label, budget, sum(len(o) for o in outputs), steps, sum(committed_tokens(u) for u in usages), seconds, concurrency,
        wire, decode, window_tokens, window_seconds, tuple(windows), sum(u.draft_fallbacks for u in usages), drafter, corruption,
    )
    return row, outputs


def parse_concurrency(text: str) -> list[int]:
    """The levels of ``--concurrency`` (``1,4,16,32``), ascending: distinct whole numbers in
    [1, :data:`MAX_CONCURRENCY`]. Raises ValueError naming the flag and the bad value."""
    hint = f"expected distinct whole numbers from 1 to {MAX_CONCURRENCY}, comma-separated, e.g. 1,4,16,32"
    levels = []
    for item in text.split(","):
        try:
            n = int(item.strip())
        except ValueError:
            raise ValueError(f"--concurrency {text!r}: {item.strip()!r} is not a whole number; {hint}") from None
        if not 1 <= n <= MAX_CONCURRENCY:
            raise ValueError(f"--concurrency {text!r}: {n} is out of range; {hint} (more would queue in the gateway)")
        if n in levels:
            raise ValueError(f"--concurrency {text!r}: {n} is given twice; {hint}")
        levels.append(n)
    return sorted(levels)


def requests_per_level(prompts: int, concurrency: int) -> int:
    """Timed requests at one level: at least ``prompts`` and a multiple of N (N × ceil(prompts / N)),
    so that N stay in flight until the queue runs dry rather than a part of N finishing alone."""
    return concurrency * math.ceil(prompts / concurrency)


@dataclass
class Level:
    """One concurrency level's prompts: 2N warm-up requests (N at a time), then the timed ones."""

    concurrency: int
    warm: list[list[int]]
    timed: list[list[int]]


def plan_levels(pool: Iterator[list[int]], levels: Sequence[int], prompts: int) -> list[Level]:
    """Each level's prompts, drawn in turn from ``pool``: no two levels share one (a cached prefix
    or a recorded oracle continuation of another level would change what is timed)."""
    plan = []
    for n in levels:
        # Two rounds of warm-up: the second's sequences start and end out of step, as the timed ones
        # do, so the passes of every batch size a level sees are captured before the timing.
        warm = 2 * n
        drawn = list(itertools.islice(pool, warm + requests_per_level(prompts, n)))
        if len(drawn) < warm + requests_per_level(prompts, n):
            raise ValueError(f"--concurrency {n}: the prompts ran out; lower --prompts, --prompt-len or --concurrency")
        plan.append(Level(n, drawn[:warm], drawn[warm:]))
    return plan


def random_prompts(vocab_size: int, length: int, seed: int = 0) -> Iterator[list[int]]:
    """Prompts of uniform random token ids, for a random target (its output is noise anyway)."""
    rng = np.random.default_rng(seed)
    while True:
        yield rng.integers(0, vocab_size, length).tolist()


def heldout_prompts(tokenizer, length: int) -> Iterator[list[int]]:
    """Consecutive windows of ``length`` tokens of the built-in pair's held-out standard-library
    modules (``splitspec.train.corpus.HELDOUT``: never trained on, tokenizer included), read from
    this interpreter's copy: real code, which the draft has not seen."""
    from splitspec.train.corpus import HELDOUT

    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for name in HELDOUT for f in (sorted((root / name).rglob("*.py")) if name.endswith("/") else [root / name])]
    ids: list[int] = []
    for f in files:
        ids += tokenizer.encode(f.read_text(encoding="utf-8"), add_special_tokens=False)
        while len(ids) >= length:
            yield ids[:length]
            ids = ids[length:]


def requests_for(ids: list[list[int]], spec: gateway_pb2.Speculation, max_tokens: int) -> list[gateway_pb2.GenerateRequest]:
    return [
        gateway_pb2.GenerateRequest(tokens=gateway_pb2.TokenIds(ids=p), max_tokens=max_tokens, ignore_eos=True, speculation=spec)
        for p in ids
    ]


def measure(
    address: str | Sequence[str], level: Level, spec: gateway_pb2.Speculation, max_tokens: int, label: str, wire: str,
    drafter: str = "", corruption: float | None = None, metrics: Sequence[int] = (),
) -> tuple[SystemRow, list[list[int]]]:
    """One row at one level: the warm-up (N at once), then the timed requests, N at a time; and the
    outputs of all, the warm-up's first (``level.warm + level.timed``: an oracle's table needs the
    warm-up's too, or an adaptive budget learns from it that the draft is never right). ``metrics``:
    the /metrics ports of the row's gateways and its target, read around the timed requests for
    the row's ``split``."""
    n = level.concurrency
    logger.info('row "%s" (%s wire, concurrency %d): %d warm-up requests, then %d timed', label, wire, n, len(level.warm), len(level.timed))
    _, warm = run_batch(address, requests_for(level.warm, spec, max_tokens), n, "warm-up", spec.budget, wire)
    before = scrape(metrics) if metrics else None
    row, timed = run_batch(address, requests_for(level.timed, spec, max_tokens), n, label, spec.budget, wire, drafter, corruption)
    if before is not None:
        row = replace(row, split=means(before, scrape(metrics)))
    logger.info(
        'row "%s": AL %.2f, %.1f tok/s, %.2f ms a decode step, %.1f s', label, row.acceptance_length, row.tokens_per_s, row.ms_per_step, row.seconds,
    )
    return row, warm + timed


DFLASH_LOG = "draft-dflash"  # the random DFlash draft's process name: its log is DFLASH_LOG.log
SHAPED_LOG = "draft-shaped-oracle"  # the --shaped-oracle draft's


def worker_flags(quantized: bool, cap_gb: float, draft_gb: float, shared: bool) -> tuple[list[str], list[str]]:
    """The flags of the random target and the random DFlash draft: ``--keep-quantized`` for a
    quantized shape (its blocks stay blocks, as a real Q4_K_M pair is served) and ``--memory-cap-gb``
    as ``splitspec serve --memory-cap-gb cap_gb --draft-memory-gb draft_gb`` gives it: each worker the
    whole cap on devices of their own, else the draft ``draft_gb`` (0: a third) and the target the rest."""
    from splitspec.cli.serve import memory_caps

    target_cap, draft_cap = memory_caps(cap_gb, draft_gb, shared)
    keep = ["--keep-quantized"] if quantized else []
    return [*keep, *target_cap], [*keep, *draft_cap]


_SIZE = r"(-?[\d.]+) (GiB|MiB|KiB)"
_UNIT_GIB = {"GiB": 1.0, "MiB": 1 / 1024, "KiB": 1 / 1024**2}


def worker_memory(log: Path) -> dict:
    """What a worker's log (``services.worker.memory_plan``) says of its memory, in GiB: ``plan`` (the
    total of its memory plan), ``cap`` and ``budget`` (when capped) and ``verdict`` (``fits`` or
    ``over by ...``), and ``reserved`` (what torch held after start-up: CUDA targets only). A figure
    the log does not state is absent."""
    text = log.read_text(errors="replace") if log.exists() else ""
    out: dict = {}
    plan = text[text.find("memory plan:") :] if "memory plan:" in text else ""
    if (m := re.search(r"^\s*total\s+" + _SIZE, plan, re.M)) is not None:
        out["plan"] = float(m[1]) * _UNIT_GIB[m[2]]
    if (m := re.search(r"cap " + _SIZE + r" \(--memory-cap-gb [^)]*\), budget " + _SIZE + r" after .*?: (.*)$", plan, re.M)) is not None:
        out |= {"cap": float(m[1]) * _UNIT_GIB[m[2]], "budget": float(m[3]) * _UNIT_GIB[m[4]], "verdict": m[5].strip()}
    if (m := re.search(r"memory after start-up: torch holds ([\d.]+) GiB", text)) is not None:
        out["reserved"] = float(m[1])
    return out


def run_system(
    shape: str,
    device: str,
    draft_device: str,
    dtype: str,
    corruptions: list[float],
    budget: int | str,
    prompts: int,
    prompt_len: int,
    max_tokens: int,
    levels: Sequence[int],
    work_dir: Path,
    log_dir: Path,
    wires: tuple[str, ...] = ("socket",),
    busy_poll_us: int = 0,
    gateways_per_draft: int = 1,
    target_flags: Sequence[str] = (),
    draft_flags: Sequence[str] = (),
    shaped_oracle: float | None = None,
) -> list[SystemRow]:
    """At each concurrency level: the AR row, then one row per draft, for each gateway ``--wire`` in
    ``wires``. The workers are shared and the wires take turns row by row, so both see the same
    machine state. The AR rows of the first wire record the oracle's table for that level. Each draft
    (and wire) gets ``gateways_per_draft`` gateway processes, the clients spread over them.
    ``target_flags`` and ``draft_flags`` go to the random target and the random DFlash draft's
    worker (``--keep-quantized``, ``--memory-cap-gb``: :func:`worker_flags`); the OracleDrafter holds no
    model and gets none. With ``shaped_oracle`` (a corruption rate) one more draft worker runs the
    random DFlash draft's passes and answers with the oracle's proposals (``splitspec.bench.shaped_oracle``),
    with the DFlash draft's flags. The workers' logs are ``target.log``, ``draft-dflash.log`` and
    ``draft-shaped-oracle.log`` in ``log_dir``."""
    from splitspec.bench.random_weights import random_draft_config, random_target_config

    target_model = f"random:{shape}"
    config = random_target_config(target_model)
    # The target records the DFlash draft's taps in the passes it captures at start (the oracle's steps want none).
    taps = ",".join(str(t) for t in random_draft_config(f"{target_model}-dflash").target_layer_ids)
    tokenizer = synthetic_tokenizer(config.vocab_size, work_dir / "tokenizer.json")
    table = work_dir / "oracle.jsonl"
    table.write_text("")
    plan = plan_levels(random_prompts(config.vocab_size, prompt_len), levels, prompts)
    # The paged KV cache holds every sequence of the top level at full length (64 positions to spare
    # each, for block rounding and the bonus row) and no more: its auto size would take most of a GPU
    # that the draft shares, and a whole extra sequence at 16K positions would not fit a 24 GiB cap.
    tree, gateway_flags, largest = _tree_spec(budget)
    kv_tokens = max(levels) * (prompt_len + max_tokens + 2 * largest + 64)
    # Sequences and tree nodes sized to the run as well (the gateway releases a request's sequence before
    # its last reply, so at most the top level's clients are live): a hybrid target keeps state slots and
    # tree rows per sequence (151 MB and 2 MB a row at 27B), which the defaults (64 sequences, 256 nodes)
    # would put at 180 GiB in its memory plan, far over any --memory-cap-gb.
    sized = ["--max-sequences", str(max(levels)), "--max-tree-nodes", str(max(1, largest))]
    # Two CPU workers that each spin every core stall each other at every op (a kept-quantized
    # target dequantizes in many small ones): split the cores between them, as `splitspec serve` does.
    threads = ["--threads", str(max(1, (os.cpu_count() or 2) // 2))] if device == "cpu" and draft_device == "cpu" else []

    rows = []
    with Cluster(log_dir, busy_poll_us) as c:
        target = c.start(
            "target", "random-target", "--model", target_model, "--device", device, "--dtype", dtype,
            "--max-kv-tokens", str(kv_tokens), *sized, *threads, "--draft-taps", taps, *target_flags,
        )
        drafts = {oracle_label(p): ("oracle-draft", "--table", str(table), "--corruption", str(p)) for p in corruptions}
        # The draft's contexts sized to the run like the target's: one slot per live sequence, as long as
        # its prompt and output (the defaults, 32 slots of 4,096 positions and passes of 64 sequences,
        # take 5 GiB at 27B, which a capped draft sharing a 24 GiB card cannot hold).
        draft_sized = ["--max-sequences", str(max(levels))]
        if draft_device != "cpu":  # a CPU draft keeps no slots (its default)
            draft_sized += ["--graph-sequences", str(max(levels)), "--graph-context", str(prompt_len + max_tokens + 2 * largest + 64)]
        random_draft = ("--model", f"{target_model}-dflash", "--device", draft_device, "--dtype", dtype, *draft_sized, *threads, *draft_flags)
        drafts[DFLASH_LABEL] = ("random-draft", *random_draft)
        kinds = {oracle_label(p): ("oracle", p) for p in corruptions} | {DFLASH_LABEL: ("dflash", None)}
        if shaped_oracle is not None:
            label = shaped_oracle_label(shaped_oracle)
            drafts[label] = ("shaped-oracle-draft", *random_draft, "--table", str(table), "--corruption", str(shaped_oracle))
            kinds[label] = (SHAPED, shaped_oracle)
        names = {DFLASH_LABEL: DFLASH_LOG} | {label: SHAPED_LOG for label, kind in kinds.items() if kind[0] == SHAPED}
        draft_addresses = {
            label: c.start(names.get(label, f"draft{i}"), args[0], "--target-model", target_model, *args[1:])
            for i, (label, args) in enumerate(drafts.items())
        }
        gateways = {
            (wire, label): [
                c.start(
                    f"gateway{i}{f'.{g}' if g else ''}-{wire}", "gateway", "--target", target, "--draft", draft, "--tokenizer", str(tokenizer),
                    "--wire", wire, *gateway_flags,
                )
                for g in range(gateways_per_draft)
            ]
            for wire in wires
            for i, (label, draft) in enumerate(draft_addresses.items())
        }
        off = Spec(mode=Spec.OFF)

        def ports(addresses: list[str], *workers: str) -> list[int]:  # a row's gateways' /metrics, the target's, its draft's
            return [c.metrics_ports[a] for a in (*addresses, target, *workers)]

        for level in plan:
            for wire in wires:
                first = gateways[wire, next(iter(drafts))]
                row, outputs = measure(first, level, off, max_tokens, AR_LABEL, wire, "off", metrics=ports(first))
                rows.append(row)
                if wire == wires[0]:
                    with table.open("a") as f:  # the oracle re-reads its table when the file changes
                        f.writelines(json.dumps({"tokens": p + out}) + "\n" for p, out in zip(level.warm + level.timed, outputs))
            for label in drafts:
                for wire in wires:
                    mine = gateways[wire, label]
                    row = measure(mine, level, tree, max_tokens, label, wire, *kinds[label], metrics=ports(mine, draft_addresses[label]))[0]
                    rows.append(replace(row, budget=budget))
    return rows


def _tree_spec(budget: int | str) -> tuple[gateway_pb2.Speculation, list[str], int]:
    """For ``--budget`` (a number or ``auto``): the speculating requests' ``Speculation`` (``auto``:
    they name no budget, so the gateway's adaptive policy chooses), the gateway's flags, and the
    largest tree a step may verify (``auto``: the policy's largest)."""
    if budget == AUTO:
        return Spec(mode=Spec.DDTREE, budget=0), ["--budget", AUTO], DEFAULT_MAX_BUDGET
    return Spec(mode=Spec.DDTREE, budget=budget), [], budget


def run_builtin_system(
    device: str,
    dtype: str,
    budget: int | str,
    prompts: int,
    prompt_len: int,
    max_tokens: int,
    levels: Sequence[int],
    log_dir: Path,
    wires: tuple[str, ...] = ("socket",),
    draft_arch: str = "dflash",
) -> list[SystemRow]:
    """The sweep on the built-in pair (``splitspec.builtin``) as ``splitspec serve`` serves it with
    no model flags but ``--builtin-draft draft_arch`` (one ``serve`` per wire): at each level the AR
    row, then the trained draft's (:data:`BUILTIN_LABELS`), whose AL is real. Prompts are held-out
    standard-library code."""
    from splitspec.builtin import builtin_pair
    from splitspec.models.loader import read_target_config
    from splitspec.text.tokenizer import Tokenizer

    pair = builtin_pair(draft_arch=draft_arch)
    if pair is None:
        raise ValueError(f"--pair builtin: the built-in pair's weights ({draft_arch} draft) are not installed (splitspec/builtin/)")
    context = read_target_config(str(pair[0])).max_context
    if prompt_len + max_tokens > context:
        raise ValueError(f"--pair builtin: --prompt-len {prompt_len} + --max-tokens {max_tokens} exceed the pair's context of {context}")
    plan = plan_levels(heldout_prompts(Tokenizer.from_gguf(pair[0]), prompt_len), levels, prompts)
    rows = []
    tree, gateway_flags, _ = _tree_spec(budget)
    with Cluster(log_dir) as c:
        gateways = {
            # No model flags: serve picks the built-in pair (checked above) and splits the CPU threads; no
            # --budget either (unless auto): every request below names its own.
            wire: c.start(
                f"serve-{wire}", "serve", "--http-listen", "", "--device", device, "--dtype", dtype, "--wire", wire,
                "--builtin-draft", draft_arch, *gateway_flags,
            )
            for wire in wires
        }
        kinds = ((Spec(mode=Spec.OFF), AR_LABEL, "off"), (tree, BUILTIN_LABELS[draft_arch], draft_arch))
        for level in plan:
            for spec, label, drafter in kinds:
                for wire in wires:
                    row = measure(gateways[wire], level, spec, max_tokens, label, wire, drafter)[0]
                    rows.append(row if spec.mode == Spec.OFF else replace(row, budget=budget))
    return rows
