"""Where a decode step goes through the services, read from their own Prometheus /metrics.

A benchmark row's decode ms per step (``SystemRow.ms_per_step``) is what a client sees. The
services count the parts of it themselves; a row scrapes the gateways and the target before and
after its timed requests and keeps the means over the row (:class:`StepSplit`):

- ``verify_rpc_ms``: a gateway's round trip of one Verify (``splitspec_rpc_duration_seconds``,
  ``rpc="TargetWorker/Verify"``, on every wire). Target-only decode steps are pipelined on the
  socket and stream wires (``TargetClient.decode``: the next request is sent before this answer
  arrives), and each is timed from when the gateway starts waiting for its answer: there the
  figure is the gateway's wait, which may be shorter than the target's pass;
- ``propose_rpc_ms``: its round trip of one Propose (``rpc="DraftWorker/Propose"``; none without a draft);
- ``target_pass_ms``: the target's batched verify pass that each step ran in, from its preparation
  to its settle (``splitspec_worker_forward_duration_seconds``, ``phase="verify"``, observed once a
  step; a pass that captured a CUDA graph is not counted);
- ``target_queue_ms``: a step's wait in the target for its pass to start
  (``splitspec_worker_queue_seconds``, ``phase="verify"``);
- ``draft_pass_ms`` and ``draft_queue_ms``: the same of the draft's batched pass that each Propose
  ran in (``phase="propose"``; none for a drafter that runs no pass);
- ``prompt_ms_per_step``: the target's prompt passes over the row (``phase="prefill"``) divided
  by its decode steps (the verify passes' count): the share of other requests' prompts each step
  carries under load. A request's prompt is paid once over its decode steps, so a row that
  commits AL tokens a step pays it over 1 / AL as many steps as AR does: at 32 users, 512-token
  prompts and 128 new tokens, a prompt every 4 steps of AR against one or more a step at AL 6.

So for a drafted step at one user, step − (Verify + Propose round trips) is the gateway's own time,
Verify round trip − (queue + pass) the wire and the target's host work outside the pass, and
Propose round trip − (the draft's queue + pass) the same of the draft (the tap features it
receives among them); a
pipelined target-only step is its pass plus what the target's passes leave between them. As
PromQL over a live deployment, the mean Verify round trip::

    sum(rate(splitspec_rpc_duration_seconds_sum{rpc="TargetWorker/Verify"}[5m]))
      / sum(rate(splitspec_rpc_duration_seconds_count{rpc="TargetWorker/Verify"}[5m]))
"""

from __future__ import annotations

import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

PROMPTS = "target_prompts"  # the target's prompt passes: no StepSplit mean, a share of each step (prompt_ms_per_step)
# (histogram, the label that picks the series, its value): each StepSplit field's source, and PROMPTS'
SERIES = {
    "verify_rpc_ms": ("splitspec_rpc_duration_seconds", "rpc", "TargetWorker/Verify"),
    "propose_rpc_ms": ("splitspec_rpc_duration_seconds", "rpc", "DraftWorker/Propose"),
    "target_pass_ms": ("splitspec_worker_forward_duration_seconds", "phase", "verify"),
    "target_queue_ms": ("splitspec_worker_queue_seconds", "phase", "verify"),
    "draft_pass_ms": ("splitspec_worker_forward_duration_seconds", "phase", "propose"),
    "draft_queue_ms": ("splitspec_worker_queue_seconds", "phase", "propose"),
    PROMPTS: ("splitspec_worker_forward_duration_seconds", "phase", "prefill"),
}

Totals = dict[str, tuple[float, float]]  # StepSplit field -> (sum of seconds, count) of its series


@dataclass(frozen=True)
class StepSplit:
    """Means over a row in milliseconds (module docstring); None where no call was counted."""

    verify_rpc_ms: float | None = None
    propose_rpc_ms: float | None = None
    target_pass_ms: float | None = None
    target_queue_ms: float | None = None
    draft_pass_ms: float | None = None
    draft_queue_ms: float | None = None
    prompt_ms_per_step: float | None = None


def _add(out: Totals, field: str, total: float, count: float) -> None:
    t, c = out.get(field, (0.0, 0.0))
    out[field] = (t + total, c + count)


def totals(text: str) -> Totals:
    """The running sums and counts of :data:`SERIES` in one /metrics page (Prometheus text format)."""
    out: Totals = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for field, (name, label, value) in SERIES.items():
                if sample.labels.get(label) == value and sample.name in (f"{name}_sum", f"{name}_count"):
                    is_sum = sample.name.endswith("_sum")
                    _add(out, field, sample.value if is_sum else 0.0, 0.0 if is_sum else sample.value)
    return out


def scrape(ports: Sequence[int], timeout: float = 10.0) -> Totals:
    """:func:`totals` of every loopback ``port``'s /metrics, added together (a row's gateways)."""
    out: Totals = {}
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as page:
            for field, (total, count) in totals(page.read().decode()).items():
                _add(out, field, total, count)
    return out


def means(before: Totals, after: Totals) -> StepSplit:
    """The means of what was counted between two scrapes of the same processes."""

    def counted(field: str) -> tuple[float, float]:
        (total, count), (total0, count0) = after.get(field, (0.0, 0.0)), before.get(field, (0.0, 0.0))
        return total - total0, count - count0

    out = {}
    for field in SERIES.keys() - {PROMPTS}:
        total, count = counted(field)
        out[field] = 1e3 * total / count if count > 0 else None
    prompts, steps = counted(PROMPTS)[0], counted("target_pass_ms")[1]
    return StepSplit(**out, prompt_ms_per_step=1e3 * prompts / steps if steps > 0 else None)
