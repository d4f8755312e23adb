"""The gateway's view of the target's health against a real gRPC health service: a worker that is
not serving or cannot be reached is down at once; one that answers is up however late it answers
(a long step holding its loop); only a check left unanswered for the answer timeout (a hung worker)
takes it down."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.monitor import WorkerMonitor

INTERVAL_S = 0.2
ANSWER_TIMEOUT_S = 1.5


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.mode = "serving"

    async def Check(self, request, context):
        if self.mode == "late":  # several intervals late, within the answer timeout
            await asyncio.sleep(5 * INTERVAL_S)
        elif self.mode == "hung":
            await asyncio.sleep(2 * ANSWER_TIMEOUT_S)
        status = health_pb2.HealthCheckResponse.NOT_SERVING if self.mode == "not serving" else health_pb2.HealthCheckResponse.SERVING
        return health_pb2.HealthCheckResponse(status=status)


def test_a_worker_that_answers_is_never_down_however_late(tmp_path):
    async def scenario():
        health = Health()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        address = f"unix:{tmp_path / 'target.sock'}"
        server.add_insecure_port(address)
        await server.start()
        changes = []

        async def changed(up: bool) -> None:
            changes.append(up)

        async with grpc.aio.insecure_channel(address) as channel:
            monitor = WorkerMonitor(channel, None, changed, lambda: None, INTERVAL_S)
            monitor.answer_timeout_s = ANSWER_TIMEOUT_S
            seen = []

            async def check(mode: str, times: int = 1) -> None:
                health.mode = mode
                for _ in range(times):
                    await monitor.check_once()
                    seen.append((mode, monitor.target_up))

            await check("late", 4)  # a long step holding the worker's loop, check after check
            await check("serving")
            await check("not serving")
            await check("late")  # a late SERVING answer brings it back too
            await check("hung")
            await check("serving")
            await server.stop(None)
            await check("serving")  # nothing listens any more
        return seen, changes

    seen, changes = asyncio.run(scenario())
    assert [up for _, up in seen] == [True] * 5 + [False, True, False, True, False]
    assert changes == [False, True, False, True, False]
