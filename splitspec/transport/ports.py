"""Free loopback ports for processes this one starts (benchmarks' and tests' services)."""

from __future__ import annotations

import socket

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port free on the loopback interface right now, and not one this process handed out
    before: a port closed again is free to the kernel, which may hand it out twice (two services
    started by one process, given the same port, would clash)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
