"""The gateway's view of the target's health against a real gRPC health service: a worker that is
not serving or cannot be reached is down at once, one that is late (busy on its event loop) only
after LATE_CHECKS_DOWN late checks in a row, and any answer in time resets the count."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.monitor import LATE_CHECKS_DOWN, WorkerMonitor

INTERVAL_S = 0.5  # the check's timeout is max(0.5, interval)


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.mode = "serving"

    async def Check(self, request, context):
        if self.mode == "late":
            await asyncio.sleep(2 * INTERVAL_S)
        status = health_pb2.HealthCheckResponse.NOT_SERVING if self.mode == "not serving" else health_pb2.HealthCheckResponse.SERVING
        return health_pb2.HealthCheckResponse(status=status)


def test_late_checks_take_a_run_of_them_to_mark_the_target_down(tmp_path):
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
            seen = []

            async def check(mode: str, times: int = 1) -> None:
                health.mode = mode
                for _ in range(times):
                    await monitor.check_once()
                    seen.append((mode, monitor.target_up))

            await check("late", LATE_CHECKS_DOWN - 1)  # a capture holding the worker's loop
            await check("serving")  # in time again: the count starts over
            await check("late", LATE_CHECKS_DOWN)
            await check("serving")
            await check("not serving")
            await check("serving")
            await server.stop(None)
            await check("serving")  # nothing listens any more
        return seen, changes

    seen, changes = asyncio.run(scenario())
    ups = [up for _, up in seen]
    assert ups == [True] * LATE_CHECKS_DOWN + [True] * (LATE_CHECKS_DOWN - 1) + [False, True, False, True, False]
    assert changes == [False, True, False, True, False]
