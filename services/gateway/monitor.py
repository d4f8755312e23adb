"""Worker health as the gateway sees it, refreshed by periodic gRPC health checks.

The gateway's own health follows the target (without it nothing can be served). The draft is
optional: while it is down, sequences run target-only; when it answers again (and still fits the
target) speculation resumes, in new and in running sequences.

A target that cannot be reached, or says it is not serving, is down at once. One that answers is
up, however late its answer: a worker answers its health checks on its event loop, which a long
step can hold for a while (a step on the loop thread, or a first CUDA-graph capture of a shape),
and the requests in flight are doing fine. Only a check left unanswered for ``ANSWER_TIMEOUT_S``
(a hung or stopped process) takes the target down; a late answer is logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
ANSWER_TIMEOUT_S = 10.0  # a health check unanswered this long: the worker is hung, down


async def is_serving(channel: grpc.aio.Channel, timeout: float) -> bool | None:
    """True or False as the worker answers (False also when it cannot be reached); None when the
    check ran out of time."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        return None if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else False
    return reply.status == SERVING


class WorkerMonitor:
    def __init__(
        self,
        target_channel: grpc.aio.Channel,
        draft_channel: grpc.aio.Channel | None,
        on_target_change: Callable[[bool], Awaitable[None]],
        draft_fits: Callable[[], Awaitable[bool]],
        interval_s: float = 1.0,
    ) -> None:
        self.target_channel, self.draft_channel = target_channel, draft_channel
        self.on_target_change, self.draft_fits = on_target_change, draft_fits
        self.interval_s = interval_s
        self.answer_timeout_s = max(ANSWER_TIMEOUT_S, 2 * interval_s)
        self.target_up = True
        self.draft_up = draft_channel is not None

    def mark_draft_down(self) -> None:
        """Called by a sequence whose Propose failed, so others stop trying until a check passes."""
        if self.draft_up:
            logger.warning("draft worker marked down; sequences continue target-only")
        self.draft_up = False

    async def check_once(self) -> None:
        """Check the target, and the draft while it is down, at the same time: a slow answer of
        one does not hold the other's check."""
        await asyncio.gather(self._check_target(), self._check_draft())

    async def _check_target(self) -> None:
        t0 = time.monotonic()
        target_up = await is_serving(self.target_channel, self.answer_timeout_s)
        took = time.monotonic() - t0
        if target_up is None:
            logger.warning("target worker left its health check unanswered for %.1f s", took)
            target_up = False
        elif took > max(0.5, self.interval_s):
            logger.info("target worker answered its health check late (%.1f s); a worker that answers is up", took)
        if target_up != self.target_up:
            logger.warning("target worker is %s", "back" if target_up else "DOWN: requests get UNAVAILABLE")
            self.target_up = target_up
            await self.on_target_change(target_up)

    async def _check_draft(self) -> None:
        if self.draft_channel is not None and not self.draft_up:
            if await is_serving(self.draft_channel, self.answer_timeout_s) is True and await self.draft_fits():
                logger.info("draft worker is back; speculation resumes")
                self.draft_up = True

    async def run(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.interval_s)
