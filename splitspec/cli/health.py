"""``splitspec health ADDRESS``: ask a service's ``grpc.health.v1`` endpoint whether it is serving.

Exit code 0 when it answers SERVING, 1 otherwise (NOT_SERVING, unknown service, unreachable), so
container health checks can run it without ``grpc_health_probe``. The empty service name is the
whole process (liveness); ``splitspec.v1.TargetWorker``, ``splitspec.v1.DraftWorker`` or
``splitspec.v1.Gateway`` asks for one API (readiness).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help="service address (host:port or unix:PATH)")
    p.add_argument("--service", default="", help="health service name ('' = the whole process)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")


def run(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(args.address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(f"{args.address} {args.service or '(process)'}: {status}")
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1
