"""Worker health as the gateway sees it, refreshed by periodic gRPC health checks.

The gateway's own health follows the target (without it nothing can be served). The draft is
optional: while it is down, sequences run target-only; when it answers again (and still fits the
target) speculation resumes, in new and in running sequences.

A target that cannot be reached, or says it is not serving, is down at once. One that is only
late is down after ``LATE_CHECKS_DOWN`` late checks in a row: a worker serving one sequence runs
its steps on its event loop, so a step that captures a new CUDA graph (a second or two on first
use of a shape) holds its health check, and the requests in flight are doing fine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
LATE_CHECKS_DOWN = 3


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
        self.target_up = True
        self.target_late = 0  # health checks in a row the target answered too late
        self.draft_up = draft_channel is not None

    def mark_draft_down(self) -> None:
        """Called by a sequence whose Propose failed, so others stop trying until a check passes."""
        if self.draft_up:
            logger.warning("draft worker marked down; sequences continue target-only")
        self.draft_up = False

    async def check_once(self) -> None:
        timeout = max(0.5, self.interval_s)
        target_up = await is_serving(self.target_channel, timeout)
        self.target_late = self.target_late + 1 if target_up is None else 0
        if target_up is None:
            logger.info("target worker late to its health check (%d in a row; down after %d)", self.target_late, LATE_CHECKS_DOWN)
            target_up = self.target_up and self.target_late < LATE_CHECKS_DOWN
        if target_up != self.target_up:
            logger.warning("target worker is %s", "back" if target_up else "DOWN: requests get UNAVAILABLE")
            self.target_up = target_up
            await self.on_target_change(target_up)
        if self.draft_channel is not None and not self.draft_up:
            if await is_serving(self.draft_channel, timeout) is True and await self.draft_fits():
                logger.info("draft worker is back; speculation resumes")
                self.draft_up = True

    async def run(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.interval_s)
