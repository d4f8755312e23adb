"""Prometheus metrics of the three services: every exported name, and the one place they are wired.

Each service process keeps its own registry and serves it at ``/metrics`` on its own port
(``--metrics-port``; 0 turns it off), bound to the host of its ``--listen`` address (loopback when
it listens on a Unix socket). Names start with ``splitspec_`` and end in their unit. Every series
carries ``model`` (the served target's file name, see :func:`model_name`); the only other labels
have small fixed value sets: ``mode`` (ddtree, chain, off), ``rpc`` (``Service/Method`` of a worker
call), ``phase`` (prefill, verify, propose), ``position`` (draft depth, 1 .. block size - 1),
``reason`` (a finish reason, a gRPC status code or a fallback cause, lower case), ``kind``
(drafting, target_only) and ``budget`` (the adaptive budget's candidates, at most ten, and the
last ten fixed budgets requests ran).

Terms. A *step* is one verify pass. It commits the root (last step's bonus token) plus the
*accepted* draft nodes: accepted + 1 tokens, bonus included as in the literature. The *acceptance
length* (AL) is tokens committed by verify steps over verify steps, defined once in
:mod:`splitspec.spec.acceptance_length`: the prompt's first token comes from the prefill, which is
no step, and is not counted (so AL is not generated tokens / steps), and a step cut short by a stop
condition counts every token it committed. The histogram ``spec_decode_acceptance_length_tokens``
observes each step's committed tokens, so its ``_sum / _count`` is AL; target-only decoding gives
exactly 1. The *draft tokens* of a step are the positions it speculated: the depth of its tree (a
chain's length); its *tree nodes* are the nodes it sent to verification. Steps that ran target-only
because the draft failed are *fallbacks*; they count as steps (AL 1), so the figures below are what
users got, not what the draft could do. A request's ``usage.steps`` and
``usage.mean_acceptance_length`` count the same steps these metrics do.

PromQL (add ``{model="..."}`` matchers or ``by (model)`` for several models):

- acceptance rate (accepted / speculated positions)::

    sum(rate(splitspec_spec_decode_accepted_tokens_total[5m]))
      / sum(rate(splitspec_spec_decode_draft_tokens_total[5m]))

- mean acceptance length, AL (tokens committed by verify steps / verify steps, bonus included)::

    1 + sum(rate(splitspec_spec_decode_accepted_tokens_total[5m]))
      / sum(rate(splitspec_spec_decode_steps_total[5m]))

  (the dashboard's form), or the same value from the histogram, whose observations are the steps'
  committed tokens::

    sum(rate(splitspec_spec_decode_acceptance_length_tokens_sum[5m]))
      / sum(rate(splitspec_spec_decode_acceptance_length_tokens_count[5m]))

- per-depth acceptance (share of steps whose accepted path reached depth ``position``)::

    sum by (position) (rate(splitspec_spec_decode_accepted_tokens_per_pos_total[5m]))
      / on () group_left () sum(rate(splitspec_spec_decode_steps_total[5m]))

- tree budget per step, mean and p90 by mode (the node budget each drafted step's tree was built
  under: the request's or the fixed ``--budget``, or under ``--budget auto`` the gateway's choice for
  the load, large trees while few sequences share the target's passes and small ones under load)::

    sum by (mode) (rate(splitspec_spec_decode_budget_nodes_sum[5m]))
      / sum by (mode) (rate(splitspec_spec_decode_budget_nodes_count[5m]))

    histogram_quantile(0.9, sum by (le, mode) (rate(splitspec_spec_decode_budget_nodes_bucket[5m])))

- p90 inter-token latency::

    histogram_quantile(0.9, sum by (le) (rate(splitspec_inter_token_latency_seconds_bucket[5m])))

- wire and queueing time of a hop (round trip minus the worker's forward pass)::

    sum(rate(splitspec_rpc_duration_seconds_sum{rpc="TargetWorker/Verify"}[5m]))
      / sum(rate(splitspec_rpc_duration_seconds_count{rpc="TargetWorker/Verify"}[5m]))
    - sum(rate(splitspec_worker_forward_duration_seconds_sum{phase="verify"}[5m]))
      / sum(rate(splitspec_worker_forward_duration_seconds_count{phase="verify"}[5m]))

  (the worker's own share of the waiting is ``splitspec_worker_queue_seconds``, below)

- sequences per batched pass, mean and p90 by phase (verify on the target, propose on the draft;
  near 1 while sequences run one at a time)::

    sum by (phase) (rate(splitspec_worker_pass_sequences_sum[5m]))
      / sum by (phase) (rate(splitspec_worker_pass_sequences_count[5m]))

    histogram_quantile(0.9, sum by (le, phase) (rate(splitspec_worker_pass_sequences_bucket[5m])))

- rows per verify pass, mean (every sequence's tree nodes plus its root)::

    sum(rate(splitspec_worker_pass_rows_sum{phase="verify"}[5m]))
      / sum(rate(splitspec_worker_pass_rows_count{phase="verify"}[5m]))

- the share of verify passes prepared while the pass before was on the device (the target's
  staged passes: near 1 when speculating cohorts take turns, 0 when every user decodes in one
  pass)::

    sum(rate(splitspec_worker_passes_prepared_ahead_total{phase="verify"}[5m]))
      / sum(rate(splitspec_worker_pass_sequences_count{phase="verify"}[5m]))

- queueing in a worker, p50 and p99 by phase (a step's wait for the batched pass it ran in to start)::

    histogram_quantile(0.5, sum by (le, phase) (rate(splitspec_worker_queue_seconds_bucket[5m])))

    histogram_quantile(0.99, sum by (le, phase) (rate(splitspec_worker_queue_seconds_bucket[5m])))

- the gateway's adaptive budget (``--budget auto``): its choice, the committed tok/s it expects
  of a sequence at each candidate budget, and what it prices a round of each kind (``kind``:
  drafting, or target_only while the choice is 0) with: ``t_other``, the passes a round holds
  ``q`` and the sequences of its pass ``n`` (``services.gateway.budget``)::

    splitspec_adaptive_budget_nodes

    splitspec_adaptive_budget_expected_tokens_per_second

    splitspec_adaptive_budget_round_other_seconds

  (``splitspec_adaptive_budget_round_passes`` is ``q``, ``splitspec_adaptive_budget_pass_sequences``
  ``n``, ``splitspec_adaptive_budget_pass_level`` the level its passes are priced at: the seconds
  the rounds' own passes took over what the cost curve gives their rows, each by ``kind``), and
  the draft's share of a drafting round's time outside its pass::

    splitspec_adaptive_budget_draft_seconds
      / on (instance, model) splitspec_adaptive_budget_round_other_seconds{kind="drafting"}

- the target's agreed budget over every adaptive gateway's votes, and the votes it counts (each
  gateway follows the agreed budget while one is live: ``splitspec.spec.budget_choice``)::

    splitspec_worker_agreed_budget_nodes

    splitspec_worker_budget_votes

- paged KV cache of the target, blocks held vs in all, and the share held (at 1 the newest
  sequence is preempted and prefills wait for blocks)::

    sum by (instance) (splitspec_worker_kv_blocks_used)

    sum by (instance) (splitspec_worker_kv_blocks_capacity)

    sum by (instance) (splitspec_worker_kv_blocks_used)
      / sum by (instance) (splitspec_worker_kv_blocks_capacity)

- the draft's fast path: context slots held, and sequences outside the slots (they run the eager
  pass, several times slower a step, until a slot frees: raise ``--graph-sequences`` when this
  stays above 0)::

    splitspec_worker_graph_slots_used

    splitspec_worker_live_sequences - on (instance, model) splitspec_worker_graph_slots_used

- pass shapes whose CUDA graph capture failed (draft and target; each runs eagerly from then on,
  the worker's log says why): alert when above 0::

    max by (instance) (splitspec_worker_graph_capture_failures) > 0
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics, start_http_server
from prometheus_client.core import GaugeMetricFamily

from splitspec import __version__
from splitspec.errors import ServiceError

if TYPE_CHECKING:
    from services.gateway.budget import BudgetFigures
    from services.gateway.stats import StepStats
    from splitspec.transport.rpc import StepConnection

# `_created` series would double every counter and histogram for a timestamp nobody graphs.
disable_created_metrics()

BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048)
# Seconds. Speculation commits several tokens per step, so per-token latency starts near 1 ms.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BYTES_BUCKETS = tuple(64 * 4**i for i in range(13))  # 64 B .. 1 GiB
LENGTH_BUCKETS = (*range(1, 17), 20, 24, 32)  # tokens committed per step
BUDGET_BUCKETS = (0, 1, 2, 4, 6, 8, 12, 16, 22, 32, 48, 64, 96, 128, 192, 256)  # tree nodes per step

# Worker calls of the speculation loop; Info is a start-up call that may wait minutes for a model load.
OBSERVED_RPCS = ("Prefill", "Verify", "Propose", "Release")


def model_name(path: str) -> str:
    """The ``model`` label: the file or folder name of a model path, without a ``.gguf`` suffix."""
    return Path(path).name.removesuffix(".gguf") or "unknown"


def status_reason(exc: BaseException) -> str:
    """The ``reason`` label of a failure: its gRPC status code in lower case."""
    if isinstance(exc, ServiceError):
        return exc.code.lower()
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name.lower()
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    return "internal"


def serve_metrics(registry: CollectorRegistry, port: int, listen: str) -> None:
    """Serve ``registry`` at ``http://HOST:port/metrics``, HOST being the host of ``listen``."""
    if port == 0:
        return
    host = "127.0.0.1" if listen.startswith("unix:") else listen.rsplit(":", 1)[0].strip("[]")
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(f"--metrics-port {port}: cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


class _Metrics:
    """A registry plus the build-info series every service exports."""

    def __init__(self, service: str, model: str = "", registry: CollectorRegistry | None = None) -> None:
        self.service, self.model = service, model
        self.registry = registry or CollectorRegistry()
        self._info = Info("splitspec_build", "Version and placement of this process (value 1)", registry=self.registry)
        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels: str):
        """The series of ``metric`` for this process's model and ``labels``, looked up once (``labels()`` is slow)."""
        key = (metric, self.model, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(self.model, *labels)
        return found

    def describe(self, **fields: str) -> None:
        """Set the build-info labels: service, version and model, plus ``fields`` (device, dtype, ...)."""
        self._info.info({"service": self.service, "version": __version__, "model": self.model, **fields})

    def serve(self, port: int, listen: str) -> None:
        serve_metrics(self.registry, port, listen)


class GatewayMetrics(_Metrics):
    """Request latencies, token counts, speculation counters and per-hop RPC figures of a gateway.

    ``model`` is set once the target worker has reported its model path.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__("gateway", registry=registry)
        r = self.registry

        def histogram(name, doc, buckets, *labels):
            return Histogram(name, doc, ["model", *labels], buckets=buckets, registry=r)

        def counter(name, doc, *labels):
            return Counter(name, doc, ["model", *labels], registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, ["model"], registry=r)

        self.ttft = histogram("splitspec_time_to_first_token_seconds", "Request arrival to its first generated token", TTFT_BUCKETS)
        self.itl = histogram(
            "splitspec_inter_token_latency_seconds",
            "Gap between a step's tokens and the previous step's, divided over its tokens (one observation per token)",
            ITL_BUCKETS,
        )
        self.e2e = histogram("splitspec_e2e_request_latency_seconds", "Request arrival to its last response (successful requests)", E2E_BUCKETS)
        self.queue = histogram("splitspec_request_queue_time_seconds", "Request arrival to its admission into the speculation loop", QUEUE_BUCKETS)
        self.running = gauge("splitspec_num_requests_running", "Requests in the speculation loop")
        self.waiting = gauge("splitspec_num_requests_waiting", "Requests received and not yet admitted")
        self.prompt_tokens = counter("splitspec_prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("splitspec_generation_tokens", "Generated tokens sent to clients")
        self.success = counter("splitspec_request_success", "Finished requests by finish reason (length, stop, eos, context)", "reason")
        self.failure = counter("splitspec_request_failure", "Failed requests by gRPC status code", "reason")
        self.steps = counter("splitspec_spec_decode_steps", "Verify passes (speculation steps)", "mode")
        self.draft_tokens = counter("splitspec_spec_decode_draft_tokens", "Draft positions speculated (tree depth per step)", "mode")
        self.accepted = counter("splitspec_spec_decode_accepted_tokens", "Accepted draft tokens (bonus excluded)", "mode")
        self.accepted_per_pos = counter(
            "splitspec_spec_decode_accepted_tokens_per_pos", "Steps whose accepted path reached draft depth `position`", "mode", "position"
        )
        self.tree_nodes = counter("splitspec_spec_decode_tree_nodes", "Draft tree nodes sent to verification", "mode")
        self.acceptance_length = histogram(
            "splitspec_spec_decode_acceptance_length_tokens",
            "Tokens committed per verify step, bonus included (the prefill's token is no step's); _sum / _count is AL",
            LENGTH_BUCKETS, "mode",
        )
        self.budget = histogram(
            "splitspec_spec_decode_budget_nodes",
            "Node budget of each drafted step's tree (fixed, or chosen for the load under --budget auto)",
            BUDGET_BUCKETS, "mode",
        )
        self.fallbacks = counter("splitspec_draft_fallbacks", "Steps run target-only, by cause (a gRPC status code or no_draft)", "reason")
        self.rpc_duration = histogram("splitspec_rpc_duration_seconds", "Round trip of a worker call, as the gateway sees it", STEP_BUCKETS, "rpc")
        self.rpc_request_bytes = histogram("splitspec_rpc_request_bytes", "Serialized size of a worker call's request", BYTES_BUCKETS, "rpc")
        self.rpc_response_bytes = histogram("splitspec_rpc_response_bytes", "Serialized size of a worker call's response", BYTES_BUCKETS, "rpc")
        self.rpc_failures = counter("splitspec_rpc_failures", "Failed worker calls by gRPC status code", "rpc", "reason")

    def request(self) -> RequestObserver:
        return RequestObserver(self)

    def observe_step(self, mode: str, step: StepStats) -> None:
        child = self.child
        child(self.steps, mode).inc()
        child(self.draft_tokens, mode).inc(step.draft_depth)
        child(self.accepted, mode).inc(step.accepted)
        for depth in range(1, step.accepted + 1):
            child(self.accepted_per_pos, mode, str(depth)).inc()
        child(self.tree_nodes, mode).inc(step.tree_nodes)
        child(self.acceptance_length, mode).observe(step.committed)
        if step.budget is not None:
            child(self.budget, mode).observe(step.budget)
        if step.fallback:
            child(self.fallbacks, step.fallback).inc()

    def step_observer(self, mode: str) -> Callable[[StepStats], None]:
        return lambda step: self.observe_step(mode, step)

    def watch_budget(self, figures: Callable[[], BudgetFigures]) -> None:
        """Export the adaptive budget's ``figures()`` (``BudgetPolicy.figures``), read at each scrape."""
        self.registry.register(_BudgetCollector(self, figures))

    def interceptor(self) -> RpcObserver:
        return RpcObserver(self)


class _BudgetCollector:
    """The adaptive budget's figures as gauges, read when scraped: a series exists once its figure
    does (the choice once made, a kind of round once seen)."""

    def __init__(self, metrics: GatewayMetrics, figures: Callable[[], BudgetFigures]) -> None:
        self.metrics, self.figures = metrics, figures

    def collect(self):
        f, model = self.figures(), self.metrics.model
        families = {
            "nodes": GaugeMetricFamily(
                "splitspec_adaptive_budget_nodes", "Tree budget --budget auto gives adaptive steps now (0: target-only runs)", labels=["model"]
            ),
            "expected": GaugeMetricFamily(
                "splitspec_adaptive_budget_expected_tokens_per_second",
                "Committed tokens per second the adaptive budget expects of a sequence at each candidate budget", labels=["model", "budget"],
            ),
            "forecast": GaugeMetricFamily(
                "splitspec_adaptive_budget_forecast_tokens_per_second",
                "Committed tokens per second the adaptive budget's model expects of a sequence at each fixed budget that requests ran, "
                "from their trees, and at 0 (target-only): beside the rate measured there, how far the model is off",
                labels=["model", "budget"],
            ),
            "draft": GaugeMetricFamily(
                "splitspec_adaptive_budget_draft_seconds", "The draft's proposal as the gateway waits for it (t_draft)", labels=["model"]
            ),
            "other": GaugeMetricFamily(
                "splitspec_adaptive_budget_round_other_seconds", "A round's time outside its verify pass and its wait (t_other), by kind",
                labels=["model", "kind"],
            ),
            "passes": GaugeMetricFamily(
                "splitspec_adaptive_budget_round_passes", "Verify passes a round holds, its own and those it waits behind (q), by kind",
                labels=["model", "kind"],
            ),
            "sequences": GaugeMetricFamily(
                "splitspec_adaptive_budget_pass_sequences", "Sequences of the verify passes a round is priced at (n), by kind",
                labels=["model", "kind"],
            ),
            "level": GaugeMetricFamily(
                "splitspec_adaptive_budget_pass_level",
                "The level a round's passes are priced at: its kind's own passes' seconds over the cost curve's at their rows, by kind",
                labels=["model", "kind"],
            ),
        }
        if f.choice is not None:
            families["nodes"].add_metric([model], f.choice)
        for budget, rate in f.expected.items():
            families["expected"].add_metric([model, str(budget)], rate)
        for budget, rate in f.forecast.items():
            families["forecast"].add_metric([model, str(budget)], rate)
        if f.rounds:
            families["draft"].add_metric([model], f.draft_s)
        for kind, (other_s, passes, sequences) in f.rounds.items():
            families["other"].add_metric([model, kind], other_s)
            families["passes"].add_metric([model, kind], passes)
            families["sequences"].add_metric([model, kind], sequences)
        for kind, level in f.levels.items():
            families["level"].add_metric([model, kind], level)
        yield from families.values()


class RequestObserver:
    """Times one Generate call from its arrival; a context manager that counts failures on exit."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.first_token_s: float | None = None  # seconds from arrival to the first token
        self._last: float | None = None
        self._admitted = False

    def __enter__(self) -> RequestObserver:
        self.metrics.child(self.metrics.waiting).inc()
        return self

    def admitted(self, prompt_tokens: int) -> None:
        m, child = self.metrics, self.metrics.child
        child(m.queue).observe(time.perf_counter() - self.arrival)
        child(m.waiting).dec()
        child(m.running).inc()
        child(m.prompt_tokens).inc(prompt_tokens)
        self._admitted = True

    def tokens(self, count: int) -> None:
        """``count`` tokens were just sent: the first one is timed from arrival, later ones from the previous batch."""
        if count <= 0:
            return
        m, child, now = self.metrics, self.metrics.child, time.perf_counter()
        child(m.generation_tokens).inc(count)
        if self._last is None:
            self.first_token_s = now - self.arrival
            child(m.ttft).observe(self.first_token_s)
            gap, count = 0.0, count - 1  # tokens of the first batch arrive together with it
        else:
            gap = (now - self._last) / count
        itl = child(m.itl)
        for _ in range(count):
            itl.observe(gap)
        self._last = now

    def finished(self, reason: str) -> float:
        """Count a successful request; returns its end-to-end seconds."""
        elapsed = time.perf_counter() - self.arrival
        self.metrics.child(self.metrics.e2e).observe(elapsed)
        self.metrics.child(self.metrics.success, reason).inc()
        return elapsed

    def __exit__(self, exc_type, exc, tb) -> None:
        m = self.metrics
        m.child(m.running if self._admitted else m.waiting).dec()
        if exc is not None:
            m.child(m.failure, status_reason(exc)).inc()


class RpcObserver(grpc.aio.UnaryUnaryClientInterceptor):
    """Client interceptor on the gateway's worker channels: duration, payload sizes and failures per RPC.

    A step on a per-sequence stream (``VerifyStream``, ``ProposeStream``) is one logical call: the
    gateway's clients time it with :meth:`observe` under the unary RPC's name (``TargetWorker/Verify``),
    so the figures and dashboards read the same whichever wire carries the steps.
    """

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        method = client_call_details.method
        method = method.decode() if isinstance(method, bytes) else method
        service, _, name = method.rpartition("/")
        if name not in OBSERVED_RPCS:
            return await continuation(client_call_details, request)

        async def call():
            return await (await continuation(client_call_details, request))

        return await self.observe(f"{service.rpartition('.')[2]}/{name}", request, call())

    async def observe(self, rpc: str, request, response: Awaitable, connection: StepConnection | None = None):
        """Await ``response`` (the reply to ``request``), counting it under ``rpc`` (``Service/Method``);
        its size is the ``connection``'s count of the answer's bytes where it keeps one (a step
        socket's frame): ``ByteSize()`` serializes the message again, milliseconds of the event
        loop for a prompt's tap features (BENCHMARKS.md [S19])."""
        m = self.metrics
        t0 = time.perf_counter()
        try:
            reply = await response
        except grpc.aio.AioRpcError as exc:
            m.child(m.rpc_failures, rpc, exc.code().name.lower()).inc()
            raise
        m.child(m.rpc_duration, rpc).observe(time.perf_counter() - t0)
        m.child(m.rpc_request_bytes, rpc).observe(request.ByteSize())
        counted = connection.answer_bytes if connection is not None else None
        m.child(m.rpc_response_bytes, rpc).observe(reply.ByteSize() if counted is None else counted)
        return reply


class WorkerMetrics(_Metrics):
    """Forward-pass durations, live sequences, cache usage and load time of a target or draft worker."""

    def __init__(self, service: str, model: str, registry: CollectorRegistry | None = None) -> None:
        super().__init__(service, model, registry)
        r = self.registry
        self._forward = Histogram(
            "splitspec_worker_forward_duration_seconds", "Device time of one call, by phase (prefill, verify, propose)",
            ["model", "phase"], buckets=STEP_BUCKETS, registry=r,
        )
        self._load = Gauge("splitspec_worker_model_load_seconds", "Time the model took to load", ["model"], registry=r)
        self._pass_sequences = Histogram(
            "splitspec_worker_pass_sequences", "Sequences whose steps ran in one batched forward pass, by phase",
            ["model", "phase"], buckets=BATCH_BUCKETS, registry=r,
        )
        self._pass_rows = Histogram(
            "splitspec_worker_pass_rows", "Rows (tree nodes + roots of every sequence) of one batched verify pass",
            ["model", "phase"], buckets=ROW_BUCKETS, registry=r,
        )
        self._ahead = Counter(
            "splitspec_worker_passes_prepared_ahead", "Batched passes prepared while the pass before was on the device, by phase",
            ["model", "phase"], registry=r,
        )
        self._queue = Histogram(
            "splitspec_worker_queue_seconds",
            "Time a step waited for the batched pass it ran in to start, by phase (a pipelined target-only step "
            "arrives while its sequence's step before it runs, and waits for that pass too)",
            ["model", "phase"], buckets=STEP_BUCKETS, registry=r,
        )
        self._gauges = {
            name: Gauge(name, doc, ["model"], registry=r)
            for name, doc in (
                ("splitspec_worker_live_sequences", "Sequences holding state on this worker"),
                ("splitspec_worker_max_sequences", "Sequences this worker admits at most"),
                ("splitspec_worker_kv_cache_reserved_tokens", "KV cache positions reserved by live sequences (target)"),
                ("splitspec_worker_kv_cache_capacity_tokens", "KV cache positions this worker reserves at most (target)"),
                ("splitspec_worker_kv_blocks_used", "Paged KV cache blocks held by live sequences (target)"),
                ("splitspec_worker_kv_blocks_capacity", "Paged KV cache blocks in all (target)"),
                ("splitspec_worker_graph_slots_used", "Context slots of the fast (CUDA-graph) path held by sequences (draft)"),
                ("splitspec_worker_graph_slots_capacity", "Context slots of the fast (CUDA-graph) path in all (draft)"),
                ("splitspec_worker_graph_capture_failures", "Pass shapes whose CUDA graph capture failed: they run eagerly, several times slower"),
            )
        }

    def forward(self, phase: str, forward_ns: int) -> None:
        self.child(self._forward, phase).observe(forward_ns / 1e9)

    def batched(self, phase: str, results: list, waits: list[float], ahead: bool = False) -> None:
        """One batched pass: its steps' results (exceptions for steps that failed alone; a result's
        ``pass_rows`` when it has them), how long each step waited for the pass, and whether it was
        prepared while the pass before was on the device."""
        self.child(self._pass_sequences, phase).observe(len(results))
        prepared_ahead = self.child(self._ahead, phase)  # exported (0) from the first pass on
        if ahead:
            prepared_ahead.inc()
        rows = next((r.pass_rows for r in results if getattr(r, "pass_rows", 0)), 0)
        if rows:
            self.child(self._pass_rows, phase).observe(rows)
        queue = self.child(self._queue, phase)
        for wait in waits:
            queue.observe(wait)

    def loaded(self, seconds: float) -> None:
        self.child(self._load).set(seconds)

    def watch(self, **readers: Callable[[], float]) -> None:
        """Read gauges at scrape time: ``live_sequences=lambda: ...`` sets ``splitspec_worker_live_sequences``."""
        for key, read in readers.items():
            self.child(self._gauges[f"splitspec_worker_{key}"]).set_function(read)

    def watch_board(self, figures: Callable[[], tuple[int | None, int]]) -> None:
        """Export the target's budget board (``BudgetBoard.figures``: the agreed budget, or None, and
        the live votes), read at each scrape."""
        self.registry.register(_BoardCollector(self.model, figures))


class _BoardCollector:
    """The budget board's figures as gauges, read when scraped; the agreed budget only while one is."""

    def __init__(self, model: str, figures: Callable[[], tuple[int | None, int]]) -> None:
        self.model, self.figures = model, figures

    def collect(self):
        agreed, votes = self.figures()
        budget = GaugeMetricFamily(
            "splitspec_worker_agreed_budget_nodes", "Tree budget the target agreed over the adaptive gateways' votes", labels=["model"]
        )
        if agreed is not None:
            budget.add_metric([self.model], agreed)
        count = GaugeMetricFamily("splitspec_worker_budget_votes", "Adaptive gateways whose budget votes the target counts now", labels=["model"])
        count.add_metric([self.model], votes)
        yield budget
        yield count
